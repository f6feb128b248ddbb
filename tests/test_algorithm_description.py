"""An algorithm is its file plus one registry line: one defined and registered here, in this file
alone, is built by the front, checked, planned and reported (docs/architecture.md, "Adding an
algorithm"); and the built-in ones are read from their descriptions everywhere."""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import List, Optional

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from conservation import assert_bitwise_agreement, assert_conservation, mixed, run_steps  # noqa: E402,I001

from oktopk_triton import SparseAllreduce, config  # noqa: E402
from oktopk_triton.algorithms import (REGISTRY, Algorithm, Description, Option,  # noqa: E402
                                      description_of, descriptions, get_algorithm,
                                      register_algorithm)
from oktopk_triton.algorithms import schedule as S  # noqa: E402
from oktopk_triton.algorithms._sparse import volume_formula_range  # noqa: E402
from oktopk_triton.bench.ddp_report import display_name  # noqa: E402
from oktopk_triton.checks import int_at_least  # noqa: E402
from oktopk_triton.comm import LocalCluster  # noqa: E402
from oktopk_triton.planning import DEFAULT_KERNELS, parse_net, project, step_time  # noqa: E402


# -- the worked example of docs/architecture.md -------------------------------------------------
class SharedRandk(Algorithm):
    """Random-k with a shared seed: every rank picks the same k positions, so one allreduce of
    k values delivers them whole; the rest stays owed."""

    description = Description(
        name="sharedrandk", config="SharedRandk", display="shared random-k",
        advice="Shared random-k. Advice: 1. ``seed`` (default 0): the positions' seed.",
        options={"seed": Option(0, int_at_least(0), "an int >= 0", annotation=int)},
        volume=lambda n, k, P, **o: (2.0 * k * ((P - 1) / P),) * 2,   # an allreduce of k
        passes=(4 + 4 + 12 + 20, 0, 0))      # checks, acc, commit

    @classmethod
    def schedule(cls, n: int, k: int, P: int, **options) -> List[S.CollectiveSpec]:
        o = S.resolve_options(cls, n, k, P, options)
        if k >= n:
            return S.dense_step_specs(n, P, o)
        return S.flag_specs(P, o) + ([S.allreduce(4 * k, P)] if P > 1 else [])

    def step(self, grad: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        acc = self.accumulate(grad)
        g = torch.Generator().manual_seed(self.opts["seed"] + self.step_count)
        idx = torch.randperm(self.numel, generator=g)[:self.k].to(acc.device)
        val = acc[idx]
        if self.P > 1:
            self.comm.allreduce(val)
        out.index_copy_(0, idx, val / self.P)
        acc.index_fill_(0, idx, 0.0)
        self.commit_residual(acc, nonfinite)
        self.stats.update(local_selected=self.k, global_selected=self.k, overflow=0)


@pytest.fixture
def registered():
    register_algorithm("sharedrandk", SharedRandk)
    yield SharedRandk
    REGISTRY.pop("sharedrandk", None)


def test_the_registered_algorithm_is_built_and_keeps_the_contract(registered):
    res = run_steps("sharedrandk", P=3, n=600, steps=5, density=0.05, grad_fn=mixed(seed=0))
    assert_conservation(res)
    assert_bitwise_agreement(res)

    def front(comm):
        m = torch.nn.Linear(10, 4)
        sar = SparseAllreduce(m.parameters(), comm=comm, density=0.1,
                              algorithm=config.as_config("sharedrandk").replace(seed=3))
        ledger = sar.audit()
        for _ in range(3):
            m.zero_grad()
            m(torch.randn(5, 10, generator=torch.Generator().manual_seed(comm.rank))).sum() \
                .backward()
            sar.reduce_gradients()
        return sar.algorithm.opts["seed"], ledger.check()

    for seed, audit in LocalCluster(2).run(front):
        assert seed == 3 and audit["checked"] and audit["relative_error"] < 1e-6


def test_the_registered_algorithm_is_checked(registered):
    cfg = config.as_config("sharedrandk")
    assert type(cfg).__name__ == "SharedRandk" and cfg.seed == 0
    assert type(cfg).__doc__.startswith("Shared random-k")
    assert cfg.describe() == {"algorithm": "sharedrandk", "wire_format": "fp32",
                              "momentum": 0.0, "momentum_masking": None, "warmup_steps": 0,
                              "seed": 0}
    with pytest.raises(ValueError, match=r"^sharedrandk: seed must be an int >= 0, got -1$"):
        type(cfg)(seed=-1)
    with pytest.raises(ValueError, match=r"^sharedrandk: seed must be an int >= 0, got 'x'$"):
        SharedRandk(100, _one_comm(), 0.1, seed="x")      # built from keywords
    with pytest.raises(TypeError, match="unknown option"):
        cfg.replace(seeds=1)
    with pytest.raises(ValueError, match="compact"):
        type(cfg)(wire_format="compact")      # the base class refuses what it does not carry


def _one_comm():
    return LocalCluster(1).run(lambda c: c)[0]


def test_the_registered_algorithm_is_planned(registered):
    n, density, P = 1 << 20, 0.01, 8
    row = step_time("sharedrandk", n, density, P, parse_net("10Gbps"), DEFAULT_KERNELS)
    k = row["k"]
    lo, hi = volume_formula_range("sharedrandk", n, k, P)
    assert lo == hi == 2.0 * k * 7 / 8
    # the schedule: the flag (4 bytes) and the allreduce of k values
    assert row["bytes_per_rank"] == pytest.approx(4 * hi + 2 * 4 * 7 / 8)
    assert row["select_ms"] == pytest.approx(1e3 * n * DEFAULT_KERNELS.memory_s(40))
    rows = project(n, density, [2, 8], parse_net("10Gbps"), DEFAULT_KERNELS)
    assert {r["algorithm"] for r in rows} >= {"dense", "oktopk", "sharedrandk"}


def test_the_registered_algorithm_is_reported(registered):
    assert display_name("sharedrandk") == "shared random-k"
    assert display_name("oktopk") == "Ok-Topk" and display_name("gtopk") == "gTop-k"
    assert display_name("unregistered") == "unregistered"


# -- the built-in algorithms, from their descriptions ---------------------------------------------
@pytest.mark.parametrize("name", sorted(descriptions(builtin=True)))
def test_a_builtin_is_read_from_its_description(name):
    d = description_of(name)
    cls = get_algorithm(name)
    cfg = config.CONFIGS[name]
    assert cls.name == d.name == name and cls.sparse == d.sparse
    assert cls.OPTIONS == d.defaults() == {f.name: f.default for f in dataclasses.fields(cfg)
                                           if f.name in d.options}
    assert cfg.__name__ == d.config and getattr(config, d.config) is cfg
    assert cfg.__doc__ == d.advice and cfg.__module__ == "oktopk_triton.config"
    for option in d.options:                   # every option is in the advice
        assert f"``{option}``" in d.advice, (name, option)


def test_description_less_classes_still_register():
    class Plain(Algorithm):
        name = "plainalg"
        OPTIONS = {"x": 1}

        def step(self, grad, out, nonfinite):   # pragma: no cover - never stepped here
            raise AssertionError

    register_algorithm("plainalg", Plain)
    try:
        cfg = config.as_config("plainalg")
        assert isinstance(cfg, config.Registered) and cfg.own_options() == ("x",)
        assert description_of("plainalg") is None and "plainalg" not in descriptions()
    finally:
        REGISTRY.pop("plainalg", None)


def test_the_worked_example_in_the_docs_runs():
    """docs/architecture.md's example class, as written there, keeps the step contract."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "architecture.md")).read()
    block = text.split("## Adding an algorithm", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    source = block.split("\nregister_algorithm(", 1)[0]
    ns = {"torch": torch}
    exec(compile(source, "docs/architecture.md", "exec"), ns)
    res = run_steps(ns["SharedRandk"], P=3, n=300, steps=3, density=0.1, grad_fn=mixed(seed=1))
    assert_conservation(res)
    assert_bitwise_agreement(res)
    assert ns["SharedRandk"].OPTIONS == {"seed": 0}


def test_the_settings_module_stays_light():
    """config.py makes the settings objects on first use: importing it (or the rank launcher,
    which a forked rank unpickles before its environment is in place) loads no algorithm and
    no kernel, so a rank reads TRITON_INTERPRET from its own environment."""
    import subprocess
    code = ("import sys, oktopk_triton.config, oktopk_triton.bench.ranks, "
            "oktopk_triton.deprecation; print(sorted(m for m in sys.modules if m.startswith(("
            "'oktopk_triton.kernels', 'oktopk_triton.algorithms', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
