"""Print the results tables (markdown) from the JSON files in bench/results/.

    python -m tools.readme_tables            # all tables (from the repository root)
docs/research/results.md quotes this output verbatim, and the README's short results summary takes
its figures from there (tests/test_readme.py checks that each is in docs/), so every number comes
from a recorded file. It
first rewrites bench/results/index.json (one entry per result file below bench/results: its
path there, benchmark, date, commit, dirty, device; oktopk_triton.bench.records.index) and
finds every file it draws through that index.
"""
from __future__ import annotations

import os
import sys

from oktopk_triton.bench import records

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RES = os.path.join(ROOT, "bench", "results")


def _index():
    """The entries of bench/results/index.json (main rewrites it first)."""
    return records.read(os.path.join(RES, "index.json"))["files"]


def _load(name):
    """The record the index lists as ``name`` (its path under bench/results, or its file name);
    None when it lists none."""
    rel = next((e["file"] for e in _index() if name in (e["file"], os.path.basename(e["file"]))),
               None)
    return records.read(os.path.join(RES, rel)) if rel else None


def _files(entries, benchmark: str, prefix: str = ""):
    """The index's files of ``benchmark`` whose names start with ``prefix``, sorted by name."""
    return sorted((e["file"] for e in entries if e["benchmark"] == benchmark
                   and os.path.basename(e["file"]).startswith(prefix)), key=os.path.basename)


def train_table(name: str) -> str:
    d = _load(name)
    if d is None:
        return f"(no {name})\n"
    c = d["config"]
    head = (f"`{name}`: {c['world_size']} ranks, density {c['density']}, {c['model']}, "
            f"{c['epochs']} epochs, seeds {c['seeds']}\n\n")
    def ok(cell):   # a failed run: its status, then empty cells
        return lambda s: cell(s) if s.get("status") == "ok" else ""

    cols = [("algorithm", lambda s: s["algorithm"]),
            ("test accuracy % (mean ± sd)", lambda s: (
                f"{100 * s['final_test_acc']:.2f} ± {100 * s['final_test_acc_std']:.2f}"
                if s.get("status") == "ok" else s.get("status"))),
            ("vs dense (points)", ok(lambda s: f"{s['acc_vs_dense_points']:+.2f}")),
            ("bytes/rank/step", ok(lambda s: f"{s['bytes_per_step'] / 1e3:.1f} kB")),
            ("vs dense bytes", ok(lambda s: f"{s['bytes_vs_dense']:.4f}")),
            ("time/step ms", ok(lambda s: f"{s['time_per_step_ms']:.1f}"))]
    return head + records.table(d["summary"], cols, markdown=True) + "\n"


LOWER_BOUND = "lower bound 2k(P−1)/P"


def collectives_table(name: str) -> str:
    d = _load(name)
    if d is None:
        return f"(no {name})\n"
    name = os.path.basename(name)
    rows = d["results"]
    Ps = sorted({r["P"] for r in rows})
    algs = []
    for r in rows:
        if r["algorithm"] not in algs:
            algs.append(r["algorithm"])
    c = d["config"]
    out = [f"`{name}`: n = {c['n']}, density {c['density']}, backend {c['backend']}, "
           f"{c['steps']} steps, {d['date'][:10]}. MB sent per rank per step (mean after the "
           "first step); in brackets: measured / §6 formula (upper end for ranges).\n"]
    by = {(x["algorithm"], x["P"]): x for x in reversed(rows)}   # the first of each

    def cell(p):
        def f(a):
            if a == LOWER_BOUND:
                return f"{2 * c['density'] * c['n'] * (p - 1) / p * 4 / 1e6:.3f}"
            r = by.get((a, p))
            return "—" if r is None else \
                f"{r['bytes_mean'] / 1e6:.3f} ({r['ratio_to_formula_high']:.2f})"
        return f
    cols = [("algorithm", str)] + [(f"P={p}", cell(p)) for p in Ps]
    out.append(records.table(algs + [LOWER_BOUND], cols, markdown=True))
    return "\n".join(out) + "\n"


