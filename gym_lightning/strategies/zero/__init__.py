"""DeepSpeed ZeRO stages 0-3 (+ CPU/NVMe offload) on CUDA and on CPU ranks: the strategy (``strategy``) and its
parts, one concept per module: ``config`` (the JSON gym_lightning writes, reading a user's, and their checks),
``hf_auto`` (Hugging Face ``"auto"`` values), ``sizing`` (buffer sizes from the layer size), ``resolve`` (the run's
config from those and the training facts, one call), ``ops`` (DeepSpeed's
C++ ops, built once per machine), ``stage3`` (partitioned parameters one at a time), ``leaf`` (ZeRO-3's leaf
modules), ``frozen`` (frozen models held as the policy), ``universal`` (resuming on another number of ranks),
``trace`` (ZeRO-3's module trace with torchmetrics)."""

from gym_lightning.strategies.zero.strategy import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROStrategy

__all__ = ["ZeRO1Strategy", "ZeRO2Strategy", "ZeRO3Strategy", "ZeROStrategy"]
