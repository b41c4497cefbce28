"""Build DeepSpeed's JIT-compiled ops once, before the tests: ``python tests/helpers/warm_deepspeed.py [--all]``.

The ops go to gym_lightning's machine-wide op cache (``gym_lightning.strategies.zero.ops``), keyed by what they are
built from and not by the virtual environment's path, so a new environment on the same machine finds them built:
the CPU shared-memory collective (35 s cold here), and with ``--all`` the fused CPU Adam (58 s) and the async-I/O op
for NVMe offload (256 s, needs Debian's ``libaio-dev``). Compiling them in the first multi-rank test instead would
make two ranks race to build and blow that test's timeout.
Exit status 0 when every requested op is ready; ops the machine cannot build are reported and skipped.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_OPS = ("ShareMemCommBuilder",)
ALL_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "AsyncIOBuilder")


def warm(op_names: tuple[str, ...]) -> dict[str, str]:
    """Load (building if needed) each DeepSpeed op; returns name -> "<how> in Ns" or why it is not buildable."""
    from gym_lightning.strategies.zero.ops import load_ops

    report = {}
    for name in op_names:
        start = time.perf_counter()
        how = load_ops([name])[name]
        report[name] = f"{how} in {time.perf_counter() - start:.0f}s" if how in ("built", "cached", "loaded") else how
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also build CPU Adam and async I/O (NVMe offload)")
    args = parser.parse_args()
    report = warm(ALL_OPS if args.all else DEFAULT_OPS)
    for name, status in report.items():
        print(f"{name}: {status}")
    ready = ("built", "cached", "loaded")
    return 0 if all(status.startswith(ready) for name, status in report.items() if name in DEFAULT_OPS) else 1


if __name__ == "__main__":
    sys.exit(main())
