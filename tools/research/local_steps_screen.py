"""The local-steps campaign on the byte-level GPT: one row per run, then one per configuration
(averaged over its seeds), against dense data-parallel AdamW.

    python -m tools.research.local_steps_screen DIR [--dense DENSE.json] [--json OUT.json]

DIR holds one ``oktopk-bench train --model gpt`` JSON per run (the commands are in
docs/research/techniques.md). Each run is compared with dense data-parallel AdamW of the same model
preset, seed and number of steps, found in ``--dense`` (default: the committed 1200-step campaign,
dense on seeds 0-2) or among DIR's own per-step dense runs (a 4800-step dense run, say): final
validation loss against dense's, bytes per step as a fraction of dense's fp32 bytes, and the
steps ratio (the run's steps over the step at which dense's validation curve reaches the run's
final loss; planning.steps_ratio). A configuration's ratio is its mean final loss against the
mean curve of dense over the same seeds, as the README's tables compute it.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Dict, List, Optional, Tuple

from oktopk_triton.bench import records
from oktopk_triton.planning import mean_curve, steps_ratio

DENSE = "bench/results/lm/lm-gpt1m-cpu-1200steps-2026-11-25.json"
_OUTER = (("outer_lr", 1.0, "lr"), ("outer_momentum", 0.0, "m"), ("residual_decay", 1.0, "decay"))


def _options(rep: dict) -> dict:
    return rep.get("config", {}).get("options", {}) or {}


def _is_reference(run: dict, opts: dict) -> bool:
    """Dense data parallel every step: the runs everything is measured against."""
    return (run["algorithm"] == "dense" and run.get("local_steps") is None
            and int(opts.get("sync_every", 1)) == 1)


def _size(rep: dict) -> str:
    """The GPT preset a record trained (records before the field: the 1m default)."""
    return rep.get("config", {}).get("size") or "1m"


def dense_refs(paths: List[str]) -> Dict[Tuple[str, int, int], dict]:
    """(preset, seed, steps) -> dense's run, from every file given (later files win)."""
    out: Dict[Tuple[str, int, int], dict] = {}
    for path in paths:
        rep = records.read(path)
        for r in rep.get("runs", []):
            if _is_reference(r, _options(rep)):
                out[(_size(rep), r["seed"], r["steps"])] = r
    return out


def dense_run(path: str, seed: int, steps: int = 1200, size: str = "1m") -> dict:
    refs = dense_refs([path])
    if (size, seed, steps) not in refs:
        raise SystemExit(f"local_steps_screen: no dense run of the {size} model, seed {seed}, "
                         f"over {steps} steps in {path}")
    return refs[(size, seed, steps)]


def _outer(opts: dict) -> str:
    """The outer step's options that differ from the defaults, and the moment sync and the
    first moment's realignment if on."""
    parts = [f"{short} {opts[k]:g}" for k, default, short in _OUTER
             if k in opts and float(opts[k]) != default]
    every = int(opts.get("moment_sync_every", 0))
    if every:
        sparse = float(opts.get("moment_density", 0))   # a removed option, in recorded runs
        wire = f"at {sparse:g}" if sparse else opts.get("moment_dtype", "fp32")
        parts.append(f"moments {opts.get('moment_sync', 'both')} {wire} every {every}")
    if float(opts.get("moment_realign", 0)):
        parts.append(f"realign {float(opts['moment_realign']):g}")
    return ", ".join(parts) or "-"


def _ratio(curve_runs: List[dict], steps: int, final: float) -> dict:
    s, loss = mean_curve(curve_runs)
    return steps_ratio(s, loss, steps, final)


def rows(directory: str, dense_path: Optional[str] = DENSE) -> list:
    files = sorted(glob.glob(os.path.join(directory, "*.json")))
    refs = dense_refs(([dense_path] if dense_path else []) + files)
    out = []
    for path in files:
        rep = records.read(path)
        opts, size = _options(rep), _size(rep)
        for r in rep.get("runs", []):
            if _is_reference(r, opts):
                continue
            d = refs.get((size, r["seed"], r["steps"]))
            if d is None:
                raise SystemExit(f"local_steps_screen: {path}: no dense run of the {size} "
                                 f"model, seed {r['seed']}, over {r['steps']} steps (give one "
                                 "with --dense or in DIR)")
            ratio = _ratio([d], r["steps"], r["final_val_loss"])
            cons = r.get("conservation") or {}
            out.append({"tag": os.path.basename(path)[:-5], "algorithm": r["algorithm"],
                        "model": size, "seed": r["seed"], "steps": r["steps"],
                        "density": r["density"],
                        "sync_every": int(opts.get("sync_every", 1)),
                        "wire_format": opts.get("wire_format", "fp32"), "outer": _outer(opts),
                        "final_val_loss": r["final_val_loss"],
                        "dense_final_val_loss": d["final_val_loss"],
                        "loss_vs_dense_pct": 100 * (r["final_val_loss"] / d["final_val_loss"] - 1),
                        "bytes_per_step": r["bytes_per_step"],
                        "bytes_vs_dense": r["bytes_per_step"] / d["bytes_per_step"],
                        "steps_ratio": ratio["ratio"], "clamped": ratio["clamped"],
                        "replicas_identical": r.get("replicas_identical"),
                        "conservation": cons.get("relative_error") if cons.get("checked") else None,
                        "commit": rep.get("commit", rep.get("git")), "dirty": rep.get("dirty"),
                        "_dense": d})
    return out


