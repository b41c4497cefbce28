"""One-way contracts between gym_lightning's parts, read from the source: layers, named back-edges, and cycles.

Every import counts, also one inside a function (a lazy import that hides a circle is still a circle) and the
parent packages an import runs (``from gym_lightning.data.formats import x`` runs ``gym_lightning/data/__init__.py``);
imports under ``if TYPE_CHECKING:`` do not run and do not count. The root package is left out as an implied parent:
it is the public facade that imports everything, by design.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "gym_lightning"
SOURCE = Path(__file__).resolve().parents[1] / PACKAGE

# Bottom to top: a module may import its own part and the parts of lower layers, nothing else. Data flows config ->
# CLI -> module / data module -> strategy -> callbacks; the model builder knows no strategy, and neither the
# LightningModule nor a strategy knows the other (they talk through gym_lightning.protocols and models.plan).
LAYERS: tuple[dict[str, tuple[str, ...]], ...] = (
    {
        "foundation": (
            "_compat",
            "atomic",
            "errors",
            "generation",
            "lazy",
            "lora",
            "loss",
            "optim",
            "patches",
            "precision",
            "protocols",
            "quant",
            "quiet",
            "settings",
            "tokenizer",
            "vocabulary",
        )
    },
    {"models": ("models",), "data": ("data",), "metrics": ("metrics",)},
    {"planner": ("planner",), "checkpointing": ("checkpointing", "hf_folder"), "engine": ("engine",)},
    {"module": ("module", "objectives"), "strategies": ("strategies",)},
    {"callbacks": ("callbacks", "prediction_writer")},
    {"entry": ("registration", "cli", "commands", "__main__")},
)
# Back-edges the layers alone would allow, named by the contracts: the module knows nothing of the planner.
FORBIDDEN: dict[str, tuple[str, ...]] = {"module": ("planner",)}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def imported_modules(path: Path, name: str, package: str) -> set[str]:
    """The package's modules that ``path`` imports at run time (absolute and relative imports, any depth)."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                anchor = package_parts[: len(package_parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m == package or m.startswith(package + ".")}


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, each import widened to the parent packages it runs (but not to
    the importer's own parent packages, which are running already when it runs)."""
    package = root.name
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges: set[str] = set()
        for target in imported_modules(path, name, package):
            parts = target.split(".")
            edges.update(".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in paths)
        graph[name] = edges - own - {name}
    return graph


def part_of(module: str, package: str = PACKAGE) -> tuple[int, str] | None:
    """``(layer, part)`` of a module (``None`` for the root package)."""
    first = module.removeprefix(package + ".").split(".")[0] if module != package else ""
    for index, layer in enumerate(LAYERS):
        for part, names in layer.items():
            if first in names:
                return index, part
    return None


def violations(graph: dict[str, set[str]], package: str = PACKAGE) -> list[str]:
    """Every import that goes up a layer, sideways into another part, or along a ``FORBIDDEN`` edge."""
    found = []
    for source, targets in sorted(graph.items()):
        here = part_of(source, package)
        if here is None:
            continue
        for target in sorted(targets):
            there = part_of(target, package)
            if there is None or there[1] == here[1]:
                continue
            if there[0] >= here[0] or there[1] in FORBIDDEN.get(here[1], ()):
                found.append(f"{source} ({here[1]}) imports {target} ({there[1]})")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def without_root(graph: dict[str, set[str]], package: str = PACKAGE) -> dict[str, set[str]]:
    return {name: targets - {package} for name, targets in graph.items() if name != package}


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(name for name in import_graph(SOURCE) if name != PACKAGE and part_of(name) is None)
    assert not unplaced, f"give these modules a part in LAYERS: {unplaced}"


def test_no_import_goes_up_a_layer_or_into_a_sibling_part() -> None:
    assert violations(import_graph(SOURCE)) == []


def test_no_import_circle() -> None:
    assert cycles(without_root(import_graph(SOURCE))) == []


def test_the_module_and_the_model_builder_know_no_strategy() -> None:
    graph = import_graph(SOURCE)
    for source in [name for name in graph if name.startswith((f"{PACKAGE}.models", f"{PACKAGE}.module"))]:
        assert not {t for t in graph[source] if t.startswith((f"{PACKAGE}.strategies", f"{PACKAGE}.planner"))}


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / PACKAGE
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_catch_a_back_edge_a_lazy_circle_and_a_sibling_edge(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "models/__init__.py": "",
            "models/loading.py": "def f():\n    from gym_lightning.strategies import fsdp\n",
            "strategies/__init__.py": "from gym_lightning.strategies import fsdp\n",
            "strategies/fsdp.py": "from gym_lightning.models import loading\nimport gym_lightning.module\n",
            "module.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import gym_lightning.strategies\n",
            "data/__init__.py": "",
            "data/a.py": "from gym_lightning.data.b import x\n",
            "data/b.py": "def g():\n    from gym_lightning.data import a\n",
        },
    )
    graph = import_graph(root)
    assert violations(graph) == [
        "gym_lightning.models.loading (models) imports gym_lightning.strategies (strategies)",
        "gym_lightning.models.loading (models) imports gym_lightning.strategies.fsdp (strategies)",
        "gym_lightning.strategies.fsdp (strategies) imports gym_lightning.module (module)",
    ]
    found = cycles(without_root(graph))
    assert ["gym_lightning.data.a", "gym_lightning.data.b"] in found
    assert any("gym_lightning.models.loading" in c and "gym_lightning.strategies.fsdp" in c for c in found)
    assert "gym_lightning.strategies" not in graph["gym_lightning.module"]  # TYPE_CHECKING imports do not run


@pytest.mark.parametrize("text", ["from . import sibling\n", "from .sibling import x\n"])
def test_relative_imports_are_read(tmp_path: Path, text: str) -> None:
    root = _package(tmp_path, {"__init__.py": "", "data/__init__.py": "", "data/a.py": text, "data/sibling.py": ""})
    assert "gym_lightning.data.sibling" in import_graph(root)["gym_lightning.data.a"]


# Reading a checkpoint's safetensors files is the model loader's job (models.fill); a strategy only says what each
# rank holds of a tensor (an adapter, models.holdings), so no module under strategies reads such a file itself.
CHECKPOINT_READERS = ("safetensors", "SafetensorsReader", "HuggingFaceStorageReader")


def checkpoint_readers_used(path: Path) -> set[str]:
    """The safetensors modules ``path`` imports and the checkpoint readers it names (at run time)."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found.update(m for m in modules if m.split(".")[0] == "safetensors")
            found.update(a.name for a in node.names if a.name in CHECKPOINT_READERS)
        elif isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            found.update({name} & set(CHECKPOINT_READERS))
    return found


def checkpoint_reads(root: Path) -> list[str]:
    """``module: names`` for every module under ``root/strategies`` that reads a safetensors file itself."""
    return [
        f"{module_name(path, root)}: {', '.join(sorted(used))}"
        for path in sorted((root / "strategies").rglob("*.py"))
        if (used := checkpoint_readers_used(path))
    ]


def test_no_strategy_reads_a_safetensors_file_itself() -> None:
    assert checkpoint_reads(SOURCE) == [], "read checkpoints through the model loader (models.fill)"


# A module's text -> what the rule names in it (nothing: a module that reads through the loader).
READER_USES = {
    "a": ("from safetensors.torch import load_file\n", "safetensors.torch"),
    "b": ("from gym_lightning.models import conversion\nr = conversion.SafetensorsReader('x')\n", "SafetensorsReader"),
    "c": (
        "def f():\n    from torch.distributed.checkpoint import HuggingFaceStorageReader as R\n",
        "HuggingFaceStorageReader",
    ),
    "d": ("from gym_lightning.models.fill import fill_weights\n", ""),
}


def test_the_reader_rule_catches_imports_and_uses(tmp_path: Path) -> None:
    root = _package(tmp_path, {f"strategies/{name}.py": text for name, (text, _) in READER_USES.items()})
    expected = [f"{PACKAGE}.strategies.{name}: {used}" for name, (_, used) in READER_USES.items() if used]
    assert checkpoint_reads(root) == expected


# The module holds no rank rule: how many calls every rank makes, and any sum over ranks, come from the strategy or
# the loss helpers given a process group (protocols.AgreesCallCounts, loss.start_max_counts / start_rank_sum).
RANK_RULE_FREE = ("module.py",)


def distributed_calls(path: Path) -> list[str]:
    """The ``torch.distributed`` (or ``dist``) attributes ``path`` uses at run time, e.g. ``all_reduce``."""
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute | ast.Name):
            owner = ast.unparse(node.value)
            if owner in ("torch.distributed", "dist"):
                found.append(node.attr)
    return sorted(set(found))


def test_the_module_holds_no_rank_rule() -> None:
    calls = {name: used for name in RANK_RULE_FREE if (used := distributed_calls(SOURCE / name))}
    assert calls == {}, "ask the strategy (protocols.AgreesCallCounts) or a loss helper given a process group"


def test_the_rank_rule_check_sees_collectives(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("import torch\ndef f(t):\n    torch.distributed.all_reduce(t)\n    return torch.zeros(1)\n")
    assert distributed_calls(path) == ["all_reduce"]


# Strategy names are data (gym_lightning.vocabulary.STRATEGY_PRESETS): no module registers a name of its own.
def registered_names(path: Path) -> list[str]:
    """String literals passed as the first argument of a ``register(...)`` call on a strategy registry."""
    names = []
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register":
            owner = ast.unparse(node.func.value).lower()
            if "strategy" in owner and node.args and isinstance(node.args[0], ast.Constant):
                names.append(str(node.args[0].value))
    return names


def test_strategy_names_are_registered_from_the_vocabulary_only() -> None:
    found = {module_name(p, SOURCE): n for p in sorted(SOURCE.rglob("*.py")) if (n := registered_names(p))}
    assert found == {}, "add the name to gym_lightning.vocabulary.STRATEGY_PRESETS"


def test_the_registration_check_sees_a_literal_name(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("def f(strategy_registry, cls):\n    strategy_registry.register('mine', cls)\n")
    assert registered_names(path) == ["mine"]
