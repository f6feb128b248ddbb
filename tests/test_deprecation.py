"""The old keyword spellings (oktopk_triton/deprecation.py): each still works for one version,
warns with its new spelling, and gives bitwise the result of the new spelling; the clean
signatures of the fronts."""
import inspect

import pytest
import torch

from oktopk_triton import LocalSteps, OkTopk, SparseAllreduce, TopkA
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.config import as_config
from oktopk_triton.ddp import SparseAllreduceState

BE = dict(backend="torch")


def test_the_fronts_signatures_are_clean():
    sig = inspect.signature(SparseAllreduce.__init__)
    assert len(sig.parameters) <= 12
    for front in (SparseAllreduce, SparseAllreduceState):
        params = inspect.signature(front.__init__).parameters.values()
        assert all(p.kind is not p.VAR_KEYWORD for p in params)
        assert "algorithm" in inspect.signature(front.__init__).parameters


def _updates_body(comm, kwargs, calls=6):
    m = torch.nn.Linear(8, 4)
    init = torch.Generator().manual_seed(0)        # the ranks are threads: no global seed
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=init))
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.3, **kwargs)
    g = torch.Generator().manual_seed(1 + comm.rank)
    outs = []
    for _ in range(calls):
        opt.zero_grad()
        m(torch.randn(4, 8, generator=g)).sum().backward()
        outs.append(sar.reduce_updates(opt).clone())
    return outs, [p.detach().clone() for p in m.parameters()], sar.residual.clone()


def _flat_body(comm, kwargs, steps=4):
    sar = SparseAllreduce(300, comm=comm, density=0.1, **kwargs)
    g = torch.Generator().manual_seed(3 + comm.rank)
    outs = [sar(torch.randn(300, generator=g)).clone() for _ in range(steps)]
    return outs, [], sar.residual.clone()


def _same(a, b):
    for (oa, wa, ra), (ob, wb, rb) in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(oa, ob))
        assert all(torch.equal(x, y) for x, y in zip(wa, wb))
        assert torch.equal(ra, rb)


LOCAL = [("sync_every", 2), ("outer_lr", 0.5), ("outer_momentum", 0.5),
         ("residual_decay", 0.9), ("moment_sync_every", 1), ("moment_sync", "second"),
         ("moment_dtype", "bf16"), ("moment_realign", 0.3)]


def _old_and_new(body, key, value, new_spelling, new_kwargs):
    """The old spelling warns with its new one, and both give bitwise the same run."""
    with pytest.warns(DeprecationWarning) as rec:
        old = LocalCluster(2).run(body, {key: value, **BE})
    want = f"SparseAllreduce(..., {key}={value!r}) is deprecated: use {new_spelling}"
    assert want in [str(w.message) for w in rec]
    _same(old, LocalCluster(2).run(body, new_kwargs))


@pytest.mark.parametrize("key,value", LOCAL)
def test_old_local_step_keyword_warns_and_matches(key, value):
    _old_and_new(_updates_body, key, value, f"local_steps=LocalSteps({key}={value!r})",
                 dict(local_steps=LocalSteps(**{key: value}), algorithm=OkTopk(**BE)))


ALGORITHM = [("momentum", 0.9), ("wire_format", "compact"), ("volume_budget", 2.0),
             ("warmup_steps", 1), ("consistency", 0.5), ("momentum_masking", False)]


@pytest.mark.parametrize("key,value", ALGORITHM)
def test_old_algorithm_keyword_warns_and_matches(key, value):
    _old_and_new(_flat_body, key, value, f"algorithm=OkTopk({key}={value!r})",
                 dict(algorithm=OkTopk(**{key: value}, **BE)))


def test_old_options_of_another_algorithm_name_it():
    with pytest.warns(DeprecationWarning, match=r"use algorithm=TopkA\(momentum=0.9\)"):
        sar = SparseAllreduce(100, algorithm="topka", momentum=0.9)
    assert sar.config == TopkA(momentum=0.9)


