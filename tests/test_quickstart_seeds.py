"""benchmarks/quickstart_seeds.py: its table and the docs section it replaces (no training here; it measures)."""

from __future__ import annotations

from types import ModuleType


def _load() -> ModuleType:
    from benchmarks import quickstart_seeds

    return quickstart_seeds


def test_table_has_a_row_per_seed_and_min_median_max() -> None:
    bench = _load()
    results = [bench.SeedResult(0, 0.95, 0.12, 30.0, 25.0), bench.SeedResult(1, 0.91, 0.2, 40.0, 33.0)]
    section = bench.markdown(results, "python -m benchmarks.quickstart_seeds")
    assert section.startswith(bench.SECTION) and "2 of 2 seeds reach >= 0.90" in section
    assert "| 1 | 0.910 | 0.2000 | 40.0 | 33.0 |" in section
    assert "| **median** | 0.930 | 0.1600 | 35.0 | 29.0 |" in section


def test_write_docs_replaces_only_its_own_section() -> None:
    bench = _load()
    document = "# Benchmarks\n\n## 1. Other\n\ntext\n"
    first = bench.replace_section(document, f"{bench.SECTION}\n\nold\n")
    assert first.startswith(document) and first.count(bench.SECTION) == 1
    middle = first + "\n## After\n\nkept\n"
    second = bench.replace_section(middle, f"{bench.SECTION}\n\nnew\n")
    assert "old" not in second and "new" in second and "## After\n\nkept" in second and "## 1. Other" in second
