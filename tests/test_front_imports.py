"""No import circle in oktopk_triton: the import graph read from every module's source (every
import statement, those under TYPE_CHECKING and inside functions included) has no cycle, and
every module of the front imports first in a fresh interpreter (a circle at run time fails
there with a partially initialised module)."""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the source folder of the installed package (the kernels are oktopk_triton/kernels/)
SOURCES = {"oktopk_triton": ROOT / "oktopk_triton"}


def _modules():
    mods = {}
    for prefix, folder in SOURCES.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([prefix] + parts)] = f
    return mods


def _targets(name, path, node, mods):
    """The package's modules an import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    if node.level:
        base = package
        for _ in range(node.level - 1):
            base = base.rsplit(".", 1)[0]
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    out = []
    for a in node.names:
        if f"{base}.{a.name}" in mods:          # from package import submodule
            out.append(f"{base}.{a.name}")
        elif base in mods:                       # from module import name
            out.append(base)
    return out


def import_graph():
    """module -> the package's modules it imports. An import of one of its own parent packages
    is left out: Python initialises the parents before the module, so it cannot close a
    circle (``from . import __version__``)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(name, path, node, mods):
                    if t != name and not name.startswith(t + "."):
                        graph[name].add(t)
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_circle():
    # the check itself: a circle through TYPE_CHECKING-style edges is found, a chain is not
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_reads_the_front():
    g = import_graph()
    assert {"oktopk_triton.modes.flat_params", "oktopk_triton.modes.local_steps",
            "oktopk_triton.modes.updates",
            "oktopk_triton.modes.frozen_adam", "oktopk_triton.modes.density_schedule"} <= g[
        "oktopk_triton.module"]
    assert "oktopk_triton.module" in g["oktopk_triton"]       # the package's lazy __getattr__
    assert "oktopk_triton.kernels" in g["oktopk_triton.algorithms.base"]


def test_no_import_circle_in_the_package():
    found = cycles(import_graph())
    assert found == [], f"import circles among oktopk_triton's modules: {found}"


def test_no_component_of_the_front_imports_module_back():
    g = import_graph()
    reach, todo = set(), list(g["oktopk_triton.module"])
    while todo:
        m = todo.pop()
        if m not in reach:
            reach.add(m)
            todo.extend(g[m])
    assert "oktopk_triton.module" not in reach
    assert "oktopk_triton.techniques" not in g["oktopk_triton.module"]


FRESH_IMPORTS = r"""
import importlib, pkgutil, sys
import torch  # noqa: F401  (kept loaded: only the package is imported afresh)
import oktopk_triton
for framework in ("lightning", "accelerate", "transformers"):   # slow to import: blocked, the
    sys.modules[framework] = None        # integrations then stop at their one-line ImportError
names = sorted(m.name for m in pkgutil.walk_packages(oktopk_triton.__path__, "oktopk_triton."))
failed = []
for name in names:
    for k in [k for k in sys.modules if k == "oktopk_triton" or k.startswith("oktopk_triton.")]:
        del sys.modules[k]
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, ModuleNotFoundError) and not (e.name or "").startswith("oktopk_triton"):
            continue                       # an optional third-party package
        if isinstance(e, ImportError) and "[integrations]" in str(e):
            continue                       # a blocked framework, named as the user sees it
        failed.append(f"{name}: {e!r}")
print(len(names))
print("\n".join(failed))
"""


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module of the package as the first one of the package loaded (the integrations
    with their frameworks blocked: those are slow to import; tests/test_integration_*.py import
    them for real)."""
    r = subprocess.run([sys.executable, "-c", FRESH_IMPORTS], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert int(lines[0]) > 40, lines          # the walk found the package's modules
    assert lines[1:] == [], "\n".join(lines[1:])


def _front_private_names():
    """The private attributes and methods of SparseAllreduce (set or defined in module.py)."""
    tree = ast.parse((SOURCES["oktopk_triton"] / "module.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SparseAllreduce")
    names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)
             and f.name.startswith("_") and not f.name.startswith("__")}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self" and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            names.add(node.attr)
    return names


def test_the_modes_use_the_front_through_its_narrow_interface():
    """Outside module.py no code of the package reads a private field of SparseAllreduce on
    another object, and no helper takes ``sar: Any``; the front provides every member of the
    modes' Host protocol."""
    private = _front_private_names()
    assert {"_reduce", "_advance", "_updates"} <= private
    bad = []
    for path in SOURCES["oktopk_triton"].rglob("*.py"):
        if path.name == "module.py" and path.parent == SOURCES["oktopk_triton"]:
            continue
        text = path.read_text()
        if "sar: Any" in text:
            bad.append(f"{path.name}: sar: Any")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and node.attr in private and \
                    isinstance(node.value, ast.Name) and node.value.id == "sar":
                bad.append(f"{path.name}:{node.lineno}: sar.{node.attr}")
    assert not bad, bad
    import torch
    from oktopk_triton import LocalCluster, SparseAllreduce
    from oktopk_triton.modes.host import Host
    sar = SparseAllreduce([torch.nn.Parameter(torch.zeros(8))],
                          comm=LocalCluster(1).communicator(0), density=0.5)
    wanted = set(Host.__annotations__) | {n for n in vars(Host) if not n.startswith("_")}
    assert all(hasattr(sar, n) for n in wanted), [n for n in wanted if not hasattr(sar, n)]
    assert sar.parts.factory(0.25, sar.comm).k == 2        # a fresh algorithm, same class
    assert type(sar.parts.factory(0.25, sar.comm)) is type(sar.algorithm)


def test_the_architecture_tree_is_the_package():
    """docs/architecture.md's tree names every module and subpackage at the package's top, and
    nothing that is not there."""
    import re
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("```text\noktopk_triton/\n", 1)[1].split("```", 1)[0]
    named = {re.split(r"\s+", line.strip())[0] for line in block.splitlines() if line.strip()}
    top = SOURCES["oktopk_triton"]
    there = {p.name for p in top.glob("*.py") if p.name != "__init__.py"} | {
        p.name + "/" for p in top.iterdir() if (p / "__init__.py").exists()}
    assert named == there, (sorted(named - there), sorted(there - named))
