"""The import layers of docs/architecture.md, checked: every ``plait`` import points down.

Every import of every module under ``src/plait`` counts, the ones inside functions
(lazy) and under ``TYPE_CHECKING`` included: a module may name only modules of its own
part or of a lower layer. The table below is the one in docs/architecture.md; a change
to either must change both (``test_the_table_matches_the_docs``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import plait

SRC = Path(plait.__file__).parent
DOC = SRC.parents[1] / "docs" / "architecture.md"

#: Each part, by module name prefix, and its layer. A module belongs to the longest prefix
#: that matches it; it may import any part of its own layer or a lower one, and the parts
#: of one layer import each other without a cycle.
LAYERS: dict[str, int] = {
    "plait.errors": 0,
    "plait.ops": 0,
    "plait._tensor": 0,
    "plait._auth": 0,
    "plait._net": 0,
    "plait._guard": 0,
    "plait.collectives": 0,
    "plait.objects": 0,
    "plait.diagnostics": 0,
    "plait.schedule": 1,
    "plait.algos": 2,
    "plait.sim": 3,
    "plait.rendezvous": 4,
    "plait.transport": 5,
    "plait.runtime": 6,
    "plait.selection": 7,
    "plait": 8,  # the package itself, the communicator and its rooms, _init, group, testing
    "plait.torch": 9,
    "plait.ray": 9,
    "plait.dask": 9,
    "plait.compression": 9,
    "plait.bucketing": 9,
    "plait.sharded": 9,
    "plait.launch": 10,
    "plait.bench": 11,
    "plait.cli": 12,
    "plait.__main__": 12,
}

#: Imports that point up, each with the reason it is allowed. Keep this empty if you can.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _part(module: str) -> str:
    best = ""
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    assert best, f"{module} belongs to no part of the layer table"
    return best


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (SRC.parent / rel).with_suffix(".py").exists() or (SRC.parent / rel).is_dir()


def _imports(path: Path) -> set[str]:
    """Every plait module ``path`` names, anywhere in the file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "plait")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] != "plait":
                continue
            # `from plait import errors` names plait.errors, not the package.
            names = [f"{source}.{a.name}" for a in node.names if _is_module(f"{source}.{a.name}")]
            out.update(names if len(names) == len(node.names) else [source, *names])
    return out


def test_every_import_points_down() -> None:
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        here = _part(module)
        for target in sorted(_imports(path)):
            there = _part(target)
            if LAYERS[there] <= LAYERS[here]:
                continue
            if (module, target) in EXCEPTIONS:
                continue
            upward.append(f"{module} ({LAYERS[here]}) imports {target} ({LAYERS[there]})")
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_no_cycle_between_parts() -> None:
    """Parts of one layer may import each other, but never in a circle."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        here = _part(_module_name(path))
        graph.setdefault(here, set()).update(p for p in map(_part, _imports(path)) if p != here)
    done: set[str] = set()

    def visit(part: str, path: list[str]) -> None:
        if part in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(part) :], part]))
        if part in done:
            return
        for nxt in sorted(graph.get(part, ())):
            visit(nxt, [*path, part])
        done.add(part)

    for part in sorted(graph):
        visit(part, [])


def test_the_table_matches_the_docs() -> None:
    """docs/architecture.md's layer diagram lists the same layers, in the same order."""
    text = DOC.read_text()
    diagram = text.split("```", 2)[1]
    rows = [
        (int(m.group(1)), m.group(2))
        for m in re.finditer(r"^\s*(\d+)\s+(.+)$", diagram, re.MULTILINE)
    ]
    for prefix, layer in LAYERS.items():
        short = prefix.removeprefix("plait.").removeprefix("plait")
        if not short or short == "__main__":
            continue
        name = short.replace(".", "/") + ("/" if (SRC / short).is_dir() else ".py")
        shown = [n for n, row in rows if re.search(rf"(^|\s){re.escape(name)}(\s|$)", row)]
        assert shown == [layer], f"{prefix}: layer {layer} here, {shown} in {DOC.name}"
