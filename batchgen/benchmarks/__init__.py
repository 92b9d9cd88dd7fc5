"""Benchmarks are programs, not tests: they print measurements, ratios and run conditions.

Every module here with a `__main__` block is a benchmark a user runs as `batchgen bench NAME [ARGS]`
(the same as `python -m batchgen.benchmarks.NAME [ARGS]`); `batchgen bench --help` lists them, found
here, so a new one needs no list kept by hand."""

from __future__ import annotations

import ast
from pathlib import Path


def programs() -> dict[str, str]:
    """NAME -> the first line of its docstring, for every benchmark program in this package."""
    out = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        src = path.read_text()
        if path.stem.startswith("_") or 'if __name__ == "__main__"' not in src:
            continue
        doc = ast.get_docstring(ast.parse(src)) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        if first.startswith("`python -m") and ": " in first:  # "`python -m ...`: what it measures"
            first = first.split(": ", 1)[1]
        first = first.split(". ")[0].rstrip(".")
        if len(first) > 96:
            first = first[:95].rsplit(" ", 1)[0] + " ..."
        out[path.stem] = first
    return out


def run(name: str, args: list[str]) -> int:
    """Run benchmark `name` with `args` as its command line, as `python -m` would; its exit status."""
    import difflib
    import runpy
    import sys

    known = programs()
    if name not in known:
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        raise ValueError(f"no benchmark {name!r}{f'; did you mean {near[0]!r}?' if near else ''} "
                         f"(batchgen bench --help lists them: {', '.join(known)})")
    saved = sys.argv
    sys.argv = [f"batchgen bench {name}", *args]
    try:
        runpy.run_module(f"batchgen.benchmarks.{name}", run_name="__main__", alter_sys=False)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