def kernels_table(path: str) -> str:
    """``oktopk-bench kernels`` JSON: one column per n (ms and % of that run's copy bandwidth;
    the thresholds and the selection also x faster than torch.topk / topk + gather), then the
    kernel goals."""
    d = records.read(path)
    runs = d["runs"]
    name = os.path.basename(path)
    out = [f"`{name}`: {d['device']}, {d['date'][:10]}, density {d['density']}, "
           f"P = {d['regions']}, median of {d['repeats']} ({d.get('timing', '')}), "
           f"commit {str(d.get('commit'))[:10]}{'-dirty' if d.get('dirty') else ''}\n"]

    def cell(run):
        def f(nm):
            r = next((x for x in run["results"] if x["name"] == nm), None)
            if r is None:
                return "–"
            text = f"{r['ms']:.3f} ms ({r['pct_copy_bw']:.0f}%)"
            if r["kernel"] in ("magnitude_threshold", "hist_threshold"):
                text += f", {r['speedup_vs_topk']:.2f}x topk"
            if "speedup_vs_topk_gather" in r:
                text += f", {r['speedup_vs_topk_gather']:.2f}x topk + gather"
            return text
        return f
    cols = [("kernel", str)] + [(f"n = 2^{r['n'].bit_length() - 1}" if r["n"] & (r["n"] - 1) == 0
                                 else f"n = {r['n']}", cell(r)) for r in runs]
    out.append(records.table([r["name"] for r in runs[0]["results"]], cols, markdown=True))
    if d.get("goals"):
        met = {True: "yes", False: "**no**", None: "not evaluated"}
        out += ["", records.table(d["goals"], [
            ("goal", lambda g: f"{g['name']}: {g['goal']}"),
            ("n", lambda g: f"2^{g['n'].bit_length() - 1}"),
            ("target", lambda g: f"{g['target']:g}"),
            ("measured", lambda g: f"{g['value']:.3g}"), ("met", lambda g: met[g["met"]])],
            markdown=True)]
    return "\n".join(out) + "\n"


def goal_table(pairs) -> str:
    """Ok-Topk against dense over the 10-seed files: one row per (density, file, label)."""
    rows = ["| density | momentum | seeds | dense % | Ok-Topk % | gap (points) | goal | "
            "Ok-Topk bytes/rank/step | file |", "|---|---|---|---|---|---|---|---|---|"]
    for dens, name, label, goal in pairs:
        d = _load(name)
        if d is None:
            rows.append(f"| {dens} | {label} | (no {name}) | | | | | | |")
            continue
        by = {s["algorithm"]: s for s in d["summary"] if s.get("status") == "ok"}
        if "dense" not in by or "oktopk" not in by:
            continue
        de, ok = by["dense"], by["oktopk"]
        gap = 100 * (ok["final_test_acc"] - de["final_test_acc"])
        met = "met" if gap >= -goal else "missed"
        rows.append(f"| {dens} | {label} | {len(d['config']['seeds'])} | "
                    f"{100 * de['final_test_acc']:.2f} ± {100 * de['final_test_acc_std']:.2f} | "
                    f"{100 * ok['final_test_acc']:.2f} ± {100 * ok['final_test_acc_std']:.2f} | "
                    f"{gap:+.2f} | −{goal} ({met}) | {ok['bytes_per_step'] / 1e3:.1f} kB | "
                    f"`{name}` |")
    return "\n".join(rows) + "\n"


def ddp_table(path: str) -> str:
    """A ``oktopk-bench ddp`` JSON as its README table
    (oktopk_triton.bench.ddp_bench.format_markdown)."""
    from oktopk_triton.bench.ddp_bench import format_markdown
    return f"`{os.path.basename(path)}`: " + format_markdown(records.read(path)) + "\n"


def main() -> int:
    entries = records.index(RES)
    records.write(os.path.join(RES, "index.json"), {**records.header("index"), "files": entries})
    print(goal_table([
        ("1%", "train-digits-d0.01-seeds10.json", "momentum corrected + masked", 0.5),
        ("0.1%", "train-digits-d0.001-seeds10.json", "momentum corrected + masked", 1.5)]))
    for name in ("train-digits-d0.01.json", "train-digits-d0.001.json", "train-digits-demo.json"):
        print(train_table(name))
    for name in _files(entries, "collectives", "collectives-"):
        print(collectives_table(name))
    for name in _files(entries, "kernels", "gpu-kernels-"):
        print(kernels_table(os.path.join(RES, name)))
    for name in _files(entries, "ddp"):
        print(ddp_table(os.path.join(RES, name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
