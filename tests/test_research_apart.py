"""The research probes stay apart: the installed package imports nothing of ``tools`` (a fresh
interpreter that imports every module of it, with the repository root importable, holds no
``tools`` module), and an algorithm from outside the package joins through
``register_algorithm`` (what tools/research/block_probe.py uses), not by patching the registry."""
import ast
import pathlib
import subprocess
import sys

import pytest

from oktopk_triton import algorithms
from oktopk_triton.algorithms import Algorithm, get_algorithm, register_algorithm

ROOT = pathlib.Path(__file__).resolve().parents[1]

EVERY_MODULE = r"""
import importlib, pkgutil, sys
import oktopk_triton
for framework in ("lightning", "accelerate", "transformers"):   # slow to import: blocked
    sys.modules[framework] = None
names = sorted(m.name for m in pkgutil.walk_packages(oktopk_triton.__path__, "oktopk_triton."))
for name in names:
    try:
        importlib.import_module(name)
    except ImportError:
        pass                               # an optional framework or third-party package
print(len(names))
print(sorted(k for k in sys.modules if k == "tools" or k.startswith("tools.")))
"""


def test_the_package_imports_no_tools_module():
    r = subprocess.run([sys.executable, "-c", EVERY_MODULE], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    count, loaded = r.stdout.strip().splitlines()[-2:]
    assert int(count) > 40
    assert loaded == "[]", loaded


def test_no_source_of_the_package_names_tools():
    bad = []
    for folder in (ROOT / "oktopk_triton",):
        for f in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                bad += [f"{f}: {n}" for n in names if n == "tools" or n.startswith("tools.")]
    assert not bad, bad


class _Probe(Algorithm):
    name = "probe-test"

    def step(self, grad, out, nonfinite):
        out.copy_(grad)


def test_register_algorithm(monkeypatch):
    monkeypatch.setattr(algorithms, "REGISTRY", dict(algorithms.REGISTRY))
    register_algorithm("probe-test", _Probe)
    assert get_algorithm("probe-test") is _Probe
    assert "probe-test" in algorithms.available_algorithms()
    with pytest.raises(ValueError):
        register_algorithm("oktopk", _Probe)            # a built-in stays
    with pytest.raises(ValueError):
        register_algorithm("Probe", _Probe)
    with pytest.raises(TypeError):
        register_algorithm("other", object)
    assert get_algorithm("oktopk").__name__ == "OkTopk"
