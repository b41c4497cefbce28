"""A quiet console: noise silenced where it is made, and the CLI's default logger, progress bar and callbacks.

Each source below printed on every run without telling the user anything they could act on. They are silenced one
by one, at their source, so that real warnings keep reaching the console:

- DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
  (``deepspeed/accelerator/real_accelerator.py``, at WARNING level): logged by every process that imports
  deepspeed on a machine without an accelerator, i.e. by the launcher and again by every rank.
  ``silence_deepspeed_cpu_detection`` sets ``DS_ACCELERATOR=cpu``, DeepSpeed's own override, but only where its
  auto-detection would end at the CPU fallback anyway: the accelerator it picks is unchanged, it just no longer warns
  about it. Child processes (ranks) inherit the variable.
- Lightning's "💡 Tip: ... litlogger" and "💡 Tip: ... litmodels" advertisements (``rank_zero_info`` in
  ``lightning/pytorch/trainer/connectors/``), printed by every ``Trainer``. ``drop_lightning_tips`` filters exactly
  the records that start with "💡 Tip"; the other messages of that logger ("GPU available", ...) stay.
- The "tensorboardX has been removed ... `logger=True` will use CSVLogger" warning: gone because tensorboard is a
  declared dependency; ``gym fit`` logs to TensorBoard and CSV in the run folder (``cli_trainer_defaults``).
- Lightning's "Loading `train_dataloader` to estimate number of stepping batches." (an internal detail), dropped by
  the same filter, and torch's deprecation warning about ``LeafSpec()`` raised from Lightning's own
  ``utilities/_pytree.py`` on every fit (``warnings`` filter on that message from that module only).
- ``v_num`` on the progress bar: the logger's version number, the same on every step; ``GymProgressBar`` drops it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

# deepspeed/accelerator/real_accelerator.py (0.19) picks a non-CPU accelerator when one of these vendor extensions
# is importable (or torch reports CUDA/XPU, or the machine is a Mac with MPS); only otherwise does it warn.
_ACCELERATOR_EXTENSIONS = ("torch_npu", "torch_sdaa", "habana_frameworks", "torch_mlu", "torch_supa", "torch_xmlir")
LIGHTNING_TIP_PREFIX = "💡 Tip"
# Lightning's INFO records that describe its own internals, not the run: dropped like the tips.
LIGHTNING_NOISE_PREFIXES: tuple[str, ...] = (LIGHTNING_TIP_PREFIX, "Loading `train_dataloader` to estimate number of")
# torch deprecated constructing LeafSpec(); Lightning 2.6's own pytree copy still does on every fit
# (lightning/pytorch/utilities/_pytree.py): nothing a user can act on. Matched on message and module both.
LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
LEAFSPEC_MODULE = r"lightning\.pytorch\.utilities\._pytree"


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

    A user's own ``DS_ACCELERATOR`` is left alone. Must run before deepspeed is first imported.
    """
    if "DS_ACCELERATOR" not in os.environ and deepspeed_would_fall_back_to_cpu():
        os.environ["DS_ACCELERATOR"] = "cpu"


class _DropLightningTips(logging.Filter):
    """Drops Lightning's "💡 Tip" advertisements and its other ``LIGHTNING_NOISE_PREFIXES`` records; lets every other
    record of the logger through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_NOISE_PREFIXES)


def drop_lightning_tips() -> None:
    """Attach the tip filter to the loggers Lightning's ``rank_zero_info`` writes to (once)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropLightningTips) for existing in logger.filters):
            logger.addFilter(_DropLightningTips())


def quiet_console() -> None:
    """Silence the noise sources listed in this module's docstring; called once when gym_lightning is imported."""
    silence_deepspeed_cpu_detection()
    drop_lightning_tips()
    warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING, module=LEAFSPEC_MODULE)


def default_loggers(save_dir: str) -> list[Any]:
    """TensorBoard and CSV logs in the same ``<save_dir>/lightning_logs/version_N`` folder.

    TensorBoard is what ``logger: true`` gives now that tensorboard is a dependency; the CSV log is kept beside it
    because the notebooks and tests read ``metrics.csv``. The TensorBoard logger is given the CSV logger's version,
    so a new run never splits into two version folders.
    """
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if not tensorboard_available():  # an environment built before tensorboard was declared: CSV as before
        return [CSVLogger(save_dir=save_dir)]
    csv = CSVLogger(save_dir=save_dir)
    # CSV first: Lightning creates the loggers' folders in list order, and a CSVLogger that finds its folder already
    # holding TensorBoard's event file warns "exists and is not empty ... will be deleted" on every run.
    return [csv, TensorBoardLogger(save_dir=save_dir, version=csv.version)]


def tensorboard_available() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))


def cli_trainer_defaults(trainer_config: Mapping[str, Any]) -> dict[str, Any]:
    """Trainer arguments ``gym fit`` adds to the configured ones (``trainer_config``: the instantiated ``trainer``
    section): the returned ``callbacks`` are the configured ones plus the defaults below; ``logger`` is returned only
    when the config leaves it at its default.

    Defaults: ``GymProgressBar`` (unless ``enable_progress_bar: false`` or the config has a progress bar),
    ``LearningRateMonitor(logging_interval="step")`` (when there is a logger: it refuses to run without one),
    ``CurvesCallback`` (``curves.png`` at the end of fit), and TensorBoard + CSV logs in the run folder
    (``default_loggers``). A callback type the config already lists is not added twice. ``barebones`` runs get
    nothing (Lightning refuses loggers and progress bars there).
    """
    from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar

    from gym_lightning.callbacks import CurvesCallback, GymProgressBar

    if trainer_config.get("barebones"):
        return {}
    configured = trainer_config.get("callbacks") or []
    configured = list(configured) if isinstance(configured, list | tuple) else [configured]
    logger = trainer_config.get("logger")
    added: list[Any] = []
    if trainer_config.get("enable_progress_bar") is not False and not _has(configured, ProgressBar):
        added.append(GymProgressBar())
    if logger is not False and not _has(configured, LearningRateMonitor):
        added.append(LearningRateMonitor(logging_interval="step"))
    if not _has(configured, CurvesCallback):
        added.append(CurvesCallback())
    defaults: dict[str, Any] = {"callbacks": [*configured, *added]}
    if logger in (None, True):
        defaults["logger"] = default_loggers(str(trainer_config.get("default_root_dir") or os.getcwd()))
    return defaults


def _has(callbacks: list[Any], kind: type) -> bool:
    return any(isinstance(callback, kind) for callback in callbacks)


__all__ = [
    "cli_trainer_defaults",
    "deepspeed_would_fall_back_to_cpu",
    "default_loggers",
    "drop_lightning_tips",
    "quiet_console",
    "silence_deepspeed_cpu_detection",
    "tensorboard_available",
]
