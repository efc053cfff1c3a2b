"""notebooks/grafting.ipynb runs top to bottom (small settings: GRAFT_NB_SMALL=1) with nbclient."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]


def test_grafting_notebook_executes(model_dir, monkeypatch):
    monkeypatch.setenv("GRAFT_NB_SMALL", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(REPO / "notebooks/grafting.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    text = "\n".join(o.get("text", "") or str(o.get("data", {}).get("text/markdown", ""))
                     for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "small run" in text
    assert "| run | condition | colour | shape |" in text  # the experiment table
    assert "text-only KL(base || graft) over 5 prompts: max 0.0" in text
    assert "step,stage,loss,lr,tokens,seconds\n1,captions," in text and "\n2,qa," in text
    # issue 15 section: the held-out-scenes tables (multiple choice + generated + format check) and the plateaus
    assert "| generated (greedy), image |" in text and "One-word instruction obeyed" in text
    assert "plateau steps (smoothed loss within 5% of its later minimum):" in text
