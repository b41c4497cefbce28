"""DeepSpeed JSON configs: reading a user's file, the config gym_lightning writes for a stage and offload choice,
the settings every gym_lightning ZeRO run needs, and the problems of a ZeRO configuration (pure functions).

``"auto"`` values are resolved elsewhere: ``hf_auto`` (the Hugging Face Trainer's rules) and ``sizing`` (buffer
sizes from the model's layer size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from gym_lightning.errors import GymUserError
from gym_lightning.vocabulary import DEFAULT_NVME_PATH  # the zero_infinity preset's swap folder

AUTO = "auto"
OffloadDevice = Literal["none", "cpu", "nvme"]
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")
CPU_OPTIMIZERS: tuple[str, ...] = ("torch", "deepspeed")
# The stage-3 limits gym_lightning's own configs leave "auto", derived from the module's layer size
# (``sizing.stage3_limits``).
STAGE3_DERIVED_KEYS: tuple[str, ...] = (
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)
# ZeRO++ (Wang et al. 2023, https://arxiv.org/abs/2306.10209): quantized weight all-gather (qwZ), hierarchical
# secondary partition (hpZ) and quantized gradient reduce-scatter (qgZ). Stage 3 only.
ZERO_PLUS_PLUS_KEYS: tuple[str, ...] = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")


def load_deepspeed_json(config: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``config`` as a dict (a path is read as JSON); the caller's dict is never modified."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    path = Path(config)
    if not path.is_file():
        raise GymUserError(f"DeepSpeed config file not found: {path}; pass an existing JSON file or a dict.")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise GymUserError(f"{path}:{err.lineno}: invalid JSON in the DeepSpeed config ({err.msg}).") from None
    if not isinstance(value, dict):
        raise GymUserError(f"{path}: a DeepSpeed config must be a JSON object, got {type(value).__name__}.")
    return value


def zero_config(
    stage: int,
    offload_optimizer: str,
    offload_parameters: str,
    nvme_path: str | None,
    pin_memory: bool,
    bucket_size: int | None,
) -> dict[str, Any]:
    """DeepSpeed JSON config (as a dict) for the given ZeRO stage and offload choices. ``bucket_size=None`` writes
    the bucket sizes as ``"auto"``: the strategy derives them from the module's layer size
    (``sizing.derived_bucket_size``)."""
    zero: dict[str, Any] = {
        "stage": stage,
        # Stage 1 under caller-managed accumulation reduces in step(); DeepSpeed allows overlap only from stage 2.
        "overlap_comm": stage >= 2,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "allgather_bucket_size": AUTO if bucket_size is None else bucket_size,
        "reduce_bucket_size": AUTO if bucket_size is None else bucket_size,
    }
    if stage == 3:
        # Resolved from the module's layer size (sizing.stage3_limits); DeepSpeed's defaults (1e9 elements) when the
        # module states none.
        zero.update(dict.fromkeys(STAGE3_DERIVED_KEYS, AUTO))
    if offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": offload_optimizer, "nvme_path": nvme_path, "pin_memory": pin_memory}
    if offload_parameters != "none":
        zero["offload_param"] = {"device": offload_parameters, "nvme_path": nvme_path, "pin_memory": pin_memory}
    return {"zero_optimization": zero}


def offload_devices(config: dict[str, Any]) -> set[str]:
    """Where ``config`` offloads the optimizer and the parameters (``"cpu"``, ``"nvme"``; empty: nowhere)."""
    zero = config.get("zero_optimization") or {}
    sections = (zero.get("offload_optimizer"), zero.get("offload_param"))
    return {s.get("device") for s in sections if isinstance(s, dict) and s.get("device") not in (None, "none")}


def apply_gym_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the settings every gym_lightning ZeRO run needs (``strategies.zero.strategy``'s docstring says
    why); a new dict, the input is not modified."""
    config = dict(config)  # top-level keys only: a shallow copy keeps the input intact
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config["managed_gradient_accumulation"] = False
    # DeepSpeed's throughput timer synchronises the device at the start and the end of every step by default
    # (utils/timer.py; its config's own words: "at the expense of performance degradation") for a log line every
    # steps_per_print steps. Host time unless the config says otherwise; ThroughputCallback measures without.
    timers = config.get("timers") or {}
    config["timers"] = {**timers, "throughput": {"synchronized": False, **(timers.get("throughput") or {})}}
    return config


