"""The house's rules, read from the source: no import circles in the library (counting the imports
inside functions, which only hide one), the library never imports Prefect, and the scheduler and
block manager stay pure Python."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "batchgen"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module this file imports, anywhere in it (top level or inside a function)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_in_the_library():
    graph = _graph()
    assert len(graph) > 50 and graph["batchgen.engine.native"]  # the graph was read
    assert _cycles(graph) == []


def test_the_library_never_imports_prefect_and_the_scheduler_is_pure_python():
    for path in PKG.rglob("*.py"):
        assert not any(i == "prefect" or i.startswith("prefect.") for i in _imports(path)), path
    for name in ("engine/scheduler.py", "engine/block_manager.py", "engine/speculative.py"):
        assert not {i.split(".")[0] for i in _imports(PKG / name)} & {"torch", "numpy"}, name


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
