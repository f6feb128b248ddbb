"""Train a model with every allreduce and compare (``oktopk-bench train`` / ``oktopk-bench demo``
/ ``make demo``).

Two models:

* ``--model cnn`` (default; ``mlp`` too): a small CNN on scikit-learn's digits; the metric is
  test accuracy. ``make demo`` runs this one (a run is seconds).
* ``--model gpt``: a byte-level decoder-only transformer (:mod:`oktopk_triton.bench.gpt`) trained
  as a language model on the Python standard library's own ``.py`` files, split by file; the
  metric is the validation loss in nats per byte (and bits per byte). ``--size`` picks the
  model: ``1m`` (CPU default), ``25m`` and ``100m`` (GPU presets, ``--device cuda``; ranks may
  share a GPU), ``tiny`` (tests). AdamW by default; the sparse algorithms then reduce the
  optimizer's *updates* (``SparseAllreduce.reduce_updates``: each rank's AdamW steps on its own
  gradient, error feedback in update space), because AdamW on an error-fed sparse gradient
  divides a coordinate's summed owed gradient by its own scale and stalls (all sparse algorithms
  at 3.32 nats/byte against dense 2.55 at 1%); ``--reduce gradients`` runs that setup. Every
  run also counts, per parameter tensor, the entries of the reduced gradient that are nonzero
  each step (what the algorithm applied) and the steps that applied none, so a gap to dense can
  be traced to the layers that starve (``tools/lm_results.py`` tabulates it).

The digits data is ``sklearn.datasets.load_digits`` (1797 8x8 images, bundled: no download), split once
(fixed split seed) into a training and a held-out test set. ``world_size`` ranks are launched by
``torchrun`` (gloo on CPU; NCCL, through CuPy when installed, when there are at least
``world_size`` GPUs). Every rank builds the model from the same seed, trains on its own shard of
the training set and averages its gradients with :class:`oktopk_triton.SparseAllreduce`; the
loop is the one a user copies::

    sar = SparseAllreduce(model.parameters(), density=0.01, algorithm="oktopk")
    for x, y in loader:
        opt.zero_grad(); loss = F.cross_entropy(model(x), y); loss.backward()
        sar.reduce_gradients()      # averages .grad over ranks (sparse), with error feedback
        opt.step()

Launch design: ONE torchrun for the whole comparison. The workers loop over the (seed,
algorithm) runs, re-seeding the model, optimizer and data order for each, so every algorithm
sees exactly the same initial weights and batches. One launch pays interpreter start-up, the
torch import, and the process-group rendezvous once instead of once per algorithm (on the 2-core
reference machine that is ~10 s per launch for 4 processes). If a run fails (an algorithm
raises or a rank dies), torchrun stops the launch; the driver records the failure for that run
and relaunches with the runs that are left, so one broken algorithm never hides the others.

Rank 0 prints one progress line per epoch and appends one JSON record per finished run to a
results file that the driver reads. At the end of every run the parameters of all ranks are
compared bit for bit (an allgather of an exact integer checksum of the fp32 bit patterns): the
reduced gradient is bitwise identical on every rank, so the replicas must be too.
"""
from __future__ import annotations

from . import _args as A
from ._common import git_commit as _git_describe
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

# 30 epochs of 21 steps (1347 training images, 4 ranks x 16 per step): the sparse methods with
# error feedback need more steps than dense to catch up; at 15 epochs the gaps were ~2x larger.
DEFAULTS = dict(world_size=4, density=0.01, epochs=30, model="cnn", seeds=[0], batch_size=16,
                lr=0.1, momentum=0.9, schedule="cosine", warmup_epochs=1.0, weight_decay=0.0,
                test_fraction=0.25, width=32, eval_every=0, tag=None, momentum_correction=True)
# --model gpt (byte-level LM on the stdlib's .py files, bench/gpt.py): the --size preset gives
# the model and its batch, steps, eval size and lr; these are the rest. AdamW is what
# transformers train with (the Ok-Topk paper trains BERT with Adam); the sparse algorithms then
# run plain error feedback (momentum correction is SGD's).
# Warm-up: 20% of the steps (with 5% the 1m model stalled near 2.8 nats/byte for 100+ steps).
GPT_DEFAULTS = dict(size="1m", optimizer="adamw", betas=(0.9, 0.95), warmup_fraction=0.2,
                    val_fraction=0.1, eval_times=5)
