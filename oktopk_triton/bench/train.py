"""Train a model with every allreduce and compare (``oktopk-bench train`` / ``oktopk-bench demo``
/ ``make demo``).

Two models:

* ``--model cnn`` (default; ``mlp`` too): a small CNN on scikit-learn's digits; the metric is
  test accuracy. ``make demo`` runs this one (a run is seconds).
* ``--model gpt``: a byte-level decoder-only transformer (:mod:`oktopk_triton.bench.gpt`) trained as
  a language model on the Python standard library's own ``.py`` files, split by file; the metric is
  the validation loss in nats per byte (and bits per byte). ``--size`` picks the model: ``1m`` (CPU
  default), ``4m`` (1m at twice the width), ``25m`` and ``100m`` (GPU presets, ``--device cuda``;
  ranks may share a GPU), ``tiny`` (tests). AdamW by default; the sparse algorithms then reduce the
  optimizer's *updates* (``SparseAllreduce.reduce_updates``: each rank's AdamW steps on its own
  gradient, error feedback in update space), because AdamW on an error-fed sparse gradient divides a
  coordinate's summed owed gradient by its own scale and stalls (all sparse algorithms at 3.32
  nats/byte against dense 2.55 at 1%); ``--reduce gradients`` runs that setup. Every run also
  counts, per parameter tensor, the entries of the reduced gradient that are nonzero each step (what
  the algorithm applied) and the steps that applied none, so a gap to dense can be traced to the
  layers that starve (``tools/lm_results.py`` tabulates it).

Measured why: docs/research/design-notes.md, ``oktopk_triton/bench/train.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Dict

from . import _args as A
from . import records
from ._common import resolve_algorithms
from .launcher import launch, uses_cuda
from .report import format_table, plot, summarize

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

# a run's conservation (ledger.py) sums fp32 steps into fp64: rounding stays far below this
CONSERVATION_TOL = 1e-4


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
    p.add_argument("--world-size", type=A.positive_int, default=DEFAULTS["world_size"],
                   help="ranks")
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
    p.add_argument("--betas", type=A.fraction, nargs=2, default=None, metavar=("B1", "B2"),
                   help="AdamW's betas (gpt: default the --size preset's, else 0.9 0.95)")
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
    _add_gpt_arguments(p.add_argument_group("--model gpt"))
    _add_output_arguments(p)


def _add_gpt_arguments(g) -> None:
    """The options of ``--model gpt`` (the byte-level LM)."""
    g.add_argument("--size", choices=sorted(_gpt_sizes()), default=GPT_DEFAULTS["size"],
                   help="model preset: 1m (CPU default), 4m (1m at twice the width), 25m / 100m "
                        "(GPU, --device cuda), tiny (tests)")
    g.add_argument("--steps", type=A.positive_int, default=None,
                   help="training steps (default: preset's)")
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


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """Algorithm options, device, and where the results go."""
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   type=parse_option,
                   help="extra option passed to the sparse algorithms (repeatable; VALUE as "
                        "JSON where it parses, e.g. threshold_sample=0). Local steps (--model "
                        "gpt, reduce updates): sync_every=H, outer_lr, outer_momentum, "
                        "residual_decay, given to dense too (dense pseudo-gradients)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: NCCL on GPUs when there are >= world-size of them, else gloo/CPU")
    p.add_argument("--tag", default=None, help="results name: bench/results/train/train-<tag>.json")
    p.add_argument("--json", type=A.out_path, default=None,
                   help="results JSON path (default from --tag)")
    p.add_argument("--plot", type=A.out_path, default=None,
                   help="PNG path (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--timeout", type=A.positive_float, default=1800.0,
                   help="seconds before a launch (all its seeds and algorithms) is killed "
                        "(default 1800: a 4800-step GPT run on 2 CPU cores needs more)")
    p.add_argument("--quiet", action="store_true", help="no per-epoch progress lines")


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    # the demo writes to the ignored out/ (a clone stays clean); the committed reference run is
    # bench/results/train/train-digits-demo.json
    p.set_defaults(tag="digits-demo", json=os.path.join("out", "train-digits-demo.json"))


def demo_main(args) -> int:
    """``make demo``: 4 ranks, dense and every available sparse algorithm at density 1%."""
    return main(args)


def main(args) -> int:
    t0 = time.time()
    from .baselines import BASELINES
    algos, skipped = resolve_algorithms(args.algorithms, "train", extra=BASELINES)
    for name, why in skipped:
        print(f"note: skipping {name}: {why}", flush=True)
    if not algos:
        print("nothing to run", file=sys.stderr)
        return 2
    config = build_config(args, algos)
    lm = config["model"] == "gpt"
    if not lm and any(a in BASELINES for a in algos):
        print(f"oktopk-bench train: {'/'.join(BASELINES)} run with --model gpt only, got "
              f"--model {config['model']}", file=sys.stderr)
        return 2
    tag = args.tag or (f"lm-{config['size']}-d{args.density:g}" if lm else
                       f"digits-d{args.density:g}")
    json_path = args.json or records.results_path(f"train-{tag}.json")
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
    device = records.device_name("cuda:0" if uses_cuda(config) else "cpu")
    report = {**records.header("train", args, device=device), "config": config,
              "skipped": [{"algorithm": n, "why": w} for n, w in skipped],
              "failures": failures, "summary": summary, "runs": runs, "wall_s": wall,
              "host": {"cpus": os.cpu_count(), "platform": sys.platform}}
    if corpus is not None:
        report["corpus"] = corpus
    records.write(json_path, report, compact=True)
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
    checked = [r["conservation"] for r in runs if (r.get("conservation") or {}).get("checked")]
    if checked:
        worst = max(c["relative_error"] for c in checked)
        print(f"conservation: checked over the whole run in {len(checked)} of {len(runs)} "
              f"run(s), largest relative error {worst:.2e}")
    bad = [r for r in runs if not r.get("replicas_identical", False)]
    if bad:
        print(f"ERROR: replicas diverged in {len(bad)} run(s)", file=sys.stderr)
        return 1
    lost = [c for c in checked if not c["relative_error"] <= CONSERVATION_TOL]
    if lost:
        print(f"ERROR: conservation broken in {len(lost)} run(s) (relative error above "
              f"{CONSERVATION_TOL:g})", file=sys.stderr)
        return 1
    return 1 if failures else 0


def check_options(options: Dict[str, Any], algos, density: float, baselines) -> str:
    """The first problem with ``--option`` for the sparse algorithms, found before any rank is
    launched (a reducer of 1,024 entries built on a world of one, as each rank would build
    its own), or ``""``."""
    import torch
    from ..module import SparseAllreduce, keywords
    from ..comm import LocalCluster
    from .loops import local_step_options
    params = [torch.zeros(1024, requires_grad=True)]      # local steps need parameters
    for alg in algos:
        if alg in baselines:
            continue
        opts = local_step_options(options) if alg == "dense" else options
        try:
            SparseAllreduce(params, comm=LocalCluster(1).communicator(0),
                            density=1.0 if alg == "dense" else density, **keywords(alg, opts))
        except (TypeError, ValueError) as e:
            return str(e).splitlines()[0]
    return ""


def check_local_steps(args, algos, baselines) -> str:
    """The first problem with local steps (``--option sync_every=H`` and friends) for this
    command line, or ``""``: they need ``--model gpt`` and ``--reduce updates`` (or auto), and
    torch's hooks (the baselines) cannot take them."""
    from .loops import local_step_options, takes_local_steps
    options = dict(getattr(args, "option", None) or [])
    try:
        if not takes_local_steps(options):
            return ""
    except ValueError as e:
        return str(e).splitlines()[0]
    names = sorted(local_step_options(options))
    if args.model != "gpt":
        return f"{names}: local steps run with --model gpt (the digits loop reduces gradients)"
    if getattr(args, "reduce", "auto") not in ("auto", "updates"):
        return f"{names}: local steps need --reduce updates (or auto), got --reduce {args.reduce}"
    hooks = [a for a in algos if a in baselines]
    if hooks:
        return f"{names}: the baselines {hooks} are DDP hooks and cannot take local steps"
    return ""


