"""DeepSpeed's C++ ops, built once per machine instead of once per virtual environment.

DeepSpeed JIT-compiles its ops on first use (torch's ``cpp_extension.load``) under ``TORCH_EXTENSIONS_DIR``. torch's
build decision is ninja's, and ninja rebuilds whenever a compile command changes; the commands name the op's sources
and headers by their absolute paths inside the environment's ``site-packages``. So every new virtual environment
(CI builds three; a fresh clone builds one) compiles the same sources again, for minutes on a small machine
(docs/benchmarks-history.md, "DeepSpeed op builds").

Here the built library is kept under a key that names what makes it what it is and nothing that depends on where it
was built: the DeepSpeed and torch builds, the Python ABI, the machine, the op, its compiler flags and the contents
of its sources and headers. A process with the same key loads the library directly, whatever its environment's path;
the first one builds it (DeepSpeed's own ``jit_load``, pointed at the key's folder) and marks it ready.

Where: ``$GYM_DEEPSPEED_OPS_CACHE``, else ``$XDG_CACHE_HOME/gym_lightning/deepspeed_ops``, else
``~/.cache/gym_lightning/deepspeed_ops``. ``ZeROStrategy`` loads the ops its configuration needs this way before
DeepSpeed asks for them; DeepSpeed then finds them loaded (its own per-process table of loaded ops).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from gym_lightning._compat import deepspeed_loaded_ops, jit_load_replaced
from gym_lightning.atomic import atomic_file

CACHE_ENV_VAR = "GYM_DEEPSPEED_OPS_CACHE"
READY = "READY"  # written last, naming the library: a folder without it is still being built (or failed)
# Builder names (DeepSpeed's accelerator op builders) by what needs them on CPU ranks.
SHM_COMM = "ShareMemCommBuilder"  # deepspeed.comm's shared-memory collectives on CPU
CPU_ADAM = "CPUAdamBuilder"  # cpu_optimizer="deepspeed"
ASYNC_IO = "AsyncIOBuilder"  # NVMe offload (ZeRO-Infinity); needs Debian's libaio-dev


def cache_root() -> Path:
    """Where built ops are kept, one folder per key."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gym_lightning" / "deepspeed_ops"


def _compiler_version() -> str:
    compiler = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return compiler


def _files_of(builder: Any) -> Iterator[Path]:
    """The op's sources, then every file under its include folders, in a stable order."""
    for source in builder.strip_empty_entries(builder.sources()):
        yield Path(builder.deepspeed_src_path(source))
    for folder in builder.strip_empty_entries(builder.include_paths()):
        root = Path(builder.deepspeed_src_path(folder))
        yield from sorted(p for p in root.rglob("*") if p.is_file())


def op_key(builder: Any) -> str:
    """What the built library depends on, hashed; no path of the environment it is built in."""
    import deepspeed
    import torch

    digest = hashlib.sha256()
    facts = [
        deepspeed.__version__,
        torch.__version__,
        str(torch.version.git_version),
        str(torch.version.cuda),
        str(getattr(torch.version, "hip", None)),
        sys.implementation.cache_tag,
        getattr(sys, "abiflags", ""),
        platform.machine(),
        builder.name,
        " ".join(builder.strip_empty_entries(builder.cxx_args())),
        " ".join(builder.strip_empty_entries(builder.extra_ldflags())),
        _compiler_version(),
    ]
    digest.update("\0".join(facts).encode())
    for path in _files_of(builder):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"{builder.name}-{digest.hexdigest()[:20]}"


@contextmanager
def _extensions_dir(folder: Path) -> Iterator[None]:
    """torch builds into ``$TORCH_EXTENSIONS_DIR`` (read when it builds): the key's folder, for the build only."""
    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved


