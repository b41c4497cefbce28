"""Training-step transients: the fused AdamW default and ZeRO-3's gathered-parameter limits from the layer size."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from helpers.dist import rank_env, run_python

from gym_lightning import CausalLMModule
from gym_lightning.errors import GymUserError
from gym_lightning.optim import adamw_kernel, build_optimizer
from gym_lightning.strategies import ZeRO2Strategy, ZeRO3Strategy
from gym_lightning.strategies.zero.hf_auto import TrainingFacts, drop_autos, resolve_hf_deepspeed_config
from gym_lightning.strategies.zero.resolve import run_config
from gym_lightning.strategies.zero.sizing import (
    DEFAULT_BUCKET_SIZE,
    derived_bucket_size,
    optimizer_sub_group,
    stage3_limits,
)

SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64}


def test_module_default_is_fused_adamw_on_cpu() -> None:
    module = CausalLMModule("tiny-llama", config_overrides=SMALL)
    module.configure_model()
    groups = [{"params": list(module.parameters()), "weight_decay": 0.0}]
    optimizer = build_optimizer(module.hparams.optim, groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    assert optimizer.defaults["fused"] is True


def test_fused_falls_back_to_the_for_loop_where_no_kernel_exists() -> None:
    on_meta = [{"params": [torch.nn.Parameter(torch.empty(4, 4, device="meta"))]}]
    assert adamw_kernel(on_meta) == {"foreach": False}
    assert adamw_kernel([{"params": [torch.nn.Parameter(torch.ones(2))]}]) == {"fused": True}


def test_module_states_its_decoder_layer_size() -> None:
    module = CausalLMModule("tiny-qwen3", config_overrides=SMALL)
    before = module.model_facts()  # ZeRO-3 asks before the model is built (zero.Init)
    module.configure_model()
    layer = module.model.model.layers[0]
    assert before.layer_numel == module.model_facts().layer_numel == sum(p.numel() for p in layer.parameters())


def _stage3(**zero: object) -> dict:
    return {"zero_optimization": {"stage": 3, **zero}}


def test_stage3_limits_resolve_from_the_layer_size() -> None:
    auto = dict.fromkeys(
        ["stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance"], "auto"
    )
    resolved = resolve_hf_deepspeed_config(_stage3(**auto), TrainingFacts(hidden_size=32, layer_numel=1000))
    assert resolved["zero_optimization"] == {"stage": 3, **stage3_limits(1000)}
    assert stage3_limits(1000) == {
        "stage3_prefetch_bucket_size": 1000,
        "stage3_max_live_parameters": 2000,
        "stage3_max_reuse_distance": 1000,
    }
    # Without the layer size the prefetch bucket keeps HF's rule; the two others cannot be resolved.
    resolved = resolve_hf_deepspeed_config(_stage3(stage3_prefetch_bucket_size="auto"), TrainingFacts(hidden_size=32))
    assert resolved["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
    with pytest.raises(GymUserError, match=r"stage3_max_live_parameters.*layer_numel"):
        resolve_hf_deepspeed_config(_stage3(stage3_max_live_parameters="auto"), TrainingFacts())


def test_generated_stage3_config_asks_for_them_and_drops_what_nobody_states() -> None:
    zero = ZeRO3Strategy().config["zero_optimization"]
    assert [zero[key] for key in stage3_limits(1)] == ["auto"] * 3
    assert "stage3_max_live_parameters" not in ZeRO2Strategy().config["zero_optimization"]
    dropped = drop_autos(
        _stage3(stage3_max_live_parameters="auto", stage3_max_reuse_distance=5),
        tuple(f"zero_optimization.{key}" for key in stage3_limits(1)),
    )
    assert dropped == _stage3(stage3_max_reuse_distance=5)


def test_zero_buckets_default_to_one_decoder_layer() -> None:
    keys = ("reduce_bucket_size", "allgather_bucket_size")
    for strategy in (ZeRO2Strategy(), ZeRO3Strategy()):
        assert [strategy.config["zero_optimization"][key] for key in keys] == ["auto", "auto"]
    assert [ZeRO2Strategy(bucket_size=5000).config["zero_optimization"][key] for key in keys] == [5000, 5000]
    filled = run_config(ZeRO2Strategy().config, TrainingFacts(layer_numel=1234), generated=True)
    assert [filled["zero_optimization"][key] for key in keys] == [1234, 1234]
    assert derived_bucket_size(None) == DEFAULT_BUCKET_SIZE  # no layer size stated: the former default
    # Only "auto" is filled: an explicit value stays.
    mixed = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 7, "allgather_bucket_size": "auto"}}
    assert run_config(mixed, TrainingFacts(layer_numel=99), generated=True)["zero_optimization"] == {
        "stage": 2,
        "reduce_bucket_size": 7,
        "allgather_bucket_size": 99,
        **{"overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True},  # absent: the rule's
    }


def test_zero3_optimizer_sub_group_is_one_layer() -> None:
    assert optimizer_sub_group(1234, offload_optimizer=False) == 1234
    assert optimizer_sub_group(1234, offload_optimizer=True) is None  # DeepSpeed's own sub-groups for its swapping

    def sub_group(zero: dict, layer: int | None = 1234) -> object:
        config = run_config({"zero_optimization": zero}, TrainingFacts(layer_numel=layer), generated=True)
        return config["zero_optimization"].get("sub_group_size")

    assert sub_group({"stage": 3}) == 1234
    assert sub_group({"stage": 3}, layer=None) is None  # unknown layer size: DeepSpeed's default
    assert sub_group({"stage": 2}) is None
    assert sub_group({"stage": 3, "sub_group_size": 7}) == 7
    assert sub_group({"stage": 3, "offload_optimizer": {"device": "cpu"}}) is None


# The allocator pattern behind the 0.8-1.0 GiB that glibc kept per rank at 250M (strategies/_common.py): a large
# transient freed first (glibc raises its mmap threshold to its size), then many medium tensors served from the heap
# between small live ones, freed. In a fresh process each, since the setting is process-wide. Here (glibc 2.36,
# 30 Nov 2026): 39.9 MiB of the 400 MiB stay resident under glibc's defaults, 0.01 MiB with the fix.
_RETAINED_AFTER_FREE = """
import sys, torch
from gym_lightning.strategies._common import return_freed_host_memory
if sys.argv[1] == "fix":
    return_freed_host_memory(torch.device("cpu"))
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
transient = torch.ones(30 * 2**18)
del transient
before, medium, small = rss(), [], []
for _ in range(100):
    medium.append(torch.ones(2**20))  # 4 MiB
    small.append(torch.ones(16))
del medium
print((rss() - before) / 2**20)
"""


def _glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or not _glibc(), reason="glibc's allocator on Linux")
def test_cpu_ranks_return_freed_tensors_to_the_system() -> None:
    env = rank_env()
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    retained = {
        mode: float(run_python(["-c", _RETAINED_AFTER_FREE, mode], timeout=120, env=env).stdout.split()[-1])
        for mode in ("fix", "default")
    }
    assert retained["default"] > 20, f"the pattern no longer keeps freed memory under glibc's defaults: {retained}"
    assert retained["fix"] < 5, f"freed 4 MiB tensors stayed resident: {retained} MiB"
