"""``gym export``: a Hugging Face folder from a gym_lightning checkpoint of any strategy.

gym export --checkpoint outputs/run/checkpoints/last.ckpt --output_dir outputs/run/hf [--lora merged|adapter]
"""

from __future__ import annotations

from gym_lightning.checkpointing.export import export_checkpoint
from gym_lightning.commands import CommandParser


def main(argv: list[str] | None = None) -> None:
    """``gym export --checkpoint PATH --output_dir DIR [--max_shard_size 2GB] [--lora merged|adapter]``."""
    parser = CommandParser(prog="gym export", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or folder (or a folder with last.ckpt)")
    parser.add_argument("--output_dir", required=True, help="Hugging Face folder to write (replaced atomically)")
    parser.add_argument("--max_shard_size", default="2GB", help="largest safetensors file, e.g. 2GB, 500MB")
    parser.add_argument("--lora", choices=["merged", "adapter"], default="merged", help="LoRA: merged or adapter")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.output_dir, args.max_shard_size, args.lora)
    print(f"gym_lightning: exported {args.checkpoint} to {out}")
