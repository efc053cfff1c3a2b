"""The client examples of README.md and docs/**/*.md run exactly as written against the running service and print
what they show; the links between those pages resolve; the README stays short and its Layout names every module.

The rule (README "Quick start", docs/README.md): every ```python and ```bash block of README.md and of
``docs/**/*.md`` is run, unless the line right before its opening fence is ``<!-- not run: <reason> -->``. A block
that is run must be followed (blank lines between allowed) by a ```text block: what it prints. Each line of that
text block must equal a line of the block's stdout, in order (other lines may come between), where ``...`` stands
for any text; its stderr must carry no warning.

The only substitutions: ``127.0.0.1:8000`` (the pages' base URL, http:// and ws://) -> the test service's
host:port, and ``.venv/bin/python`` -> ``sys.executable`` (the interpreter of this test run, which is that venv's).
Python blocks run with ``sys.executable``, bash blocks with ``bash -e -o pipefail``, each in its own temporary
working directory, each with a bounded timeout. Needs the shared e2e lock (it starts the Ray Serve app); the
other tests of this file need no service.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").rglob("*.md"))  # every page whose blocks run and whose links resolve
README_MAX_LINES = 250
LAYOUT_PACKAGES = ("core", "services", "grafting", "video", "audio")  # each of their files is named in README's Layout
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
    (None: no such block); ``page`` the file's path relative to the repository root ("" when parsed from a
    string)."""

    line: int
    lang: str
    code: str
    not_run: str | None = None
    shown: list[str] | None = None
    page: str = ""


def fenced_blocks(text: str, page: str = "") -> list[Block]:
    """Every fenced block of ``text`` (markdown), with ``not_run`` and ``shown`` filled in as the module doc
    describes, each tagged with ``page``. Raises ValueError for a fence that is never closed."""
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
            raise ValueError(f"{page or '<text>'} line {start + 1}: fence never closed")
        prev = lines[start - 1].strip() if start else ""
        marker = NOT_RUN.match(prev)
        blocks.append(Block(start + 1, m.group(1), "".join(ln + "\n" for ln in lines[start + 1:i]),
                            prev[len("<!-- not run: "):-len(" -->")] if marker else None, page=page))
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


def prose(text: str) -> list[tuple[int, str]]:
    """(1-based line number, line) of every line of markdown ``text`` outside fenced blocks, with inline code
    spans blanked out (links and headings are read from these)."""
    out, fenced = [], False
    for n, line in enumerate(text.split("\n"), 1):
        if re.match(r"^```", line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, every character but letters, digits, ``_``, ``-`` and
    spaces dropped, spaces as ``-`` (e.g. "Websocket `WS /v1/audio/speech/stream`" ->
    "websocket-ws-v1audiospeechstream")."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of markdown ``text``'s headings (outside fenced blocks), a repeated one numbered ``-1``,
    ``-2``, ... as GitHub does."""
    seen: Counter[str] = Counter()
    out = set()
    fenced = False
    for line in text.split("\n"):
        if re.match(r"^```", line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6} +(.+?) *#* *$", line)
        if m:
            s = slug(m.group(1))
            out.add(f"{s}-{seen[s]}" if seen[s] else s)
            seen[s] += 1
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every relative markdown link ``[text](target)`` (images too) in ``text``'s prose:
    targets with a scheme (``https:``, ``mailto:``) are left out, a bare ``#anchor`` is kept."""
    out = []
    for n, line in prose(text):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                out.append((n, target))
    return out


def broken_links(page: Path) -> list[str]:
    """``page:line: target (why)`` for each relative link of markdown file ``page`` whose file does not exist,
    or whose ``#anchor`` is not a heading of the target markdown file."""
    bad = []
    for n, target in links(page.read_text()):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{n}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text())):
            bad.append(f"{where} (no such heading)")
    return bad


def layout_block() -> str:
    """The first fenced block under README's ``## Layout`` heading."""
    text = README.read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return fenced_blocks(section)[0].code


def layout_entries(block: str) -> dict[str, str]:
    """Top-level directory (``services``) -> its text in the Layout block: its line and the indented lines
    after it."""
    out: dict[str, str] = {}
    name = None
    for line in block.split("\n"):
        m = re.match(r"^(\w+)/ ", line)
        if m:
            name = m.group(1)
            out[name] = ""
        if name and line.strip():
            out[name] += line + "\n"
    return out


def package_files(pkg: str) -> list[Path]:
    """The files of top-level package ``pkg``, relative to it: every file but ``__init__.py``, caches and the
    shipped weights under ``grafting/assets/`` (named as a folder)."""
    return sorted(p.relative_to(ROOT / pkg) for p in (ROOT / pkg).rglob("*")
                  if p.is_file() and p.name != "__init__.py" and "__pycache__" not in p.parts
                  and p.suffix != ".pyc" and p.relative_to(ROOT / pkg).parts[0] != "assets")


BLOCKS = [b for page in PAGES for b in fenced_blocks(page.read_text(), str(page.relative_to(ROOT)))]
EXAMPLES = runnable(BLOCKS)