RESULTS_DIR = os.path.join("bench", "results")


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--algorithms", nargs="+", default=["all"],
                   help="algorithms to compare ('all' = dense and every available sparse one); "
                        "with --model gpt also the baselines powersgd (torch's PowerSGD hook, "
                        "rank matched to Ok-Topk's bytes at --density) and bf16 (torch's bf16 "
                        "compression hook)")
    p.add_argument("--density", type=A.density, default=DEFAULTS["density"],
                   help="fraction of the gradient each sparse algorithm sends (k = density*n)")
    p.add_argument("--world-size", type=A.positive_int, default=DEFAULTS["world_size"], help="ranks")
    p.add_argument("--epochs", type=A.positive_int, default=DEFAULTS["epochs"])
    p.add_argument("--model", choices=["cnn", "mlp", "gpt"], default=DEFAULTS["model"],
                   help="cnn/mlp: the digits classifier; gpt: a byte-level transformer LM on the "
                        "Python standard library's .py files (see --size)")
    p.add_argument("--width", type=A.positive_int, default=DEFAULTS["width"],
                   help="channels of the first conv (cnn) / hidden units / 8 (mlp)")
    p.add_argument("--seeds", "--seed", type=A.nonneg_int, nargs="+", default=DEFAULTS["seeds"],
                   help="training seeds (model init and data order); results are averaged")
    p.add_argument("--batch-size", type=A.positive_int, default=None,
                   help=f"per rank (default {DEFAULTS['batch_size']}; gpt: the --size preset's)")
    p.add_argument("--lr", type=A.positive_float, default=None,
                   help=f"peak learning rate (default {DEFAULTS['lr']}; gpt: the --size preset's)")
    p.add_argument("--momentum", type=A.fraction, default=DEFAULTS["momentum"])
    p.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="sparse algorithms: apply the momentum in the reducer, before "
                        "sparsification, with momentum factor masking (Deep Gradient "
                        "Compression); their optimizer then runs without momentum. dense always "
                        "runs plain momentum SGD. --no-momentum-correction: every algorithm uses "
                        "the optimizer's momentum on the reduced gradient. Default: on with sgd, "
                        "off with adamw")
    p.add_argument("--schedule", choices=["cosine", "constant"], default=DEFAULTS["schedule"],
                   help="learning rate: linear warm-up then cosine decay to 0, or constant")
    p.add_argument("--warmup-epochs", type=A.nonneg_float, default=DEFAULTS["warmup_epochs"])
    p.add_argument("--weight-decay", type=A.nonneg_float, default=DEFAULTS["weight_decay"])
    p.add_argument("--test-fraction", type=A.fraction, default=DEFAULTS["test_fraction"])
    p.add_argument("--train-subset", type=A.nonneg_int, default=0,
                   help="use only this many training samples (0 = all; for quick tests)")
    p.add_argument("--eval-every", type=A.nonneg_int, default=0,
                   help="evaluate every N steps as well as at every epoch end (0 = epochs only)")
    g = p.add_argument_group("--model gpt")
    g.add_argument("--size", choices=sorted(_gpt_sizes()), default=GPT_DEFAULTS["size"],
                   help="model preset: 1m (CPU default), 25m / 100m (GPU, --device cuda), tiny "
                        "(tests)")
    g.add_argument("--steps", type=A.positive_int, default=None, help="training steps (default: preset's)")
    g.add_argument("--context", type=A.positive_int, default=None,
                   help="bytes per training sequence (default and maximum: the preset's)")
    g.add_argument("--eval-sequences", type=A.positive_int, default=None,
                   help="validation windows per evaluation, spread over the validation files "
                        "and split over the ranks (default: preset's)")
    g.add_argument("--eval-times", type=A.positive_int, default=GPT_DEFAULTS["eval_times"],
                   help="evaluations spread over the run, besides the one at step 0 (gpt; "
                        "--eval-every overrides)")
    g.add_argument("--optimizer", choices=["sgd", "adamw"], default=None,
                   help="default: sgd for cnn/mlp, adamw for gpt")
    g.add_argument("--warmup-fraction", type=A.fraction, default=GPT_DEFAULTS["warmup_fraction"],
                   help="gpt: linear warm-up over this fraction of the steps, then cosine decay")
    g.add_argument("--reduce", choices=["auto", "gradients", "updates", "adam"], default="auto",
                   help="what the sparse reducer averages. gradients: the optimizer steps on the "
                        "reduced gradient (SparseAllreduce.reduce_gradients). updates: each "
                        "rank's optimizer steps on its own gradient and the reducer averages the "
                        "parameter updates, error feedback in update space "
                        "(SparseAllreduce.reduce_updates). auto (default): updates for a sparse "
                        "algorithm under adamw, gradients otherwise (dense stays plain "
                        "data-parallel AdamW, the baseline users run). adam: dense AdamW for "
                        "warmup_steps (default 20%% of steps), then frozen variance and the "
                        "preconditioned gradient reduced sparsely (SparseAllreduce.reduce_adam)")
    g.add_argument("--powersgd-start", type=A.positive_int, default=None,
                   help="--algorithms powersgd: dense allreduce steps before compressing "
                        "(torch's start_powerSGD_iter; default 2%% of --steps, at least 2)")
    g.add_argument("--val-fraction", type=A.fraction, default=GPT_DEFAULTS["val_fraction"],
                   help="gpt: fraction of the stdlib files held out for validation")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra option passed to the sparse algorithms (repeatable)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: NCCL on GPUs when there are >= world-size of them, else gloo/CPU")
    p.add_argument("--tag", default=None, help="results name: bench/results/train-<tag>.json")
    p.add_argument("--json", type=A.out_path, default=None, help="results JSON path (default from --tag)")
    p.add_argument("--plot", type=A.out_path, default=None, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--timeout", type=A.positive_float, default=1800.0,
                   help="seconds before a launch is killed")
    p.add_argument("--quiet", action="store_true", help="no per-epoch progress lines")


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    # the demo writes to the ignored out/ (a clone stays clean); the committed reference run is
    # bench/results/train-digits-demo.json
    p.set_defaults(tag="digits-demo", json=os.path.join("out", "train-digits-demo.json"))


def demo_main(args) -> int:
    """``make demo``: 4 ranks, dense and every available sparse algorithm at density 1%."""
    return main(args)


def main(args) -> int:
    t0 = time.time()
    algos, skipped = resolve_algorithms(args.algorithms)
    for name, why in skipped:
        print(f"note: skipping {name}: {why}", flush=True)
    if not algos:
        print("nothing to run", file=sys.stderr)
        return 2
    config = build_config(args, algos)
    lm = config["model"] == "gpt"
    from .baselines import BASELINES
    if not lm and any(a in BASELINES for a in algos):
        print(f"oktopk-bench train: {'/'.join(BASELINES)} run with --model gpt only, got "
              f"--model {config['model']}", file=sys.stderr)
        return 2
    tag = args.tag or (f"lm-{config['size']}-d{args.density:g}" if lm else
                       f"digits-d{args.density:g}")
    json_path = args.json or os.path.join(RESULTS_DIR, f"train-{tag}.json")
    plot_path = None if args.no_plot else (args.plot or os.path.splitext(json_path)[0] + ".png")
    length = (f"size {config['size']}, {config['steps']} steps of {config['batch_size']} x "
              f"{config['gpt']['context']} bytes per rank, {config['optimizer']}, reduce "
              f"{config.get('reduce', 'auto')}" if lm
              else f"{args.epochs} epochs")
    print(f"oktopk-bench train: {args.world_size} ranks, {args.model}, density {args.density:g}, "
          f"{length}, seeds {list(args.seeds)}, algorithms {algos}", flush=True)
    corpus = _corpus_summary(config) if lm else None
    runs, failures = launch(config, timeout=args.timeout)
    summary = summarize(runs, algos, failures)
    wall = time.time() - t0
    report = {"config": config, "git": _git_describe(), "skipped": [{"algorithm": n, "why": w} for n, w in skipped],
              "failures": failures, "summary": summary, "runs": runs, "wall_s": wall,
              "date": time.strftime("%Y-%m-%d"), "versions": _versions(),
              "host": {"cpus": os.cpu_count(), "platform": sys.platform}}
    if corpus is not None:
        report["corpus"] = corpus
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, separators=(",", ":"))
    print()
    print(format_table(summary, config))
    for fl in failures:
        print(f"FAILED {fl['algorithm']} (seed {fl['seed']}): {fl['error']}")
    for name, why in skipped:
        print(f"skipped {name}: {why}")
    print(f"results: {json_path}")
    if plot_path:
        try:
            plot(report, plot_path)
            print(f"plot:    {plot_path}")
        except Exception as e:  # the plot is a convenience; never lose the results over it
            print(f"plot failed: {e!r}")
    print(f"wall time {wall:.1f} s", flush=True)
    bad = [r for r in runs if not r.get("replicas_identical", False)]
    if bad:
        print(f"ERROR: replicas diverged in {len(bad)} run(s)", file=sys.stderr)
        return 1
    return 1 if failures else 0


