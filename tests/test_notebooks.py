"""Every notebook in notebooks/ runs top to bottom in a fresh kernel (their cells assert what they show); what a
notebook claims in numbers is read back from its outputs and checked here too."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# 04_sft_then_dpo prints the first and last logged reward margin, on the training pairs and on held-out pairs.
MARGIN_LINE = re.compile(r"^(train|held-out) rewards/margins: first (\S+) -> last (\S+)$", re.MULTILINE)


def stdout_of(notebook: nbformat.NotebookNode) -> str:
    """Everything the executed notebook's code cells printed."""
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.get("output_type") == "stream" and output.get("name") == "stdout"
    )


def check_claims(name: str, notebook: nbformat.NotebookNode) -> None:
    """The numbers a notebook shows agree with what its text says."""
    if name == "04_sft_then_dpo.ipynb":  # DPO grows the reward margin, on the pairs it trains on and held-out ones
        margins = {m[1]: (float(m[2]), float(m[3])) for m in MARGIN_LINE.finditer(stdout_of(notebook))}
        assert set(margins) == {"train", "held-out"}, stdout_of(notebook)[-2000:]
        for split, (first, last) in margins.items():
            assert last > first, (split, first, last)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": tmp_path}})
    client.execute()  # raises CellExecutionError, naming the cell, on any error or failed assertion
    check_claims(path.name, notebook)


def test_committed_notebooks_carry_no_outputs() -> None:
    """Outputs stay out of the repository (it stays light and diffs stay readable)."""
    assert NOTEBOOKS
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs: clear them"


def test_a_margin_that_did_not_grow_fails_the_notebook_s_check() -> None:
    printed = "train rewards/margins: first 0.0000 -> last 1.2000\nheld-out rewards/margins: first 0.9 -> last 0.8\n"
    cell = nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output("stream", name="stdout", text=printed)])
    with pytest.raises(AssertionError, match="held-out"):
        check_claims("04_sft_then_dpo.ipynb", nbformat.v4.new_notebook(cells=[cell]))
    grown = printed.replace("last 0.8", "last 1.5")
    cell.outputs[0].text = grown
    check_claims("04_sft_then_dpo.ipynb", nbformat.v4.new_notebook(cells=[cell]))
