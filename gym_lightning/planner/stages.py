"""The training stages as a table the cost models read (pure data): what each stage costs beyond one causal-LM step.

TRL and LLaMA-Factory: a stage is a table entry plus an objective (``gym_lightning.objectives``: ``sft.py``, ``dpo.py``,
``kto.py``, ``orpo.py``, ``simpo.py``). The planner reads three things of a stage: the sequences per example the
policy trains on (a preference pair's chosen and rejected rows, one concatenated ``[2B, T]`` batch), the sequences it
runs forward without gradient (KTO's KL rows) and whether a frozen reference's log-probabilities are read; how the
reference is held (``RunSpec.reference_hold``) and what each strategy family charges for it are the families'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StageName = Literal["sft", "pt", "dpo", "kto", "orpo", "simpo"]
# How a run holds its reference model in training (RunSpec.reference_hold).
ReferenceHold = Literal["none", "adapters_off", "copy", "precomputed"]


@dataclass(frozen=True)
class StageKind:
    """What a training stage costs beyond one causal-LM step, as the cost models read it.

    Args:
        name: The stage's key (``gym train --stage``, LLaMA-Factory's ``stage``, ``model.objective``'s name).
        description: One line for the report.
        sequences: Sequences per example the policy trains on in one forward and backward (a preference pair's
            chosen and rejected rows: 2, in one concatenated batch ``[2B, T]``).
        detached: Sequences per example the policy runs forward without gradient, in a pass of their own (KTO's
            mismatched KL row: 1).
        reference: Whether the loss reads a frozen reference model's log-probabilities of every sequence
            (``sequences + detached`` per example): one reference forward per micro-batch, unless they were
            precomputed; how the reference is held is :attr:`RunSpec.reference_hold`.
    """

    name: str
    description: str
    sequences: int = 1
    detached: int = 0
    reference: bool = False

    @property
    def rows(self) -> int:
        """Sequences per example through any forward: what the reference runs over."""
        return self.sequences + self.detached


# The stages and what each costs (objectives/: dpo.py, kto.py, orpo.py, simpo.py; data.pairs for the rows).
STAGES: dict[str, StageKind] = {
    "sft": StageKind("sft", "supervised finetuning (prompt tokens masked)"),
    "pt": StageKind("pt", "continued pretraining (every token a target)"),
    "dpo": StageKind("dpo", "DPO (chosen and rejected rows in one forward, and a reference's)", 2, reference=True),
    "kto": StageKind("kto", "KTO (each completion; its KL row without gradient; a reference over both)", 1, 1, True),
    "orpo": StageKind("orpo", "ORPO (chosen and rejected rows in one forward, no reference)", 2),
    "simpo": StageKind("simpo", "SimPO (chosen and rejected rows in one forward, no reference)", 2),
}


__all__ = ["STAGES", "ReferenceHold", "StageKind", "StageName"]
