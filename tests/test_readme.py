"""README.md's client examples run exactly as written against the running service and print what it shows.

The rule (README "Quick start"): every ```python and ```bash block of README.md is run, unless the line right
before its opening fence is ``<!-- not run: <reason> -->``. A block that is run must be followed (blank lines
between allowed) by a ```text block: what it prints. Each line of that text block must equal a line of the
block's stdout, in order (other lines may come between), where ``...`` stands for any text.

The only substitutions: ``127.0.0.1:8000`` (the README's base URL, http:// and ws://) -> the test service's
host:port, and ``.venv/bin/python`` -> ``sys.executable`` (the interpreter of this test run, which is that venv's).
Python blocks run with ``sys.executable``, bash blocks with ``bash -e -o pipefail``, each in its own temporary
working directory, each with a bounded timeout. Needs the shared e2e lock (it starts the Ray Serve app).
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BASE = "127.0.0.1:8000"
RUN_LANGS = ("python", "bash")
NOT_RUN = re.compile(r"^<!-- not run: \S.* -->$")
# Generous bound against a hang, not a speed check: the slowest block (three video jobs) takes about 15 s on an
# idle 2-core machine and under 60 s with the test suite's other load.
BLOCK_TIMEOUT_S = 300


@dataclass
class Block:
    """One fenced code block of a markdown file: ``line`` is its opening fence's 1-based line number, ``lang``
    the info string, ``code`` the text inside; ``not_run`` the reason of a ``<!-- not run: ... -->`` marker on
    the line right before the fence (None: unmarked); ``shown`` the lines of the ```text block that follows it
    (None: no such block)."""

    line: int
    lang: str
    code: str
    not_run: str | None = None
    shown: list[str] | None = None


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text`` (markdown), with ``not_run`` and ``shown`` filled in as the module doc
    describes. Raises ValueError for a fence that is never closed."""
    lines = text.split("\n")
    blocks: list[Block] = []
    closing: list[int] = []  # 0-based index of each block's closing fence
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        if i == len(lines):
            raise ValueError(f"line {start + 1}: fence never closed")
        prev = lines[start - 1].strip() if start else ""
        marker = NOT_RUN.match(prev)
        blocks.append(Block(start + 1, m.group(1), "".join(ln + "\n" for ln in lines[start + 1:i]),
                            prev[len("<!-- not run: "):-len(" -->")] if marker else None))
        closing.append(i)
        i += 1
    for a, b, end_of_a in zip(blocks, blocks[1:], closing):
        if b.lang == "text" and all(not ln.strip() for ln in lines[end_of_a + 1:b.line - 1]):
            a.shown = b.code.rstrip("\n").split("\n")
    return blocks


def runnable(blocks: list[Block]) -> list[Block]:
    """The python/bash blocks without a not-run marker."""
    return [b for b in blocks if b.lang in RUN_LANGS and b.not_run is None]


def first_unmatched(shown: list[str], out: list[str]) -> str | None:
    """The first shown line that matches no output line after the previous match (``...`` = any text, the rest
    literal, whole line, trailing spaces ignored), or None when all of them match in order."""
    rest = iter(line.rstrip() for line in out)
    for want in shown:
        pattern = re.compile(".*".join(re.escape(part) for part in want.rstrip().split("...")))
        if not any(pattern.fullmatch(got) for got in rest):
            return want
    return None


BLOCKS = fenced_blocks(README.read_text())
EXAMPLES = runnable(BLOCKS)


def test_rules_of_the_block_parser():
    md = ("intro\n<!-- not run: starts a server -->\n```bash\nmake serve\n```\n\n```python\nprint('hi')\n```\n\n"
          "```text\nhi\n```\n```bash\necho x\n```\nprose\n```text\nx\n```\n```\nlayout\n```\n")
    blocks = fenced_blocks(md)
    assert [(b.line, b.lang, b.not_run, b.shown) for b in blocks] == [
        (3, "bash", "starts a server", None), (7, "python", None, ["hi"]), (11, "text", None, None),
        (14, "bash", None, None), (18, "text", None, None), (21, "", None, None)]
    assert [b.line for b in runnable(blocks)] == [7, 14]
    assert blocks[1].code == "print('hi')\n"
    with pytest.raises(ValueError, match="line 1: fence never closed"):
        fenced_blocks("```python\nprint(1)\n")
    out = ["a", "id=chatcmpl-1f, done", "x", "Red.  "]
    assert first_unmatched(["id=chatcmpl-..., done", "Red."], out) is None
    assert first_unmatched(["...", "x"], out) is None
    assert first_unmatched(["Red.", "x"], out) == "x"      # in order
    assert first_unmatched(["Red"], out) == "Red"          # whole line
    assert first_unmatched(["a.*"], ["ab"]) == "a.*"       # only ... is a wildcard


def test_every_readme_example_is_run_and_shows_its_output():
    # every python/bash block is either marked not-run (with a reason) or run below and followed by its output
    assert len(EXAMPLES) >= 6, [b.line for b in EXAMPLES]
    assert [b.line for b in EXAMPLES if b.shown is None] == []
    assert all(BASE in b.code for b in EXAMPLES), [b.line for b in EXAMPLES if BASE not in b.code]
    marked = [b for b in BLOCKS if b.lang in RUN_LANGS and b.not_run is not None]
    assert marked and all("make serve" in b.code for b in marked), [b.line for b in marked]


@pytest.mark.parametrize("block", EXAMPLES, ids=[f"README.md:{b.line}-{b.lang}" for b in EXAMPLES])
def test_readme_example(block, serve_url, tmp_path):
    assert block.shown is not None, f"README.md:{block.line}: no ```text block with its output follows it"
    host_port = urlsplit(serve_url).netloc
    code = block.code.replace(BASE, host_port).replace(".venv/bin/python", sys.executable)
    if block.lang == "python":
        (tmp_path / "example.py").write_text(code)
        cmd = [sys.executable, "example.py"]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    report = f"README.md:{block.line} exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr[-4000:]}"
    assert p.returncode == 0, report
    assert "Warning" not in p.stderr, f"an example's output is not clean:\n{report}"  # e.g. the SDK's Sora notice
    missing = first_unmatched(block.shown, p.stdout.split("\n"))
    assert missing is None, f"shown line not printed: {missing!r}\n{report}"
