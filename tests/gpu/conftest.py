"""tests/gpu builds no DeepSpeed op: its one worker (benchmarks/workers/gpu_check.py) trains with torch optimizers
only and refuses any JIT build, so the suite-wide fixture that builds CPU Adam and async I/O for the multi-rank CPU
tests (tests/conftest.py; ~40 s and ~100 s on a cold cache, time a GPU lease does not have) is replaced here."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops() -> None:
    """Nothing to build: overrides tests/conftest.py's ``deepspeed_ops`` for the tests of this folder."""
