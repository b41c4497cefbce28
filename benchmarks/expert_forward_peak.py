"""Peak host memory and time of one MoE training step with LoRA on the experts: gym's routed forward vs peft's.

    python -m benchmarks.expert_forward_peak               # Qwen3-30B-A3B and moe-400m layers at 512 and 2,048 tokens
    python -m benchmarks.expert_forward_peak --layers moe-400m --tokens 512       # a quick look
    python -m benchmarks.expert_forward_peak --render-only --write-docs           # table from the saved results

One real-size mixture-of-experts decoder layer (a ``Qwen3MoeConfig`` with ``num_hidden_layers=1`` and a 1,024-token
vocabulary, so the embedding and the head weigh nothing beside the experts), built in bf16 on the CPU with LoRA r=16
(alpha 32) on ``all-experts`` (``experts.gate_up_proj``, ``experts.down_proj``) and the attention projections
(``gym_lightning.lora.apply_lora``; the adapters in fp32, peft's default), then one training step (forward with the
labels = the inputs + backward, bf16 weights, no autocast) on 1 x T random tokens, under:

- ``peft``: peft's own ``ParamWrapper`` forward, which parametrises each fused expert weight as ``W + s * B @ A`` for
  all E experts (``_LoraFactorsProxy``, one ``baddbmm`` into a new ``[E, out, in]`` tensor) and runs transformers'
  experts forward on it (``grouped_mm`` here); the parametrised weight is kept for the backward, which also makes
  its gradient, another ``[E, out, in]`` tensor;
- ``gym``: the same model after ``models.experts.install_routed_experts``: the (token, slot) pairs grouped by expert
  on the device, then for each expert the tokens are routed to, a view of its weight and its low-rank path
  ``s * (x @ A_e.T) @ B_e.T``; nothing of expert size is made.

Each (layer, tokens, variant) runs in its own fresh process. A thread reads the RSS (``VmRSS``, through
``gym_lightning.metrics.memory.host_rss_bytes``: ``benchmarks.common.memory.PeakSampler``) every millisecond; the
peak is above the RSS just before the step, once the garbage is collected and glibc's freed heap is returned
(``malloc_trim``); for the first step that is the baseline taken once the model is built, adapted, its adapters
given random values (lora_B starts at 0) and one 8-token warm-up step run (kernels and thread pools loaded). The
peak is the largest over ``--steps`` steps, the step time the fastest. The two variants' losses and adapter
gradients (of the first step) are compared in the parent process: the two forwards do the same work in a different
order, so they agree to bf16 rounding.

Theory: peft's step holds, beyond gym's, the parametrised weight ``W'`` of every adapted expert weight (E x out x in x
2 bytes, made in forward, kept until its backward runs) and, in backward, the gradient of one of them at a time
(``grouped_mm``'s weight gradient, the same size, consumed by ``baddbmm``'s backward): ``down_proj``'s backward runs
first (both W' alive), then ``gate_up_proj``'s (``down_proj``'s W' freed), so the extra is W_gu + max(W_gu, 2 x W_d),
1.5 GiB for a Qwen3-30B-A3B layer (W_gu = 768 MiB, W_d = 384 MiB). peft 0.21 folds one adapter into the weight
(``_LoraFactorsProxy``: ``baddbmm(W, B, A)``), so no separate delta is made; with several adapters or fp8 weights it
makes the delta too (``_LoraParameterProxy``), and 2 x the expert weights (2.25 GiB) is the bound either way.
gym's step holds the routed experts' activations only, estimated as what autograd saves per routed (token, expert)
pair: the adapter's fp32 copy of the input (4h bytes), the gate/up output for the gate's backward (3 x 2I bytes
over silu and the product), the fp32 copy of the gated activation for the down adapter (4I), the down output for the
routing weight's gradient (2h): T x k x (6h + 10I) bytes; attention, logits and the router add to both alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.docs import write_section
from benchmarks.common.launch import child_env, python_module
from benchmarks.common.memory import PeakSampler, rss
from benchmarks.common.models import SIZES
from benchmarks.common.paths import MIB, REPO_ROOT

SECTION = "## MoE expert LoRA: peak of one training step, gym's routed forward vs peft's"
VARIANTS = ("peft", "gym")
LORA = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "target_parameters": ["all-experts"]}  # fmt: skip
# One decoder layer with a small vocabulary: the experts are what is measured, not the embedding and head.
ONE_LAYER = {"num_hidden_layers": 1, "vocab_size": 1024, "tie_word_embeddings": False}
LAYERS: dict[str, dict[str, Any]] = {
    # Qwen3-30B-A3B's decoder layer (its config.json): 128 experts, top-8, 32 query / 4 key-value heads of 128.
    "qwen3-30b-a3b": {"hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "norm_topk_prob": True, **ONE_LAYER},
    "moe-400m": {**{k: v for k, v in SIZES["moe-400m"].items() if k != "model_type"}, **ONE_LAYER},
    # For the smoke test (tests/test_benchmarks.py): seconds.
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "num_hidden_layers": 1, "vocab_size": 128, "tie_word_embeddings": False},
}  # fmt: skip
# Random adapters of this std on both factors: delta = 2 * 16 * 0.02^2 ~ 0.013 std per entry, beside weights of
# std 0.02: the experts' adapters change the output measurably, and the bf16 rounding of peft's W + delta (2^-8 of
# W) stays far below the delta.
ADAPTER_STD = 0.02
WARMUP_TOKENS = 8
# bf16 agreement: the two forwards sum the same products in different orders, each rounding to bf16 (2^-8 = 0.4 %
# per operation); an error over these means they did not do the same work.
LOSS_RTOL = 1e-2
GRAD_RTOL = 5e-2


def build(layer: str, variant: str) -> Any:
    """The one-layer model of ``LAYERS[layer]`` in bf16 with LoRA (``LORA``) and seeded random adapters, gym's
    routed forward installed for ``variant == "gym"``; the same weights in every process."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from gym_lightning.lora import LoRAArgs, apply_lora
    from gym_lightning.models.experts import expert_targets, install_routed_experts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**LAYERS[layer]), dtype=torch.bfloat16)
    model = apply_lora(model, LoRAArgs.from_value(LORA), expert_targets(model))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * ADAPTER_STD)
    if variant == "gym" and install_routed_experts(model) == 0:
        raise RuntimeError(f"install_routed_experts found no adapted experts in the {layer} layer")
    return model.train()


