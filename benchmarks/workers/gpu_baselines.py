"""The GPU bench's baselines (benchmarks/workers/gpu_bench.py's ``plain``, ``hf_trainer`` and ``plain_compiled``
runs) and the step timing every run shares: a plain PyTorch loop and ``transformers.Trainer`` on the gym runs'
batches, with the same optimizer, learning rate and precision. They import neither Lightning nor gym_lightning
before their timed steps are done (``plain_compiled`` imports gym_lightning for its one compile function).
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path
from typing import Any

LR = 1e-5


def describe_optimizer(inner: Any, outer: Any = None) -> str:
    fused = any(group.get("fused") for group in inner.param_groups)
    wrapped = f"{type(outer).__name__} over " if outer is not None and inner is not outer else ""
    return f"{wrapped}{type(inner).__module__}.{type(inner).__name__} (fused={fused})"


def synchronised_clock(device_type: str) -> float:
    """``time.perf_counter()`` once the device has finished what was queued (CUDA); the host clock on a CPU."""
    if device_type == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def step_figures(warmup_seconds: list[float], tokens_per_step: int, tokens_per_sec: float | None) -> dict[str, Any]:
    """The warm-up steps' seconds, the steady step (the timed steps' mean: tokens a step / tokens a second) and the
    compile time, the first step less a steady one (issue 47's convention)."""
    first = warmup_seconds[0] if warmup_seconds else None
    steady = tokens_per_step / tokens_per_sec if tokens_per_sec else None
    return {
        "first_step_seconds": first,
        "warmup_step_seconds": warmup_seconds,
        "steady_step_seconds": steady,
        "compile_seconds": first - steady if first is not None and steady is not None else None,
    }


def batch_spec(args: argparse.Namespace) -> dict[str, int]:
    return {"batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup}


def token_ids(args: argparse.Namespace, vocab: int) -> list[Any]:
    """The input ids of ``dist_bench.make_batches`` at rank 0, drawn alike (same generator, seed and order) without
    importing it: it imports Lightning and gym_lightning, which the baselines do not run."""
    import torch

    generator = torch.Generator().manual_seed(1000)
    shape = (args.batch_size, args.seq_len)
    return [torch.randint(0, vocab, shape, generator=generator) for _ in range(args.warmup + args.steps)]


class SyncClock:
    """Host clock before the first step, at the end of each warm-up step and of the last step, each read after
    synchronising the device (the baselines queue their kernels asynchronously; the timed steps between the end of
    the warm-up and the last step get no synchronisation), as ``warmup_timer`` does for the Lightning runs."""

    def __init__(self, device: Any, warmup: int, last: int) -> None:
        self.device, self.warmup, self.last = device, warmup, last
        self.t0 = self.t1 = 0.0
        self.stamps: list[float] = []

    def start(self) -> None:
        """Before the first step (once)."""
        if not self.stamps:
            self.stamps.append(synchronised_clock(self.device.type))

    def step_end(self, step: int) -> None:
        """``step``: optimizer steps finished so far (1-based)."""
        if step > self.warmup and step != self.last:
            return
        now = synchronised_clock(self.device.type)
        if step <= self.warmup:
            self.stamps.append(now)
        if step == self.warmup:
            self.t0 = now
        if step == self.last:
            self.t1 = now

    def warmup_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


def baseline_model(model_dir: str, device: Any) -> Any:
    """The model in fp32 with SDPA, its random initialisation drawn on ``device`` (a 1.7B draw on the host alone
    takes tens of seconds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.train()


def fused_adamw(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)


def plain_loop(model: Any, batches: list[Any], clock: SyncClock) -> dict[str, Any]:
    """The loop a user writes: bf16 autocast, the model's own loss on ``labels=input_ids``, no clipping."""
    import torch

    optimizer = fused_adamw(model)
    loss = None
    clock.start()
    for step, batch in enumerate(batches, start=1):
        ids = batch.to(clock.device, non_blocking=True)
        with torch.autocast(clock.device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step_end(step)
    return {"optimizer": describe_optimizer(optimizer), "last_loss": float(loss) if loss is not None else None}


def hf_trainer_loop(model: Any, batches: list[Any], clock: SyncClock, args: argparse.Namespace) -> dict[str, Any]:
    """``transformers.Trainer`` with the plain loop's settings, on the same rows (``labels`` = ``input_ids``)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    class Clock(TrainerCallback):
        def on_step_begin(self, _args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.start()

        def on_step_end(self, _args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.step_end(state.global_step)

    # In order (the Trainer's random sampler may reorder them: the same tokens either way).
    rows = [{"input_ids": ids, "labels": ids} for batch in batches for ids in batch]
    settings = TrainingArguments(
        output_dir=str(Path(args.work) / "hf_trainer"),
        per_device_train_batch_size=args.batch_size,
        max_steps=len(batches),
        learning_rate=LR,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        optim="adamw_torch_fused",
        bf16=True,
        max_grad_norm=0.0,  # no clipping, as the plain loop
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=args.cpu_smoke,
        seed=0,
    )
    trainer = Trainer(
        model=model, args=settings, train_dataset=rows, data_collator=default_data_collator, callbacks=[Clock()]
    )
    output = trainer.train()
    outer = trainer.optimizer  # accelerate's wrapper around the torch AdamW
    return {
        "optimizer": describe_optimizer(getattr(outer, "optimizer", outer), outer),
        "mean_loss": output.training_loss,
    }


def run_baseline(args: argparse.Namespace, strategy: str, vocab: int) -> dict[str, Any]:
    """One baseline run; its throughput figures on the gym runs' conventions."""
    import torch

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    batches = token_ids(args, vocab)
    model = baseline_model(args.model, device)
    compiled = 0
    if strategy == "plain_compiled":  # the fast path's per-layer compile, nothing else of gym_lightning
        from gym_lightning.models.compiled import CompileArgs, compile_layers

        compiled = compile_layers(model, CompileArgs())
    clock = SyncClock(device, args.warmup, args.warmup + args.steps)
    loop = partial(hf_trainer_loop, args=args) if strategy == "hf_trainer" else plain_loop
    figures = loop(model, batches, clock) | {"compiled_layers": compiled}
    tokens_per_sec = args.steps * args.batch_size * args.seq_len / (clock.t1 - clock.t0)
    figures |= {"tokens_per_sec": tokens_per_sec, "clock_tokens_per_sec": tokens_per_sec}
    figures |= step_figures(clock.warmup_seconds(), args.batch_size * args.seq_len, tokens_per_sec)
    return figures | model_flops(model, device, args.seq_len, tokens_per_sec)


def model_flops(model: Any, device: Any, seq_len: int, tokens_per_sec: float) -> dict[str, Any]:
    """MFU and TFLOP/s of a baseline by ThroughputCallback's convention (imported after the timed steps: gym_lightning
    is not what the baselines run)."""
    import torch

    from gym_lightning.metrics.flops import transformer_flops
    from gym_lightning.metrics.peak_flops import dense_peak_flops

    flops = transformer_flops(model, model.config)
    achieved = flops.per_token(seq_len) * tokens_per_sec
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = dense_peak_flops(name, "bf16") if device.type == "cuda" else None
    return {
        "mfu": achieved / peak if peak else None,
        "device_tflops_per_sec": achieved / 1e12,
        "device": name,
        "flops": {"trainable_params": flops.trainable_params, "per_token": flops.per_token(seq_len)},
    }
