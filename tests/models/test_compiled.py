"""The opt-in fast path's compilation (``models.compiled``): per-decoder-layer ``torch.compile`` gives eager's losses
and gradients, keeps the model's names, compiles once for every layer and every sequence length of the data module's
variable-length batches, and composes with gradient checkpointing, LoRA, the chunked loss and QLoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch._dynamo
from helpers.families import make_family_folder
from torch._dynamo.utils import counters

from gym_lightning import CausalLMDataModule, CausalLMModule
from gym_lightning.errors import GymUserError
from gym_lightning.models.compiled import CompileArgs, compile_layers
from gym_lightning.models.decoder_layers import decoder_layers

SMALL = {"num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64}


class StepRecord(pl.Callback):
    """Per optimizer step: the loss, the batch's sequence length, dynamo's graph count; first-step gradients."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lengths: list[int] = []
        self.padded: list[bool] = []
        self.graphs: list[int] = []
        self.grads: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, _: int):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.lengths.append(int(batch["input_ids"].shape[1]))
        mask = batch.get("attention_mask")
        self.padded.append(mask is not None and not bool(mask.all()))
        self.graphs.append(counters["stats"]["unique_graphs"])

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def fit(
    data_file: Path, steps: int = 4, precision: str = "32-true", **module_args: Any
) -> tuple[StepRecord, CausalLMModule]:
    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(5)
    module = CausalLMModule(**{"attn_implementation": "sdpa", "lr": 1e-3, "fused_ops": False, **module_args})
    data = CausalLMDataModule(train_files=str(data_file), batch_size=2, seed=3)
    record = StepRecord()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=[record], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision=precision,
    )  # fmt: skip
    trainer.fit(module, data)
    return record, module


def assert_compiled_once_per_mask_kind(record: StepRecord) -> None:
    """A new length never compiles again; a batch without padding gets no mask (transformers hands SDPA
    ``is_causal`` then, its flash kernel), a padded one a mask tensor: one graph each, the first time it comes."""
    steps = range(len(record.graphs))
    new_kind = [step == 0 or record.padded[step] not in record.padded[:step] for step in steps]
    grew = [step == 0 or record.graphs[step] > record.graphs[step - 1] for step in steps]
    assert record.graphs[0] > 0, record.graphs
    assert all(new_kind[step] or not grew[step] for step in steps), (record.graphs, record.padded, record.lengths)


def assert_same_training(eager: StepRecord, compiled: StepRecord) -> None:
    # fp32 on CPU: inductor's fused kernels reorder sums (measured up to ~1e-7 relative), far inside 1e-5.
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-5, atol=0)
    assert compiled.grads.keys() == eager.grads.keys() and eager.grads
    for name, grad in eager.grads.items():
        torch.testing.assert_close(compiled.grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_compiled_layers_train_as_eager_and_compile_once_for_every_length(variable_length_jsonl: Path) -> None:
    eager, eager_module = fit(variable_length_jsonl, model="tiny-llama", config_overrides=SMALL)
    compiled, module = fit(variable_length_jsonl, model="tiny-llama", config_overrides=SMALL, compile=True)
    assert_same_training(eager, compiled)
    assert len(set(compiled.lengths)) >= 3, compiled.lengths  # the data module's batches differ in length
    # One graph for the three layers and every length.
    assert_compiled_once_per_mask_kind(compiled)
    assert eager.graphs == [0] * len(eager.graphs)
    assert list(module.model.state_dict()) == list(eager_module.model.state_dict())  # names unchanged


def test_compiled_layers_compose_with_checkpointing_lora_and_the_chunked_loss(variable_length_jsonl: Path) -> None:
    settings = {
        "model": "tiny-qwen3",
        "config_overrides": SMALL,
        "gradient_checkpointing": True,
        "lora": {"r": 4, "alpha": 8, "target_modules": ["all-linear"]},
        "loss_chunking": "on",
        "loss_chunk_tokens": 8,
    }
    eager, _ = fit(variable_length_jsonl, steps=3, **settings)
    compiled, module = fit(variable_length_jsonl, steps=3, compile=True, **settings)
    assert_same_training(eager, compiled)
    assert module.engine.chunked(module.model)
    assert_compiled_once_per_mask_kind(compiled)


@pytest.mark.slow
def test_compiled_layers_compose_with_qlora(variable_length_jsonl: Path, tmp_path: Path) -> None:
    folder = make_family_folder("llama", tmp_path / "llama")
    settings = {
        "model": str(folder),
        "lora": {"r": 4, "alpha": 8, "target_modules": ["all-linear"]},
        "quantization": {"compute_dtype": "float32"},
        "torch_dtype": "float32",  # the folder's config says bfloat16: bf16 layers differ by bf16 rounding (0.3 %)
    }
    eager, _ = fit(variable_length_jsonl, steps=3, **settings)
    compiled, _ = fit(variable_length_jsonl, steps=3, compile=True, **settings)
    assert_same_training(eager, compiled)
    assert_compiled_once_per_mask_kind(compiled)


def test_compile_layers_finds_every_decoder_layer_once() -> None:
    module = CausalLMModule("tiny-llama", config_overrides=SMALL, pretrained=False)
    module.configure_model()
    layers = decoder_layers(module.model)
    assert layers == list(module.model.model.layers)
    assert compile_layers(module.model, CompileArgs(backend="eager")) == 3
    # The layer itself is unchanged (no OptimizedModule wrapper): only its instance forward is the compiled one.
    assert all(type(layer).__name__ == "LlamaDecoderLayer" and "forward" in vars(layer) for layer in layers)


def test_bad_compile_settings_are_reported_together() -> None:
    with pytest.raises(GymUserError) as error:
        CausalLMModule("tiny-llama", compile={"mode": "reduce-overhead", "backend": ""}, mlp_tile_tokens=64)
    message = str(error.value)
    assert "CUDA graphs" in message and "compile.backend" in message and "mlp_tile_tokens" in message


def test_fast_path_settings_load_back_from_a_checkpoint_weights_only(tmp_path: Path) -> None:
    module = CausalLMModule("tiny-llama", compile=CompileArgs(mode="max-autotune-no-cudagraphs"), fused_ops=True)
    torch.save({"hyper_parameters": dict(module.hparams)}, tmp_path / "hp.ckpt")
    loaded = torch.load(tmp_path / "hp.ckpt", weights_only=True)["hyper_parameters"]  # gym_lightning allow-lists them
    again = CausalLMModule(**{**loaded, "model": "tiny-llama"})
    assert again.compile_args == module.compile_args and again.fused_ops == module.fused_ops is not None


def test_compiled_layers_under_bf16_mixed_keep_fp32_weights_and_state(variable_length_jsonl: Path) -> None:
    """The fast path computes in bf16 under autocast, as bf16-mixed does, with fp32 weights and AdamW state."""
    settings = {"model": "tiny-qwen3", "config_overrides": SMALL, "fused_ops": True}
    eager, _ = fit(variable_length_jsonl, steps=2, precision="bf16-mixed", **{**settings, "fused_ops": False})
    compiled, module = fit(variable_length_jsonl, steps=2, precision="bf16-mixed", compile=True, **settings)
    # bf16 matmuls: kernels that fuse differently round differently (bf16 has 8 bits of mantissa).
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=2e-2, atol=0)
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    state = module.trainer.optimizers[0].state
    assert state and {t.dtype for s in state.values() for t in s.values() if t.dim() > 0} == {torch.float32}
    assert all(g.dtype == torch.float32 for g in compiled.grads.values())


