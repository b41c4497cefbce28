"""Offloaded optimizers (gym_fsdp ``cpu_offload``: the optimizer steps host parameters while the model computes on
the GPU) read the non-finite flag and the loss scale only once they are complete, on the host.

Why a fake device: on a CPU run the flags, scales and parameters share one device and nothing is ever in flight, so
the defect cannot show. ``helpers.fake_cuda`` keeps the CUDA semantics it needs: tensors made on ``cuda`` report
that device (so torch's fused optimizers and ``GradScaler`` take their cross-device paths), a device-to-host copy
with ``non_blocking=True`` lands only at the next synchronisation (the host reads stale pinned memory before), and
``torch.cuda.Event`` is a double whose ``synchronize`` lands them. The first tests confirm the findings on torch's
own code (2.11's ``_fused_adam`` and ``GradScaler`` are the same as 2.13's here); the others show the fixes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.fake_cuda import CUDA, fake_cuda
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from gym_lightning._compat import grad_scaler_found_infs, start_grad_scaler_on
from gym_lightning.callbacks import NonFiniteGuard
from gym_lightning.callbacks.nonfinite import where_it_steps
from gym_lightning.precision import GymShardedGradScaler, shard_aware_scaler

INF = float("inf")


def host_step(grad: list[float]) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    """An offloaded parameter (host memory) with gradient ``grad`` and torch's fused AdamW over it."""
    param = torch.nn.Parameter(torch.ones(len(grad)))
    param.grad = torch.tensor(grad)
    return param, torch.optim.AdamW([param], lr=0.1, fused=True)


def stepped(param: torch.nn.Parameter, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer applied a step to ``param`` (weights or its step count moved)."""
    state = optimizer.state.get(param, {})
    return not torch.equal(param.detach(), torch.ones_like(param)) or int(state.get("step", 0)) != 0


# ------------------------------------------------------------------------------------------ findings (torch's code)
@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A 1-rank gloo process group (the sharded scaler all-reduces its flags over the default group)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_finding_fused_adamw_reads_a_gpu_found_inf_before_it_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_cuda(monkeypatch) as device:
        param, optimizer = host_step([1.0, float("nan"), 1.0])
        optimizer.found_inf = torch.ones((), device="cuda")  # what NonFiniteGuard handed over: "skip this step"
        optimizer.step()  # torch: found_inf.to(cpu, non_blocking=True), read at once by the CPU kernel
    assert device.late_copies >= 1 and stepped(param, optimizer) and param.isnan().any()


def test_finding_a_plain_grad_scaler_under_offload_applies_an_overflowed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's ``16-mixed`` scaler (``GradScaler("cuda")``) with host gradients: its scale and flag reach the
    host's unscaling and the fused step as copies still in flight."""
    with fake_cuda(monkeypatch) as device:
        scaler = torch.amp.GradScaler("cuda")
        param, optimizer = host_step([1.0, INF, 1.0])
        scaler.scale(torch.ones((), device="cuda"))
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    assert device.late_copies >= 1 and stepped(param, optimizer)


@pytest.mark.usefixtures("one_rank_group")
def test_finding_torchs_sharded_scaler_fails_a_fused_step() -> None:
    """``ShardedGradScaler``'s flag is ``[1]``-shaped; ``_fused_adam`` subtracts it from 0-dim step counts."""
    scaler = ShardedGradScaler("cpu")
    _, optimizer = host_step([1.0, INF, 1.0])
    scaler.scale(torch.ones(()))
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=r"output with shape \[\] doesn't match the broadcast shape \[1\]"):
        scaler.step(optimizer)


# ------------------------------------------------------------------------------------------ the guard
class OnGpu(torch.nn.Module):
    """A module that computes on the GPU while its parameters live in host memory, as under FSDP ``cpu_offload``."""

    device = CUDA

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))

    def log(self, *args: object, **kwargs: object) -> None:
        pass


