"""The launchers in front of ``gym train`` (torchrun, accelerate launch, the deepspeed launcher, srun): the process
layout each one leaves in the environment, read as ``trainer.devices``/``trainer.num_nodes`` when the flags do not
give them; without a launcher ``--devices N`` lets Lightning start the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gym_lightning.errors import GymUserError

# Launcher -> what it sets that gym train reads (the docs' launcher table; ``launcher_topology`` reads them).
LAUNCHERS: dict[str, str] = {
    "torchrun, python -m torch.distributed.run": "WORLD_SIZE and LOCAL_WORLD_SIZE: devices and nodes",
    "accelerate launch": "WORLD_SIZE and LOCAL_WORLD_SIZE (it runs torchrun): devices and nodes",
    "deepspeed": "WORLD_SIZE and LOCAL_SIZE: devices and nodes; CROSS_RANK becomes NODE_RANK; --local_rank accepted",
    "srun": "SLURM_STEP_NUM_TASKS and SLURM_STEP_NUM_NODES (inside a job step, not the batch script): devices, nodes",
    "none": "--devices N (default auto) and --num_nodes: Lightning starts the ranks",
}


def launcher_topology(env: Mapping[str, str]) -> tuple[int, int] | None:
    """``(devices per node, nodes)`` of the launcher that started this process, ``None`` without one.

    torchrun (also ``python -m torch.distributed.run`` and ``accelerate launch``, which runs it) sets
    ``LOCAL_WORLD_SIZE``; the ``deepspeed`` launcher sets ``LOCAL_SIZE``; ``srun`` sets ``SLURM_STEP_NUM_TASKS`` and
    ``SLURM_STEP_NUM_NODES`` (only inside a job step, not in the batch script that calls srun).
    """
    if "WORLD_SIZE" in env and ("LOCAL_WORLD_SIZE" in env or "LOCAL_SIZE" in env):
        world, local = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE") or env["LOCAL_SIZE"])
    elif "SLURM_STEP_NUM_TASKS" in env and "SLURM_STEP_NUM_NODES" in env:
        world, nodes = int(env["SLURM_STEP_NUM_TASKS"]), int(env["SLURM_STEP_NUM_NODES"])
        local = world // max(1, nodes)
    else:
        return None
    if local < 1 or world % local:
        raise GymUserError(
            f"the launcher started {world} processes, not a multiple of {local} per node; start the same number of "
            "processes on every node."
        )
    return local, world // local


def launcher_node_rank(env: Mapping[str, str]) -> dict[str, str]:
    """``NODE_RANK`` for Lightning where the launcher names it otherwise: the ``deepspeed`` launcher sets
    ``CROSS_RANK`` only, and Lightning's environment reads ``NODE_RANK``/``GROUP_RANK`` (else node 0 everywhere,
    so the second node's ranks would collide with the first's)."""
    if "CROSS_RANK" in env and "NODE_RANK" not in env and "GROUP_RANK" not in env:
        return {"NODE_RANK": env["CROSS_RANK"]}
    return {}


def devices_value(devices: str) -> int | str | list[int]:
    """``--devices`` as Lightning takes it: a count, a list of indices (``0,1`` or ``[0,1]``) or a name."""
    text = str(devices).strip()
    if text.isdigit() or (text.startswith("-") and text[1:].isdigit()):
        return int(text)
    if "," in text or text.startswith("["):
        return [int(part) for part in text.strip("[]").split(",") if part.strip()]
    return text


def topology_values(devices: str | None, num_nodes: int | None, env: Mapping[str, str]) -> dict[str, Any]:
    """``trainer.devices``/``trainer.num_nodes``: the flags where given, else the launcher's, else auto and 1."""
    launched = launcher_topology(env)
    chosen: int | str | list[int] = devices_value(devices) if devices is not None else "auto"
    nodes = num_nodes if num_nodes is not None else 1
    if launched is not None:
        chosen = launched[0] if devices is None else chosen
        nodes = launched[1] if num_nodes is None else nodes
    return {"trainer.devices": chosen, "trainer.num_nodes": nodes}


__all__ = ["LAUNCHERS", "devices_value", "launcher_node_rank", "launcher_topology", "topology_values"]
