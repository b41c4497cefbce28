"""``gym export``: a Hugging Face folder from a gym_lightning checkpoint of any strategy.

gym export --checkpoint outputs/run/checkpoints/last.ckpt --output_dir outputs/run/hf [--lora merged|adapter]
    [--dtype source|float32|bfloat16|float16] [--max_shard_size 5GB]
"""

from __future__ import annotations

from gym_lightning.checkpointing.reading import export_checkpoint
from gym_lightning.commands import CommandParser
from gym_lightning.hf_folder import DEFAULT_MAX_SHARD_SIZE, EXPORT_DTYPES, LORA_EXPORTS


def main(argv: list[str] | None = None) -> None:
    """``gym export --checkpoint PATH --output_dir DIR [--max_shard_size 5GB] [--lora ...] [--dtype ...]``."""
    parser = CommandParser(prog="gym export", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or folder (or a folder with last.ckpt)")
    parser.add_argument("--output_dir", required=True, help="Hugging Face folder to write (replaced atomically)")
    parser.add_argument(
        "--max_shard_size", default=DEFAULT_MAX_SHARD_SIZE, help="largest safetensors file, e.g. 5GB, 500MB"
    )
    parser.add_argument("--lora", choices=LORA_EXPORTS, default="merged", help="LoRA: merged or adapter")
    parser.add_argument(
        "--dtype", choices=EXPORT_DTYPES, default="source", help="source: the dtype of the folder the run started from"
    )
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.output_dir, args.max_shard_size, args.lora, args.dtype)
    print(f"gym_lightning: exported {args.checkpoint} to {out}")
