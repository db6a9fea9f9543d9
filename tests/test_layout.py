"""The package's folders are its rooms, and imports run one way: from the server's doors
down to the core, the GPU sources and the shared vocabulary, never back up
(docs/how-it-works.md, "The parts", lists the rooms in this order).

A new import that runs upward fails here with the line that does it: move the shared piece
down, or pass it in from above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jupyter_gpushare"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "how-it-works.md"

#: each room's rank: a module may import its own room and rooms of a lower rank only
RANK = {
    "_version": 0, "states": 0, "units": 0, "clock": 0, "fields": 0, "protocol": 0, "events": 0,
    "policy": 1,
    "sim": 2,
    "telemetry": 3, "reclaim": 4,
    "kernel": 5,
    "node": 6,
    "core": 7,
    "server": 8,
    "hub": 9, "simulate": 9, "demo": 9,
    "doctor": 10, "cli": 10, "": 11,  # "": the package's __init__ (entry points only)
}


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, where) for every import inside the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "labextension" in path.parts:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        package = module if is_package else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: package.count(".") + 2 - node.level]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            found += [(module, n, where) for n in names if n.split(".")[0] == "jupyter_gpushare"]
    return found


def test_every_room_has_a_rank():
    rooms = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    assert rooms - set(RANK) == set(), "give the new room a rank in RANK (and a line in the docs)"


def test_imports_never_run_up_the_rooms():
    upward = [f"{where}: {src} -> {dst}" for src, dst, where in imports()
              if RANK[room_of(src)] < RANK[room_of(dst)]]
    assert upward == []


def test_the_layout_is_what_the_docs_show():
    text = DOCS.read_text()
    block = text[text.index("```text\njupyter_gpushare/"):]
    block = block[: block.index("```\n", 8)]
    shown = [word.strip("/").removesuffix(".py") for line in block.splitlines()[2:]
             for word in line.split()[:4] if word.endswith(("/", ".py"))]
    assert set(shown) == set(RANK) - {"", "_version"}
    order = [RANK[room] for room in shown]
    assert order == sorted(order), "the docs list the rooms from the bottom up"


@pytest.mark.parametrize("room", ["core", "server", "node", "policy"])
def test_each_room_says_what_it_is(room):
    doc = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text()))
    assert doc and len(doc) > 40
