"""One run description (planner.spec): flat names, defaults written once, the derived parser, parallel degrees, a
stage as a table entry, and gym_fsdp's gathered units as data."""

from __future__ import annotations

import argparse
import itertools
from dataclasses import fields, replace

import pytest

from gym_lightning.commands.plan import build_parser
from gym_lightning.planner import BUNDLED, plan
from gym_lightning.planner.estimate import STRATEGY_BY_KEY, estimate, model_states
from gym_lightning.planner.families import cost_model
from gym_lightning.planner.families.fsdp import LAYOUT, fsdp_units
from gym_lightning.planner.spec import LEAVES, SECTIONS, STAGES, RunSpec, StageKind, local_tokens
from gym_lightning.planner.spec_flags import flag_fields
from gym_lightning.planner.timing import speed
from gym_lightning.strategies.parallel_dims import ParallelDims

LLAMA = BUNDLED["llama-3-8b"]


def test_every_leaf_has_one_flat_name_and_one_section() -> None:
    names = [f.name for kind in SECTIONS.values() for f in fields(kind)]
    assert len(names) == len(set(names)), "a flat name is used twice"
    assert not set(names) & set(SECTIONS), "a leaf shares a section's name"
    flags = [name for name, _ in flag_fields()]
    assert len(flags) == len(set(flags)) and set(flags) <= set(LEAVES)


def test_flat_names_build_replace_and_read_the_nested_spec() -> None:
    spec = RunSpec(lora_r=16, gpus_per_node=2, checkpoint_file_size=10)
    assert spec.adapters.lora_r == spec.lora_r == 16 and spec.parallel.gpus_per_node == 2
    assert spec.module.checkpoint_file_bytes == 10  # a flag's name sets its leaf
    changed = replace(spec, lora_r=4, nodes=3)
    assert (changed.lora_r, changed.nodes, changed.gpus_per_node, spec.lora_r) == (4, 3, 2, 16)
    assert changed.world_size == 6 and spec.flat()["lora_r"] == 16
    with pytest.raises(TypeError, match="unknown settings"):
        RunSpec(lora_rank=16)


def test_the_parser_is_the_spec_s_leaves_with_their_defaults() -> None:
    parser = build_parser()
    actions = {option.lstrip("-"): a for a in parser._actions for option in a.option_strings}
    for name, leaf in flag_fields():
        action = actions.get(name) or actions[f"no_{name}"]
        assert action.dest == leaf.name or name != leaf.name
        default = action.default
        assert default == leaf.default or (isinstance(leaf.default, tuple) and not leaf.default), name
        assert action.help == leaf.metadata["help"] or leaf.metadata["help"] in (action.help or ""), name
    assert actions["precision"].choices == ("bf16-mixed", "32-true")
    assert isinstance(actions["no_zero3_leaf_layers"], argparse._StoreFalseAction)  # on by default: --no_...
    args = vars(parser.parse_args(["--model", "x", "--no_zero3_leaf_layers", "--stage", "pt"]))
    assert (args["zero3_leaf_layers"], args["stage"]) == (False, "pt")


@pytest.mark.parametrize(
    ("world", "sequence", "hybrid_nodes"), list(itertools.product((1, 2, 8, 16), (1, 2), (None, 2)))
)
def test_degrees_agree_with_parallel_dims(world: int, sequence: int, hybrid_nodes: int | None) -> None:
    nodes = hybrid_nodes if hybrid_nodes and world % hybrid_nodes == 0 else 1
    spec = RunSpec(gpus_per_node=world // nodes, nodes=nodes, sequence_parallel_size=sequence)
    degrees = spec.degrees(hybrid=hybrid_nodes is not None)
    dims = ParallelDims(world, sequence, degrees.shard, degrees.replicate)
    assert (degrees.shard_degree, degrees.replicate_degree) == (dims.shard_degree, dims.replicate_degree)
    assert degrees.data_parallel == dims.data_parallel == spec.data_parallel_size


def test_a_stage_is_a_table_entry_the_cost_models_read(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(STAGES) == {"sft", "pt", "dpo", "kto", "orpo", "simpo"}
    base = RunSpec(gpus_per_node=8, micro_batch_size=2, seq_length=1024)
    # A stage of two sequences per example and a frozen reference: a new entry and nothing else changes its tokens,
    # activations, reference states and step time.
    monkeypatch.setitem(STAGES, "pairs", StageKind("pairs", "two sequences and a reference", 2, reference=True))
    paired = replace(base, stage="pairs")
    assert local_tokens(paired, 2) == 2 * local_tokens(base, 2)
    for key in ("ddp", "fsdp_full", "zero3"):
        strategy = STRATEGY_BY_KEY[key]
        one, two = estimate(LLAMA, strategy, base), estimate(LLAMA, strategy, paired)
        assert two.activations > one.activations
        held = cost_model(strategy, LLAMA, paired).reference_bytes()
        shards = 1 if key == "ddp" else 8
        assert held == pytest.approx(2 * LLAMA.num_params() / shards, rel=1e-3)  # a bf16 copy, held as the policy
        assert two.reference == held and two.buffers == one.buffers
        assert two.gpu_total - one.gpu_total == pytest.approx(held + two.activations - one.activations)
        assert model_states(LLAMA, strategy, paired) == model_states(LLAMA, strategy, base)
    # sft and pt cost the same
    assert estimate(LLAMA, STRATEGY_BY_KEY["zero3"], replace(base, stage="pt")) == estimate(
        LLAMA, STRATEGY_BY_KEY["zero3"], base
    )


def test_the_stage_s_extra_forward_is_in_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(STAGES, "ref", StageKind("ref", "one sequence and a reference", 1, reference=True))
    report = plan("llama-3-8b", gpu="h100")
    hw = report.machine.hardware  # type: ignore[union-attr]
    zero3 = STRATEGY_BY_KEY["zero3"]
    with_reference = speed(LLAMA, zero3, replace(report.setup, stage="ref"), hw).step.compute
    without = speed(LLAMA, zero3, report.setup, hw).step.compute
    assert 1.2 < with_reference / without < 1.45  # one more forward: about a third of forward + backward


def test_fsdp_units_are_data_in_either_layout() -> None:
    spec = RunSpec()
    assert LAYOUT == "split"  # gym_fsdp: the embedding and the norm + head units of their own (issue 55)
    root = fsdp_units(LLAMA, spec, 2, layout="root")
    split = fsdp_units(LLAMA, spec, 2, layout="split")
    embedding = LLAMA.embedding_params()
    assert (root[0].name, root[0].elements, root[0].kept) == ("root", 2 * embedding, True)
    assert [u.name for u in split[:1] + split[-1:]] == ["embedding", "norm+head"]
    assert split[-1].elements == embedding + LLAMA.hidden_size and split[-1].kept and not split[0].kept
    assert len(root) == LLAMA.num_layers + 1 and len(split) == LLAMA.num_layers + 2
    # The split layout gathers the embedding and the head one at a time: less held at once.
    fsdp = STRATEGY_BY_KEY["fsdp_full"]
    model = cost_model(fsdp, LLAMA, spec)
    held_split = model.buffers()
    model.units = lambda: fsdp_units(LLAMA, spec, 2, layout="root")  # type: ignore[method-assign]
    assert held_split < model.buffers()