def test_ddp_state_old_keywords():
    with pytest.warns(DeprecationWarning, match=r"SparseAllreduceState\(\.\.\., momentum=0.9\) "
                                                r"is deprecated: use algorithm=OkTopk"):
        old = SparseAllreduceState(density=0.1, momentum=0.9)
    new = SparseAllreduceState(density=0.1, algorithm=OkTopk(momentum=0.9))
    assert old.config == new.config and old.options == new.options
    assert old.algorithm == new.algorithm == "oktopk"


def test_fsdp_old_keywords():
    fsdp = pytest.importorskip("oktopk_triton.integrations.fsdp")
    with pytest.warns(DeprecationWarning, match=r"SparseReplicaReduce\(\.\.\., wire_format="):
        old = fsdp.SparseReplicaReduce(None, 0.1, "topka", wire_format="compact")
    new = fsdp.SparseReplicaReduce(None, 0.1, TopkA(wire_format="compact"))
    assert old.options == new.options and old.algorithm == "topka"


def test_unknown_and_doubled_keywords_refused():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bogus'\]"):
        SparseAllreduce(100, bogus=1)
    m = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="not both"):
        SparseAllreduce(m.parameters(), local_steps=LocalSteps(sync_every=2), sync_every=4)


def test_objects_check_on_construction_in_one_line():
    for build, match in ((lambda: OkTopk(volume_budget=0), "oktopk: volume_budget must be"),
                         (lambda: OkTopk(momentum=1.0), "momentum must be a float in"),
                         (lambda: TopkA(wire_format="nope"), "wire_format must be one of"),
                         (lambda: LocalSteps(sync_every=0), "sync_every must be a positive"),
                         (lambda: as_config("nope"), "unknown algorithm")):
        with pytest.raises(ValueError, match=match) as e:
            build()
        assert "\n" not in str(e.value)
    assert OkTopk().describe()["algorithm"] == "oktopk"
    assert "volume_budget=4.0" in repr(OkTopk())


def test_the_objects_defaults_are_the_algorithms():
    from oktopk_triton.algorithms import get_algorithm
    from oktopk_triton.config import CONFIGS
    for name, cls in CONFIGS.items():
        cfg = cls()
        assert {k: cfg.options()[k] for k in cfg.own_options()} == get_algorithm(name).OPTIONS


def test_the_rooms_are_small():
    """The front's class is at most 200 lines and no module of the package over 600; module
    docstrings say what a thing does in at most 25 lines (the why lives in docs/research)."""
    import ast
    import glob
    import os
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "oktopk_triton")
    tree = ast.parse(open(os.path.join(root, "module.py")).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SparseAllreduce")
    assert cls.end_lineno - cls.lineno + 1 <= 200
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        text = open(path).read()
        assert len(text.splitlines()) <= 600, path
        doc = ast.get_docstring(ast.parse(text), clean=False) or ""
        assert doc.count("\n") + 1 <= 25, path


def test_a_moved_module_imports_by_its_old_name_with_a_warning():
    """In a fresh interpreter, for every moved module: the old name gives the module at its new
    place (one object), with one DeprecationWarning naming it; the new name warns nothing."""
    import subprocess
    import sys
    from oktopk_triton.deprecation import MOVED_MODULES
    code = """import importlib, warnings
from oktopk_triton.deprecation import MOVED_MODULES
for old, new in MOVED_MODULES.items():
    warnings.simplefilter('error')
    b = importlib.import_module(new)
    warnings.simplefilter('always')
    with warnings.catch_warnings(record=True) as w:
        a = importlib.import_module(old)
    assert a is b and a.__spec__.name == new, (old, a.__spec__)
    assert len(w) == 1 and w[0].category is DeprecationWarning, (old, w)
    assert new in str(w[0].message), w[0].message
    importlib.reload(a)
print(len(MOVED_MODULES))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-800:]
    assert r.stdout.split() == [str(len(MOVED_MODULES))]
