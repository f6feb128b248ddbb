"""tools/gpu_check.py on CPU: the dry run's command list, and the runner (stage limits, MPS start
and stop, summary) with a fake MPS control binary and stand-in stages."""
import importlib.util
import json
import os
import re
import signal
import sys

import pytest

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                    "gpu_check.py")


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod          # dataclasses look their module up while decorating
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("gpu_check", None)


def _flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.mark.slow
def test_dry_run_command_list(gc, tmp_path, capsys):
    rc = gc.main(["--dry-run", "--out", str(tmp_path), "--date", "2026-11-23"])
    text = capsys.readouterr().out
    assert rc == 0
    assert not any(tmp_path.iterdir())                     # a dry run writes nothing
    lines = re.findall(r"^\[([a-z0-9-]+)\] timeout ([0-9.]+)s: (.*)$", text, re.M)
    names = [n for n, _, _ in lines]
    assert names == ["install", "mps-start", "tests", "compile-check", "kernels",
                     "collectives-p4", "collectives-p8", "ddp", "graph", "mps-stop"]
    limits = {n: float(t) for n, t, _ in lines}
    assert sum(limits.values()) < 9 * 60 and all(t > 0 for t in limits.values())
    assert f"limits sum: {sum(limits.values()):g}s" in text
    cmds = {n: c for n, _, c in lines}
    assert "pip install -q --no-deps --no-build-isolation -e ." in cmds["install"]
    assert cmds["mps-start"].startswith("nvidia-cuda-mps-control -d")
    assert cmds["mps-stop"].startswith("echo quit | nvidia-cuda-mps-control")
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/" in text and "CUDA_MPS_LOG_DIRECTORY=/tmp/" in text
    assert "-m pytest" in cmds["tests"] and "'not slow'" in cmds["tests"]
    assert " -n 8 " in cmds["tests"]                     # xdist workers: serial took > 100 s
    assert "tests/test_kernel_selection.py" in cmds["tests"]
    assert cmds["compile-check"].endswith("-m oktopk_triton.kernels._compile_check")
    # the same stages from build_stages: flags and sizes
    st = {s.name: s for s in gc.build_stages(str(tmp_path), "2026-11-23")}
    assert _flag(st["kernels"].argv, "--json") == str(tmp_path / "gpu-kernels-2026-11-23.json")
    for name, P, n in (("collectives-p4", 4, 1 << 26), ("collectives-p8", 8, 1 << 25)):
        a = st[name].argv
        assert a[a.index("oktopk_triton.cli") + 1] == "collectives"
        assert (_flag(a, "--backend"), _flag(a, "--comm")) == ("nccl", "cupy")
        assert (int(_flag(a, "--world-sizes")), int(_flag(a, "--n"))) == (P, n)
        assert float(_flag(a, "--density")) == 0.01
        assert (int(_flag(a, "--steps")), int(_flag(a, "--warmup"))) == (8, 3)
        assert os.path.dirname(_flag(a, "--json")) == str(tmp_path)
        assert os.path.basename(_flag(a, "--json")).startswith("gpu-collectives-")
    a = st["ddp"].argv
    assert (_flag(a, "--backend"), int(_flag(a, "--world-size"))) == ("nccl", 4)
    assert _flag(a, "--json") == str(tmp_path / "ddp-nccl-2026-11-23.json")
    assert float(_flag(a, "--timeout")) < st["ddp"].timeout_s   # the bench gives up first
    # the tool check ran and reported in one line per problem (no GPU here: some are missing)
    assert re.search(r"^tools: (all present|\d+ missing)$", text, re.M)
    for own in ("kernels", "ddp"):   # this checkout's own parsers accept their stages' flags
        assert f"stage {own}:" not in text


def test_ddp_stage_flags_parse(gc, tmp_path):
    from oktopk_triton import cli
    st = {s.name: s for s in gc.build_stages(str(tmp_path), "2026-11-23")}
    for name in ("kernels", "ddp"):
        argv = st[name].argv[3:]
        args = cli.build_parser(argv[0]).parse_args(argv)
        assert args.command == name


def test_default_out_puts_each_file_in_its_benchmark_folder(gc, tmp_path):
    st = {s.name: s for s in gc.build_stages(str(tmp_path), "2026-11-23", by_benchmark=True)}
    assert st["kernels"].outputs == [str(tmp_path / "kernels" / "gpu-kernels-2026-11-23.json")]
    assert st["ddp"].outputs[0] == str(tmp_path / "ddp" / "ddp-nccl-2026-11-23.json")
    assert all(os.path.dirname(o) == str(tmp_path / "collectives")
               for s in st.values() if s.name.startswith("collectives") for o in s.outputs)
    assert st["graph"].outputs[0].startswith(str(tmp_path / "gpu-profile") + os.sep)


FAKE_MPS = r"""#!/bin/bash
pipe="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}"
case "$1" in
  -d) mkdir -p "$pipe"; nohup "$0" serve >/dev/null 2>&1 & echo $! > "$pipe/pid"
      for i in $(seq 50); do [ -e "$pipe/control" ] && exit 0; sleep 0.1; done; exit 1;;
  serve) touch "$pipe/control"; while [ -e "$pipe/control" ]; do sleep 0.05; done; exit 0;;
  *) read cmd; [ "$cmd" = quit ] && rm -f "$pipe/control"; exit 0;;
esac
"""


