"""The integrations without their frameworks, and what they check before any process starts: a
missing framework is an ImportError naming the extra, a model that is not DDP is refused, the
examples compile."""
import importlib
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = {"lightning": "lightning", "accelerate": "accelerate",
              "transformers": "transformers"}


def _uninstall(monkeypatch, framework):
    """Make ``framework`` and its submodules look uninstalled (None in sys.modules makes an
    import raise ImportError), also where another test imported them already."""
    for key in [k for k in sys.modules if k == framework or k.startswith(framework + ".")]:
        monkeypatch.setitem(sys.modules, key, None)
    monkeypatch.setitem(sys.modules, framework, None)


@pytest.mark.parametrize("module,framework", sorted(FRAMEWORKS.items()))
def test_missing_framework_names_the_extra(monkeypatch, module, framework):
    name = f"oktopk_triton.integrations.{module}"
    monkeypatch.delitem(sys.modules, name, raising=False)
    _uninstall(monkeypatch, framework)
    with pytest.raises(ImportError, match=r"needs .*pip install \"oktopk-triton\[integrations\]\""):
        importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_the_package_imports_without_any_framework(monkeypatch):
    for fw in FRAMEWORKS.values():
        _uninstall(monkeypatch, fw)
    monkeypatch.delitem(sys.modules, "oktopk_triton.integrations", raising=False)
    mod = importlib.import_module("oktopk_triton.integrations")
    assert mod.RANK_DIR == "oktopk"


def test_register_refuses_a_model_that_is_not_ddp():
    from oktopk_triton.ddp import SparseAllreduceState
    from oktopk_triton.integrations import register_on_ddp
    with pytest.raises(TypeError, match="expected the DistributedDataParallel model .* got "
                                        "Linear"):
        register_on_ddp(torch.nn.Linear(2, 2), SparseAllreduceState(), who="test")


def test_strategy_and_callback_refuse_foreign_arguments():
    pytest.importorskip("lightning")
    from oktopk_triton.integrations.lightning import SparseDDPStrategy, rank_dir
    with pytest.raises(TypeError, match="ddp_comm_hook is set by the strategy"):
        SparseDDPStrategy(ddp_comm_hook=lambda s, b: None)
    with pytest.raises(TypeError, match="state must be a SparseAllreduceState"):
        SparseDDPStrategy(state="oktopk")
    assert rank_dir("ck/last.ckpt") == "ck/last.ckpt.oktopk"
    assert SparseDDPStrategy(density=0.2).sparse_state.density == 0.2


@pytest.mark.parametrize("name", ["lightning_sparse", "accelerate_sparse", "trainer_sparse",
                                  "fsdp_hsdp_sparse"])
def test_examples_compile(name):
    with open(os.path.join(ROOT, "examples", f"{name}.py")) as f:
        code = f.read()
    compile(code, name, "exec")
    assert "oktopk_triton.integrations" in code