def zero_problems(
    stage: Any,
    offload_optimizer: Any,
    offload_parameters: Any,
    nvme_path: str | None,
    cpu_optimizer: Any,
    config_stage: Any = None,
    has_config: bool = False,
) -> list[str]:
    """Every problem with a ZeRO configuration, each with its fix."""
    if has_config and (offload_optimizer != "none" or offload_parameters != "none" or nvme_path):
        return [
            "offload_optimizer/offload_parameters/nvme_path are ignored when config is given; "
            "set zero_optimization.offload_optimizer / offload_param in the config instead."
        ]
    problems = []
    if stage not in (0, 1, 2, 3):
        problems.append(
            f"stage={stage!r} is not a ZeRO stage; use 0 (no sharding: DeepSpeed's engine as plain data parallelism), "
            "1 (shard optimizer state), 2 (+ gradients) or 3 (+ parameters)."
        )
    if config_stage is not None and stage != config_stage:
        problems.append(f"stage={stage} disagrees with the config's zero_optimization.stage={config_stage}; keep one.")
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_parameters", offload_parameters)):
        if value not in OFFLOAD_DEVICES:
            problems.append(f"{name}={value!r} is not one of {OFFLOAD_DEVICES}.")
    if offload_parameters != "none" and stage != 3:
        problems.append(
            f"offload_parameters={offload_parameters!r} needs stage=3 (only stage 3 partitions parameters); "
            "use stage=3 or offload_parameters='none'."
        )
    return problems + _offload_problems(offload_optimizer, offload_parameters, nvme_path, cpu_optimizer)


def _offload_problems(
    offload_optimizer: Any, offload_parameters: Any, nvme_path: str | None, cpu_optimizer: Any
) -> list[str]:
    problems = []
    if "nvme" in (offload_optimizer, offload_parameters) and not nvme_path:
        problems.append("NVMe offload needs nvme_path=<folder on a fast local disk>; set it or use offload 'cpu'.")
    if nvme_path and "nvme" not in (offload_optimizer, offload_parameters):
        problems.append(
            f"nvme_path={nvme_path!r} is unused; set offload_optimizer/offload_parameters='nvme' or drop nvme_path."
        )
    if cpu_optimizer not in CPU_OPTIMIZERS:
        problems.append(f"cpu_optimizer={cpu_optimizer!r} is not one of {CPU_OPTIMIZERS}.")
    elif cpu_optimizer == "deepspeed" and offload_optimizer == "none":
        problems.append(
            "cpu_optimizer='deepspeed' runs the optimizer on CPU; it needs offload_optimizer='cpu' or 'nvme' "
            "(or use cpu_optimizer='torch')."
        )
    return problems


def zero_plus_plus_problems(config: dict[str, Any], device_type: str, world_size: int) -> list[str]:
    """Problems of the ZeRO++ keys in ``config`` for a run on ``device_type`` ranks (each with its fix).

    qwZ/qgZ run DeepSpeed's CUDA quantization kernels, which have no CPU build; hpZ keeps a secondary parameter
    partition inside each node so that all-gathers stay on the fast intra-node links, which needs CUDA devices.
    """
    zero = config.get("zero_optimization") or {}
    hpz = zero.get("zero_hpz_partition_size", 1)
    enabled = [key for key in ZERO_PLUS_PLUS_KEYS[:2] if zero.get(key) is True]
    enabled += [f"zero_hpz_partition_size={hpz}"] if hpz not in (None, 1) else []
    if not enabled:
        return []
    names = ", ".join(enabled)
    problems = []
    if zero.get("stage") != 3:
        problems.append(
            f"ZeRO++ ({names}) needs zero_optimization.stage=3, got {zero.get('stage')!r}; use stage 3 or drop them."
        )
    if device_type != "cuda":
        problems.append(
            f"ZeRO++ ({names}) cannot run on {device_type} ranks: it needs CUDA GPUs (DeepSpeed's quantization "
            "kernels and hierarchical partitioning have no CPU implementation). Remove these keys (or set them to "
            "false / 1) for CPU runs; keep them for GPU runs."
        )
    elif not isinstance(hpz, int) or isinstance(hpz, bool) or hpz < 1 or world_size % hpz:
        problems.append(
            f"zero_hpz_partition_size={hpz!r} must be a whole number >= 1 that divides the world size "
            f"({world_size}); use the number of GPUs per node."
        )
    return problems


__all__ = [
    "AUTO",
    "CPU_OPTIMIZERS",
    "DEFAULT_NVME_PATH",
    "OFFLOAD_DEVICES",
    "STAGE3_DERIVED_KEYS",
    "ZERO_PLUS_PLUS_KEYS",
    "OffloadDevice",
    "apply_gym_defaults",
    "load_deepspeed_json",
    "offload_devices",
    "zero_config",
    "zero_plus_plus_problems",
    "zero_problems",
]
