"""Build DeepSpeed's JIT-compiled ops once, before the tests: ``python tests/helpers/warm_deepspeed.py [--all]``.

DeepSpeed compiles C++ ops on first use and caches them under the torch extensions folder
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``): the CPU shared-memory collective (~25 s), and with
``--all`` the fused CPU Adam (~40 s) and the async-I/O op for NVMe offload (~100 s, needs Debian's ``libaio-dev``).
Compiling them in the first multi-rank test instead would make two ranks race to build and blow that test's timeout.
Exit status 0 when every requested op is ready; ops the machine cannot build are reported and skipped.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_OPS = ("ShareMemCommBuilder",)
ALL_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "AsyncIOBuilder")


def warm(op_names: tuple[str, ...]) -> dict[str, str]:
    """Load (building if needed) each DeepSpeed op; returns name -> "ready in Ns" / "not buildable here"."""
    from deepspeed.accelerator import get_accelerator

    report = {}
    for name in op_names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            report[name] = "not buildable here (missing system library or not this accelerator)"
            continue
        start = time.perf_counter()
        builder.load(verbose=False)
        report[name] = f"ready in {time.perf_counter() - start:.0f}s"
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also build CPU Adam and async I/O (NVMe offload)")
    args = parser.parse_args()
    report = warm(ALL_OPS if args.all else DEFAULT_OPS)
    for name, status in report.items():
        print(f"{name}: {status}")
    return 0 if all(status.startswith("ready") for name, status in report.items() if name in DEFAULT_OPS) else 1


if __name__ == "__main__":
    sys.exit(main())