def _corpus_summary(config) -> Dict[str, Any]:
    """Where the LM's bytes came from and the unigram entropy (nats/byte) to beat."""
    from .gpt import load_corpus
    c = load_corpus(config["val_fraction"])
    return dict(c.info, unigram_nats_per_byte=c.unigram_entropy())


def parse_option(s: str):
    """``--option KEY=VALUE`` (VALUE read as JSON where it is JSON, else a string)."""
    if "=" not in s or not s.split("=", 1)[0]:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        v = json.loads(v)
    except ValueError:
        pass
    return k, v


def check_args(args) -> str:
    """Called by the CLI once the line is parsed: the first problem with ``--option`` for the
    algorithms asked for, before any rank is launched, or ``""``."""
    from .baselines import BASELINES
    algos, _ = resolve_algorithms(args.algorithms, "train", extra=BASELINES)
    bad = (check_local_steps(args, algos, BASELINES)
           or check_options(dict(getattr(args, "option", None) or []), algos, args.density,
                            BASELINES))
    return f"--option: {bad}" if bad else ""


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
               options=dict(args.option), device=args.device,
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
                   warmup_fraction=getattr(args, "warmup_fraction",
                                           GPT_DEFAULTS["warmup_fraction"]),
                   val_fraction=getattr(args, "val_fraction", GPT_DEFAULTS["val_fraction"]),
                   reduce=getattr(args, "reduce", "auto"),
                   powersgd_start=getattr(args, "powersgd_start", None),
                   betas=list(getattr(args, "betas", None)
                              or train_defaults.get("betas", GPT_DEFAULTS["betas"])), epochs=None,
                   width=None, test_fraction=None, train_subset=None)
    return cfg
