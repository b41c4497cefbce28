"""Reference log-probabilities (``objectives.preference``): which provider a run gets, that the LoRA base with its
adapters off is the frozen base model (gym's routed expert adapters included), that precomputed values give the live
loss and gradients, that a strategy's ``HoldsFrozenModels`` is asked, and that the reference never lands in the
module's parameters, state dict or pickled hyper-parameters."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.families import make_family_folder
from objective_harness import Harness, harness, save_folder, tokenized_pairs

from gym_lightning import CausalLMModule
from gym_lightning.errors import GymUserError
from gym_lightning.lora import LoRAArgs
from gym_lightning.models.plan import BuildPlan
from gym_lightning.objectives import DPO, KTO
from gym_lightning.objectives.preference import (
    REFERENCE_LOGPS_KEY,
    AdaptersOff,
    FrozenCopy,
    PolicyAsReference,
    Precomputed,
    precompute_reference,
    reference_for,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_folder(tmp_path_factory.mktemp("reference") / "policy", seed=0)


def perturb_adapters(model: torch.nn.Module) -> int:
    """Random ``lora_B`` factors (peft starts them at zero, which would make the adapters a no-op)."""
    generator = torch.Generator().manual_seed(3)
    factors = [p for n, p in model.named_parameters() if "lora_B" in n]
    with torch.no_grad():
        for p in factors:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return len(factors)


def test_each_run_gets_its_reference_provider(folder: Path) -> None:
    full, lora = harness(folder, DPO()), harness(folder, DPO(), lora=LoRAArgs(r=2))
    assert isinstance(reference_for(full, precompute=False, ref_model=None), FrozenCopy)
    assert isinstance(reference_for(lora, precompute=False, ref_model=None), AdaptersOff)
    assert isinstance(reference_for(lora, precompute=False, ref_model=str(folder)), FrozenCopy)
    assert isinstance(reference_for(full, precompute=True, ref_model=None), Precomputed)
    assert isinstance(precompute_reference(full), PolicyAsReference)  # before the first step: the policy itself
    assert isinstance(precompute_reference(lora), AdaptersOff)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_lora_adapters_off_is_the_frozen_base(family: str, folder: Path, tmp_path: Path) -> None:
    """The LoRA policy's reference is its base model with the adapters off: the same log-probabilities as a frozen
    copy loaded from the folder, while the adapted policy's differ. On the mixture of experts the routed experts'
    adapters (gym's forward, ``models.experts``) are switched off too."""
    source = folder if family == "llama" else make_family_folder(family, tmp_path / family)
    targets = {"target_modules": ["all-linear"]} if family == "llama" else {"target_parameters": ["all-experts"]}
    objective = DPO()
    ours = harness(source, objective, lora=LoRAArgs(r=2, **targets), torch_dtype="float32")
    assert perturb_adapters(ours.model) > 0
    batch = tokenized_pairs(source)
    assert isinstance(objective.reference(ours), AdaptersOff)
    off = objective.reference(ours).logps(ours, batch)
    copy = FrozenCopy(str(source))
    copy.setup(ours)
    frozen = copy.logps(ours, batch)
    torch.testing.assert_close(off, frozen, rtol=1e-5, atol=1e-5)
    adapted = ours.engine.sequence_logps(ours.model, batch).logps.detach()
    assert (adapted - frozen).abs().max() > 1e-2  # the adapters do change the policy
    assert not off.requires_grad and not frozen.requires_grad


def test_adapters_off_under_fsdp2_bf16_leaves_the_adapters_trainable_for_its_first_forward(folder: Path) -> None:
    """gym_fsdp, LoRA, bf16-mixed: the reference (adapters off) is the fit's first forward, when FSDP2 reads which
    parameters train and their dtype. peft's disable_adapter switches the adapters' requires_grad off; seen so,
    the policy's backward failed ("attempting to assign a gradient with dtype BFloat16 ... grad_dtype Float")."""
    import torch.distributed as dist
    from helpers.dist import free_port
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gym_lightning.strategies.fsdp import mixed_precision_policy

    ours = harness(folder, DPO(), lora=LoRAArgs(r=2), torch_dtype="float32")
    batch = tokenized_pairs(folder)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        policy = mixed_precision_policy("bf16-mixed", "none")
        fully_shard(ours.model, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
        AdaptersOff().logps(ours, batch)
        ours.engine.sequence_logps(ours.model, batch).logps.sum().backward()
    finally:
        dist.destroy_process_group()
    grads = [p.grad for p in ours.model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)


def test_precomputed_reference_gives_the_live_loss_and_gradients(folder: Path) -> None:
    batch = tokenized_pairs(folder)
    results = []
    for precompute in (False, True):
        objective = DPO(beta=0.5, loss_type=["sigmoid", "sft"], precompute_ref_log_probs=precompute)
        torch.manual_seed(0)  # the same LoRA factors
        ours = harness(folder, objective, lora=LoRAArgs(r=2, target_modules=["all-linear"]))
        perturb_adapters(ours.model)
        if precompute:
            with pytest.raises(GymUserError, match="precompute_ref_log_probs is on, so every batch needs"):
                objective.training_step(ours, batch)
            live = precompute_reference(ours).logps(ours, batch)  # the data module's pass before training
            batch = {**batch, REFERENCE_LOGPS_KEY: live}
        loss = objective.training_step(ours, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in ours.model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, ours.values("rewards/margins", "rewards/chosen")))
    (live_loss, live_grads, live_metrics), (pre_loss, pre_grads, pre_metrics) = results
    torch.testing.assert_close(pre_loss, live_loss)
    assert pre_metrics == pytest.approx(live_metrics, abs=1e-6) and live_metrics["rewards/margins"] != 0
    assert pre_grads.keys() == live_grads.keys() and pre_grads
    for name, grad in live_grads.items():
        torch.testing.assert_close(pre_grads[name], grad, msg=name)


def test_a_random_initialised_policy_s_copy_holds_its_initial_values() -> None:
    """A preset (random initialisation) has no folder to load the reference from: the copy takes the policy's
    values, so a first step's rewards are zero (the policy is its own reference)."""
    torch.manual_seed(0)
    objective = DPO()
    ours = harness("tiny-llama", objective, config_overrides={"num_hidden_layers": 1})
    batch = tokenized_pairs("tiny-llama")
    objective.training_step(ours, batch)
    assert ours.values("rewards/chosen", "rewards/rejected") == {"rewards/chosen": 0.0, "rewards/rejected": 0.0}


def test_a_random_initialised_copy_keeps_the_initial_values_through_a_restore() -> None:
    """Lightning restores a checkpoint into a replicated policy before ``on_fit_start``: the copy takes the values
    the policy had when ``configure_model`` built it, not the restored ones."""
    torch.manual_seed(0)
    objective = DPO()
    module = CausalLMModule("tiny-llama", objective=objective, config_overrides={"num_hidden_layers": 1})
    module.configure_model()
    batch = tokenized_pairs("tiny-llama")
    initial = module.engine.sequence_logps(module.model, batch).logps.detach()
    with torch.no_grad():  # what a checkpoint restore does to the policy
        for parameter in module.model.parameters():
            parameter.add_(0.05)
    ours = Harness(module)
    objective.on_fit_start(ours)
    torch.testing.assert_close(objective.reference(ours).logps(ours, batch), initial)
    assert (module.engine.sequence_logps(module.model, batch).logps.detach() - initial).abs().max() > 1e-2


class HoldingStrategy:
    """A strategy that holds frozen models itself (``protocols.HoldsFrozenModels``): records what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[BuildPlan, Any]] = []
        self.dtypes: list[torch.dtype | None] = []

    def hold_frozen(
        self, build: Any, copy_of: torch.nn.Module | None = None, dtype: torch.dtype | None = None
    ) -> torch.nn.Module:
        plan = BuildPlan()
        model = build(plan)
        self.calls.append((plan, copy_of))
        self.dtypes.append(dtype)
        return model


def test_a_strategy_that_holds_frozen_models_builds_the_reference(folder: Path) -> None:
    objective = KTO()
    ours = harness(folder, objective)  # on_fit_start without a strategy: a whole copy on the module's device
    assert isinstance(objective._reference, FrozenCopy) and objective._reference.model is not None
    strategy = HoldingStrategy()
    objective._reference = None
    ours.trainer.strategy = strategy
    objective.on_fit_start(ours)
    (plan, copy_of), model = strategy.calls[0], objective._reference.model
    assert isinstance(plan, BuildPlan) and copy_of is None  # a pretrained folder: its weights come from the folder
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_reference_dtype_is_asked_of_the_strategy_and_kept_by_a_whole_copy(folder: Path) -> None:
    """``reference_dtype`` reaches the strategy that holds the reference (``hold_frozen``'s ``dtype``) and, without
    one, the whole copy's parameters; the policy keeps its own dtype."""
    objective = KTO(reference_dtype="bfloat16")
    ours = harness(folder, objective)
    params = list(objective._reference.model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.dtype for p in ours.module.model.parameters()} == {torch.float32}
    strategy = HoldingStrategy()
    objective._reference = None
    ours.trainer.strategy = strategy
    objective.on_fit_start(ours)
    assert strategy.dtypes == [torch.bfloat16]
    assert DPO().reference_settings().dtype is None


def test_a_reference_dtype_that_cannot_be_honoured_is_refused_in_one_line() -> None:
    from gym_lightning.strategies.zero.frozen import check_zero3_dtype

    assert any(
        "reference_dtype must be one of float32, bfloat16, float16" in p for p in DPO(reference_dtype="int8").problems()
    )
    assert any("reference_dtype" in p for p in KTO(reference_dtype="fp8").problems())
    bf16 = {"bf16": {"enabled": True}}
    check_zero3_dtype(bf16, torch.bfloat16)  # the engine's dtype, or none asked: held as the policy
    check_zero3_dtype({}, None)
    with pytest.raises(
        GymUserError, match=r"ZeRO-3 partitions the reference in the engine's dtype \(float32\)"
    ) as error:
        check_zero3_dtype({}, torch.bfloat16)
    assert "\n" not in str(error.value)


def test_another_fit_s_strategy_builds_the_reference_again(folder: Path) -> None:
    """The reference belongs to the strategy that holds it: a second fit (a new Trainer, another strategy) with the
    same objective asks its own strategy, and the same strategy is asked once."""
    objective = DPO()
    ours = harness(folder, objective)
    first, second = HoldingStrategy(), HoldingStrategy()
    for strategy in (first, first, second):
        ours.trainer.strategy = strategy
        objective.on_fit_start(ours)
    assert (len(first.calls), len(second.calls)) == (1, 1)
    assert objective._reference.model is not None


def test_a_sharding_strategy_without_the_protocol_is_refused(folder: Path) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    ours = harness(folder, DPO())  # set up without a strategy
    ours.trainer.strategy = ModelParallelStrategy()
    with pytest.raises(GymUserError, match="cannot hold a frozen reference model the same way"):
        DPO().on_fit_start(ours)
    DPO(precompute_ref_log_probs=True).on_fit_start(ours)  # holds no reference: nothing to refuse


def test_the_reference_is_never_saved_with_the_module(folder: Path) -> None:
    objective = DPO(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    ours = harness(folder, objective)
    reference = objective._reference.model
    assert reference is not None
    ids = {id(p) for p in reference.parameters()}
    assert not ids & {id(p) for p in ours.module.parameters()}
    assert len(ours.module.state_dict()) == len(ours.module.model.state_dict())
    buffer = io.BytesIO()
    torch.save({"hyper_parameters": dict(ours.module.hparams)}, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)["hyper_parameters"]["objective"]
    assert loaded == objective and loaded._reference is None
    assert buffer.getbuffer().nbytes < 10_000  # settings only: no tensor of the reference
