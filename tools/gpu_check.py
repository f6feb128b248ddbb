#!/usr/bin/env python3
"""One command for a GPU machine: MPS, the CUDA tests, the kernel checks and every GPU benchmark.

    python3 -m tools.gpu_check [--plan check|steps] [--out DIR] [--dry-run] [--only STAGE ...]
                                [--skip STAGE ...]
    make gpu-check [GPU_CHECK_OUT=DIR]        (--plan check)
    make gpu-steps [GPU_CHECK_OUT=DIR]        (--plan steps)

Stages, in order, each under its own time limit (the limits sum to under 9 minutes, so the
whole fits one 10-minute call on one H100):

  install        pip install -q --no-deps --no-build-isolation -e .  (only when
                 ``oktopk_triton.kernels`` does not import from this checkout)
  mps-start      nvidia-cuda-mps-control -d, with CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY
                 under /tmp (every later stage inherits them; without MPS, ranks that share a GPU
                 are time-sliced and their step times are meaningless)
  tests          pytest -m "not slow", the CUDA-relevant files first
  compile-check  python -m oktopk_triton.kernels._compile_check
  kernels        oktopk-bench kernels                        -> gpu-kernels-DATE.json
  collectives-p4 oktopk-bench collectives --backend nccl --comm cupy, P=4, n=2^26, 1%
                 -> gpu-collectives-nccl-cupy-P4-n67108864-DATE.json
  collectives-p8 the same at P=8, n=2^25
                 -> gpu-collectives-nccl-cupy-P8-n33554432-DATE.json
  ddp            oktopk-bench ddp, P=4                       -> ddp-nccl-DATE.json (+ .md table)
  graph          python -m tools.gpu_profile --graph, n=2^26: each step eager and from a CUDA graph
                 -> gpu-profile-graph-DATE.json
  mps-stop       echo quit | nvidia-cuda-mps-control        (always, also after a failure or a
                 signal, when this script started the daemon)

``--plan steps`` (under 9 minutes as well): install, mps-start, then

  steps-p4       oktopk-bench collectives --backend nccl, P=4, n=2^26, 1%: dense, Ok-Topk eager
                 and graphed, on the fp32 and the compact wire (``oktopk:wire_format=compact,
                 graph=1``), 20 timed steps each (medians, quartiles), host syncs of a steady
                 step (a replay when graphed)   -> gpu-collectives-steps-P4-n67108864-DATE.json
  steps-p8       the same at P=8, n=2^25
  gpt-every-step oktopk-bench train --model gpt --size 25m --device cuda, 4 ranks, 100 steps:
                 dense and Ok-Topk 1% every step   -> lm-gpu-25m-steps-every-DATE.json
  gpt-local-steps  the same for local steps (sync_every=4, 8%, compact)
                 -> lm-gpu-25m-steps-local-DATE.json
  mps-stop

Every stage's output goes to ``DIR/gpu-check-logs/STAGE.log`` (its last lines are echoed); every
benchmark writes its JSON into DIR as it finishes; ``DIR/gpu-check-DATE.json`` (and ``.txt``)
records each stage's command, limit, wall time and exit status and is rewritten after every stage,
so a run cut short still says how far it got. A stage that fails or times out (exit 124) does not
stop the ones after it. Exit status: 0 when every stage ran and passed, else 1.

``--dry-run`` prints every command with its limit, checks that the tools the stages need exist
(python modules, the MPS control binary, a CUDA device, the flags of the benchmark parsers) and
reports what is missing, without running anything.

Needs only loopback networking; torch, triton and cupy must already be installed.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 540                     # 9 minutes: the limits of all stages together stay below
MPS_PIPE_DEFAULT = "/tmp/oktopk-mps-pipe"
MPS_LOG_DEFAULT = "/tmp/oktopk-mps-log"
MPS_CONTROL = "nvidia-cuda-mps-control"
# the test files that exercise the CUDA path, run first so that a time limit cuts the others
CUDA_TEST_FILES = ("test_kernel_selection.py", "test_kernel_histogram.py",
                   "test_kernel_threshold.py", "test_kernel_scatter.py", "test_kernel_region.py",
                   "test_kernel_elementwise.py", "test_kernel_dispatch.py", "test_comm.py",
                   "test_step_costs.py", "test_oktopk.py", "test_algorithms.py", "test_ddp.py",
                   "test_module.py", "test_graph.py", "test_kernel_completion.py")

# collectives runs: (P, n)
COLLECTIVE_RUNS = ((4, 1 << 26), (8, 1 << 25))
DENSITY = 0.01
# measured on an H100 (2026-11-25): tests 115 s with 8 workers (more than 100 s with one), kernels
# 21 s, collectives 100 s at P=4 and 66 s at P=8, ddp 68 s
TIMEOUTS = {"install": 20, "mps-start": 5, "tests": 150, "compile-check": 30, "kernels": 30,
            "collectives-p4": 110, "collectives-p8": 80, "ddp": 75, "graph": 30, "mps-stop": 5}
TEST_WORKERS = 8                   # pytest-xdist workers on the GPU machine (16 cores there)

# the "steps" plan (--plan steps): the step times that decide the launch-light work, each variant
# with 20 timed steps after 7 (3 eager + the capture + 3 replays) so that medians and spreads
# mean something; estimates, not yet run: a start with Triton compiling ~40 s, dense at P=4,
# n=2^26 ~113 ms a step, the 25m GPT ~110 ms a dense step
STEP_VARIANTS = ("dense", "oktopk", "oktopk:graph=1", "oktopk:wire_format=compact",
                 "oktopk:wire_format=compact,graph=1")
STEP_COUNTS = ("--steps", "27", "--warmup", "7")
GPT_STEPS = 100
STEPS_TIMEOUTS = {"install": 20, "mps-start": 5, "steps-p4": 150, "steps-p8": 120,
                  "gpt-every-step": 110, "gpt-local-steps": 80, "mps-stop": 5}
PLANS = ("check", "steps")


@dataclass
class Stage:
    name: str
    argv: List[str]
    timeout_s: float
    outputs: List[str] = field(default_factory=list)   # files the stage writes into --out
    stdin: Optional[str] = None
    note: str = ""
    bench: Optional[str] = None    # the oktopk-bench subcommand, whose parser must accept argv

    def command(self) -> str:
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        return f"echo {shlex.quote(self.stdin.strip())} | {cmd}" if self.stdin else cmd


def build_stages(out_dir: str, date: str, python: str = sys.executable,
                 timeout_scale: float = 1.0, by_benchmark: bool = False,
                 plan: str = "check") -> List[Stage]:
    """Every stage of ``plan``, in order (install and mps-start are conditional at run time);
    each file in its benchmark's folder under ``out_dir`` with ``by_benchmark``, else in
    ``out_dir``."""
    if plan == "steps":
        return _step_stages(out_dir, date, python, timeout_scale, by_benchmark)

    def t(name: str) -> float:
        return round(TIMEOUTS[name] * timeout_scale, 1)

    def out(name: str) -> str:
        return os.path.join(out_dir, _records().folder_of(name) if by_benchmark else "", name)

    bench = [python, "-m", "oktopk_triton.cli"]
    stages = [
        *_common_stages(python, t),
        Stage("tests", [python, "-m", "pytest", "-q", "-ra", "-m", "not slow", "-p",
                        "no:cacheprovider", "-n", str(TEST_WORKERS), "--durations=15",
                        *test_files()], t("tests")),
        Stage("compile-check", [python, "-m", "oktopk_triton.kernels._compile_check"],
              t("compile-check")),
        Stage("kernels", [*bench, "kernels", "--json", out(f"gpu-kernels-{date}.json")],
              t("kernels"), outputs=[out(f"gpu-kernels-{date}.json")], bench="kernels"),
    ]
    for P, n in COLLECTIVE_RUNS:
        path = out(f"gpu-collectives-nccl-cupy-P{P}-n{n}-{date}.json")
        stages.append(Stage(
            f"collectives-p{P}",
            [*bench, "collectives", "--backend", "nccl", "--comm", "cupy", "--algorithms", "all",
             "--world-sizes", str(P), "--n", str(n), "--density", str(DENSITY), "--steps", "8",
             "--warmup", "3", "--json", path], t(f"collectives-p{P}"), outputs=[path],
            bench="collectives"))
    ddp_json, ddp_md = out(f"ddp-nccl-{date}.json"), out(f"ddp-nccl-{date}.md")
    stages.append(Stage(
        "ddp", [*bench, "ddp", "--backend", "nccl", "--world-size", "4", "--hooks", "all",
                "--algorithms", "all", "--density", str(DENSITY), "--steps", "8", "--warmup", "3",
                "--timeout", str(max(10, int(t("ddp")) - 10)), "--json", ddp_json,
                "--markdown", ddp_md], t("ddp"), outputs=[ddp_json, ddp_md], bench="ddp"))
    graph_json = out(f"gpu-profile-graph-{date}.json")
    stages.append(Stage(
        "graph", [python, "-m", "tools.gpu_profile", "--log2", "26", "--reps", "10", "--steps",
                  "oktopk", "spardl", "dense", "--graph", "--json", graph_json], t("graph"),
        outputs=[graph_json], note="each step eager and replayed from a CUDA graph, one rank"))
    stages.append(Stage("mps-stop", [MPS_CONTROL], t("mps-stop"), stdin="quit\n",
                        note="always at the end (also on failure) when this script started MPS"))
    return stages


def _common_stages(python: str, t) -> List[Stage]:
    return [Stage("install", [python, "-m", "pip", "install", "-q", "--no-deps",
                              "--no-build-isolation", "-e", "."], t("install"),
                  note="only when oktopk_triton.kernels does not import from this checkout"),
            Stage("mps-start", [MPS_CONTROL, "-d"], t("mps-start"),
                  note="only when no MPS daemon is running on CUDA_MPS_PIPE_DIRECTORY")]


def _step_stages(out_dir: str, date: str, python: str, timeout_scale: float,
                 by_benchmark: bool) -> List[Stage]:
    """``--plan steps``: eager and graphed Ok-Topk steps on the fp32 and the compact wire
    against dense (NCCL ranks under MPS, P=4 at n=2^26 and P=8 at n=2^25, host syncs counted on
    a steady step of each), then the 25m GPT's per-step times: dense and 1% every step, and
    local steps (every 4th call syncs 8% on the compact wire)."""
    def t(name: str) -> float:
        return round(STEPS_TIMEOUTS[name] * timeout_scale, 1)

    def out(name: str) -> str:
        return os.path.join(out_dir, _records().folder_of(name) if by_benchmark else "", name)

    bench = [python, "-m", "oktopk_triton.cli"]
    stages = _common_stages(python, t)
    for P, n in COLLECTIVE_RUNS:
        path = out(f"gpu-collectives-steps-P{P}-n{n}-{date}.json")
        stages.append(Stage(
            f"steps-p{P}",
            [*bench, "collectives", "--backend", "nccl", "--comm", "cupy", "--algorithms",
             *STEP_VARIANTS, "--world-sizes", str(P), "--n", str(n), "--density", str(DENSITY),
             *STEP_COUNTS, "--probe-reps", "3", "--json", path], t(f"steps-p{P}"),
            outputs=[path], bench="collectives"))
    gpt = [*bench, "train", "--model", "gpt", "--size", "25m", "--device", "cuda",
           "--world-size", "4", "--steps", str(GPT_STEPS), "--seeds", "0", "--no-plot"]
    every = out(f"lm-gpu-25m-steps-every-{date}.json")
    stages.append(Stage("gpt-every-step", [*gpt, "--algorithms", "dense", "oktopk", "--density",
                                           str(DENSITY), "--json", every],
                        t("gpt-every-step"), outputs=[every], bench="train"))
    local = out(f"lm-gpu-25m-steps-local-{date}.json")
    stages.append(Stage("gpt-local-steps", [*gpt, "--algorithms", "oktopk", "--density", "0.08",
                                            "--option", "sync_every=4", "--option",
                                            "wire_format=compact", "--json", local],
                        t("gpt-local-steps"), outputs=[local], bench="train"))
    stages.append(Stage("mps-stop", [MPS_CONTROL], t("mps-stop"), stdin="quit\n",
                        note="always at the end (also on failure) when this script started MPS"))
    return stages


def test_files() -> List[str]:
    """tests/test_*.py, the CUDA-relevant ones first (relative to the repository root)."""
    found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "tests", "test_*.py")))
    first = [f for f in CUDA_TEST_FILES if f in found]
    return [f"tests/{f}" for f in first + [f for f in found if f not in first]]


# -- environment -----------------------------------------------------------------------------------
def stage_env() -> Dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)     # compiled kernels on the GPU machine
    env.setdefault("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DEFAULT)
    env.setdefault("CUDA_MPS_LOG_DIRECTORY", MPS_LOG_DEFAULT)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def mps_running(pipe_dir: str) -> bool:
    """An MPS control daemon serves ``pipe_dir``: its control pipe exists and a process named
    nvidia-cuda-mps-control is alive (oktopk_triton.bench.ranks.detect_mps, what the benchmarks
    use, asks the daemon itself)."""
    if not os.path.exists(os.path.join(pipe_dir, "control")):
        return False
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip().startswith("nvidia-cuda-mps"):
                    return True
        except OSError:
            continue
    return False


def installed_here(python: str, env: Dict[str, str]) -> bool:
    """``oktopk_triton.kernels`` imports from this checkout (i.e. the editable install is live)."""
    code = ("import os, oktopk_triton, oktopk_triton.kernels as k; "
            "print(os.path.realpath(oktopk_triton.__file__)); print(os.path.realpath(k.__file__))")
    try:
        p = subprocess.run([python, "-c", code], cwd="/", env=env, capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    repo = os.path.realpath(REPO) + os.sep
    lines = p.stdout.split()
    return p.returncode == 0 and len(lines) == 2 and all(x.startswith(repo) for x in lines)


_CHECK_SCRIPT = r"""
import importlib, io, json, sys, contextlib
mods, benches = json.loads(sys.argv[1]), json.loads(sys.argv[2])
r = {"modules": {}, "benches": {}}
for m in mods:
    try:
        importlib.import_module(m)
        r["modules"][m] = ""
    except Exception as e:
        r["modules"][m] = repr(e)[:160]
