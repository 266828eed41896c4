"""The package's layout stays readable: the modules of module/ and
benchmarks/ import each other in one direction only (no circle, counting the
imports made inside functions too), and no source file (the package, csrc/,
the tests, scripts/, examples/) is longer than 800 lines."""
import ast
import os

import transformer_engine_c

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the package imported: the source tree's, or an installed copy where the tests run apart from the sources
PKG = os.path.dirname(os.path.abspath(transformer_engine_c.__file__))
ACYCLIC = ("module", "benchmarks")
SIZED = ("csrc", "tests", "scripts", "examples")
SOURCE_EXT = {".py", ".c", ".h", ".cu", ".cuh", ".cc", ".cpp"}
MAX_LINES = 800


def sibling_imports(pkgdir):
    """{module: the set of modules of the same folder it imports} of the .py
    files in pkgdir, from `from . import x`, `from .x import ...` and
    `from ..pkg.x import ...` naming the folder itself."""
    names = {f[:-3] for f in os.listdir(pkgdir) if f.endswith(".py")}
    pkg = os.path.basename(pkgdir)
    graph = {}
    for name in sorted(names):
        with open(os.path.join(pkgdir, name + ".py")) as f:
            tree = ast.parse(f.read())
        deps = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            parts = (node.module or "").split(".") if node.module else []
            if node.level == 2 and parts[:1] == [pkg]:
                parts = parts[1:]
            elif node.level != 1:
                continue
            if parts:
                deps.add(parts[0])
            else:
                deps.update(a.name for a in node.names)
        graph[name] = (deps & names) - {name}
    return graph


def circles(graph):
    """The modules that reach themselves through their imports."""
    def reach(start):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return seen
    return sorted(m for m in graph if m in reach(m))


def long_files(root, dirs=SIZED, limit=MAX_LINES):
    """(path relative to root, lines) of each source file under dirs longer than limit."""
    hits = []
    for d in dirs:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, d)):
            dirnames[:] = sorted(n for n in dirnames if n not in {"__pycache__", "build"} and not n.startswith("."))
            for name in sorted(filenames):
                if os.path.splitext(name)[1] in SOURCE_EXT:
                    path = os.path.join(dirpath, name)
                    with open(path, "rb") as f:
                        n = f.read().count(b"\n")
                    if n > limit:
                        hits.append((os.path.relpath(path, root), n))
    return hits


def test_no_import_circles():
    for d in ACYCLIC:
        found = circles(sibling_imports(os.path.join(PKG, d)))
        assert not found, f"{d}: these modules import themselves through others: {found}"


def test_no_long_source_files():
    hits = long_files(ROOT) + long_files(os.path.dirname(PKG), (os.path.basename(PKG),))
    assert not hits, f"source files over {MAX_LINES} lines: {hits}"


def test_the_checkers_catch_a_circle_and_a_long_file(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n")  # inside a function: still an edge
    (pkg / "c.py").write_text("from ..pkg.a import x\n")
    (pkg / "d.py").write_text("from . import a\nimport os\n")
    assert circles(sibling_imports(str(pkg))) == ["a", "b", "c"]
    (pkg / "c.py").write_text("import pkg.a\n")  # absolute: not followed, the circle is gone
    assert circles(sibling_imports(str(pkg))) == []
    (pkg / "long.c").write_text("x;\n" * (MAX_LINES + 1))
    (pkg / "ok.c").write_text("x;\n" * MAX_LINES)
    assert long_files(str(tmp_path), ("pkg",)) == [("pkg/long.c", MAX_LINES + 1)]
