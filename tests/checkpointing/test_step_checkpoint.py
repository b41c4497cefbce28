"""Single-process checkpointing tests: atomic saves and keep-k, a crash while saving, safe loading, the non-finite
guard, the resumable loader and random states. The 2-rank SIGKILL/resume/export tests are in
checkpointing/test_resume.py."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from gym_lightning import CausalLMDataModule, CausalLMModule
from gym_lightning.callbacks import NonFiniteGuard, NonFiniteLossError
from gym_lightning.checkpointing import StepCheckpoint, UnsafeCheckpointError, load_weights_only
from gym_lightning.checkpointing.callback import link_atomically, publish, staging_path
from gym_lightning.checkpointing.rng import capture_rng_state, restore_rng_state
from gym_lightning.checkpointing.safe_load import weights_only_checkpoint_engine
from gym_lightning.data.loader import STEP_TOKENS_KEY, StepTokenDataLoader, batches_to_skip
from gym_lightning.errors import GymUserError
from gym_lightning.strategies import GymDDPStrategy

SMALL = {"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}
SMALL["num_key_value_heads"] = 1


def tiny_module(**kwargs: Any) -> CausalLMModule:
    return CausalLMModule("tiny-llama", config_overrides=SMALL, lr=1e-2, scheduler="constant", **kwargs)


def fit(
    module: CausalLMModule, root: Path, callbacks: list[pl.Callback], max_steps: int, **fit_kwargs: Any
) -> pl.Trainer:
    trainer = pl.Trainer(
        max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, callbacks=callbacks, accelerator="cpu", devices=1,
    )  # fmt: skip
    records = [{"prompt": f"{i}+{i}=", "completion": str(2 * i) * (1 + i % 3)} for i in range(48)]
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps(record) + "\n" for record in records))
    trainer.fit(module, CausalLMDataModule(train_files=str(train), batch_size=4, max_seq_length=16), **fit_kwargs)
    return trainer


# ------------------------------------------------------------------------------------------------ periodic + atomic
def test_step_checkpoints_keep_newest_k_and_link_last(tmp_path: Path) -> None:
    fit(tiny_module(), tmp_path, [StepCheckpoint(tmp_path / "ck", every_n_steps=2, keep_last=2)], max_steps=7)
    names = sorted(os.listdir(tmp_path / "ck"))
    # steps 2, 4, 6 by the period, 7 at the end of training; the newest two are kept (each with its manifest);
    # nothing hidden is left over
    manifests = ["step-00000006.ckpt.manifest.json", "step-00000007.ckpt.manifest.json"]
    assert names == sorted(["last.ckpt", "step-00000006.ckpt", "step-00000007.ckpt", *manifests])
    assert os.readlink(tmp_path / "ck" / "last.ckpt") == "step-00000007.ckpt"
    assert load_weights_only(tmp_path / "ck" / "last.ckpt")["global_step"] == 7


def test_a_crash_while_saving_leaves_last_on_the_previous_complete_checkpoint(tmp_path: Path, monkeypatch) -> None:
    original = pl.Trainer.save_checkpoint

    def dies_half_way(self: pl.Trainer, filepath: str | Path, weights_only: bool | None = None, **kwargs: Any) -> None:
        if self.global_step == 4:
            Path(filepath).write_bytes(b"PK\x03\x04 half a checkpoint")
            raise RuntimeError("killed while saving")
        original(self, filepath, weights_only, **kwargs)

    monkeypatch.setattr(pl.Trainer, "save_checkpoint", dies_half_way)
    with pytest.raises(RuntimeError, match="killed while saving"):
        fit(tiny_module(), tmp_path, [StepCheckpoint(tmp_path / "ck", every_n_steps=2)], max_steps=8)
    folder = tmp_path / "ck"
    assert os.readlink(folder / "last.ckpt") == "step-00000002.ckpt"
    assert not (folder / "step-00000004.ckpt").exists(), "a half-written checkpoint must not get a real name"
    assert staging_path(folder / "step-00000004.ckpt").exists()  # it stays hidden; the next save replaces it

    monkeypatch.setattr(pl.Trainer, "save_checkpoint", original)
    callback = StepCheckpoint(folder, every_n_steps=2)
    resumed = fit(tiny_module(), tmp_path, [callback], max_steps=6, ckpt_path="last")
    assert resumed.global_step == 6
    steps = [f"step-0000000{step}.ckpt" for step in (2, 4, 6)]
    assert sorted(os.listdir(folder)) == sorted(["last.ckpt", *steps, *(f"{name}.manifest.json" for name in steps)])


def test_publish_and_link_replace_atomically(tmp_path: Path) -> None:
    old, new = tmp_path / "step-1.ckpt", tmp_path / "step-2.ckpt"
    old.mkdir()
    link_atomically(old, tmp_path / "last.ckpt")
    staging = staging_path(new)
    staging.mkdir()
    (staging / "shard").write_text("complete")
    publish(staging, new)
    link_atomically(new, tmp_path / "last.ckpt")
    assert (tmp_path / "last.ckpt" / "shard").read_text() == "complete" and not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step-1.ckpt", "step-2.ckpt"]


def test_step_checkpoint_settings_are_validated_together() -> None:
    with pytest.raises(ValueError, match=r"every_n_steps must be .*keep_last must be"):
        StepCheckpoint(every_n_steps=0, keep_last=0)


# ------------------------------------------------------------------------------------------------ safe loading
class Payload:
    """Unpickling this calls a function: exactly what weights_only=True exists to refuse."""

    def __reduce__(self) -> tuple[Any, tuple]:
        return (os.getpid, ())


@pytest.mark.parametrize("content", [b"\x80\x02.", b"\x80\x020", b"", b"not a checkpoint\n"])
def test_a_broken_file_is_a_user_error_naming_it(tmp_path: Path, content: bytes) -> None:
    # b"\x80\x02." made torch's weights-only unpickler raise IndexError (pop from an empty stack), which escaped as a
    # traceback: 1 in 15 files of random bytes did (test_cli_errors.py's "random" case failed on CI).
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(content)
    with pytest.raises(GymUserError, match=r"broken\.ckpt' is not a readable PyTorch checkpoint"):
        load_weights_only(broken)


def test_pickle_bearing_checkpoints_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Payload()}, evil)
    with pytest.raises(UnsafeCheckpointError, match=r"weights_only=True.*GLOBAL posix.getpid"):
        load_weights_only(evil)
    with pytest.raises(UnsafeCheckpointError, match="Refused to load"):
        GymDDPStrategy().load_checkpoint(evil)  # the strategies' path (FSDP and ZeRO share refuse_unsafe_pickles)
    with pytest.raises(UnsafeCheckpointError, match="Refused to load"):
        weights_only_checkpoint_engine().load(str(evil))  # DeepSpeed's checkpoint engine as ZeROStrategy installs it
    torch.save({"weights": torch.ones(2)}, tmp_path / "plain.pt")
    assert load_weights_only(tmp_path / "plain.pt")["weights"].sum() == 2


# ------------------------------------------------------------------------------------------------ non-finite guard
class PoisonLoss(pl.Callback):
    """Turn one micro-batch's loss into NaN (through the input of the loss: the model itself stays finite)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at_step:
            summed = module.engine.token_loss
            module.engine.token_loss = lambda m, b: summed(m, b)._replace(loss=summed(m, b).loss * float("nan"))
        elif "token_loss" in vars(module.engine):
            del module.engine.token_loss


