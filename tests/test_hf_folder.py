"""Export to a Hugging Face folder (full and LoRA-merged, by the HFExport callback), atomic writes, and loading from
folders and presets."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

from gym_lightning import CausalLMDataModule, CausalLMModule, HFExport, LoRAArgs
from gym_lightning.atomic import atomic_directory
from gym_lightning.errors import GymUserError
from gym_lightning.hf_folder import ExportSource, hf_tensors, write_export
from gym_lightning.lazy import LazyTensor, eager
from gym_lightning.models import build_causal_lm
from gym_lightning.tokenizer import load_tokenizer

SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64}
PROBE = torch.tensor([[5, 9, 12, 40, 7, 3, 22, 8]])


def fit_briefly(module: pl.LightningModule, root: Path, export: HFExport, data: Any = None) -> None:
    trainer = pl.Trainer(
        max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, callbacks=[export],
    )  # fmt: skip
    trainer.fit(module, data if data is not None else CausalLMDataModule(dataset="addition", batch_size=16))


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def test_export_round_trip_matches_module_logits(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    module = CausalLMModule("tiny-qwen3", config_overrides=SMALL, lr=1e-2)
    fit_briefly(module, tmp_path, HFExport(output_dir=str(out)))
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert not any(name.endswith(".bin") for name in names)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(reloaded), logits(module.model), rtol=1e-5, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("12+34=")["input_ids"]) == "12+34="


def test_lora_trains_adapters_only_and_exports_merged(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    lora = LoRAArgs(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    module = CausalLMModule("tiny-llama", config_overrides=SMALL, lr=5e-2, lora=lora)
    module.configure_model()
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    fit_briefly(module, tmp_path, HFExport(output_dir=str(out)))
    lora_b = [p for n, p in module.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in lora_b), "the adapters did not train, so the merge would prove nothing"
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    torch.testing.assert_close(logits(reloaded), logits(module.model), rtol=1e-4, atol=1e-5)


class OwnLM(pl.LightningModule):
    """Not a CausalLMModule: the HF model under another name, no tokenizer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_causal_lm("tiny-llama", config_overrides=SMALL).train()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_export_works_for_any_module_holding_an_hf_model(tmp_path: Path) -> None:
    module, out = OwnLM(), tmp_path / "hf"
    before = logits(module.net).clone()
    module.net.train()
    fit_briefly(module, tmp_path, HFExport(output_dir=str(out)), DataLoader(PROBE.repeat(6, 1), batch_size=2))
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "generation_config.json"}
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(reloaded), logits(module.net), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(reloaded), before), "the model did not train, so the export proves little"


class NoHFModel(OwnLM):
    """No submodule with ``save_pretrained``: nothing HFExport could write."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.net = torch.nn.Linear(8, 8)
        self.steps = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return self.net(batch.float()).pow(2).mean()


def test_export_without_output_dir_writes_nothing_and_needs_no_hf_model(tmp_path: Path) -> None:
    fit_briefly(NoHFModel(), tmp_path, HFExport(), DataLoader(PROBE.repeat(6, 1), batch_size=2))
    assert list(tmp_path.iterdir()) == []


def test_export_without_an_hf_model_fails_before_training(tmp_path: Path) -> None:
    module = NoHFModel()
    with pytest.raises(GymUserError, match="HFExport found no Hugging Face model in NoHFModel"):
        fit_briefly(module, tmp_path, HFExport(output_dir=str(tmp_path / "hf")), DataLoader(PROBE, batch_size=1))
    assert module.steps == 0, "trained although the export could never succeed"


def _source(tensors: dict[str, torch.Tensor], scaling: float | None = None, base: Any = None) -> ExportSource:
    lazy = {key: eager(value) for key, value in tensors.items()}
    return ExportSource(
        lazy, base if base is not None else torch.nn.Module(), object() if scaling else None, scaling, None
    )


def test_lora_merges_by_hand_and_adapters_keep_peft_names() -> None:
    state = {
        "base_model.model.proj.base_layer.weight": torch.ones(2, 3),
        "base_model.model.proj.lora_A.default.weight": torch.tensor([[1.0, 0.0, 2.0]]),
        "base_model.model.proj.lora_B.default.weight": torch.tensor([[1.0], [3.0]]),
        "base_model.model.norm.weight": torch.ones(3),
    }
    merged = {key: value.load() for key, value in hf_tensors(_source(state, scaling=0.5), "merged").items()}
    assert set(merged) == {"proj.weight", "norm.weight"}
    torch.testing.assert_close(merged["proj.weight"], torch.tensor([[1.5, 1.0, 2.0], [2.5, 1.0, 4.0]]))
    adapter = hf_tensors(_source(state, scaling=0.5), "adapter")
    assert set(adapter) == {"base_model.model.proj.lora_A.weight", "base_model.model.proj.lora_B.weight"}


class CountingTensors:
    """Lazy tensors that count how many bytes they have handed out and are still alive (weakref finalizers)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.live = self.peak = 0
        self.tensors = {key: LazyTensor((size,), torch.float32, self._loader(size)) for key, size in sizes.items()}

    def _loader(self, size: int) -> Any:
        def load() -> torch.Tensor:
            tensor = torch.ones(size)
            self.live += tensor.nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._release, tensor.nbytes)
            return tensor

        return load

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes


def test_export_holds_one_tensor_at_a_time(tmp_path: Path) -> None:
    sizes = {f"layer{i}.weight": 1000 + 100 * i for i in range(12)}  # 4.0-8.4 kB each, 74.4 kB in all
    counting = CountingTensors(sizes)
    base = build_causal_lm("tiny-llama", config_overrides=SMALL)
    source = ExportSource(counting.tensors, base, None, None, None)
    out = write_export(source, tmp_path / "hf", max_shard_size=20_000, dtype="float32")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 5 and index["metadata"]["total_size"] == 4 * sum(sizes.values())
    assert counting.peak == 4 * max(sizes.values()), f"{counting.peak} bytes alive at once: more than one tensor"
    assert counting.live == 0
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert files[0] == "model-00001-of-00005.safetensors"


def test_export_writes_the_source_dtype_shards_and_drops_tied_weights_like_save_pretrained(tmp_path: Path) -> None:
    source_dir = tmp_path / "bf16"
    build_causal_lm("tiny-llama", config_overrides=SMALL).to(torch.bfloat16).save_pretrained(source_dir)
    load_tokenizer(None).save_pretrained(source_dir)
    module = CausalLMModule(str(source_dir), torch_dtype="float32", lr=1e-2)
    fit_briefly(module, tmp_path, HFExport(output_dir=str(tmp_path / "hf"), max_shard_size="40kB"))
    assert next(module.model.parameters()).dtype == torch.float32, "trained in fp32"
    out = tmp_path / "hf"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"], "tied to the embeddings: save_pretrained stores it once"
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert next(reloaded.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(reloaded.lm_head.weight, reloaded.model.embed_tokens.weight)
    expected = {k: v.to(torch.bfloat16) for k, v in module.model.state_dict().items()}
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_export_settings_are_checked_together() -> None:
    pattern = r"(?s)HFExport \(3 problem\(s\)\):.*lora='both'.*dtype='fp8'.*max_shard_size 'big'"
    with pytest.raises(GymUserError, match=pattern):
        HFExport(output_dir="out", lora="both", dtype="fp8", max_shard_size="big")  # type: ignore[arg-type]


def test_adapter_export_of_a_model_without_adapters_fails_before_training(tmp_path: Path) -> None:
    module = CausalLMModule("tiny-llama", config_overrides=SMALL)
    with pytest.raises(GymUserError, match=r"lora=.adapter.*has none"):
        fit_briefly(module, tmp_path, HFExport(output_dir=str(tmp_path / "hf"), lora="adapter"))


def test_atomic_directory_keeps_the_old_folder_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "export"
    with atomic_directory(target) as staging:
        (staging / "a.txt").write_text("first")
    with pytest.raises(RuntimeError), atomic_directory(target) as staging:
        (staging / "a.txt").write_text("half")
        raise RuntimeError("killed while writing")
    assert (target / "a.txt").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["export"], "no staging folder may be left behind"


def test_local_folder_loads_its_weights(tmp_path: Path) -> None:
    source = build_causal_lm("tiny-llama", config_overrides=SMALL)
    source.save_pretrained(tmp_path / "folder")
    module = CausalLMModule(str(tmp_path / "folder"), tokenizer=None)
    module.configure_model()
    torch.testing.assert_close(logits(module.model), logits(source))


def test_config_only_folder_needs_pretrained_false(tmp_path: Path) -> None:
    build_causal_lm("tiny-llama", config_overrides=SMALL).config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="pretrained=false"):
        build_causal_lm(str(tmp_path))
    model = build_causal_lm(str(tmp_path), pretrained=False)
    assert model.config.num_hidden_layers == 2


def test_unreachable_hub_name_says_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"local folder.*preset: tiny-llama, tiny-qwen3"):
        build_causal_lm("no-such-org/no-such-model-xyz")


def test_unknown_config_override_is_named() -> None:
    with pytest.raises(ValueError, match="num_layerz"):
        build_causal_lm("tiny-llama", config_overrides={"num_layerz": 2})


def test_remote_code_is_off_by_default() -> None:
    assert CausalLMModule().hparams.trust_remote_code is False


@pytest.mark.parametrize(("preset", "count"), [("tiny-llama", 492_160), ("tiny-qwen3", 492_288)])
def test_presets_are_real_architectures_of_a_few_hundred_thousand_parameters(preset: str, count: int) -> None:
    model = build_causal_lm(preset)
    assert type(model).__name__ == {"tiny-llama": "LlamaForCausalLM", "tiny-qwen3": "Qwen3ForCausalLM"}[preset]
    assert sum(p.numel() for p in model.parameters()) == count