def _import_library(name: str, library: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load the DeepSpeed op library {library}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_op(builder_name: str) -> tuple[ModuleType, str]:
    """DeepSpeed's op ``builder_name`` loaded in this process through DeepSpeed's own ``load`` (so that an op that
    loads another first, as async I/O loads the pinned-memory op, still does), with every JIT build it makes going
    through the machine-wide cache; returns the module and how it came (``"loaded"``, ``"cached"``, ``"built"``)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(builder_name)
    if builder.name in deepspeed_loaded_ops():
        return deepspeed_loaded_ops()[builder.name], "loaded"
    outcomes: dict[str, str] = {}
    with jit_load_replaced(lambda op, original, verbose: _cached_jit_load(op, original, verbose, outcomes)):
        module = builder.load(verbose=False)
    return module, outcomes.get(builder.name, "loaded")


def _cached_jit_load(builder: Any, jit_load: Any, verbose: bool, outcomes: dict[str, str]) -> ModuleType:
    """``builder``'s library from its key's folder, built there first (DeepSpeed's ``jit_load``) if it is not yet."""
    folder = cache_root() / op_key(builder)
    ready = folder / READY
    if ready.is_file() and (library := folder / ready.read_text().strip()).is_file():
        module = _import_library(builder.name, library)
        deepspeed_loaded_ops()[builder.name] = module  # as DeepSpeed's jit_load records what it loads
        outcomes[builder.name] = "cached"
        return module
    folder.mkdir(parents=True, exist_ok=True)
    with _extensions_dir(folder):
        module = jit_load(builder, verbose)
    _mark_ready(folder, Path(module.__file__).resolve())
    outcomes[builder.name] = "built"
    return module


def _mark_ready(folder: Path, library: Path) -> None:
    """Name ``library`` in the folder's ``READY`` file: the ranks of a node that built (or waited for) the same op
    write it one at a time, and a reader sees the old file or the whole new one."""
    from filelock import FileLock

    with FileLock(str(folder / f"{READY}.lock")), atomic_file(folder / READY) as file:
        file.write(os.path.relpath(library, folder).encode())


def ops_needed(device_type: str, cpu_optimizer: str, nvme: bool, config: dict[str, Any] | None = None) -> list[str]:
    """The op builders a ZeRO run loads: the shared-memory collective on CPU ranks, the fused CPU Adam for
    ``cpu_optimizer="deepspeed"`` or where DeepSpeed builds it itself (``builds_cpu_adam``), async I/O for NVMe
    offload."""
    needed = [SHM_COMM] if device_type == "cpu" else []
    needed += [CPU_ADAM] if cpu_optimizer == "deepspeed" or builds_cpu_adam(config or {}) else []
    return needed + ([ASYNC_IO] if nvme else [])


def builds_cpu_adam(config: dict[str, Any]) -> bool:
    """Whether DeepSpeed makes its own ``DeepSpeedCPUAdam``: a JSON ``optimizer`` block of the Adam family with the
    optimizer offloaded (HF's ``ds_config_zero2/3.json``). Not loaded from the cache first, DeepSpeed compiled it into
    ``~/.cache/torch_extensions`` in the middle of the run (docs/benchmarks-history.md, "DeepSpeed op builds")."""
    optimizer = config.get("optimizer")
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer")
    device = offload.get("device") if isinstance(offload, dict) else None
    kind = str(optimizer.get("type", "")).lower() if isinstance(optimizer, dict) else ""
    return kind in ("adam", "adamw", "cpuadam") and device in ("cpu", "nvme")


def load_ops(names: list[str]) -> dict[str, str]:
    """:func:`load_op` each of ``names`` that this machine can build; name -> how it came, or why not."""
    from deepspeed.accelerator import get_accelerator

    report = {}
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            report[name] = "not buildable here (missing system library or not this accelerator)"
            continue
        try:
            report[name] = load_op(name)[1]
        except OSError as err:  # an unwritable cache: DeepSpeed builds the op itself when it needs it
            report[name] = f"not cached ({type(err).__name__}: {err})"
    return report


__all__ = [
    "ASYNC_IO",
    "CACHE_ENV_VAR",
    "CPU_ADAM",
    "SHM_COMM",
    "builds_cpu_adam",
    "cache_root",
    "load_op",
    "load_ops",
    "op_key",
    "ops_needed",
]
