"""The import layers of the tree (docs/design/architecture.md, "The layers of the code"): each module imports only
its own layer group or layers below it, no family imports another, and there is no import circle.

Read from the source with ``ast`` (every ``import``, at module level or inside a function), so the check costs no
imports and sees lazy ones too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "grafting", "video", "audio", "services")

# (group, rank): a module may import a module of its own group or of a lower rank, never a higher one or another
# group of the same rank (the families).
LAYERS = [
    ("core", 0),
    ("grafting", 1), ("video", 1), ("audio", 1),
    ("services.boundary", 2),
    ("services.config", 3),
    ("services.engines", 4), ("services.jobs", 4),
    ("services.deployments", 5),
    ("services.api", 6),
    ("services.serve_app", 7), ("services", 7),
    ("services.cli", 8), ("services.cluster", 8),
]


def layer_of(module: str) -> tuple[str, int] | None:
    """The (group, rank) of a project module (longest matching prefix), None for a module outside the project."""
    best = None
    for group, rank in LAYERS:
        if module == group or module.startswith(group + "."):
            if best is None or len(group) > len(best[0]):
                best = (group, rank)
    return best


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path, top_level_only: bool = False) -> set[str]:
    """The project modules ``path`` imports (relative imports resolved; ``from a import b`` counts ``a.b`` when
    that is a module of the tree, else ``a``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in MODULES else mod)
    return {m for m in out if layer_of(m) is not None and m.split(".")[0] in PACKAGES}


FILES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "vllm_ext" not in p.parts
               and "engine_site" not in p.parts)
MODULES = {module_name(p) for p in FILES}


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None] == []


def test_imports_go_down_the_layers_and_never_across_families():
    bad = []
    for path in FILES:
        src = module_name(path)
        g_src, r_src = layer_of(src)
        for dst in imports_of(path):
            g_dst, r_dst = layer_of(dst)
            if g_dst != g_src and r_dst >= r_src:
                bad.append(f"{src} -> {dst}")
    assert bad == []


def test_no_import_circle():
    """No circle among module-level imports (a lazy import inside a function is allowed to point back up a
    package's own modules, never across layers: the test above)."""
    graph = {module_name(p): imports_of(p, top_level_only=True) for p in FILES}
    state: dict[str, int] = {}
    circles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d == m or d not in graph:
                continue
            if state.get(d) == 1:
                circles.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_the_checker_sees_a_violation(tmp_path):
    """The checker itself: a family importing another family, and the ingress importing upward, are caught."""
    assert layer_of("video.engine") == ("video", 1) and layer_of("grafting.train.loop") == ("grafting", 1)
    assert layer_of("services.api.chat") == ("services.api", 6)
    assert layer_of("services.deployments.vlm")[1] < layer_of("services.api.app")[1]
    assert layer_of("services.boundary")[1] < layer_of("services.jobs.manager")[1]
    assert layer_of("numpy") is None
