"""``ParallelDims``: the arithmetic the sampler, gym_fsdp's mesh and the sequence groups read (no process group)."""

from __future__ import annotations

import pytest

from gym_lightning.errors import GymUserError
from gym_lightning.strategies.fsdp import shard_replicas
from gym_lightning.strategies.parallel_dims import ParallelDims


def test_sequence_groups_divide_the_data_parallel_degree() -> None:
    dims = ParallelDims(8, sequence=2)
    assert dims.data_parallel == 4
    assert [dims.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.sequence_rank(r) for r in range(8)] == [0, 1] * 4
    assert dims.sequence_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.problems() == []


def test_without_sequence_parallelism_every_rank_is_a_replica() -> None:
    dims = ParallelDims(3)
    assert (dims.data_parallel, dims.data_parallel_rank(2), dims.sequence_groups()) == (3, 2, [[0], [1], [2]])


@pytest.mark.parametrize(
    ("sharding", "shape", "names"),
    [
        ("full", (8,), ("shard",)),
        ("grad_op", (8,), ("shard",)),
        ("hybrid", (2, 4), ("replicate", "shard")),
        ("none", (8, 1), ("replicate", "shard")),
    ],
)
def test_the_shard_mesh_of_each_sharding(sharding: str, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    dims = ParallelDims(8, replicate=shard_replicas(sharding, num_nodes=2, num_processes=4))
    assert (dims.mesh_shape, dims.mesh_dim_names) == (shape, names)
    assert dims.replicate_degree * dims.shard_degree == 8 and dims.problems() == []


def test_hybrid_sharding_on_one_node_keeps_its_replicate_dimension() -> None:
    dims = ParallelDims(4, replicate=shard_replicas("hybrid", num_nodes=1, num_processes=4))
    assert (dims.mesh_shape, dims.mesh_dim_names) == ((1, 4), ("replicate", "shard"))


def test_every_problem_is_listed_in_one_error() -> None:
    dims = ParallelDims(6, sequence=4, replicate=4, tensor=2)
    problems = dims.problems()
    assert len(problems) == 3
    assert "sequence_parallel_size=4 does not divide the 6 rank(s)" in problems[0]
    with pytest.raises(GymUserError, match=r"Invalid sequence parallelism \(3 problem\(s\)\)"):
        dims.raise_if_invalid("Invalid sequence parallelism")
    assert ParallelDims(4, sequence=0).problems() == ["sequence_parallel_size must be an integer >= 1 (1: off), got 0."]
    assert ParallelDims(0).problems() == ["world_size must be an integer >= 1, got 0."]
    assert ParallelDims(4, shard=2, replicate=1).problems() == ["replicate=1 x shard=2 is not the 4 rank(s)."]


def test_a_valid_layout_is_returned_unchanged() -> None:
    dims = ParallelDims(4, sequence=2, shard=2, replicate=2)
    assert dims.raise_if_invalid() is dims