def one_rank_trainer() -> SimpleNamespace:
    identity = SimpleNamespace(reduce=lambda tensor, reduce_op: tensor)  # no process group: flags pass through
    return SimpleNamespace(
        world_size=1, global_rank=0, global_step=0, current_epoch=0, log_every_n_steps=50, strategy=identity,
        precision_plugin=SimpleNamespace(),
    )  # fmt: skip


def test_the_guard_hands_an_offloaded_fused_optimizer_a_complete_host_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    guard, trainer = NonFiniteGuard(action="skip"), one_rank_trainer()
    with fake_cuda(monkeypatch):
        module = OnGpu()
        module.weight.grad = torch.tensor([1.0, float("nan"), 1.0])  # offloaded gradient shard, finite loss
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.1, fused=True)
        guard.on_fit_start(trainer, module)  # type: ignore[arg-type]
        guard.on_before_backward(trainer, module, torch.ones((), device="cuda"))  # type: ignore[arg-type]
        guard.on_before_optimizer_step(trainer, module, optimizer)  # type: ignore[arg-type]
        handed = optimizer.found_inf
        optimizer.step()
        guard.on_train_batch_end(trainer, module, None, None, 0)  # type: ignore[arg-type]
        guard.on_train_end(trainer, module)  # type: ignore[arg-type]
    assert not stepped(module.weight, optimizer), "the step the flag skips was applied"
    assert handed.device.type == "cpu" and handed.item() == 1.0
    assert guard.skipped_steps == 1  # the deferred host copy of the flags, read after its event


def test_a_flag_stays_where_the_optimizer_steps_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_cuda(monkeypatch) as device:
        flag = torch.ones((), device="cuda")
        gpu_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2, device="cuda"))], fused=True)
        assert where_it_steps(flag, gpu_optimizer) is flag  # the GPU kernel reads it in stream order: no wait
        host_flag = torch.ones(())
        assert where_it_steps(host_flag, host_step([1.0])[1]) is host_flag
    assert device.late_copies == 0


# ------------------------------------------------------------------------------------------ 16-mixed
@pytest.mark.usefixtures("one_rank_group")
def test_the_sharded_scaler_under_offload_skips_an_overflowed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_cuda(monkeypatch) as device:
        scaler = shard_aware_scaler(torch.amp.GradScaler("cuda"), "cpu")  # what gym_fsdp makes under offload
        assert isinstance(scaler, GymShardedGradScaler)
        param, optimizer = host_step([1.0, INF, 1.0])
        scaled = scaler.scale(torch.ones((), device="cuda"))
        assert scaled.device.type == "cuda" and scaled.item() == 2.0**16
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    assert device.late_copies == 0 and not stepped(param, optimizer)
    assert scaler.get_scale() == 2.0**15  # backed off


@pytest.mark.usefixtures("one_rank_group")
def test_the_sharded_scaler_clamps_the_flags_summed_over_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks that both overflowed sum their flags to 2; torch's fused kernels skip only where it is 1."""
    param, optimizer = host_step([1.0, INF, 1.0])
    scaler = GymShardedGradScaler("cpu")
    start_grad_scaler_on(scaler, torch.device("cpu"))

    def summed_over_two_ranks(tensor: torch.Tensor, **kwargs: object) -> SimpleNamespace:
        tensor.mul_(2)
        return SimpleNamespace(wait=lambda: None)

    monkeypatch.setattr(torch.distributed, "all_reduce", summed_over_two_ranks)
    scaler.unscale_(optimizer)
    assert [f.item() for f in grad_scaler_found_infs(scaler, optimizer).values()] == [1.0]
    scaler.step(optimizer)
    assert not stepped(param, optimizer)


def test_only_a_plain_grad_scaler_is_replaced() -> None:
    plain = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    sharded = shard_aware_scaler(plain, "cpu")
    assert isinstance(sharded, GymShardedGradScaler) and sharded.get_scale() == 1024.0
    assert sharded.get_growth_interval() == 7
    assert shard_aware_scaler(sharded, "cpu") is sharded and shard_aware_scaler(None, "cpu") is None