try:
    import torch
    r["cuda"], r["gpus"] = torch.cuda.is_available(), torch.cuda.device_count()
except Exception:
    r["cuda"], r["gpus"] = False, 0
for name, argv in benches.items():
    err = io.StringIO()
    try:
        from oktopk_triton import cli
        with contextlib.redirect_stderr(err):
            cli.build_parser(argv[0]).parse_args(argv)
        r["benches"][name] = ""
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        r["benches"][name] = (lines or ["rejected"])[-1]
    except Exception as e:
        r["benches"][name] = repr(e)[:200]
print(json.dumps(r))
"""


def check_tools(stages: List[Stage], python: str, env: Dict[str, str]) -> List[str]:
    """What the stages need and this machine lacks (one line each): python modules, a CUDA
    device, the MPS control binary, and the benchmark flags against this checkout's parsers
    (one interpreter checks all of them)."""
    missing: List[str] = []
    mods = ["torch", "triton", "numpy", "pytest", "xdist", "cupy", "cupy.cuda.nccl", "pip"]
    benches = {st.name: st.argv[3:] for st in stages if st.bench is not None}
    try:
        p = subprocess.run([python, "-c", _CHECK_SCRIPT, json.dumps(mods), json.dumps(benches)],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        have = json.loads(p.stdout.strip().splitlines()[-1])
    except Exception as exc:  # noqa: BLE001
        return [f"{python}: cannot run the checks ({exc})"]
    for m in mods:
        if have["modules"].get(m):
            missing.append(f"python module {m}: {have['modules'][m]}")
    if not have.get("cuda"):
        missing.append("CUDA device: torch.cuda.is_available() is False")
    if shutil.which(MPS_CONTROL) is None:
        missing.append(f"{MPS_CONTROL} not on PATH (the benchmarks would run time-sliced)")
    if shutil.which("nvidia-smi") is None:
        missing.append("nvidia-smi not on PATH (no NVIDIA driver tools)")
    for name, problem in have["benches"].items():
        if problem:
            missing.append(f"stage {name}: `oktopk-bench {benches[name][0]}` does not accept "
                           f"its flags here: {problem}")
    return missing


# -- running ---------------------------------------------------------------------------------------
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Interrupted(Exception):
    """A signal arrived: the current stage is killed, MPS stopped, the summary written."""


def _on_signal(signum, frame):  # noqa: ARG001
    raise Interrupted(f"signal {signum}")


def run_stage(st: Stage, env: Dict[str, str], log_path: str) -> Dict[str, object]:
    """Run one stage in its own process group under its limit; its record."""
    t0 = time.monotonic()
    rec: Dict[str, object] = {"name": st.name, "command": st.command(), "timeout_s": st.timeout_s,
                              "log": log_path}
    with open(log_path, "w") as log:
        log.write(f"$ {st.command()}\n")
        log.flush()
        try:
            proc = subprocess.Popen(st.argv, cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT,
                                    stdin=subprocess.PIPE if st.stdin else subprocess.DEVNULL,
                                    start_new_session=True, text=True)
        except OSError as exc:
            rec.update(rc=127, status="missing", wall_s=0.0, error=str(exc))
            log.write(f"cannot start: {exc}\n")
            return rec
        try:
            if st.stdin:
                proc.stdin.write(st.stdin)
                proc.stdin.close()
            rc = proc.wait(timeout=st.timeout_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, status = 124, "timeout"
            log.write(f"\n[gpu_check] {st.name}: killed after {st.timeout_s:g}s\n")
        except BaseException:
            _kill_group(proc)
            raise
    rec.update(rc=rc, status=status, wall_s=round(time.monotonic() - t0, 2))
    return rec


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM then SIGKILL to the stage's own process group (its rank processes included, also
    those whose parent already exited): the package's one home for it, ranks.kill_group."""
    from oktopk_triton.bench.ranks import kill_group
    kill_group(proc.pid)
    proc.poll()


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