def test_rules_of_the_block_parser():
    md = ("intro\n<!-- not run: starts a server -->\n```bash\nmake serve\n```\n\n```python\nprint('hi')\n```\n\n"
          "```text\nhi\n```\n```bash\necho x\n```\nprose\n```text\nx\n```\n```\nlayout\n```\n")
    blocks = fenced_blocks(md, "x.md")
    assert [(b.line, b.lang, b.not_run, b.shown) for b in blocks] == [
        (3, "bash", "starts a server", None), (7, "python", None, ["hi"]), (11, "text", None, None),
        (14, "bash", None, None), (18, "text", None, None), (21, "", None, None)]
    assert [b.line for b in runnable(blocks)] == [7, 14]
    assert blocks[1].code == "print('hi')\n" and blocks[1].page == "x.md"
    with pytest.raises(ValueError, match="x.md line 1: fence never closed"):
        fenced_blocks("```python\nprint(1)\n", "x.md")
    out = ["a", "id=chatcmpl-1f, done", "x", "Red.  "]
    assert first_unmatched(["id=chatcmpl-..., done", "Red."], out) is None
    assert first_unmatched(["...", "x"], out) is None
    assert first_unmatched(["Red.", "x"], out) == "x"      # in order
    assert first_unmatched(["Red"], out) == "Red"          # whole line
    assert first_unmatched(["a.*"], ["ab"]) == "a.*"       # only ... is a wildcard


def test_rules_of_the_link_checker():
    md = ("# Chimera\n## Quick start\n## Websocket `WS /v1/audio/speech/stream`\n## Quick start\n"
          "see [a](docs/a.md#x), [b](#quick-start), ![c](img.png) and [d](https://example.com/x) `[e](f.md)`\n"
          "```\n[g](h.md)\n# not a heading\n```\n")
    assert anchors(md) == {"chimera", "quick-start", "websocket-ws-v1audiospeechstream", "quick-start-1"}
    assert links(md) == [(5, "docs/a.md#x"), (5, "#quick-start"), (5, "img.png")]
    assert slug("GPU profile: fetching the weights and the memory plan") == \
        "gpu-profile-fetching-the-weights-and-the-memory-plan"
    assert layout_entries("a/   x.py\n  more y.py\nb/   z.py\n") == {"a": "a/   x.py\n  more y.py\n", "b": "b/   z.py\n"}
    assert named_in("a/ x.py, sub/ (y.py)", Path("sub/y.py")) and named_in("a/ sub/y.py", Path("sub/y.py"))
    assert not named_in("a/ y.py, sub/ (x.py)", Path("sub/y.py")) and not named_in("a/ y.py", Path("sub/y.py"))
    assert named_in("a/ x.py, sub/ (y.py)", Path("x.py")) and not named_in("a/ xx.py", Path("x.py"))


def test_broken_links_names_each_missing_file_and_heading(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# Bee\n## Two words\n")
    page = tmp_path / "a.md"
    page.write_text("# Top\n[ok](sub/b.md#two-words) [ok](#top) [ok](sub/b.md) [ok](sub)\n"
                    "[x](sub/c.md) [y](sub/b.md#three) [z](#nowhere) [w](sub#bee)\n")
    assert broken_links(page) == [f"{page}:3: sub/c.md (no such file)", f"{page}:3: sub/b.md#three (no such heading)",
                                  f"{page}:3: #nowhere (no such heading)", f"{page}:3: sub#bee (no such heading)"]


def test_every_example_is_run_and_shows_its_output():
    # every python/bash block is either marked not-run (with a reason) or run below and followed by its output
    assert len(EXAMPLES) >= 6, [(b.page, b.line) for b in EXAMPLES]
    assert {b.page for b in EXAMPLES} > {"README.md"}, "the docs' examples are found and run too"
    assert [(b.page, b.line) for b in EXAMPLES if b.shown is None] == []
    assert all(BASE in b.code for b in EXAMPLES), [(b.page, b.line) for b in EXAMPLES if BASE not in b.code]
    marked = [b for b in BLOCKS if b.lang in RUN_LANGS and b.not_run is not None]
    assert marked and all("make serve" in b.code for b in marked), [(b.page, b.line) for b in marked]


def test_readme_is_short_and_the_docs_exist():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES
    assert ROOT / "docs" / "README.md" in PAGES and len(PAGES) > 10


def test_every_relative_link_resolves():
    assert sum(len(links(p.read_text())) for p in PAGES) > 50  # the checker sees the links
    assert [bad for page in PAGES for bad in broken_links(page)] == []


def named_in(entry: str, f: Path) -> bool:
    """Whether Layout ``entry`` names file ``f`` (relative to its package): by its file name, and for a file of a
    subfolder after that folder's own name (``train/ ... loop.py``), so a subpackage's files are listed with it."""
    if len(f.parts) > 1:
        folder = re.search(rf"(?<![\w.]){re.escape(f.parent.name)}/", entry)
        if not folder:
            return False
        entry = entry[folder.end():]
    return re.search(rf"(?<![\w.]){re.escape(f.name)}(?!\w)", entry) is not None


def test_layout_names_every_module():
    entries = layout_entries(layout_block())
    missing = [f"{pkg}/{f}" for pkg in LAYOUT_PACKAGES for f in package_files(pkg)
               if not named_in(entries.get(pkg, ""), f)]
    assert missing == [], f"README's Layout leaves out {missing}"


@pytest.mark.parametrize("block", EXAMPLES, ids=[f"{b.page}:{b.line}" for b in EXAMPLES])
def test_example(block, serve_url, tmp_path):
    assert block.shown is not None, f"{block.page}:{block.line}: no ```text block with its output follows it"
    host_port = urlsplit(serve_url).netloc
    code = block.code.replace(BASE, host_port).replace(".venv/bin/python", sys.executable)
    if block.lang == "python":
        (tmp_path / "example.py").write_text(code)
        cmd = [sys.executable, "example.py"]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    report = f"{block.page}:{block.line} exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr[-4000:]}"
    assert p.returncode == 0, report
    assert "Warning" not in p.stderr, f"an example's output is not clean:\n{report}"  # e.g. the SDK's Sora notice
    missing = first_unmatched(block.shown, p.stdout.split("\n"))
    assert missing is None, f"shown line not printed: {missing!r}\n{report}"