def configurations(rs: list) -> list:
    """One row per configuration: its seeds, mean final loss, and the ratio of that mean against
    dense's mean curve over the same seeds."""
    groups: Dict[tuple, list] = {}
    for r in rs:
        key = (r["model"], r["algorithm"], r["sync_every"], r["density"], r["wire_format"],
               r["outer"], r["steps"])
        groups.setdefault(key, []).append(r)
    out = []
    for (model, alg, H, dens, wire, outer, steps), g in groups.items():
        final = sum(r["final_val_loss"] for r in g) / len(g)
        dense_final = sum(r["dense_final_val_loss"] for r in g) / len(g)
        ratio = _ratio([r["_dense"] for r in g], steps, final)
        cons = [r["conservation"] for r in g if r["conservation"] is not None]
        out.append({"model": model, "algorithm": alg, "sync_every": H, "density": dens,
                    "wire_format": wire,
                    "outer": outer, "steps": steps, "seeds": sorted(r["seed"] for r in g),
                    "final_val_loss": final, "loss_vs_dense_pct": 100 * (final / dense_final - 1),
                    "bytes_vs_dense": sum(r["bytes_vs_dense"] for r in g) / len(g),
                    "steps_ratio": ratio["ratio"], "clamped": ratio["clamped"],
                    "ratio_per_seed": [r["steps_ratio"] for r in g],
                    "conservation_max": max(cons) if cons else None,
                    "conservation_checked": len(cons)})
    return sorted(out, key=lambda c: (c["model"], c["steps"], c["bytes_vs_dense"] > 0.1,
                                      c["steps_ratio"]))


def _key(name: str):
    return lambda r: r[name]


_RUN_COLUMNS = [
    ("run", _key("tag")), ("model", _key("model")), ("seed", _key("seed")),
    ("steps", _key("steps")),
    ("H", _key("sync_every")), ("density per sync", lambda r: f"{r['density']:g}"),
    ("wire", _key("wire_format")), ("outer", _key("outer")),
    ("bytes vs dense", lambda r: f"{r['bytes_vs_dense']:.4f}"),
    ("final val loss", lambda r: f"{r['final_val_loss']:.4f}"),
    ("vs dense", lambda r: f"{r['loss_vs_dense_pct']:+.1f}%"),
    ("steps ratio", lambda r: f"{r['steps_ratio']:.2f}"),
    ("conservation", lambda r: "-" if r["conservation"] is None else f"{r['conservation']:.0e}")]
_CONFIG_COLUMNS = [
    ("model", _key("model")), ("algorithm", _key("algorithm")), ("steps", _key("steps")),
    ("H", _key("sync_every")),
    ("density per sync", lambda c: f"{c['density']:g}"), ("wire", _key("wire_format")),
    ("outer", _key("outer")), ("seeds", lambda c: len(c["seeds"])),
    ("bytes vs dense", lambda c: f"{c['bytes_vs_dense']:.4f}"),
    ("final val loss", lambda c: f"{c['final_val_loss']:.4f}"),
    ("vs dense", lambda c: f"{c['loss_vs_dense_pct']:+.1f}%"),
    ("steps ratio", lambda c: f"{c['steps_ratio']:.2f}"),
    ("per seed", lambda c: " ".join(f"{x:.2f}" for x in c["ratio_per_seed"]))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--dense", default=DENSE)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rs = rows(a.dir, a.dense)
    rs.sort(key=lambda r: (r["model"], r["steps"], r["algorithm"], r["sync_every"], r["density"],
                           r["tag"]))
    print(records.table(rs, _RUN_COLUMNS, markdown=True))
    print()
    cs = configurations(rs)
    print(records.table(cs, _CONFIG_COLUMNS, markdown=True))
    if a.json:
        rec = records.header("lm-local-steps", vars(a))
        rec.update({"dense": a.dense, "runs": [{k: v for k, v in r.items() if k != "_dense"}
                                               for r in rs], "configurations": cs})
        records.write(a.json, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
