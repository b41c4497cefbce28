"""The longest sequence that fits: a bisection over :func:`~gym_lightning.planner.estimate.estimate` (pure, no torch).

Under sequence parallelism (``Setup.sequence_parallel_size``) and a tiled MLP (``Setup.mlp_tile_tokens``) the
question a long-context finetune asks is not "which strategy fits 2,048 tokens" but "how long a sequence fits";
docs/planner.md, "Long sequences", has the formulas and a table for the bundled shapes.
"""

from __future__ import annotations

import math
from dataclasses import replace

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.estimate import Setup, Strategy, check_setup, estimate, modelled

# The lengths are searched on a grid of 1,024 tokens (and of sp, which must divide a length without padding): fine
# enough at the 10^4-10^6 tokens these answers are, and the granularity a user picks a --seq_length at.
SEQUENCE_GRID = 1024
# An upper bound for the search (2^40 tokens), so that a memory term that stopped growing with the length could
# not make the doubling run forever. Every setting has per-token activations, so it is never reached in practice.
MAX_SEQUENCE = 2**40


def sequence_step(setup: Setup, grid: int = SEQUENCE_GRID) -> int:
    """The step of the searched lengths: the least common multiple of ``grid`` and sp, so that every length is a
    whole number of grid units and splits evenly over the sp ranks of a group."""
    return math.lcm(grid, setup.sequence_parallel_size)


def longest_sequence(shape: ModelShape, strategy: Strategy, setup: Setup, grid: int = SEQUENCE_GRID) -> int:
    """The longest sequence (tokens, a multiple of :func:`sequence_step`: 1,024 and sp) whose training step fits the
    GPU memory with ``strategy`` at micro-batch 1, all else as ``setup``; 0 if not even one step fits, or if the
    planner does not model the combination (:func:`~gym_lightning.planner.estimate.modelled`).

    "Fits" is :attr:`Estimate.fits_gpu`, the table's GPU criterion: host memory does not depend on the length and
    is reported by the table itself. Memory grows with the length (every per-token term, the eager ``s^2`` term,
    the logits up to one chunk), so a doubling search then a bisection finds the boundary: about 2 log2(s/1,024)
    estimates. Raises the planner's :class:`GymUserError` for impossible sequence-parallel settings."""
    check_setup(shape, setup)
    if not modelled(strategy, setup):
        return 0
    step = sequence_step(setup, grid)
    base = replace(setup, micro_batch_size=1)

    def fits(units: int) -> bool:
        return estimate(shape, strategy, replace(base, seq_length=units * step)).fits_gpu

    if not fits(1):
        return 0
    low, high = 1, 2
    while high * step <= MAX_SEQUENCE and fits(high):
        low, high = high, 2 * high
    if high * step > MAX_SEQUENCE:
        return low * step
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * step