def step(model: Any, tokens: int) -> tuple[float, dict[str, Any]]:
    """One forward + backward on 1 x ``tokens`` seeded random ids; returns the loss and the trainable parameters'
    gradients (fp32, cleared from the model)."""
    import torch

    ids = torch.randint(model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grads[name] = param.grad.float() if param.grad is not None else None
            param.grad = None
    return float(loss), grads


def _released_rss() -> int:
    """RSS once the garbage is collected and glibc has handed its freed heap back (``malloc_trim``): what a step's
    peak is measured above, so that what an earlier step freed but the heap kept does not count twice."""
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss()


def measure(layer: str, variant: str, tokens: int, steps: int, grads_file: Path) -> dict[str, Any]:
    """Build, warm up, then ``steps`` measured steps, each one's peak RSS above the released RSS just before it
    (the post-build baseline for the first) and its seconds; the first step's loss and gradients go to
    ``grads_file``."""
    import torch

    model = build(layer, variant)
    step(model, WARMUP_TOKENS)  # kernels, thread pools and the allocator's first arenas
    baseline = _released_rss()
    peaks, seconds, loss = [], [], 0.0
    for index in range(steps):
        before = _released_rss()
        start = time.perf_counter()
        with PeakSampler(interval=0.001) as sampler:
            step_loss, grads = step(model, tokens)
        seconds.append(time.perf_counter() - start)
        peaks.append(sampler.peak_bytes() - before)
        if index == 0:
            loss = step_loss
            torch.save({"loss": step_loss, "grads": grads}, grads_file)
        del grads
    return {"baseline_MiB": baseline / MIB, "peak_MiB": max(peaks) / MIB, "peaks_MiB": [p / MIB for p in peaks],
            "seconds": min(seconds), "all_seconds": seconds, "loss": loss,
            "experts_implementation": model.config._experts_implementation}  # fmt: skip


def run_child(workdir: Path, layer: str, variant: str, tokens: int, steps: int) -> dict[str, Any]:
    """``measure`` in a fresh process (its peak is its own); ``{"failed": exit status, "stderr": tail}`` if it
    failed."""
    out = workdir / f"{layer}-{tokens}-{variant}.json"
    command = python_module(__spec__.name, "--role", "child", "--layers", layer, "--variants", variant,
                            "--tokens", str(tokens), "--steps", str(steps), "--workdir", workdir)  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, env=child_env(threads=None), capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        return {"failed": done.returncode, "stderr": done.stderr[-2000:]}
    return json.loads(out.read_text())


def agreement(workdir: Path, layer: str, tokens: int) -> dict[str, Any]:
    """gym's loss and gradients against peft's (the first measured step of each): the loss's relative difference
    and, over the trainable tensors, the largest ``|g_gym - g_peft| / |g_peft|`` (Frobenius norms)."""
    import torch

    peft_run, gym_run = (torch.load(workdir / f"{layer}-{tokens}-{v}.pt") for v in VARIANTS)
    problems = [] if peft_run["grads"].keys() == gym_run["grads"].keys() else ["different trainable tensors"]
    worst, worst_name = 0.0, ""
    for name, expected in peft_run["grads"].items():
        actual = gym_run["grads"].get(name)
        if expected is None or actual is None:
            problems.append(f"{name}: no gradient ({'peft' if expected is None else 'gym'})")
            continue
        error = float((actual - expected).norm() / expected.norm().clamp_min(1e-30))
        if error > worst:
            worst, worst_name = error, name
    loss_error = abs(gym_run["loss"] - peft_run["loss"]) / abs(peft_run["loss"])
    expert_grads = sum("experts" in n and "lora_" in n for n in peft_run["grads"])
    return {"loss_rel": loss_error, "grad_rel": worst, "worst_tensor": worst_name, "expert_adapter_grads": expert_grads,
            "agree": not problems and loss_error <= LOSS_RTOL and worst <= GRAD_RTOL, "problems": problems}  # fmt: skip


def expert_bytes(layer: str) -> int:
    """Bytes of one layer's fused expert weights in bf16: E x (2I x h + h x I) x 2."""
    c = LAYERS[layer]
    return c["num_experts"] * 3 * c["moe_intermediate_size"] * c["hidden_size"] * 2


def peft_extra(layer: str) -> int:
    """peft's parametrised weights and one gradient at a time: W_gu + max(W_gu, 2 x W_d) bytes (docstring)."""
    gate_up, down = 2 * expert_bytes(layer) // 3, expert_bytes(layer) // 3
    return gate_up + max(gate_up, 2 * down)


def routed_activations(layer: str, tokens: int) -> int:
    """The estimate of what gym's routed step saves for its backward: T x k x (6h + 10I) bytes (docstring)."""
    c = LAYERS[layer]
    return tokens * c["num_experts_per_tok"] * (6 * c["hidden_size"] + 10 * c["moe_intermediate_size"])


def _describe(layer: str) -> str:
    c = LAYERS[layer]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return (f"{layer}: hidden {c['hidden_size']}, {c['num_experts']} experts (top-{c['num_experts_per_tok']}, "
            f"moe_intermediate_size {c['moe_intermediate_size']}), {c['num_attention_heads']} q / "
            f"{c['num_key_value_heads']} kv heads of {head_dim}, "
            f"expert weights {expert_bytes(layer) / MIB:,.0f} MiB in bf16")  # fmt: skip


def render(results: dict[str, Any], steps: int) -> str:
    """The markdown section: per layer and token count, each variant's peak above its baseline and step time, the
    difference beside the theory, and the two variants' agreement."""
    lines = [
        SECTION, "",
        f"`python -m benchmarks.expert_forward_peak` (see its docstring). One Qwen3-MoE decoder layer "
        "(`num_hidden_layers=1`, vocabulary 1,024) in bf16 on the CPU, LoRA r=16 alpha=32 on `all-experts` + the "
        "attention projections (fp32 adapters, random values), one training step (forward + backward, no "
        "autocast) on 1 x T tokens; each variant in a fresh process. peft = peft 0.21's own `ParamWrapper` "
        "forward (transformers' `grouped_mm` experts forward on `W + s * B @ A` for all experts); gym = "
        "`models.experts.install_routed_experts`. Peak = the largest RSS (a thread polls `metrics.memory."
        "host_rss_bytes` every 1 ms) during a step minus the RSS just before it (garbage collected, `malloc_trim`; "
        "before the "
        f"first: once the model is built and warmed up with an 8-token step), MiB, the largest of {steps} steps; "
        f"time = the fastest on this machine's 2 shared cores. peft's extra (theory) = its parametrised "
        "`[E, out, in]` weights, kept from forward to their backward, plus the gradient of one at a time: W_gu + "
        "max(W_gu, 2 x W_d) (bf16; the bound 2 x the expert weights holds were both gradients alive at once or the "
        "delta made apart, as peft does for several adapters); "
        "gym's own = the routed activations, T x k x (6h + 10I) bytes. Agreement = gym vs peft: the "
        "loss's relative difference, and the largest relative (Frobenius) error over every adapter gradient "
        f"(targets {LOSS_RTOL:g} and {GRAD_RTOL:g}: bf16 rounding).",
        "",
    ]  # fmt: skip
    layers = list(dict.fromkeys(key.split("/")[0] for key in results))
    lines += [f"- {_describe(layer)}" for layer in layers] + [""]
    lines += [
        "| layer | T | peft peak | gym peak | peft - gym | peft's extra (theory) | 2 x expert weights | "
        "gym's theory (routed activations) | "
        "peft step (s) | gym step (s) | loss rel. diff | worst grad rel. error | agree |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, result in results.items():
        layer, tokens = key.split("/")[0], int(key.split("/")[1])
        runs = [result.get(v, {}) for v in VARIANTS]
        failed = [f"{v} failed (exit {r.get('failed')})" for v, r in zip(VARIANTS, runs, strict=True)
                  if "peak_MiB" not in r]  # fmt: skip
        if failed:
            lines.append(f"| {layer} | {tokens} | {'; '.join(failed)} |" + " |" * 11)
            continue
        peft_run, gym_run = runs
        check = result.get("agreement", {})
        lines.append(
            f"| {layer} | {tokens:,} | {peft_run['peak_MiB']:,.0f} | {gym_run['peak_MiB']:,.0f} | "
            f"{peft_run['peak_MiB'] - gym_run['peak_MiB']:,.0f} | {peft_extra(layer) / MIB:,.0f} | "
            f"{2 * expert_bytes(layer) / MIB:,.0f} | "
            f"{routed_activations(layer, tokens) / MIB:,.0f} | {peft_run['seconds']:.2f} | {gym_run['seconds']:.2f} | "
            f"{check.get('loss_rel', float('nan')):.1e} | {check.get('grad_rel', float('nan')):.1e} | "
            f"{'yes' if check.get('agree') else 'NO'} |"
        )
    lines += [
        "",
        "Step times are CPU times on this machine's 2 cores and move with whatever else runs there (one step, "
        "moe-400m T=512 gym, took 0.1 s in one run and 8.6 s in another): the peaks are the figures; a GPU's times "
        "are owed (`benchmarks/routed_forward_speed.py` times the routed forward alone, side by side). gym's "
        "measured peak is above its routed-activation estimate, which leaves out the attention's activations and "
        "the fp32 adapter gradients; the remainder is not broken down further. gym groups the routed (token, slot) "
        "pairs by expert on the device (one host read per layer), gathers the tokens once and takes each expert's "
        "factors from one `unbind` (their gradient is one stack); the first version indexed the factors expert by "
        "expert, which zero-filled a whole-factor gradient per expert (121 `fill_` and 128 `add_` in a torch "
        "profile of a moe-400m step) and measured 219 / 93 MiB (moe-400m, T=512) and 1,874 / 427 MiB "
        "(Qwen3-30B-A3B, T=512) peft / gym.",
    ]
    return "\n".join(lines) + "\n"


def write_docs(section: str) -> None:
    """Replace this script's section of docs/benchmarks.md (the first time: before the History section)."""
    write_section(SECTION, section)


def run_all(args: argparse.Namespace, results: dict[str, Any], results_file: Path) -> None:
    """Every layer x token count: each variant in its own process, then their agreement; saved as they come."""
    for layer in args.layers:
        for tokens in args.tokens:
            result: dict[str, Any] = {}
            for variant in args.variants:
                print(f"{layer} T={tokens} {variant} ...", file=sys.stderr, flush=True)
                result[variant] = run_child(args.workdir, layer, variant, tokens, args.steps)
                if "failed" in result[variant]:
                    print(result[variant]["stderr"], file=sys.stderr)
            if all("peak_MiB" in result.get(v, {}) for v in VARIANTS):
                result["agreement"] = agreement(args.workdir, layer, tokens)
            for variant in VARIANTS:  # the gradients are compared: not kept (up to 55 MB each)
                (args.workdir / f"{layer}-{tokens}-{variant}.pt").unlink(missing_ok=True)
            results[f"{layer}/{tokens}"] = result
            results_file.write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", nargs="+", default=["qwen3-30b-a3b", "moe-400m"], choices=list(LAYERS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per run (the time is the fastest)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gym-expert-forward")
    parser.add_argument("--render-only", action="store_true", help="rebuild the table from earlier results")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--role", choices=["parent", "child"], default="parent", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.role == "child":
        layer, variant, tokens = args.layers[0], args.variants[0], args.tokens[0]
        result = measure(layer, variant, tokens, args.steps, args.workdir / f"{layer}-{tokens}-{variant}.pt")
        (args.workdir / f"{layer}-{tokens}-{variant}.json").write_text(json.dumps(result))
        return
    results_file = args.workdir / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    if not args.render_only:
        run_all(args, results, results_file)
    section = render(results, args.steps)
    print(section)
    if args.write_docs:
        write_docs(section)


if __name__ == "__main__":
    main()