def test_generation_with_a_kv_cache_runs_the_eager_layers() -> None:
    """A KV cache is Python state dynamo would guard on per layer (a graph per layer and cache length): calls that
    carry one take the eager forward, and generate the same tokens as an uncompiled model."""
    torch._dynamo.reset()
    counters.clear()
    module = CausalLMModule("tiny-llama", config_overrides=SMALL, pretrained=False, attn_implementation="sdpa")
    module.configure_model()
    model = module.model.eval()
    prompt = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
    compile_layers(model, CompileArgs())
    assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False), expected)
    assert counters["stats"]["unique_graphs"] == 0


def test_the_chunked_loss_reads_the_decoders_output_and_never_a_models_own() -> None:
    from gym_lightning.engine import decoder_output

    module = CausalLMModule("tiny-llama", config_overrides=SMALL, pretrained=False)
    module.configure_model()
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with decoder_output(module.model) as captured:
        reference = module.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[-1]
    assert captured.hooked and torch.equal(captured.value, reference)  # after the final norm, as hidden_states[-1]
    with decoder_output(module.model.model) as captured:  # get_decoder() of a decoder is the model itself
        module.model.model(input_ids=ids)
    assert not captured.hooked and captured.value is None


@pytest.fixture
def restores_dynamo_ddp_mode() -> Any:
    from gym_lightning._compat import dynamo_ddp_mode, set_dynamo_ddp_mode

    before = dynamo_ddp_mode()
    yield
    set_dynamo_ddp_mode(before)


def test_dynamo_ddp_setting_exists_and_takes_both_modes(restores_dynamo_ddp_mode: None) -> None:
    """``_compat``'s private dynamo setting: ``torch._dynamo.config.optimize_ddp`` with the modes gym sets."""
    from gym_lightning._compat import DYNAMO_DDP_MODES, dynamo_ddp_mode, set_dynamo_ddp_mode

    assert hasattr(torch._dynamo.config, "optimize_ddp")
    for mode in DYNAMO_DDP_MODES:
        set_dynamo_ddp_mode(mode)
        assert torch._dynamo.config.optimize_ddp == mode and dynamo_ddp_mode() == mode
    with pytest.raises(ValueError, match="python_reducer"):
        set_dynamo_ddp_mode("python_reducer")


@pytest.mark.parametrize(("buckets", "mode"), [(False, "no_optimization"), (True, "ddp_optimizer")])
def test_compiled_layers_are_one_graph_under_ddp_unless_asked(
    buckets: bool, mode: str, restores_dynamo_ddp_mode: None
) -> None:
    """``compile.ddp_buckets`` picks dynamo's DDP mode (tests/strategies/test_compiled_strategies.py counts the
    graphs per layer it gives at world size 2)."""
    from transformers import AutoModelForCausalLM

    from gym_lightning._compat import dynamo_ddp_mode
    from gym_lightning.models.presets import preset_config

    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    assert compile_layers(model, CompileArgs.from_value({"ddp_buckets": buckets})) == 2
    assert dynamo_ddp_mode() == mode
