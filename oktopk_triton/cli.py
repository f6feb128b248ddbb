"""``oktopk-bench``: kernel, collective and training benchmarks.

    oktopk-bench kernels      [--n 16777216 67108864 268435456] [--density 0.01] [--json PATH]
    oktopk-bench collectives  --algorithms all --world-sizes 2 4 8 --n ... [--backend local]
    oktopk-bench ddp          --world-size 4 --hooks all --algorithms all --density 0.01
                              [--json PATH]
    oktopk-bench train        --algorithms dense oktopk --density 0.01 --world-size 4
    oktopk-bench train        --model gpt [--size 1m|25m|100m] [--device cuda] --seeds 0 1 2
    oktopk-bench demo         (what `make demo` runs)
    oktopk-bench project      --model bert-large --density 0.01 --net 100Gbps,5us [--plot PATH]
    oktopk-bench launches     [--algorithms oktopk] [--modes gradients sync] [--check] [--json PATH]
    oktopk-bench faults       [--out out/faults] [--steps 512] [--sync-every 32] [--density 0.2]
    oktopk-bench diloco       [--out out/diloco] [--seeds 0 1 2] [--steps 300] [--sync-every 15]
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module in oktopk_triton.bench, help)
SUBCOMMANDS = {
    "kernels": ("kernels", "time every selection kernel and threshold + select against "
                           "torch.topk + gather"),
    "collectives": ("collectives", "bytes per rank and step time of every algorithm over world "
                                   "sizes"),
    "ddp": ("ddp_bench", "step time of DDP on a Linear stack with each comm hook: none, "
                         "allreduce, fp16, PowerSGD, sparse"),
    "train": ("train", "train a model with each algorithm and compare: the digits CNN (default) or "
                       "a byte-level GPT on the Python stdlib (--model gpt)"),
    "demo": ("train", "the main job: 4 ranks, dense and every sparse algorithm at density 1%"),
    "project": ("project", "project every algorithm's step time to 1024 GPUs for a model size "
                           "and a network"),
    "launches": ("launches", "count what one steady step dispatches, launches, sends and reads "
                             "on the host, per algorithm, wire format and mode (CPU trace)"),
    "faults": ("faults", "4 torchft replicas train the digits CNN with SparseDiLoCo while one is "
                         "killed and restarted, against torchft's dense DiLoCo (what `make "
                         "faults` runs)"),
    "diloco": ("diloco", "4 torchft replicas train the 1m GPT: SparseDiLoCo against DiLoCo "
                         "(fp32 and should_quantize) at the same H and at equal bytes, each with "
                         "and without churn, over seeds"),
}


def build_parser(command=None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (a missing optional dependency of one
    benchmark never breaks the others)."""
    from .bench._args import Parser
    p = Parser(prog="oktopk-bench", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, (mod, help_) in SUBCOMMANDS.items():
        # help strings are %-formatted by argparse, descriptions are not
        sp = sub.add_parser(name, help=help_.replace("%", "%%"), description=help_)
        if name != command:
            continue
        m = importlib.import_module(f"oktopk_triton.bench.{mod}")
        adder = getattr(m, "add_demo_arguments", None) if name == "demo" else None
        (adder or m.add_arguments)(sp)
        sp.set_defaults(_module=m, _entry="demo_main" if name == "demo" else "main")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if args.command == "collectives" and args.warmup >= args.steps:
        parser.exit(2, f"oktopk-bench collectives: error: --warmup ({args.warmup}) must be less "
                       f"than --steps ({args.steps}): no step would be timed\n")
    check = getattr(args._module, "check_args", None)
    bad = check(args) if check is not None else ""     # a module's checks across options
    if bad:
        parser.exit(2, f"oktopk-bench {args.command}: error: {bad}\n")
    fn = getattr(args._module, args._entry, None) or args._module.main
    return int(fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
