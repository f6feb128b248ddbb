"""Packaging: the version has one home and a CHANGELOG entry, the package is typed and ships its
marker, Python 3.10+, and the library prints nothing (it logs to "oktopk_triton")."""
import ast
import logging
import os
import re

import pytest

import oktopk_triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# user-facing output: the CLI and the benchmarks print their results
PRINTING = ("oktopk_triton/cli.py", "oktopk_triton/bench/",
            "oktopk_triton/kernels/_compile_check.py")


def _pyproject():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_version_has_one_home_and_a_changelog_entry():
    pp = _pyproject()
    assert "version" in pp["project"]["dynamic"] and "version" not in pp["project"]
    assert pp["tool"]["setuptools"]["dynamic"]["version"]["attr"] == "oktopk_triton.__version__"
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        heads = re.findall(r"^## (\S+)", f.read(), re.M)
    assert heads and heads[0] == oktopk_triton.__version__, heads


def test_typed_and_python_310():
    pp = _pyproject()
    assert pp["project"]["requires-python"] == ">=3.10"
    assert os.path.isfile(os.path.join(ROOT, "oktopk_triton", "py.typed"))
    assert "py.typed" in pp["tool"]["setuptools"]["package-data"]["oktopk_triton"]
    # every package directory is installed
    listed = set(pp["tool"]["setuptools"]["packages"])
    for d, _, files in os.walk(os.path.join(ROOT, "oktopk_triton")):
        if "__init__.py" in files:
            assert os.path.relpath(d, ROOT).replace(os.sep, ".") in listed, d


def test_library_prints_nothing():
    offenders = []
    for base in ("oktopk_triton",):
        for d, _, files in os.walk(os.path.join(ROOT, base)):
            for name in files:
                rel = os.path.relpath(os.path.join(d, name), ROOT).replace(os.sep, "/")
                if not name.endswith(".py") or rel.startswith(PRINTING):
                    continue
                with open(os.path.join(ROOT, rel)) as f:
                    tree = ast.parse(f.read())
                offenders += [f"{rel}:{n.lineno}" for n in ast.walk(tree)
                              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                              and n.func.id == "print"]
    assert not offenders, offenders


def test_logs_go_to_the_package_logger(tmp_path, caplog):
    from oktopk_triton import SparseAllreduce
    from oktopk_triton.comm.local import SingleCommunicator
    sar = SparseAllreduce(10, SingleCommunicator(), density=0.5, algorithm="dense")
    with caplog.at_level(logging.INFO, logger="oktopk_triton"):
        sar.save(str(tmp_path))
        sar.load(str(tmp_path))
    names = {r.name for r in caplog.records}
    assert names == {"oktopk_triton.checkpoint"}, names
    assert any("saved to" in r.getMessage() for r in caplog.records)
