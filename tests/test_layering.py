"""The architecture stays as docs/architecture.md draws it: checked on the source with ``ast``.

Rules (DESIGN.md, "Layout (the rooms)"):
1. ``partitioner/core`` is the ground floor: it imports nothing of ours outside itself.
2. Nothing in ``partitioner/core``, ``passes/`` or ``backends/`` imports the compile driver, the
   CLI or the runtime launcher: they sit on top.
3. No import cycle between the rooms. A room is a top-level package (``passes``, ``backends``,
   ``models_zoo``), or a sub-package or module of ``partitioner`` (``partitioner.cost``,
   ``partitioner.artifact``, ...). Imports inside functions count: a lazy import is still a
   dependency; imports under ``if TYPE_CHECKING:`` (annotations only) do not.
4. Size: no function or method over 80 lines and no class over 250 lines in the product code
   (``partitioner/``, ``passes/``, ``backends/``, ``models_zoo/``), decorators and docstrings
   included.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("partitioner", "passes", "backends", "models_zoo")
TOP_FLOOR = ("partitioner.compiler", "partitioner.cli", "partitioner.commands", "partitioner.runtime.launch")
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _walk_runtime(tree: ast.AST):
    """``ast.walk`` without the bodies of ``if TYPE_CHECKING:`` (imports for annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
            else:
                todo.append(child)


def _imports(path: Path) -> set[str]:
    """Every module of ours that ``path`` imports (``from a import b`` yields ``a`` and ``a.b``)."""
    mod = _module(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found: set[str] = set()
    for node in _walk_runtime(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found |= {f"{name}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "partitioner" and len(parts) > 1 else parts[0]


def test_the_walker_sees_lazy_and_relative_imports():
    """The checks below would pass vacuously if the walker missed imports."""
    found = _imports(ROOT / "partitioner" / "compiler.py")
    assert "partitioner.runtime.launch" in found  # imported inside Artifact.run
    assert "backends.tvm.fallback" in _imports(ROOT / "backends" / "tvm" / "lower.py") \
        or "backends.tvm" in _imports(ROOT / "backends" / "tvm" / "lower.py")


def test_core_imports_nothing_of_ours_above_it():
    bad = [f"{_module(p)} imports {m}" for p in _sources() if _within(_module(p), "partitioner.core")
           for m in _imports(p) if not _within(m, "partitioner.core") and m != "partitioner"]
    assert not bad, "\n".join(bad)


def test_lower_floors_do_not_import_the_driver_cli_or_launcher():
    lower = ("partitioner.core", "passes", "backends")
    bad = [f"{_module(p)} imports {m}" for p in _sources() if any(_within(_module(p), f) for f in lower)
           for m in _imports(p) if any(_within(m, top) for top in TOP_FLOOR)]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_rooms():
    graph = nx.DiGraph()
    why: dict[tuple[str, str], str] = {}
    for p in _sources():
        src = _room(_module(p))
        graph.add_node(src)
        for m in _imports(p):
            dst = _room(m)
            if dst != src and dst != "partitioner":  # the package's lazy API table is not a room
                graph.add_edge(src, dst)
                why.setdefault((src, dst), f"{_module(p)} -> {m}")
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    detail = [why[e] for c in cycles for e in graph.subgraph(c).edges]
    assert not cycles, f"import cycles between rooms {cycles}: " + "; ".join(detail)


def _too_long() -> list[str]:
    out: list[str] = []
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = node.end_lineno - first + 1
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                if length > limit:
                    out.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} is {length} lines (limit {limit})")
    return out


def test_no_function_or_class_is_too_long():
    too_long = _too_long()
    assert not too_long, "\n".join(too_long)


def test_rooms_are_the_documented_ones():
    """Every sub-package of partitioner is a room named in docs/architecture.md."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rooms = defaultdict(list)
    for p in (ROOT / "partitioner").iterdir():
        if p.is_dir() and (p / "__init__.py").is_file():
            rooms[p.name].append(p)
    missing = [name for name in rooms if f"partitioner/{name}/" not in doc]
    assert not missing, f"rooms missing from docs/architecture.md: {missing}"


# ---- docs/architecture.md names what a reader meets ------------------------------------------------
#: The modules a compile and a run go through (docs/architecture.md, "A compile" and "A run"): each
#: of them, and every module of ours each imports, must be named in the document.
SPINE = ("partitioner.cli", "partitioner.commands.compile", "partitioner.commands.run", "partitioner.compiler",
         "partitioner.partition", "partitioner.artifact", "partitioner.lowering.lower", "partitioner.runtime.launch",
         "partitioner.runtime.worker", "backends.tvm.build", "backends.tvm.lower", "backends.tvm.import_pipeline",
         "backends.tvm.executable")
_DOC_PATH = re.compile(r"[A-Za-z_][\w/]*\.py\b|[A-Za-z_]\w*/[\w/]*/(?=[\s`),.;:]|$)")  # files; folders a/b/


def _doc() -> str:
    return (ROOT / "docs" / "architecture.md").read_text()


def _named(path: Path, doc: str) -> bool:
    """Named = the repo-relative path, or a tail of it with at least two parts (``core/errors.py``)."""
    parts = path.relative_to(ROOT).parts
    return any("/".join(parts[k:]) in doc for k in range(len(parts) - 1))


def test_files_named_in_the_architecture_doc_exist():
    """Every ``*.py`` or nested folder (``a/b/``) the document names is a real file or folder (a
    tail of its path)."""
    real = {p.relative_to(ROOT).as_posix() for pkg in (*PACKAGES, "benchmarks", "tests", "docs")
            for p in [ROOT / pkg, *(ROOT / pkg).rglob("*")] if "__pycache__" not in p.parts}
    missing = sorted({t for t in _DOC_PATH.findall(_doc())
                      if not any(r == t.rstrip("/") or r.endswith("/" + t.rstrip("/")) for r in real)})
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_the_compile_and_run_paths_are_named_in_the_architecture_doc():
    sources = {_module(p): p for p in _sources()}
    assert set(SPINE) <= set(sources), sorted(set(SPINE) - set(sources))
    met = set(SPINE)
    for mod in SPINE:
        for m in _imports(sources[mod]):
            while m not in sources and "." in m:
                m = m.rsplit(".", 1)[0]
            met.add(m)
    doc = _doc()
    missing = sorted(str(sources[m].relative_to(ROOT)) for m in met
                     if m in sources and sources[m].name != "__init__.py" and not _named(sources[m], doc))
    assert not missing, f"modules on the compile/run path missing from docs/architecture.md: {missing}"
