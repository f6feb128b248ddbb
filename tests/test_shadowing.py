"""Nothing in the repository hides an installed distribution, and nothing in it points outside.

Whenever the repository root is on ``sys.path`` (``python -m pytest``, ``python -c``, a notebook
or a script started at the root; pytest's ``pythonpath`` setting too) a folder there with an
``__init__.py``, or a ``.py`` file, is imported ahead of site-packages. A top-level ``kernels/``
once hid Hugging Face's ``kernels`` distribution, which ``transformers.Trainer`` imports."""
import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the folders whose modules can stand first on sys.path: the root (python -m, -c, pytest's
# pythonpath) and tests/ (pytest's rootdir import mode puts a test's folder there)
FOLDERS = (ROOT, ROOT / "tests")
OWN = {"oktopk_triton"}


def _importable_names(folder: pathlib.Path):
    """The top-level names a folder on sys.path provides ahead of site-packages: regular
    packages (folders with ``__init__.py``) and modules. A folder without ``__init__.py`` is a
    namespace portion, which any regular package or module later on the path wins over."""
    names = set()
    for p in folder.iterdir():
        if p.is_dir() and (p / "__init__.py").is_file():
            names.add(p.name)
        elif p.suffix == ".py" and p.is_file():
            names.add(p.stem)
    return names


def test_no_name_in_the_tree_hides_an_installed_distribution():
    installed = importlib.metadata.packages_distributions()
    hidden = {f"{folder.name}/{name}: {installed[name]}"
              for folder in FOLDERS for name in _importable_names(folder) - OWN
              if name in installed}
    assert not hidden, f"these hide installed distributions: {sorted(hidden)}"


def test_a_stand_in_kernels_distribution_wins_at_the_root(tmp_path):
    """A site directory holding a stand-in ``kernels`` distribution: a Python started at the
    root (the root first on sys.path, as ``python -c`` puts it) imports the stand-in."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("STAND_IN = True\n")
    info = site / "kernels-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.0.1\n")
    (info / "top_level.txt").write_text("kernels\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = ("import sys, kernels; assert sys.path[0] == '', sys.path[:2]; "
            "print(kernels.__file__); print(getattr(kernels, 'STAND_IN', False))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    where, stand_in = r.stdout.split()
    assert stand_in == "True", f"`import kernels` at the root found {where}, not the stand-in"
    # and the package's own kernels are still its own, from the same directory
    r = subprocess.run([sys.executable, "-c", "import oktopk_triton.kernels as k; "
                        "print(k.__name__, hasattr(k, 'fused_select'))"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["oktopk_triton.kernels", "True"]


def _tracked_links():
    r = subprocess.run(["git", "ls-files", "-s", "-z"], cwd=ROOT, capture_output=True,
                       timeout=60)
    if r.returncode != 0:
        pytest.skip("not a git checkout")
    entries = [e.decode() for e in r.stdout.split(b"\0") if e]
    return [e.split("\t", 1)[1] for e in entries if e.startswith("120000 ")]


def test_no_tracked_file_is_a_link_out_of_the_tree():
    outside = []
    for rel in _tracked_links():
        path = ROOT / rel
        target = os.readlink(path)
        resolved = (path.parent / target).resolve()
        if os.path.isabs(target) or not resolved.is_relative_to(ROOT):
            outside.append(f"{rel} -> {target}")
    assert not outside, f"tracked links that lead out of the repository: {outside}"


def test_the_tools_edit_no_sys_path():
    """The tools run as modules from the root (``python -m tools.gpu_check``), which puts this
    checkout first on sys.path: none of them edits it."""
    import ast
    edits = []
    for f in sorted((ROOT / "tools").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                edits.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not edits, f"sys.path is read or edited in {edits}"
