"""``notebooks/chaining.ipynb`` runs top to bottom (nbclient) with small settings; its own asserts check that
drift correction keeps the last clip's luma within 2% of the first and that without it the luma falls > 12%."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def test_chaining_notebook_executes(model_dir, monkeypatch):
    monkeypatch.setenv("CHAIN_NB_SIZE", "64")
    monkeypatch.setenv("CHAIN_NB_CLIPS", "4")
    monkeypatch.setenv("CHAIN_NB_STEPS", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(ROOT / "notebooks" / "chaining.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    out = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "4 clips x 9 frames -> 33 frames" in out
    assert "corrected " in out and out.rstrip().endswith("ok")
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # seam frames, clips with/without correction, luma curves
