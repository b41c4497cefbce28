"""Which tensors the weight initialisation writes while a strategy sets up: ``python init_worker.py OUT.json``.

``CausalLMModule`` with LoRA on the built-in tiny Llama, one process per strategy in turn, one step each. Every
``torch.nn.init`` call (what peft's ``reset_lora_parameters`` and ``nn.Linear`` use) is recorded with whether its
tensor is one a sharding engine manages (a ZeRO-3 parameter, which carries ``ds_id``, or a ``DTensor`` shard) and
where it lives. An engine-managed tensor is gathered on the GPU in a GPU job, so a draw into it uses the CUDA
generator and differs from the CPU draw of the other strategies; on a CPU the identity shows it.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.lora import LoRAArgs
from gym_lightning.module import CausalLMModule

STRATEGIES = ("gym_ddp", "gym_fsdp", "zero3")
INITS = ("kaiming_uniform_", "uniform_", "normal_", "zeros_", "ones_", "trunc_normal_", "xavier_uniform_")
WRITES: list[dict[str, Any]] = []


def _recording(name: str, init: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init)
    def record(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        engine = hasattr(tensor, "ds_id") or isinstance(tensor, DTensor)
        WRITES.append({"init": name, "engine": engine, "device": str(tensor.device), "shape": list(tensor.shape)})
        return init(tensor, *args, **kwargs)

    return record


def main(out: str) -> None:
    for name in INITS:
        setattr(torch.nn.init, name, _recording(name, getattr(torch.nn.init, name)))
    results: dict[str, list[dict[str, Any]]] = {}
    for strategy in STRATEGIES:
        WRITES.clear()
        module = CausalLMModule(model="tiny-llama", lora=LoRAArgs(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
        data = CausalLMDataModule(dataset="addition", batch_size=4, max_seq_length=32)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False, limit_val_batches=0,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, datamodule=data)
        results[strategy] = list(WRITES)
    with open(out, "w") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
