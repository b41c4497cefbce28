"""Last: which DeepSpeed ops the checks asked for. None may be built (a build takes the device's minutes): every
build is refused, which fails the check whose run asked for it, with the op's name; this test also fails when a code
path caught that error and went on. On the CPU only DeepSpeed's shared-memory collective loads."""

from __future__ import annotations

from typing import Any

import pytest
from gpu_runs import Check

pytestmark = pytest.mark.gpu


def test_no_deepspeed_op_was_built(check: Check, op_loads: list[dict[str, Any]]) -> None:
    refused = sorted({load["op"] for load in op_loads if load.get("refused")})
    verdict: dict[str, Any] = {"ok": not refused, "figures": {"loaded": op_loads}}
    if refused:
        verdict["detail"] = f"a JIT build of {', '.join(refused)} was asked for"
    check("op_builds", verdict)