def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    module = tiny_module()
    expected = r"loss \(NaN or inf\) on rank\(s\) \[0\] in optimizer step 4 \(epoch 0; 3 steps"
    callbacks = [NonFiniteGuard(), StepCheckpoint(tmp_path / "ck", every_n_steps=1), PoisonLoss(at_step=3)]
    with pytest.raises(NonFiniteLossError, match=expected):
        fit(module, tmp_path, callbacks, max_steps=6)
    assert os.readlink(tmp_path / "ck" / "last.ckpt") == "step-00000003.ckpt"
    state = load_weights_only(tmp_path / "ck" / "last.ckpt")["state_dict"]
    assert all(torch.isfinite(value).all() for value in state.values())


def test_nonfinite_skip_drops_the_step_and_counts_it(tmp_path: Path) -> None:
    module, guard = tiny_module(), NonFiniteGuard(action="skip")
    callbacks = [guard, StepCheckpoint(tmp_path / "ck", every_n_steps=1, keep_last=-1), PoisonLoss(at_step=3)]
    trainer = fit(module, tmp_path, callbacks, max_steps=6)
    assert trainer.global_step == 6 and guard.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in module.parameters())
    before, after, later = (load_weights_only(tmp_path / "ck" / f"step-0000000{n}.ckpt") for n in (3, 4, 5))
    for key, value in before["state_dict"].items():  # step 4 was dropped: no update at all, unlike step 5
        assert torch.equal(after["state_dict"][key], value), key
    assert any(not torch.equal(later["state_dict"][k], v) for k, v in before["state_dict"].items())
    assert after["callbacks"]["NonFiniteGuard"] == {"skipped_steps": 1}


# ------------------------------------------------------------------------------------------------ resumable loader
def token_batches(count: int) -> list[dict[str, torch.Tensor]]:
    rows = []
    for i in range(count):
        labels = torch.full((1, 6), -100)
        labels[0, : 2 + i % 4] = i
        rows.append({"input_ids": torch.zeros(1, 6, dtype=torch.long), "labels": labels})
    return rows


