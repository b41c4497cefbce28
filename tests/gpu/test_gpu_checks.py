"""Correctness of every strategy on one device (gpu_runs.py's docstring says how each check decides): bf16-mixed
training against fp32, FSDP's CPU offload, validation metrics, the HF export, equal random initial weights, the
chunked loss, QLoRA and DDP's compression hooks."""

from __future__ import annotations

from functools import partial

import pytest
from gpu_runs import (
    HOOKS,
    TRAIN_RUNS,
    Check,
    Context,
    Runs,
    check_chunked,
    check_export,
    check_hook,
    check_init,
    check_offload,
    check_qlora,
    check_train,
    check_val,
    qlora_strategy,
)

pytestmark = pytest.mark.gpu
RUN_NAMES = [name for name, _, _ in TRAIN_RUNS]


@pytest.mark.parametrize("name", RUN_NAMES)
def test_train(check: Check, runs: Runs, name: str) -> None:
    check(f"train/{name}", partial(check_train, runs, name))


def test_fsdp_cpu_offload(check: Check, ctx: Context, runs: Runs) -> None:
    check("offload/gym_fsdp", partial(check_offload, ctx, runs))


def test_validation_metrics(check: Check, runs: Runs) -> None:
    check("val_metrics", partial(check_val, runs))


@pytest.mark.parametrize("name", RUN_NAMES)
def test_export_reloads_to_the_trained_logits(check: Check, ctx: Context, runs: Runs, name: str) -> None:
    check(f"export/{name}", lambda: check_export(ctx, runs(name)))


def test_equal_initial_weights(check: Check, ctx: Context) -> None:
    check("init_weights", partial(check_init, ctx))


def test_chunked_loss(check: Check, ctx: Context, runs: Runs) -> None:
    check("chunked_loss", partial(check_chunked, ctx, runs))


def test_qlora(check: Check, ctx: Context) -> None:
    check(f"qlora/{qlora_strategy()}", partial(check_qlora, ctx))


@pytest.mark.parametrize("hook", HOOKS)
def test_ddp_compression_hook(check: Check, ctx: Context, runs: Runs, hook: str) -> None:
    check(f"ddp_hook/{hook}", partial(check_hook, ctx, runs, hook))
