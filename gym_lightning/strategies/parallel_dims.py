"""The parallel degrees of a run in one place, as torchtitan's ``ParallelDims``: pure arithmetic, no process group.

The W ranks (``world_size``) hold the model in one of two layouts, and independently share sequences:

- shard x replicate: parameters are split over ``shard`` ranks and each split is held by ``replicate`` groups
  (``replicate * shard = W``). DDP and ZeRO use no mesh; gym_fsdp builds its ``fully_shard`` mesh from these
  (``mesh_shape``): 1-D over all ranks, or 2-D (replicate, shard) for hybrid sharding over nodes.
- sequence: groups of ``sequence`` consecutive ranks share each training sequence (Ulysses;
  ``strategies.sequence``); the sampler deals batches to the W / ``sequence`` groups, so that is the data-parallel
  degree, and a rank's data-parallel rank is its group's index.
- tensor: 1 (tensor parallelism is not offered; the degree is here so that the arithmetic already accounts for it).
"""

from __future__ import annotations

from dataclasses import dataclass

from gym_lightning.errors import raise_if_problems

SHARD_DIM = "shard"
REPLICATE_DIM = "replicate"


def size_problems(size: object) -> list[str]:
    """Why ``sequence_parallel_size=size`` is not a group size (empty when it is)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return [f"sequence_parallel_size must be an integer >= 1 (1: off), got {size!r}."]
    return []


def world_problems(size: int, world_size: int) -> list[str]:
    """Why ``sequence_parallel_size=size`` cannot run on ``world_size`` ranks (empty when it can)."""
    if world_size % size:
        return [
            f"sequence_parallel_size={size} does not divide the {world_size} rank(s) (devices x num_nodes): each "
            f"group of {size} ranks shares a sequence. Use a size that divides {world_size}, or change the devices."
        ]
    return []


def _is_degree(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ParallelDims:
    """How ``world_size`` ranks divide into shard, replicate, sequence (and tensor) groups.

    Args:
        world_size: All ranks of the job (devices x num_nodes).
        sequence: Ranks that share each training sequence (``sequence_parallel_size``; 1: off).
        shard: Ranks each parameter is split over; ``None``: ``world_size / replicate``.
        replicate: Copies of each shard (hybrid sharding: the nodes); ``None``: no replicate dimension, the shard
            mesh is 1-D over all ranks (the same degree as 1, a different mesh).
        tensor: Tensor-parallel degree; only 1 is offered.
    """

    world_size: int
    sequence: int = 1
    shard: int | None = None
    replicate: int | None = None
    tensor: int = 1

    @property
    def replicate_degree(self) -> int:
        """Copies of each parameter shard (1 without a replicate dimension)."""
        return 1 if self.replicate is None else self.replicate

    @property
    def shard_degree(self) -> int:
        """Ranks each parameter is split over."""
        return self.world_size // self.replicate_degree if self.shard is None else self.shard

    @property
    def data_parallel(self) -> int:
        """Ranks, or groups of ranks, that train on different batches: the sampler's number of replicas."""
        return self.world_size // (self.sequence * self.tensor)

    def data_parallel_rank(self, global_rank: int) -> int:
        """The sampler's rank of ``global_rank``: the index of its sequence (and tensor) group."""
        return global_rank // (self.sequence * self.tensor)

    def sequence_rank(self, global_rank: int) -> int:
        """``global_rank``'s place in its sequence group (which slice of every sequence it holds)."""
        return global_rank % self.sequence

    def sequence_groups(self) -> list[list[int]]:
        """The sequence groups' ranks: ``world_size / sequence`` groups of ``sequence`` consecutive ranks."""
        return [list(range(first, first + self.sequence)) for first in range(0, self.world_size, self.sequence)]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The shape of the shard mesh: ``(shard,)``, or ``(replicate, shard)`` with a replicate dimension."""
        if self.replicate is None:
            return (self.shard_degree,)
        return (self.replicate, self.shard_degree)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The names of the shard mesh's dimensions, as ``fully_shard`` reads them."""
        return (SHARD_DIM,) if self.replicate is None else (REPLICATE_DIM, SHARD_DIM)

    def problems(self) -> list[str]:
        """Every reason these degrees do not describe ``world_size`` ranks (empty when they do)."""
        if not _is_degree(self.world_size):
            return [f"world_size must be an integer >= 1, got {self.world_size!r}."]
        problems = size_problems(self.sequence) or world_problems(self.sequence, self.world_size)
        invalid = [
            f"{name} must be an integer >= 1 or None, got {value!r}."
            for name, value in (("shard", self.shard), ("replicate", self.replicate))
            if value is not None and not _is_degree(value)
        ]
        problems += invalid
        if not invalid and self.replicate_degree * self.shard_degree != self.world_size:
            problems.append(
                f"replicate={self.replicate_degree} x shard={self.shard_degree} is not the {self.world_size} rank(s)."
            )
        if self.tensor != 1:
            problems.append(f"tensor={self.tensor!r}: tensor parallelism is not offered; use 1.")
        return problems

    def raise_if_invalid(self, subject: str = "Invalid parallel degrees") -> ParallelDims:
        """These degrees, or one ``GymUserError`` about ``subject`` that lists every problem."""
        raise_if_problems(subject, self.problems())
        return self


__all__ = ["ParallelDims", "size_problems", "world_problems"]