_STAGE_COLUMNS = [("stage", lambda r: r["name"]), ("status", lambda r: r["status"]),
                  ("rc", lambda r: r.get("rc", "")),
                  ("wall s", lambda r: f"{r.get('wall_s', 0):.1f}"),
                  ("limit s", lambda r: f"{r['timeout_s']:.1f}")]


def write_summary(summary: Dict[str, object], out_dir: str, date: str) -> str:
    records = _records()
    records.write(os.path.join(out_dir, f"gpu-check-{date}.json"), summary)
    rows = [records.table(summary["stages"], _STAGE_COLUMNS, left=2, sep="  "),
            f"total {summary['wall_s']:.1f} s (limits sum to {summary['limits_sum_s']:.0f} s); "
            f"MPS: {summary['mps']}"]
    with open(os.path.join(out_dir, f"gpu-check-{date}.txt"), "w") as f:
        f.write("\n".join(rows) + "\n")
    return "\n".join(rows)


def _records():
    """oktopk_triton.bench.records from this checkout (installed or not: ``python -m
    tools.gpu_check`` at the root puts it first on sys.path): the one header and writer of every
    JSON of the project (the commit with its -dirty marker, versions, MPS/NCCL settings,
    arguments)."""
    from oktopk_triton.bench import records
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None,
                    help="directory for every JSON, the logs and the summary (default: each "
                         "benchmark's folder under bench/results of this checkout)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the commands and check the tools; run nothing")
    ap.add_argument("--plan", choices=PLANS, default="check",
                    help="check (default): tests, kernels and every GPU benchmark; steps: the "
                         "eager and graphed steps on both wires, host syncs, the 25m GPT's "
                         "step times")
    ap.add_argument("--only", nargs="+", default=None, metavar="STAGE", help="run only these")
    ap.add_argument("--skip", nargs="+", default=[], metavar="STAGE", help="do not run these")
    ap.add_argument("--timeout-scale", type=float, default=1.0,
                    help="multiply every stage's limit (e.g. 2 on a slower GPU)")
    ap.add_argument("--date", default=None, help="date in file names (default today)")
    args = ap.parse_args(argv)

    date = args.date or datetime.date.today().isoformat()
    out_dir = os.path.abspath(args.out) if args.out else os.path.join(REPO, "bench", "results")
    python = sys.executable
    stages = build_stages(out_dir, date, python, args.timeout_scale, by_benchmark=not args.out,
                          plan=args.plan)
    if not args.out:      # the summary and the logs: the gpu-check benchmark's own folder
        out_dir = os.path.join(out_dir, _records().folder_of("gpu-check"))
    names = [s.name for s in stages]
    for n in (args.only or []) + args.skip:
        if n not in names:
            ap.error(f"unknown stage {n!r}; stages: {' '.join(names)}")
    selected = [s for s in stages if (args.only is None or s.name in args.only)
                and s.name not in args.skip]
    env = stage_env()
    limits = sum(s.timeout_s for s in selected)

    if args.dry_run:
        print(f"gpu_check dry run: repo {REPO}, out {out_dir}, python {python}")
        print(f"env: CUDA_MPS_PIPE_DIRECTORY={env['CUDA_MPS_PIPE_DIRECTORY']} "
              f"CUDA_MPS_LOG_DIRECTORY={env['CUDA_MPS_LOG_DIRECTORY']} (TRITON_INTERPRET unset)")
        for s in selected:
            print(f"[{s.name}] timeout {s.timeout_s:g}s: {s.command()}"
                  + (f"   # {s.note}" if s.note else ""))
        print(f"limits sum: {limits:g}s (budget {BUDGET_S}s)")
        missing = check_tools(selected, python, env)
        for m in missing:
            print(f"missing: {m}")
        print("tools: all present" if not missing else f"tools: {len(missing)} missing")
        return 0

    os.makedirs(out_dir, exist_ok=True)
    log_dir = os.path.join(out_dir, "gpu-check-logs")
    os.makedirs(log_dir, exist_ok=True)
    os.makedirs(env["CUDA_MPS_PIPE_DIRECTORY"], exist_ok=True)
    os.makedirs(env["CUDA_MPS_LOG_DIRECTORY"], exist_ok=True)
    saved_handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)

    t_start = time.monotonic()
    summary: Dict[str, object] = {
        **_records().header("gpu-check", args), "file_date": date, "host": os.uname().nodename,
        "out": out_dir, "limits_sum_s": limits,
        "budget_s": BUDGET_S, "mps": None, "stages": [], "wall_s": 0.0}
    started_mps = False
    failed = False
    pipe_dir = env["CUDA_MPS_PIPE_DIRECTORY"]

    def record(rec):
        summary["stages"].append(rec)
        summary["wall_s"] = round(time.monotonic() - t_start, 2)
        write_summary(summary, out_dir, date)
        print(f"== {rec['name']}: {rec['status']} (rc {rec.get('rc')}, "
              f"{rec.get('wall_s', 0):.1f}s of {rec['timeout_s']:g}s)", flush=True)

    try:
        for st in selected:
            log_path = os.path.join(log_dir, f"{st.name}.log")
            if st.name == "mps-stop":
                continue                       # in finally
            if st.name == "install" and installed_here(python, env):
                record({"name": st.name, "command": st.command(), "timeout_s": st.timeout_s,
                        "status": "skipped", "rc": 0, "wall_s": 0.0,
                        "note": "already installed from this checkout"})
                continue
            if st.name == "mps-start":
                if mps_running(pipe_dir):
                    summary["mps"] = "already running (left running)"
                    record({"name": st.name, "command": st.command(), "timeout_s": st.timeout_s,
                            "status": "skipped", "rc": 0, "wall_s": 0.0,
                            "note": "an MPS daemon already serves this pipe directory"})
                    continue
                if shutil.which(MPS_CONTROL) is None:
                    summary["mps"] = "unavailable"
                    record({"name": st.name, "command": st.command(), "timeout_s": st.timeout_s,
                            "status": "missing", "rc": 127, "wall_s": 0.0,
                            "note": f"{MPS_CONTROL} not found: ranks sharing a GPU run "
                                    f"time-sliced"})
                    failed = True
                    continue
            print(f"\n== {st.name} (limit {st.timeout_s:g}s): {st.command()}", flush=True)
            rec = run_stage(st, env, log_path)
            if st.name == "mps-start":
                deadline = time.monotonic() + 5.0
                while not mps_running(pipe_dir) and time.monotonic() < deadline:
                    time.sleep(0.1)
                started_mps = mps_running(pipe_dir)
                summary["mps"] = "started" if started_mps else "failed to start"
                if not started_mps and rec["status"] == "ok":
                    rec["status"] = "failed"
            rec["outputs"] = [p for p in st.outputs if os.path.exists(p)]
            missing_out = [p for p in st.outputs if not os.path.exists(p)]
            if missing_out:
                rec["outputs_missing"] = missing_out
            failed |= rec["status"] != "ok"
            print(_tail(log_path), end="", flush=True)
            record(rec)
    except Interrupted as exc:
        failed = True
        summary["interrupted"] = str(exc)
        print(f"\n[gpu_check] interrupted: {exc}", flush=True)
    finally:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)     # the cleanup is not interrupted
        try:
            stop = next((s for s in stages if s.name == "mps-stop"), None)
            if started_mps and stop is not None:
                rec = run_stage(stop, env, os.path.join(log_dir, "mps-stop.log"))
                deadline = time.monotonic() + 5.0
                while mps_running(pipe_dir) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if mps_running(pipe_dir) and rec["status"] == "ok":
                    rec["status"] = "failed"
                summary["mps"] = ("started, stopped" if rec["status"] == "ok"
                                  else "started, stop failed")
                failed |= rec["status"] != "ok"
                record(rec)
            summary["wall_s"] = round(time.monotonic() - t_start, 2)
            summary["ok"] = not failed
            print("\n" + write_summary(summary, out_dir, date), flush=True)
        finally:
            for sig, handler in saved_handlers.items():
                signal.signal(sig, handler)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