def test_runner_limits_mps_and_summary(gc, tmp_path, monkeypatch, capsys):
    bindir, pipe, out = tmp_path / "bin", tmp_path / "pipe", tmp_path / "out"
    bindir.mkdir()
    fake = bindir / "nvidia-cuda-mps-control"
    fake.write_text(FAKE_MPS)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", str(tmp_path / "log"))
    real = gc.build_stages

    def stand_ins(out_dir, date, python=sys.executable, timeout_scale=1.0, **kw):
        st = {s.name: s for s in real(out_dir, date, python, timeout_scale, **kw)}
        py = [sys.executable, "-c"]
        # tests: fails; kernels: writes its JSON (and sees the MPS pipe directory); ddp: hangs
        st["tests"].argv = py + ["import sys; print('1 failed'); sys.exit(3)"]
        st["kernels"].argv = py + [
            "import json, os, sys; json.dump({'pipe': os.environ['CUDA_MPS_PIPE_DIRECTORY'], "
            "'interp': os.environ.get('TRITON_INTERPRET')}, open(sys.argv[1], 'w'))",
            st["kernels"].outputs[0]]
        st["ddp"].argv = py + ["import time; time.sleep(60)"]
        st["ddp"].timeout_s = 1.0
        return list(st.values())

    monkeypatch.setattr(gc, "build_stages", stand_ins)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    before = signal.getsignal(signal.SIGTERM)
    try:
        rc = gc.main(["--out", str(out), "--date", "2026-11-23",
                      "--only", "mps-start", "tests", "kernels", "ddp"])
    finally:
        pidfile = pipe / "pid"
        if pidfile.exists():   # never leave the fake daemon behind
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    assert rc == 1                                          # tests failed, ddp timed out
    assert signal.getsignal(signal.SIGTERM) == before      # handlers restored
    summ = json.loads((out / "gpu-check-2026-11-23.json").read_text())
    # the project's result header: the commit keeps its -dirty marker as a flag of its own
    assert summ["benchmark"] == "gpu-check" and isinstance(summ["dirty"], bool)
    assert summ["commit"] and not summ["commit"].endswith("-dirty")
    assert summ["arguments"]["only"] == ["mps-start", "tests", "kernels", "ddp"]
    st = {s["name"]: s for s in summ["stages"]}
    assert list(st) == ["mps-start", "tests", "kernels", "ddp", "mps-stop"]
    assert st["mps-start"]["status"] == "ok"
    assert (st["tests"]["status"], st["tests"]["rc"]) == ("failed", 3)
    assert st["kernels"]["status"] == "ok"
    assert st["kernels"]["outputs"] == [str(out / "gpu-kernels-2026-11-23.json")]
    assert (st["ddp"]["status"], st["ddp"]["rc"]) == ("timeout", 124)
    assert st["ddp"]["wall_s"] < 20                         # killed at its limit
    assert st["mps-stop"]["status"] == "ok" and summ["mps"] == "started, stopped"
    assert not (pipe / "control").exists()                  # the daemon is gone
    assert summ["ok"] is False
    # every stage saw the MPS pipe directory and no Triton interpreter
    seen = json.loads((out / "gpu-kernels-2026-11-23.json").read_text())
    assert seen == {"pipe": str(pipe), "interp": None}
    assert "1 failed" in (out / "gpu-check-logs" / "tests.log").read_text()
    table = (out / "gpu-check-2026-11-23.txt").read_text()
    assert "timeout" in table and "mps-stop" in table


@pytest.mark.slow
def test_steps_plan_dry_run(gc, tmp_path, capsys):
    """``--plan steps``: its own stages under the same budget, the collectives variants and the
    GPT runs accepted by this checkout's parsers and option checks."""
    rc = gc.main(["--plan", "steps", "--dry-run", "--out", str(tmp_path), "--date", "2026-11-26"])
    text = capsys.readouterr().out
    assert rc == 0 and not any(tmp_path.iterdir())
    lines = re.findall(r"^\[([a-z0-9-]+)\] timeout ([0-9.]+)s: (.*)$", text, re.M)
    assert [n for n, _, _ in lines] == ["install", "mps-start", "steps-p4", "steps-p8",
                                        "gpt-every-step", "gpt-local-steps", "mps-stop"]
    assert sum(float(t) for _, t, _ in lines) < gc.BUDGET_S
    for own in ("steps-p4", "steps-p8", "gpt-every-step", "gpt-local-steps"):
        assert f"stage {own}:" not in text
    st = {s.name: s for s in gc.build_stages(str(tmp_path), "2026-11-26", plan="steps")}
    from oktopk_triton import cli
    from oktopk_triton.bench import collectives as C
    from oktopk_triton.bench import train as T
    for name, P, n in (("steps-p4", 4, 1 << 26), ("steps-p8", 8, 1 << 25)):
        a = st[name].argv
        args = cli.build_parser("collectives").parse_args(a[3:])
        assert (args.world_sizes, args.n, args.backend) == ([P], n, "nccl")
        assert args.steps - args.warmup >= 20
        labels, skipped = C.resolve_variants(args.algorithms, args.backend, args.warmup)
        assert labels == list(gc.STEP_VARIANTS) and not skipped
    for name in ("gpt-every-step", "gpt-local-steps"):
        args = cli.build_parser("train").parse_args(st[name].argv[3:])
        assert (args.size, args.device, args.world_size) == ("25m", "cuda", 4)
        assert T.check_args(args) == ""
    with pytest.raises(SystemExit):
        gc.main(["--plan", "nosuch", "--dry-run"])