def _corpus_summary(config) -> Dict[str, Any]:
    """Where the LM's bytes came from and the unigram entropy (nats/byte) to beat."""
    from .gpt import load_corpus
    c = load_corpus(config["val_fraction"])
    return dict(c.info, unigram_nats_per_byte=c.unigram_entropy())


def _versions() -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {"python": sys.version.split()[0]}
    for mod in ("torch", "triton", "oktopk_triton"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", None)
        except Exception:
            out[mod] = None
    return out


def _parse_option(s: str):
    if "=" not in s:
        raise SystemExit(f"--option expects KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        v = json.loads(v)
    except ValueError:
        pass
    return k, v


def _gpt_sizes():
    from .gpt import SIZES
    return SIZES


def build_config(args, algos) -> Dict[str, Any]:
    """The run's configuration (what the workers get and the JSON records): the command line
    with every model-dependent default resolved."""
    model = args.model
    optimizer = getattr(args, "optimizer", None) or ("adamw" if model == "gpt" else "sgd")
    mc = getattr(args, "momentum_correction", None)
    if mc is None:  # DGC's momentum correction is an SGD-momentum device
        mc = DEFAULTS["momentum_correction"] and optimizer == "sgd"
    cfg = dict(algorithms=algos, density=args.density, world_size=args.world_size,
               epochs=args.epochs, model=model, width=args.width, seeds=list(args.seeds),
               batch_size=args.batch_size or DEFAULTS["batch_size"],
               lr=args.lr if args.lr is not None else DEFAULTS["lr"], momentum=args.momentum,
               momentum_correction=bool(mc), optimizer=optimizer,
               schedule=args.schedule, warmup_epochs=args.warmup_epochs,
               weight_decay=args.weight_decay, test_fraction=args.test_fraction,
               train_subset=args.train_subset, eval_every=args.eval_every,
               options=dict(_parse_option(o) for o in args.option), device=args.device,
               quiet=args.quiet)
    if model == "gpt":
        size = getattr(args, "size", None) or GPT_DEFAULTS["size"]
        gcfg, train_defaults = _gpt_sizes()[size]
        gpt = gcfg.as_dict()
        if getattr(args, "context", None):
            if args.context > gcfg.context:
                raise SystemExit(f"--context {args.context} exceeds the {size} preset's "
                                 f"{gcfg.context} (learned positions)")
            gpt["context"] = args.context
        steps = getattr(args, "steps", None) or int(train_defaults["steps"])
        eval_times = max(1, int(getattr(args, "eval_times", None) or GPT_DEFAULTS["eval_times"]))
        cfg.update(size=size, gpt=gpt, steps=steps,
                   batch_size=args.batch_size or int(train_defaults["batch_size"]),
                   lr=args.lr if args.lr is not None else float(train_defaults["lr"]),
                   eval_sequences=(getattr(args, "eval_sequences", None)
                                   or int(train_defaults["eval_sequences"])),
                   eval_every=args.eval_every or max(1, math.ceil(steps / eval_times)),
                   warmup_fraction=getattr(args, "warmup_fraction", GPT_DEFAULTS["warmup_fraction"]),
                   val_fraction=getattr(args, "val_fraction", GPT_DEFAULTS["val_fraction"]),
                   reduce=getattr(args, "reduce", "auto"),
                   powersgd_start=getattr(args, "powersgd_start", None),
                   betas=list(GPT_DEFAULTS["betas"]), epochs=None, width=None, test_fraction=None,
                   train_subset=None)
    return cfg


# ------------------------------------------------------------------------------------------
# driver: one torchrun for all runs, relaunch after a failure
# ------------------------------------------------------------------------------------------
def launch(config: Dict[str, Any], timeout: float = 1800.0):
    jobs = [(seed, alg) for seed in config["seeds"] for alg in config["algorithms"]]
    done: Dict[tuple, dict] = {}
    failures: List[dict] = []
    env = dict(os.environ)
    # the CPU path of the kernels is the torch reference; the Triton *interpreter* (what the
    # test suite turns on) would make training ~100x slower
    env.pop("TRITON_INTERPRET", None)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory(prefix="oktopk-train-") as tmp:
        attempt = 0
        while True:
            todo = [j for j in jobs if j not in done and
                    not any((f["seed"], f["algorithm"]) == j for f in failures)]
            if not todo:
                break
            attempt += 1
            cfg = dict(config, jobs=[list(j) for j in todo])
            cfg_path = os.path.join(tmp, f"config{attempt}.json")
            out_path = os.path.join(tmp, f"results{attempt}.jsonl")
            with open(cfg_path, "w") as f:
                json.dump(cfg, f)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(config["world_size"]),
                   "-m", "oktopk_triton.bench.train", "--worker", cfg_path, out_path]
            try:
                rc = subprocess.run(cmd, env=env, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            records = _read_jsonl(out_path)
            errors = {}
            for r in records:
                key = (r["seed"], r["algorithm"])
                if "error" in r:
                    errors.setdefault(key, r["error"])
                else:
                    done[key] = r
            if rc == 0 and all(j in done for j in todo):
                break
            # the first unfinished run is the one that failed
            pending = [j for j in todo if j not in done]
            if not pending:
                break
            failed = pending[0]
            failures.append({"seed": failed[0], "algorithm": failed[1],
                             "error": errors.get(failed, f"launch ended with rc={rc}")})
            print(f"!! {failed[1]} (seed {failed[0]}) failed: {failures[-1]['error']}; "
                  f"relaunching for the remaining runs", flush=True)
    runs = [done[j] for j in jobs if j in done]
    return runs, failures


def _read_jsonl(path: str) -> List[dict]:
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    out.append(json.loads(line))
    return out


def summarize(runs: List[dict], algos: List[str], failures: List[dict]) -> List[dict]:
    """One row per algorithm: mean and sample sd over seeds of the final metric (test accuracy
    for the digits, validation loss for the LM), bytes and time per step, and the comparison
    with dense (points of accuracy; relative loss gap in percent for the LM)."""
    rows = []
    for alg in algos:
        rs = [r for r in runs if r["algorithm"] == alg]
        if not rs:
            rows.append({"algorithm": alg, "status": "failed", "n_seeds": 0})
            continue
        lm = "final_val_loss" in rs[0]
        key = "final_val_loss" if lm else "final_test_acc"
        vals = [r[key] for r in rs]
        m = sum(vals) / len(vals)
        sd = math.sqrt(sum((a - m) ** 2 for a in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        row = {"algorithm": alg, "status": "ok", "n_seeds": len(rs),
               "seeds": [r["seed"] for r in rs],
               key: m, key + "_std": sd, key + "_per_seed": vals,
               "final_train_loss": sum(r["final_train_loss"] for r in rs) / len(rs),
               "bytes_per_step": sum(r["bytes_per_step"] for r in rs) / len(rs),
               "time_per_step_ms": sum(r["time_per_step_ms"] for r in rs) / len(rs),
               "reduce_ms": sum(r["reduce_ms"] for r in rs) / len(rs),
               "numel": rs[0]["numel"], "k": rs[0]["k"],
               "replicas_identical": all(r["replicas_identical"] for r in rs)}
        if lm:
            row["final_val_bpb"] = m / math.log(2)
            row["applied_per_step"] = (sum(sum(r["applied_curve"]) / len(r["applied_curve"])
                                           for r in rs) / len(rs))
        rows.append(row)
    dense = next((r for r in rows if r["algorithm"] == "dense" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok" and dense is not None:
            if "final_val_loss" in r:
                r["loss_vs_dense_pct"] = 100.0 * (r["final_val_loss"] / dense["final_val_loss"] - 1)
                # paired over the seeds both ran (same init and batches): the gap's spread
                common = [s for s in r["seeds"] if s in dense["seeds"]]
                gaps = [100.0 * (r["final_val_loss_per_seed"][r["seeds"].index(s)] /
                                 dense["final_val_loss_per_seed"][dense["seeds"].index(s)] - 1)
                        for s in common]
                r["loss_vs_dense_pct_per_seed"] = gaps
            else:
                r["acc_vs_dense_points"] = 100.0 * (r["final_test_acc"] - dense["final_test_acc"])
            r["bytes_vs_dense"] = r["bytes_per_step"] / dense["bytes_per_step"]
    return rows


def format_table(summary: List[dict], config: Dict[str, Any]) -> str:
    n_seeds = len(config["seeds"])
    seeds = f" (mean±sd, {n_seeds} seeds)" if n_seeds > 1 else ""
    if config.get("model") == "gpt":
        g = config["gpt"]

        def loss(r):
            v = f"{r['final_val_loss']:.4f}"
            return v + (f" ± {r['final_val_loss_std']:.4f}" if n_seeds > 1 else "")

        title = (f"density {config['density']:g}, {config['world_size']} ranks, gpt "
                 f"{config['size']} (d {g['d_model']}, {g['n_layer']} layers, context "
                 f"{g['context']}), {config['steps']} steps, {config['optimizer']}")
        columns = [("val nats/byte" + seeds, 32, loss),
                   ("bits/byte", 9, lambda r: f"{r['final_val_bpb']:.3f}"),
                   ("vs dense", 9, lambda r: f"{r.get('loss_vs_dense_pct', 0.0):+.2f}%"),
                   ("applied/step", 12, lambda r: f"{r['applied_per_step']:.0f}")]
        return _table(summary, config, title, columns,
                      "applied = nonzero entries of the reduced gradient; ")

    def acc(r):
        a = f"{100 * r['final_test_acc']:.2f}"
        return a + (f" ± {100 * r['final_test_acc_std']:.2f}" if n_seeds > 1 else "")

    title = (f"density {config['density']:g}, {config['world_size']} ranks, {config['model']}, "
             f"{config['epochs']} epochs")
    columns = [("test acc %" + seeds, 28, acc),
               ("vs dense", 9, lambda r: f"{r.get('acc_vs_dense_points', 0.0):+.2f}")]
    return _table(summary, config, title, columns, "")


# the columns every results table ends with: (header, width, cell of a summary row)
_TABLE_TAIL = [
    ("bytes/rank/step", 16, lambda r: _fmt_bytes(r["bytes_per_step"])),
    ("x dense", 8, lambda r: f"{r.get('bytes_vs_dense', float('nan')):.4f}"),
    ("time/step ms", 13, lambda r: f"{r['time_per_step_ms']:.1f}"),
    ("reduce ms", 10, lambda r: f"{r['reduce_ms']:.2f}"),
    ("replicas", 9, lambda r: "identical" if r["replicas_identical"] else "DIVERGED"),
]


def _table(summary: List[dict], config: Dict[str, Any], title: str, columns, note: str) -> str:
    """A results table: one row per algorithm, ``columns`` (the metric first) then the tail
    columns, a FAILED row for a run that failed, and the model's size and k below."""
    cols = list(columns) + _TABLE_TAIL
    head = f"{'algorithm':<10} " + " ".join(f"{h:>{w}}" for h, w, _ in cols)
    lines = [title, head, "-" * len(head)]
    for r in summary:
        if r["status"] != "ok":
            lines.append(f"{r['algorithm']:<10} {'FAILED':>{cols[0][1]}}")
            continue
        lines.append(f"{r['algorithm']:<10} " + " ".join(f"{cell(r):>{w}}" for _, w, cell in cols))
    ok = [r for r in summary if r.get("numel")]
    if ok:
        n = ok[0]["numel"]
        lines.append(f"(model: {n} parameters; sparse k = {max(1, round(config['density'] * n))} "
                     f"at density {config['density']:g}; {note}bytes counted by the communicator)")
    return "\n".join(lines)


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(b) < 1000 or unit == "GB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1000.0
    return f"{b:.1f}"


def plot(report: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report["config"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    lm = cfg.get("model") == "gpt"
    curve = "val_curve" if lm else "acc_curve"
    scale = 1.0 if lm else 100.0
    lo, hi = float("inf"), -float("inf")
    for alg in cfg["algorithms"]:
        rs = [r for r in report["runs"] if r["algorithm"] == alg]
        if not rs:
            continue
        # the metric: mean over seeds at the common evaluation steps
        steps = [s for s, _ in rs[0][curve]]
        ys = [scale * sum(r[curve][i][1] for r in rs) / len(rs) for i in range(len(steps))]
        if len(ys) > 1:
            lo, hi = min(lo, min(ys[1:])), max(hi, max(ys[1:]))
        style = dict(lw=2.2, color="black") if alg == "dense" else dict(lw=1.4)
        (line,) = ax1.plot(steps, ys, label=alg, marker=".", **style)
        b = rs[0]["bytes_curve"]
        ax2.plot(range(1, len(b) + 1), b, label=alg, color=line.get_color(),
                 lw=style["lw"])
    ax1.set_xlabel("step")
    ax1.grid(alpha=0.3)
    if lm:
        uni = (report.get("corpus") or {}).get("unigram_nats_per_byte")
        if uni:
            ax1.axhline(uni, color="gray", ls=":", lw=1, label="unigram entropy")
        ax1.set_ylabel("validation loss (nats/byte)")
        if hi > lo:
            ax1.set_ylim(lo - 0.05 * (hi - lo), max(hi, uni or hi) + 0.05 * (hi - lo))
        ax1.legend(loc="upper right", fontsize=8)
        ax1.set_title(f"byte LM ({cfg['size']}), {cfg['world_size']} ranks, "
                      f"density {cfg['density']:g}")
    else:
        ax1.set_ylabel("test accuracy (%)")
        ax1.set_ylim(80.0, 100)
        ax1.legend(loc="lower right", fontsize=8)
        ax1.set_title(f"digits, {cfg['world_size']} ranks, density {cfg['density']:g}")
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_ylabel("bytes sent per rank per step")
    ax2.grid(alpha=0.3, which="both")
    ax2.set_title("communication volume")
    ax2.legend(loc="best", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------
# worker (one per rank, started by torchrun)
# ------------------------------------------------------------------------------------------
def make_model(kind: str, width: int = 32):
    """cnn (width 32): conv 1->32 ->64 (3x3), pool, fc 1024->64->10: 85,450 parameters;
    mlp (width 32): 64->256->256->10: 85,002 parameters."""
    import torch.nn as nn
    if kind == "cnn":
        w = width
        return nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * w * 16, 64), nn.ReLU(), nn.Linear(64, 10))
    if kind == "mlp":
        h = 8 * width
        return nn.Sequential(nn.Flatten(), nn.Linear(64, h), nn.ReLU(), nn.Linear(h, h),
                             nn.ReLU(), nn.Linear(h, 10))
    raise ValueError(f"unknown model {kind!r}")


def load_data(test_fraction: float = 0.25, train_subset: int = 0, split_seed: int = 0):
    """Digits as float tensors [N, 1, 8, 8] in [0, 1]; a fixed stratified-enough random split."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    d = load_digits()
    X = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.from_numpy(np.random.RandomState(split_seed).permutation(len(y)))
    n_test = int(round(test_fraction * len(y)))
    te, tr = perm[:n_test], perm[n_test:]
    if train_subset:
        tr = tr[:train_subset]
    return X[tr], y[tr], X[te], y[te]


def _comm_and_device(cfg):
    import torch
    import torch.distributed as dist
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = (cfg.get("device", "auto") == "cuda" or
                (cfg.get("device", "auto") == "auto" and torch.cuda.is_available()
                 and torch.cuda.device_count() >= world))
    import datetime
    if use_cuda:
        n_gpu = torch.cuda.device_count()
        if n_gpu == 0:
            raise RuntimeError("--device cuda: no CUDA device is visible")
        device = torch.device("cuda", local_rank % n_gpu)
        if n_gpu < world:
            # ranks share a GPU: NCCL refuses two ranks on one device of one host, so every rank
            # claims its own host (NCCL then talks over loopback sockets; start MPS first, see
            # docs/gpu-measurements.md)
            os.environ.setdefault("NCCL_HOSTID", f"oktopk-train-rank{local_rank}")
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300),
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    from ..comm import default_communicator
    comm = default_communicator(device)
    return comm, device


def _param_checksum(model):
    """Exact checksum of the fp32 bit patterns (int64 sum of the int32 views, and of them times a
    position weight so a permutation is caught too)."""
    import torch
    flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
    bits = flat.view(torch.int32).to(torch.int64)
    w = torch.arange(1, bits.numel() + 1, dtype=torch.int64) % 1000003
    return torch.stack([bits.sum(), (bits * w).sum()])


def replicas_identical(model) -> bool:
    import torch
    import torch.distributed as dist
    cs = _param_checksum(model)
    dev = next(model.parameters()).device
    cs = cs.to(dev)
    out = [torch.zeros_like(cs) for _ in range(dist.get_world_size())]
    dist.all_gather(out, cs)
    return all(torch.equal(o, out[0]) for o in out)


def evaluate(model, X, y, batch: int = 512) -> float:
    import torch
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(y), batch):
            correct += (model(X[i:i + batch]).argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return correct / max(1, len(y))


def train_one(cfg, algorithm: str, seed: int, comm, device, data, log) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from .. import SparseAllreduce

    Xtr, ytr, Xte, yte = data
    P, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)  # the same init on every rank
    model = make_model(cfg["model"], cfg["width"]).to(device)
    # momentum correction: the sparse reducers keep the velocity (with DGC's masking) and the
    # optimizer runs without momentum; dense stays the plain momentum SGD baseline (at density 1
    # the masking would remove every entry's momentum)
    corrected = bool(cfg.get("momentum_correction")) and algorithm != "dense"
    opt = _make_optimizer(cfg, model.parameters(), corrected)
    options = dict(cfg.get("options") or {}) if algorithm != "dense" else {}
    if corrected:
        options["momentum"] = cfg["momentum"]
    density = cfg["density"] if algorithm != "dense" else 1.0
    sar = SparseAllreduce(model.parameters(), comm=comm, density=density, algorithm=algorithm,
                          **options)
    numel = sum(p.numel() for p in model.parameters())
    k = max(1, int(round(density * numel)))
    init_identical = replicas_identical(model)

    per_rank = len(ytr) // P
    bs = cfg["batch_size"]
    steps_per_epoch = max(1, math.ceil(per_rank / bs))
    g = torch.Generator().manual_seed(10007 * seed + 17)
    acc_curve = [(0, evaluate(model, Xte, yte))]
    bytes_curve: List[int] = []
    stats_curve: Dict[str, List[float]] = {}
    step_times: List[float] = []
    reduce_times: List[float] = []
    epoch_losses: List[float] = []
    total_steps = steps_per_epoch * cfg["epochs"]
    warmup = int(round(cfg.get("warmup_epochs", 0) * steps_per_epoch))

    def lr_at(i):  # i = steps done so far
        if cfg.get("schedule", "constant") == "constant":
            return cfg["lr"]
        if i < warmup:
            return cfg["lr"] * (i + 1) / warmup
        t = (i - warmup) / max(1, total_steps - warmup)
        return cfg["lr"] * 0.5 * (1 + math.cos(math.pi * t))

    step = 0
    eval_every = int(cfg.get("eval_every") or 0)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for epoch in range(cfg["epochs"]):
        perm = torch.randperm(len(ytr), generator=g)     # same on every rank
        shard = perm[rank::P][:per_rank]                  # this rank's part of the epoch
        loss_sum = torch.zeros((), dtype=torch.float64)
        for b in range(steps_per_epoch):
            idx = shard[b * bs:(b + 1) * bs]
            x, y = Xtr[idx].to(device), ytr[idx].to(device)
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            sync()
            t1 = time.perf_counter()
            sar.reduce_gradients()   # averages .grad over ranks, error feedback inside
            sync()
            t2 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.step()
            sync()
            t3 = time.perf_counter()
            step += 1
            step_times.append(t3 - t0)
            reduce_times.append(t2 - t1)
            bytes_curve.append(int(sar.stats["bytes_sent"]))
            _record_stats(stats_curve, sar.stats)
            loss_sum += float(loss.detach())
            if eval_every and step % eval_every == 0 and b != steps_per_epoch - 1:
                acc_curve.append((step, evaluate(model, Xte, yte)))
        # mean training loss over ranks and batches of the epoch (one tiny allreduce)
        lt = (loss_sum / steps_per_epoch).to(torch.float32).reshape(1).to(device)
        dist.all_reduce(lt)
        epoch_loss = float(lt) / P
        epoch_losses.append(epoch_loss)
        acc = evaluate(model, Xte, yte)
        acc_curve.append((step, acc))
        if rank == 0 and log:
            recent = step_times[-steps_per_epoch:]
            print(f"  [{algorithm:>9} seed {seed}] epoch {epoch + 1:>2}/{cfg['epochs']}  "
                  f"step {step:>4}  loss {epoch_loss:.4f}  test acc {100 * acc:6.2f}%  "
                  f"bytes/step {_fmt_bytes(sum(bytes_curve[-steps_per_epoch:]) / steps_per_epoch):>9}"
                  f"  {1000 * sum(recent) / len(recent):6.1f} ms/step", flush=True)
    identical = replicas_identical(model) and init_identical
    warm = 2 if len(step_times) > 4 else 0  # the first steps include one-time set-up
    return {
        "algorithm": algorithm, "seed": seed, "density": density,
        "world_size": P, "numel": numel, "k": k, "steps": step,
        "final_test_acc": acc_curve[-1][1], "acc_curve": acc_curve,
        "final_train_loss": epoch_losses[-1], "train_loss_per_epoch": epoch_losses,
        "bytes_per_step": sum(bytes_curve) / len(bytes_curve), "bytes_curve": bytes_curve,
        "time_per_step_ms": 1000 * sum(step_times[warm:]) / len(step_times[warm:]),
        "reduce_ms": 1000 * sum(reduce_times[warm:]) / len(reduce_times[warm:]),
        "replicas_identical": bool(identical), "device": str(device),
        "stats_curve": stats_curve,
        "backend": type(comm).__name__,
    }


def _make_optimizer(cfg, params, corrected: bool):
    import torch
    if cfg.get("optimizer", "sgd") == "adamw":
        return torch.optim.AdamW(params, lr=cfg["lr"], betas=tuple(cfg.get("betas", (0.9, 0.95))),
                                 weight_decay=cfg["weight_decay"])
    return torch.optim.SGD(params, lr=cfg["lr"], momentum=0.0 if corrected else cfg["momentum"],
                           weight_decay=cfg["weight_decay"])


def _lm_eval(model, val, starts, length: int, device, batch: int = 64) -> float:
    """Mean next-byte cross entropy (nats) over the validation windows ``starts``; each rank
    evaluates every P-th window and one allreduce sums (the replicas are identical, so this is
    the loss of the one model, P times faster)."""
    import torch
    import torch.distributed as dist
    from .gpt import batch_at
    P, rank = dist.get_world_size(), dist.get_rank()
    mine = starts[rank::P]
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad(), _autocast(device):
        for i in range(0, len(mine), batch):
            x = batch_at(val, mine[i:i + batch].to(val.device), length)
            tot[0] += model.loss(x).double() * x.shape[0]
            tot[1] += x.shape[0]
    model.train()
    dist.all_reduce(tot)
    return float(tot[0] / tot[1])


def _autocast(device):
    """bf16 autocast on CUDA (how a GPU trains a transformer); nothing on CPU."""
    import contextlib
    import torch
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class _LayerCounter:
    """Per parameter tensor: how many entries of the reduced gradient are nonzero each step (the
    entries an algorithm applied), how many steps applied none (starved), and the squared norms
    of the local and the reduced gradient. Kept on the device (no host read per step); one
    segmented sum and one fused norm per step, no gradient-sized int64 temporaries."""

    def __init__(self, model, steps: int, device) -> None:
        import torch
        self.names, self.sizes = [], []
        for name, p in model.named_parameters():   # the order SparseAllreduce flattens in
            if p.requires_grad:
                self.names.append(name)
                self.sizes.append(p.numel())
        self.lengths = torch.tensor(self.sizes, device=device)
        z = lambda dt: torch.zeros(len(self.sizes), dtype=dt, device=device)
        self.applied = z(torch.int64)
        self.starved = z(torch.int64)
        self.sq_local = z(torch.float64)
        self.sq_reduced = z(torch.float64)
        self.per_step = torch.zeros(steps, dtype=torch.int64, device=device)

    def start(self, params) -> None:
        """Remember the initial weights: a run's movement per tensor is the end minus these."""
        self.init = [p.detach().clone() for p in params]

    def moved(self, params) -> List[float]:
        import torch
        d = torch._foreach_sub([p.detach() for p in params], self.init)
        return [float(x) ** 2 for x in torch._foreach_norm(d)]

    def local(self, params) -> None:
        import torch
        norms = torch._foreach_norm([p.grad for p in params])
        self.sq_local += torch.stack(norms).double() ** 2

    def reduced(self, step: int, flat) -> None:
        import torch
        # fp32 sums of 0/1 are exact below 2^24 entries per tensor (the 100m preset's largest
        # tensor has 2.4M)
        per = torch.segment_reduce((flat != 0).float(), "sum", lengths=self.lengths)
        per = per.round().to(torch.int64)
        self.applied += per
        self.starved += (per == 0).to(torch.int64)
        self.per_step[step] = per.sum()
        views = list(flat.float().split(self.sizes))
        self.sq_reduced += torch.stack(torch._foreach_norm(views)).double() ** 2

    def report(self, steps: int, params) -> Dict[str, Any]:
        applied = self.applied.cpu().tolist()
        starved = self.starved.cpu().tolist()
        sl, sr = self.sq_local.cpu().tolist(), self.sq_reduced.cpu().tolist()
        mv = self.moved(params)
        layers = {n: {"numel": s, "applied_per_step": a / max(1, steps), "starved_steps": st,
                      "grad_sq_local": l, "grad_sq_reduced": r, "moved_sq": m}
                  for n, s, a, st, l, r, m in zip(self.names, self.sizes, applied, starved, sl,
                                                  sr, mv)}
        return {"layers": layers, "applied_curve": self.per_step.cpu().tolist()}


def resolve_reduce(cfg: Dict[str, Any], algorithm: str) -> str:
    """What a run reduces: ``gradients`` or ``updates`` (``--reduce auto``: updates for a sparse
    algorithm under AdamW, whose per-coordinate normalisation undoes error feedback's summed
    gradients; gradients for dense, the plain data-parallel baseline, and for SGD)."""
    mode = cfg.get("reduce", "auto") or "auto"
    if mode != "auto":
        return mode
    return ("updates" if algorithm != "dense" and cfg.get("optimizer") == "adamw"
            else "gradients")


class _LMReducer:
    """How one language-model run averages over ranks: a :class:`SparseAllreduce` mode
    (``gradients``, ``updates`` or ``adam``; dense is ``gradients`` at density 1), or one of
    torch's DDP compression hooks (``powersgd``, ``bf16``; bench/baselines.py), which average
    the gradients during backward. ``reduce()`` returns the flat vector applied this step."""

    def __init__(self, cfg, algorithm: str, model, params, comm, device) -> None:
        from .. import SparseAllreduce
        from .baselines import BASELINES, HookBaseline, powersgd_rank_for
        self.params, self.model, self.hook = params, model, None
        self.numel = sum(p.numel() for p in params)
        if algorithm in BASELINES:
            # density: the one its bytes are matched to (its table in merged reports)
            self.mode, self.density, self.k = "gradients", cfg["density"], self.numel
            self.opt = _make_optimizer(cfg, model.parameters(), False)
            target = _oktopk_bytes(self.numel, cfg["density"], comm.world_size)
            rank = powersgd_rank_for([p.shape for p in params], target, comm.world_size)
            start = cfg.get("powersgd_start") or max(2, round(0.02 * cfg["steps"]))
            self.hook = HookBaseline(model, algorithm, rank=rank, start_iter=start, device=device)
            self.powersgd = {"rank": rank, "start_iter": max(2, int(start)),
                             "target_bytes": target} if algorithm == "powersgd" else None
            return
        corrected = bool(cfg.get("momentum_correction")) and algorithm != "dense"
        self.opt = _make_optimizer(cfg, model.parameters(), corrected)
        options = dict(cfg.get("options") or {}) if algorithm != "dense" else {}
        if corrected:
            options["momentum"] = cfg["momentum"]
        self.density = cfg["density"] if algorithm != "dense" else 1.0
        mode = resolve_reduce(cfg, algorithm)
        if mode == "adam" and algorithm == "dense":
            mode = "gradients"   # the baseline stays plain data-parallel AdamW
        if mode == "adam":   # techniques.FrozenAdam: beta1 is the reducer's momentum correction
            options.update(adam="frozen", momentum=float(cfg.get("betas", (0.9, 0.95))[0]))
            options.setdefault("warmup_steps", max(1, int(round(0.2 * cfg["steps"]))))
        self.mode = mode
        self.sar = SparseAllreduce(params, comm=comm, density=self.density, algorithm=algorithm,
                                   **options)
        self.numel, self.k = self.sar.numel, self.sar.k

    @property
    def stats(self):
        return self.hook.stats if self.hook else self.sar.stats

    @property
    def steps_optimizer(self) -> bool:
        """Whether the loop calls ``opt.step()`` after :meth:`reduce` (gradients reduced)."""
        return self.mode == "gradients"

    def loss(self, x):
        return self.hook.loss(x) if self.hook else self.model.loss(x)

    def reduce(self):
        if self.hook:
            self.hook.finish_step()
            return self.hook.averaged_gradient(self.params)
        if self.mode == "adam":
            return self.sar.reduce_adam(self.opt)
        if self.mode == "updates":
            # this rank's AdamW steps on its own gradient; the reducer averages the updates
            # (error feedback in update space) and sets the weights; reduce ms includes the step
            return self.sar.reduce_updates(self.opt)
        return self.sar.reduce_gradients()   # averages .grad over ranks, error feedback inside

    def describe(self) -> Dict[str, Any]:
        return {"powersgd": self.powersgd} if self.hook and self.powersgd else {}


def _oktopk_bytes(n: int, density: float, P: int) -> int:
    """Bytes per rank of a steady Ok-Topk step at this density (its static schedule)."""
    from ..algorithms.schedule import schedule_of, total_bytes
    return total_bytes(schedule_of("oktopk", n, max(1, int(density * n)), P))


def train_one_lm(cfg, algorithm: str, seed: int, comm, device, data, log) -> Dict[str, Any]:
    """One run of the byte-level LM (``--model gpt``); the record mirrors :func:`train_one`'s
    with validation loss (nats/byte) and bits per byte in place of accuracy."""
    import torch
    import torch.distributed as dist
    from .gpt import GPT, GPTConfig, batch_at, val_starts

    train_bytes, val_bytes = data
    P, rank = dist.get_world_size(), dist.get_rank()
    gcfg = GPTConfig(**cfg["gpt"])
    L = gcfg.context + 1                      # a window: context inputs and their next bytes
    torch.manual_seed(seed)                    # the same init on every rank
    model = GPT(gcfg).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    red = _LMReducer(cfg, algorithm, model, params, comm, device)
    opt = red.opt
    numel, k, density, mode = red.numel, red.k, red.density, red.mode
    init_identical = replicas_identical(model)
    counter = _LayerCounter(model, cfg["steps"], device)
    assert sum(counter.sizes) == numel
    counter.start(params)

    steps, bs = cfg["steps"], cfg["batch_size"]
    warmup = int(round(cfg.get("warmup_fraction", 0.0) * steps))

    def lr_at(i):
        if cfg.get("schedule", "cosine") == "constant":
            return cfg["lr"]
        if i < warmup:
            return cfg["lr"] * (i + 1) / warmup
        return cfg["lr"] * 0.5 * (1 + math.cos(math.pi * (i - warmup) / max(1, steps - warmup)))

    # this rank's windows: the same for every algorithm at a given seed, different per rank
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + 17)
    vstarts = val_starts(len(val_bytes), cfg["eval_sequences"], L)
    val_curve = [(0, _lm_eval(model, val_bytes, vstarts, L, device))]
    train_curve: List[tuple] = []
    bytes_curve: List[int] = []
    stats_curve: Dict[str, List[float]] = {}
    step_times: List[float] = []
    reduce_times: List[float] = []
    loss_acc = torch.zeros((), dtype=torch.float64, device=device)
    since = 0
    eval_every = int(cfg["eval_every"])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for step in range(steps):
        starts = torch.randint(0, len(train_bytes) - L, (bs,), generator=g)
        x = batch_at(train_bytes, starts.to(train_bytes.device), L)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        with _autocast(device):
            loss = red.loss(x)
        loss.backward()
        counter.local(params)   # a baseline's hook has averaged them already
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        sync()
        t1 = time.perf_counter()
        flat = red.reduce()
        sync()
        t2 = time.perf_counter()
        if red.steps_optimizer:
            opt.step()
        sync()
        t3 = time.perf_counter()
        counter.reduced(step, flat)
        step_times.append(t3 - t0)
        reduce_times.append(t2 - t1)
        bytes_curve.append(int(red.stats["bytes_sent"]))
        _record_stats(stats_curve, red.stats)
        loss_acc += loss.detach().double()
        since += 1
        done = step + 1
        if done % eval_every == 0 or done == steps:
            lt = (loss_acc / since).reshape(1)
            dist.all_reduce(lt)
            train_curve.append((done, float(lt) / P))
            loss_acc.zero_()
            since = 0
            val_curve.append((done, _lm_eval(model, val_bytes, vstarts, L, device)))
            if rank == 0 and log:
                recent = step_times[-eval_every:]
                print(f"  [{algorithm:>9} seed {seed}] step {done:>5}/{steps}  train "
                      f"{train_curve[-1][1]:.4f}  val {val_curve[-1][1]:.4f} nats/byte "
                      f"({val_curve[-1][1] / math.log(2):.3f} bits/byte)  bytes/step "
                      f"{_fmt_bytes(sum(bytes_curve[-eval_every:]) / len(recent)):>9}  "
                      f"{1000 * sum(recent) / len(recent):7.1f} ms/step", flush=True)
    identical = replicas_identical(model) and init_identical
    warm = 2 if len(step_times) > 4 else 0
    layer_report = counter.report(steps, params)
    final = val_curve[-1][1]
    return {
        "reduce": mode, **red.describe(),
        "algorithm": algorithm, "seed": seed, "density": density, "world_size": P,
        "numel": numel, "k": k, "steps": steps,
        "final_val_loss": final, "final_val_bpb": final / math.log(2), "val_curve": val_curve,
        "final_train_loss": train_curve[-1][1], "train_curve": train_curve,
        "bytes_per_step": sum(bytes_curve) / len(bytes_curve), "bytes_curve": bytes_curve,
        "time_per_step_ms": 1000 * sum(step_times[warm:]) / len(step_times[warm:]),
        "reduce_ms": 1000 * sum(reduce_times[warm:]) / len(reduce_times[warm:]),
        "replicas_identical": bool(identical), "device": str(device),
        "stats_curve": stats_curve, "applied_curve": layer_report["applied_curve"],
        "layers": layer_report["layers"], "backend": type(comm).__name__,
    }


def _record_stats(curves: Dict[str, List[float]], stats: Dict[str, Any]) -> None:
    """Per-step numeric stats of the algorithm (counts, overflow, thresholds, capacities): a host
    read of a few scalars per step, fine for this benchmark (and free on CPU)."""
    import torch
    for key, v in stats.items():
        if key == "bytes_sent" or v is None:
            continue
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                continue
            v = v.item()
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, (int, float)):
            curves.setdefault(key, []).append(v)


def worker_main(cfg_path: str, out_path: str) -> int:
    import traceback

    import torch
    import torch.distributed as dist
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed deprecations
    torch.set_num_threads(1)
    with open(cfg_path) as f:
        cfg = json.load(f)
    comm, device = _comm_and_device(cfg)
    rank = dist.get_rank()
    if cfg["model"] == "gpt":
        from .gpt import load_corpus
        corpus = load_corpus(cfg["val_fraction"])
        data = (corpus.train.to(device), corpus.val.to(device))
        train_fn = train_one_lm
    else:
        Xtr, ytr, Xte, yte = load_data(cfg["test_fraction"], cfg.get("train_subset", 0))
        data = (Xtr.to(device), ytr.to(device), Xte.to(device), yte.to(device))
        train_fn = train_one
    for seed, alg in cfg["jobs"]:
        t0 = time.time()
        try:
            rec = train_fn(cfg, alg, seed, comm, device, data, log=not cfg.get("quiet"))
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            tb = traceback.format_exc()
            print(f"[rank {rank}] {alg} seed {seed} failed:\n{tb}", file=sys.stderr, flush=True)
            # any rank may be the one that raised: each appends its own short line
            with open(out_path, "a") as f:
                f.write(json.dumps({"seed": seed, "algorithm": alg, "error": err}) + "\n")
            raise
        rec["wall_s"] = time.time() - t0
        if rank == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if not cfg.get("quiet"):
                metric = (f"val loss {rec['final_val_loss']:.4f} nats/byte "
                          f"({rec['final_val_bpb']:.3f} bits/byte)" if "final_val_loss" in rec
                          else f"test acc {100 * rec['final_test_acc']:.2f}%")
                print(f"  [{alg:>9} seed {seed}] done in {rec['wall_s']:.1f} s: "
                      f"{metric}, {_fmt_bytes(rec['bytes_per_step'])}"
                      f"/step, {rec['time_per_step_ms']:.1f} ms/step, replicas "
                      f"{'identical' if rec['replicas_identical'] else 'DIVERGED'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2], sys.argv[3]))
    print("usage: torchrun ... -m oktopk_triton.bench.train --worker CONFIG.json OUT.jsonl\n"
          "       (use `oktopk-bench train` to run the comparison)", file=sys.stderr)
    sys.exit(2)


def resolve_algorithms(names: List[str]):
    """(algorithms to run, [(skipped, why)]) for ``train``: the library's algorithms and the
    baselines of bench/baselines.py (``powersgd``, ``bf16``; named explicitly, not in ``all``)."""
    from ._common import resolve_algorithms as resolve
    from .baselines import BASELINES
    lowered = [x.lower() for x in names]
    extra = [x for x in lowered if x in BASELINES]
    rest = [x for x in lowered if x not in BASELINES]
    run, skipped = resolve(rest, "train") if rest else ([], [])
    return run + [x for x in dict.fromkeys(extra)], skipped
