"""A quiet console: noise silenced where it is made. The command line applies it (``gym_lightning.cli.main``);
importing gym_lightning does not, since it changes the process (an environment variable, log filters, a warnings
filter): a Python user who wants the same calls :func:`quiet_console` before importing deepspeed.

Each source below printed on every run without telling the user anything they could act on. They are silenced one
by one, at their source (each function's docstring says how), so that real warnings keep reaching the console:

- DeepSpeed's "Setting accelerator to CPU ..." on every process of a machine without an accelerator
  (:func:`silence_deepspeed_cpu_detection`);
- Lightning's "💡 Tip: ... litlogger" / "litmodels" advertisements and its "Loading `train_dataloader` to estimate
  number of stepping batches." (:func:`drop_lightning_tips`), and torch's deprecation warning about ``LeafSpec()``
  raised from Lightning's own ``utilities/_pytree.py`` on every fit (a ``warnings`` filter on that message from that
  module only);
- bitsandbytes' "Failed to load CPU gemm_4bit_forward ..." (:func:`drop_bitsandbytes_gemm_notice`);
- torch 2.13's FutureWarnings that ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are deprecated, raised
  from its ``c10d_logger`` wrapper on each call DeepSpeed's ZeRO makes (thousands in a few zero3 steps; torch 2.11,
  the floor, has no replacement to call): a ``warnings`` filter on those two messages from that module;
- the "tensorboardX has been removed ..." warning: gone because tensorboard is a declared dependency (``gym fit``
  logs to TensorBoard and CSV in the run folder, ``cli.cli_trainer_defaults``);
- ``v_num`` on the progress bar, the same on every step: ``GymProgressBar`` drops it (``callbacks.progress``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings

# deepspeed/accelerator/real_accelerator.py (0.19) picks a non-CPU accelerator when one of these vendor extensions
# is importable (or torch reports CUDA/XPU, or the machine is a Mac with MPS); only otherwise does it warn.
_ACCELERATOR_EXTENSIONS = ("torch_npu", "torch_sdaa", "habana_frameworks", "torch_mlu", "torch_supa", "torch_xmlir")
LIGHTNING_TIP_PREFIX = "💡 Tip"
BNB_CPU_LOGGER, BNB_GEMM_NOTICE = "bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"
# Lightning's INFO records that describe its own internals, not the run: dropped like the tips.
LIGHTNING_NOISE_PREFIXES: tuple[str, ...] = (LIGHTNING_TIP_PREFIX, "Loading `train_dataloader` to estimate number of")
# torch deprecated constructing LeafSpec(); Lightning 2.6's own pytree copy still does on every fit
# (lightning/pytorch/utilities/_pytree.py): nothing a user can act on. Matched on message and module both.
LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
LEAFSPEC_MODULE = r"lightning\.pytorch\.utilities\._pytree"
# torch 2.13 deprecates the two collectives DeepSpeed 0.19's ZeRO calls on every bucket (deepspeed/comm/torch.py);
# the warning is raised from torch's own wrapper module, so it names no caller to filter on.
C10D_DEPRECATION_WARNING = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
C10D_DEPRECATION_MODULE = r"torch\.distributed\.c10d_logger"


def deepspeed_would_fall_back_to_cpu() -> bool:
    """Whether DeepSpeed's accelerator auto-detection ends at its CPU fallback (the case it warns about)."""
    import torch

    if torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()):
        return False
    if sys.platform == "darwin":
        return False
    return not any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_EXTENSIONS)


def silence_deepspeed_cpu_detection() -> None:
    """Set ``DS_ACCELERATOR=cpu`` where DeepSpeed would pick the CPU anyway, so that it does not warn about it.

    DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    (``deepspeed/accelerator/real_accelerator.py``, at WARNING level) is logged by every process that imports
    deepspeed on a machine without an accelerator, i.e. by the launcher and again by every rank. ``DS_ACCELERATOR``
    is DeepSpeed's own override, set only where its auto-detection would end at the CPU fallback anyway: the
    accelerator it picks is unchanged. Child processes (ranks) inherit the variable. A user's own
    ``DS_ACCELERATOR`` is left alone. Must run before deepspeed is first imported.
    """
    if "DS_ACCELERATOR" not in os.environ and deepspeed_would_fall_back_to_cpu():
        os.environ["DS_ACCELERATOR"] = "cpu"


class _DropPrefixes(logging.Filter):
    """Drops the records whose message starts with one of ``prefixes``; lets every other record through."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def _drop_on(logger_name: str, prefixes: tuple[str, ...]) -> None:
    """Attach a ``_DropPrefixes(prefixes)`` filter to the logger (once)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _DropPrefixes) and f.prefixes == prefixes for f in logger.filters):
        logger.addFilter(_DropPrefixes(prefixes))


def drop_lightning_tips() -> None:
    """Drop Lightning's "💡 Tip" advertisements and its other ``LIGHTNING_NOISE_PREFIXES`` records from the loggers
    its ``rank_zero_info`` writes to (once); every other record of those loggers gets through.

    The tips ("💡 Tip: ... litlogger", "💡 Tip: ... litmodels": ``rank_zero_info`` in
    ``lightning/pytorch/trainer/connectors/``) are printed by every ``Trainer``; the other messages of that logger
    ("GPU available", ...) stay, but for "Loading `train_dataloader` to estimate number of stepping batches." (an
    internal detail).
    """
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        _drop_on(name, LIGHTNING_NOISE_PREFIXES)


def drop_bitsandbytes_gemm_notice() -> None:
    """Drop bitsandbytes' ``BNB_GEMM_NOTICE`` from its CPU backend's logger (once).

    "Failed to load CPU gemm_4bit_forward from kernels-community ... pip install kernels" (its ``backends/cpu/ops.py``,
    at WARNING level, on import on CPUs with AVX512-BF16) is about a 4-bit matmul kernel gym_lightning does not call
    (QLoRA uses its dequantisation only, ``quant/nf4.py``).
    """
    _drop_on(BNB_CPU_LOGGER, (BNB_GEMM_NOTICE,))


def quiet_console() -> None:
    """Silence the noise sources listed in this module's docstring (idempotent); the command line calls it first."""
    silence_deepspeed_cpu_detection()
    drop_lightning_tips()
    drop_bitsandbytes_gemm_notice()
    warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING, module=LEAFSPEC_MODULE)
    warnings.filterwarnings(
        "ignore", message=C10D_DEPRECATION_WARNING, category=FutureWarning, module=C10D_DEPRECATION_MODULE
    )


__all__ = [
    "deepspeed_would_fall_back_to_cpu",
    "drop_bitsandbytes_gemm_notice",
    "drop_lightning_tips",
    "quiet_console",
    "silence_deepspeed_cpu_detection",
]