def test_loader_resumes_after_the_consumed_batches_with_the_same_windows() -> None:
    data = token_batches(7)
    make = lambda: StepTokenDataLoader(data, batch_size=None, accumulate_grad_batches=3)  # noqa: E731
    reference = [(int(b["labels"][0, 0]), int(b[STEP_TOKENS_KEY])) for b in make()]
    interrupted = make()
    iterator = iter(interrupted)
    consumed = [next(iterator) for _ in range(4)]  # one full window and one batch of the next
    state = interrupted.state_dict()
    assert state["samples_consumed"] == len(consumed)
    resumed = make()
    resumed.load_state_dict(state)
    rest = [(int(b["labels"][0, 0]), int(b[STEP_TOKENS_KEY])) for b in resumed]
    assert rest == reference[4:], "the partial window keeps its token count from the epoch's own grouping"
    assert len(list(resumed)) == 7, "only the first pass after loading skips"


def test_resume_position_converts_between_rank_counts() -> None:
    # 3 batches of 2 on each of 2 ranks = the first 12 samples of the permutation = 6 batches of 2 on 1 rank.
    assert batches_to_skip({"samples_consumed": 12}, batch_size=2, num_replicas=1, num_batches=20) == 6
    assert batches_to_skip({"samples_consumed": 40}, batch_size=2, num_replicas=1, num_batches=20) == 0  # epoch done
    with pytest.raises(ValueError, match="not a multiple of the new global batch"):
        batches_to_skip({"samples_consumed": 12}, batch_size=8, num_replicas=1, num_batches=20)


def test_a_new_layout_resumes_only_on_a_whole_number_of_its_steps() -> None:
    from torch.utils.data import DistributedSampler

    def loader(ranks: int, accumulate: int) -> StepTokenDataLoader:
        data = list(range(48))
        sampler = DistributedSampler(data, num_replicas=ranks, rank=0, shuffle=False)
        return StepTokenDataLoader(data, batch_size=2, sampler=sampler, accumulate_grad_batches=accumulate)

    saved = {"samples_consumed": 8, "batch_size": 2, "num_replicas": 2, "accumulate_grad_batches": 2}
    one_rank = loader(1, 4)
    one_rank.load_state_dict(saved)  # one optimizer step of 8 samples on either layout
    assert one_rank.resumed_batches == 4
    with pytest.raises(GymUserError, match=r"not a whole number of optimizer steps.*same global batch"):
        loader(1, 4).load_state_dict({**saved, "samples_consumed": 4})  # half a step of the 2-rank run
    same_layout = loader(2, 2)
    same_layout.load_state_dict({**saved, "samples_consumed": 4})  # mid-window: the same windows continue
    assert same_layout.resumed_batches == 1


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    import numpy as np

    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    restore_rng_state(load_weights_only(tmp_path / "rng.pt"))
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected


def test_the_ranks_that_wrote_a_zero_checkpoint_are_counted_from_its_files(tmp_path: Path) -> None:
    from gym_lightning.strategies.zero.universal import checkpoint_world_size

    assert checkpoint_world_size(tmp_path) is None
    (tmp_path / "latest").write_text("checkpoint")
    (tmp_path / "checkpoint").mkdir()
    for rank in (0, 1):
        (tmp_path / "checkpoint" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    (tmp_path / "checkpoint" / "mp_rank_00_model_states.pt").touch()
    assert checkpoint_world_size(tmp_path) == 2


# ------------------------------------------------------------------------------------------------ LoRA export
@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_gym_export_of_a_lora_checkpoint(tmp_path: Path, mode: str) -> None:
    """A LoRA run's checkpoint exports as merged weights or as a PEFT adapter; both reproduce the module's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gym_lightning import LoRAArgs
    from gym_lightning.checkpointing.reading import export_checkpoint
    from gym_lightning.models import build_causal_lm

    lora = LoRAArgs(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    module = CausalLMModule("tiny-llama", config_overrides=SMALL, lr=5e-2, scheduler="constant", lora=lora)
    fit(module, tmp_path, [StepCheckpoint(tmp_path / "ck", every_n_steps=3)], max_steps=3)
    assert any(p.abs().max() > 0 for n, p in module.model.named_parameters() if "lora_B" in n), "adapters untrained"
    out = export_checkpoint(tmp_path / "ck" / "last.ckpt", tmp_path / "hf", lora=mode)
    if mode == "merged":
        exported = AutoModelForCausalLM.from_pretrained(out)
    else:
        assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
        base = build_causal_lm("tiny-llama", config_overrides=SMALL)
        weights = module.model.get_base_model().state_dict()
        base.load_state_dict({k.replace(".base_layer", ""): v for k, v in weights.items() if "lora_" not in k})
        exported = PeftModel.from_pretrained(base, out)
    probe = torch.tensor([[5, 9, 12, 40, 7, 3]])
    module.model.eval()
    exported.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=probe).logits, module.model(input_ids=probe).logits)
