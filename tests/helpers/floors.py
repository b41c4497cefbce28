"""The floors subset of the suite (``pytest -m floors``; the marker is set in tests/conftest.py)."""

from __future__ import annotations

# What .ci/run runs a second time in the GPU image's environment at the declared floors (torch 2.11, transformers
# 5.17, peft 0.21.0, lightning 2.6.6, the bundled DeepSpeed and datasets): the paths whose behaviour those versions
# change, not a second copy of the suite (issue 56). `pytest -m floors` selects them; tests/test_floors.py checks that
# every entry still names collected tests. Keep each entry's reason beside it.
FLOORS: tuple[str, ...] = (
    # private Lightning / DeepSpeed / peft / transformers / torch members and the patches' probes, at each version
    "tests/test_compat.py",
    "tests/test_patches.py",
    # the bundle's jsonargparse: every shipped config parses; user errors stay one line
    "tests/test_cli.py::test_every_shipped_config_parses",
    "tests/test_cli_errors.py",
    # transformers' loading (meta build, sharded load, the one loader) and its MoE classes, per family
    "tests/models/test_one_loader.py",
    "tests/models/test_moe_training.py",
    "tests/models/test_expert_lora_families.py",
    # peft's wrappers and FSDP2's integer (NF4) parameters: QLoRA under every strategy, exports merged and adapter
    "tests/quant/test_qlora_model.py",
    "tests/quant/test_qlora_runs.py",
    # DeepSpeed's CPU ops (built for this torch) and each strategy's 2-rank trajectory and exact resume (DCP, ZeRO)
    "tests/strategies/zero/test_ops.py",
    "tests/strategies/test_multirank.py::test_causal_lm_loss_trajectory_matches_single_process",
    "tests/checkpointing/test_resume.py::test_sigkill_mid_epoch_then_resume_matches_uninterrupted",
    # Hugging Face DeepSpeed JSON through gym train on 2 ranks
    "tests/commands/test_train.py::test_shipped_json_trains_on_two_cpu_ranks",
    # benchmarks/gpu.sh --cpu-smoke: it runs only in the GPU image, at these versions (skipped in the README's suite)
    "tests/test_gpu_smoke.py",
)


def floor_files() -> list[str]:
    """The test files the floors entries live in (what .ci/run hands pytest beside ``-m floors``: collecting only
    these keeps the image-like environment from importing test modules of what it lacks, such as TRL)."""
    return sorted({entry.split("::")[0] for entry in FLOORS})


if __name__ == "__main__":
    print(" ".join(floor_files()))
