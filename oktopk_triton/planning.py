"""Planning a run: which algorithm on my cluster, and how soon does it reach a loss.

A cost model of one steady step of every algorithm, from P = 2 to 1024 GPUs, for a model size, a
density and a network (:func:`project`, :func:`step_time`), its validation against measured
steps (:func:`validate`), and the time to dense's loss: a projected step time times a *steps
ratio*, how many times dense's steps an algorithm needs to reach the loss it ends at
(:func:`ratios_from_train`, :func:`time_to_loss`). ``oktopk-bench project`` is its command line
(:mod:`oktopk_triton.bench.project`).

**What is projected.** step time = communication + selection kernels, per rank, for one steady
step (after calibration and warm-up). The forward and backward passes (dense compute) are
**excluded**: this is the time the gradient exchange adds to a step that does not overlap it.

**Communication** prices each algorithm's own schedule (``Algorithm.schedule``: every call of a
step with its bytes, as ``bytes_sent`` counts them, and rounds; tested against recorded traffic)
on a network of per-GPU bandwidth β (bytes/s, each direction) and per-message latency α (the
formula of each kind of call is in the note linked below).

The calls of a step run one after the other (no overlap between them); the time of the rank the
step waits for is taken (``schedule(rank=None)``).

Measured why: docs/research/design-notes.md, ``oktopk_triton/planning.py``.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .algorithms import REGISTRY
from .algorithms._sparse import _log2ceil

ALGORITHMS = tuple(REGISTRY)  # every registered algorithm is priced, dense first

# -- networks -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Network:
    """Per-GPU bandwidth (bytes/s, each direction) and per-message latency (s)."""
    bandwidth: float
    latency: float
    name: str = ""

    def describe(self) -> str:
        return (f"{self.name + ': ' if self.name else ''}{self.bandwidth * 8 / 1e9:g} Gb/s "
                f"({self.bandwidth / 1e9:.3g} GB/s) per GPU, {self.latency * 1e6:g} us per message")


# name -> (spec, what it stands for). Latencies: per message as NCCL sees it, software included.
NET_PRESETS = {
    "10Gbps": ("10Gbps,50us", "10 GbE, TCP sockets"),
    "25Gbps": ("25Gbps,25us", "25 GbE, TCP sockets"),
    "100Gbps": ("100Gbps,5us", "100 Gb/s InfiniBand EDR / RoCE, GPUDirect RDMA"),
    "400Gbps": ("400Gbps,3us", "400 Gb/s InfiniBand NDR, GPUDirect RDMA"),
}
_BW_UNITS = {"gbps": 1e9 / 8, "gb/s": 1e9, "mbps": 1e6 / 8, "mb/s": 1e6, "tbps": 1e12 / 8,
             "tb/s": 1e12, "kb/s": 1e3, "b/s": 1.0}
_LAT_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_net(text: str) -> Network:
    """``100Gbps,5us`` | ``3GB/s,50us`` | a preset name (``10Gbps`` ... ``400Gbps``).

    ``Gbps``/``Mbps``/``Tbps`` are bits per second, ``GB/s``/``MB/s`` bytes per second (case
    sensitive on the b/B: ``Gb/s`` is read as bits, like ``Gbps``)."""
    t = text.strip()
    if t in NET_PRESETS:
        return dataclasses.replace(parse_net(NET_PRESETS[t][0]), name=t)
    parts = [p.strip() for p in t.split(",")]
    if len(parts) != 2:
        raise ValueError(f"network {text!r}: expected BANDWIDTH,LATENCY (e.g. 100Gbps,5us) or one "
                         f"of {sorted(NET_PRESETS)}")
    m = re.fullmatch(r"([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]+)", parts[0])
    if not m:
        raise ValueError(f"network {text!r}: bad bandwidth {parts[0]!r}")
    unit = m.group(2)
    key = unit.lower()
    if key.endswith("/s") and unit[-3] == "b":       # Gb/s: bits
        key = key[:-2] + "ps"
    if key not in _BW_UNITS:
        raise ValueError(f"network {text!r}: unknown bandwidth unit {unit!r} (Gbps, Mbps, Tbps, "
                         "GB/s, MB/s)")
    bw = float(m.group(1)) * _BW_UNITS[key]
    m = re.fullmatch(r"([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([a-zµ]+)", parts[1].lower())
    if not m or m.group(2) not in _LAT_UNITS:
        raise ValueError(f"network {text!r}: bad latency {parts[1]!r} (e.g. 5us, 0.05ms)")
    lat = float(m.group(1)) * _LAT_UNITS[m.group(2)]
    if bw <= 0 or lat < 0:
        raise ValueError(f"network {text!r}: bandwidth must be > 0 and latency >= 0")
    return Network(bw, lat, t)


# -- models ---------------------------------------------------------------------------------------
MODEL_PRESETS = {"resnet50": 25_600_000, "bert-large": 340_000_000, "gpt2-xl": 1_500_000_000}


# -- kernels --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelCosts:
    """Per-element costs of the passes over n (seconds per element, one rank alone on its GPU)."""
    copy_bandwidth: float            # bytes/s of a device copy (read + write counted)
    fused_select_s: float            # Ok-Topk's fused select pass, per element
    topk_s: float                    # torch.topk over n fp32, per element
    source: str                      # "default" or the JSON's path
    device: str = "assumed H100-class GPU"

    def memory_s(self, bytes_per_element: float) -> float:
        return bytes_per_element / self.copy_bandwidth


_N28 = float(1 << 28)
# An H100 80GB HBM3 at n = 2^28 (bench/results/kernels/gpu-kernel-variants-call1.json,
# 2026-11-23): copy 0.731 ms (2.94 TB/s); fused select with the in-pass histogram at the
# launcher's configuration (BLOCK 2048, 4 warps) 2.90 ms, i.e. 32 bytes-equivalent per element at
# that bandwidth for the
# 12 it moves; torch.topk(acc.abs(), k) 5.83 ms (64 bytes-equivalent: a multi-pass radix select).
DEFAULT_KERNELS = KernelCosts(copy_bandwidth=8 * _N28 / 0.731e-3, fused_select_s=2.90e-3 / _N28,
                              topk_s=5.83e-3 / _N28, source="default",
                              device="defaults: an H100's copy 2.94 TB/s, fused select 2.90 ms and "
                                     "torch.topk 5.83 ms at 2^28 (gpu-kernel-variants-call1.json)")

# Per algorithm, one steady step: (bytes per element of its memory-bound passes over n, fused
# select passes, torch.topk passes over n in fp32 units: a top-k of int64 keys counts 2, twice the
# radix digits). Counted op by op from each algorithm's code, with check_finite="skip": every
# algorithm pays the non-finite check (read grad: 4) and the zeroed output (4); commit_residual
# under the check is a where (12) and a copy (8).
PASSES = {
    # clone (8), div_ (8), copy into out (8)
    "dense": (4 + 4 + 24, 0, 0),
    # fused_select reads grad and residual and writes the residual in its own pass; the rest of
    # the step works on rows of ~k entries (entry_work)
    "oktopk": (4 + 4, 1, 0),
    # acc (12); topk_entries: the int64 keys in one kernel (kernels.magnitude_keys: read 4,
    # write 8; the torch ops before it moved 92), a top-k of n int64 keys; out /= P (8);
    # commit (20)
    "topka": (4 + 4 + 12 + 12 + 8 + 20, 0, 2),
    # as TopkA (its top-k of n int64 keys) without the division (out.index_copy_)
    "gtopk": (4 + 4 + 12 + 12 + 20, 0, 2),
    # acc (12); Spar-Reduce-Scatter touches (P-1)/P of n on each side: index_select + |.| +
    # index_copy on the sending side (24), index_select + index_copy on the receiving side (16),
    # the block top-ks cover n once (fp32); padded out (4), copy + div (16), commit (20)
    "spardl": (4 + 4 + 12 + 40 + 4 + 16 + 20, 0, 1),
    # acc (12), |acc| (8) and a top-k over n; selection buffer (4), counts (5), |sel| (8) and a
    # row-wise top-k over n; residual scatter clone (8); padded out (4); copy + div (16),
    # commit (20)
    "topkdsa": (4 + 4 + 12 + 8 + 4 + 5 + 8 + 8 + 4 + 16 + 20, 0, 2),
    # acc (12), std_mean (4), 8 counting passes (kernels.gaussian_threshold: read 4 each; the
    # torch ops before it: |acc| once, then >=, !=, &, sum, 14 each), the selection
    # (kernels.select_above: acc read twice, the kept mask written, 9; the mask and compaction
    # before it: 136), the sent entries zeroed in acc (9) and commit (20), out /= P (8)
    "gaussiank": (4 + 4 + 12 + 4 + 8 * 4 + 9 + 9 + 20 + 8, 0, 0),
}


def find_kernels_json(folder: str = os.path.join("bench", "results")) -> Optional[str]:
    """The newest ``gpu-kernels-*.json`` in ``folder`` or below it (its ``kernels/`` folder)."""
    paths = sorted(glob.glob(os.path.join(folder, "**", "gpu-kernels-*.json"), recursive=True),
                   key=lambda p: (os.path.getmtime(p), p))
    return paths[-1] if paths else None


def load_kernels(path: str) -> KernelCosts:
    """Per-element costs from a kernels JSON, at the largest n it holds. Formats:

    * ``oktopk-bench kernels`` (several sizes): top-level ``entries[{kernel, n, ms, grad_dtype,
      velocity, hist}]`` (or ``runs[{n, results}]``): ``copy``, ``torch_topk`` and the fp32
      ``fused_select`` with the histogram and without velocity (the Ok-Topk step without
      momentum);
    * the older single-size one: ``n`` and ``results[{name, median_ms}]`` (``copy``, ``fused
      select``, ``torch.topk``);
    * the row format of ``tools/gpu_kernel_variants.py``: ``rows[{what, log2n, ms, hist}]`` (the
      fastest fused-select variant with the histogram)."""
    with open(path) as f:
        d = json.load(f)
    device = str(d.get("device", "?"))
    if d.get("device_type") not in (None, "cuda"):
        raise ValueError(f"{path}: a {d.get('device_type')} run, not a GPU run")
    entries = d.get("entries") or [r for run in d.get("runs", []) for r in run.get("results", [])]
    if entries:
        n = max(int(r["n"]) for r in entries if r.get("kernel") == "fused_select")

        def pick(kernel, *prefs):
            rows = [r for r in entries if r.get("kernel") == kernel and int(r.get("n", -1)) == n]
            for pref in prefs + ({},):
                ok = [r for r in rows if all(r.get(key) == v for key, v in pref.items())]
                if ok:
                    return min(float(r.get("ms", r.get("median_ms"))) for r in ok) * 1e-3
            return None
        copy, topk = pick("copy"), pick("torch_topk")
        fused = pick("fused_select", {"grad_dtype": "fp32", "hist": True, "velocity": False},
                     {"hist": True, "velocity": False}, {"hist": True})
    elif "results" in d and "n" in d:
        n = int(d["n"])
        rows = {r["name"]: float(r["median_ms"]) * 1e-3 for r in d["results"]}
        copy, fused, topk = rows.get("copy"), rows.get("fused select"), rows.get("torch.topk")
    elif "rows" in d:
        rows = d["rows"]
        big = max(int(r["log2n"]) for r in rows if r.get("what") == "fused_select")
        n = 1 << big

        def best(what, pred=lambda r: True):
            ms = [float(r["ms"]) for r in rows
                  if r.get("what") == what and int(r.get("log2n", -1)) == big and pred(r)]
            return min(ms) * 1e-3 if ms else None
        copy = best("copy")
        fused = best("fused_select", lambda r: r.get("hist", True)) or best("fused_select")
        topk = best("torch.topk")
    else:
        raise ValueError(f"{path}: not a kernels JSON (no entries, results/n or rows)")
    if not (copy and fused and topk):
        raise ValueError(f"{path}: needs copy, fused select and torch.topk timings")
    return KernelCosts(copy_bandwidth=8.0 * n / copy, fused_select_s=fused / n, topk_s=topk / n,
                       source=path, device=device)


def resolve_kernels(spec: Optional[str], folder: str = os.path.join("bench", "results")
                    ) -> Tuple[KernelCosts, Optional[str]]:
    """``spec``: a path, ``none`` (the defaults) or None (newest gpu-kernels JSON in ``folder``,
    else the defaults). Returns (costs, a note when a found file could not be used)."""
    if spec is not None and spec.lower() in ("none", "default", "defaults"):
        return DEFAULT_KERNELS, None
    path = spec or find_kernels_json(folder)
    if path is None:
        return DEFAULT_KERNELS, None
    try:
        return load_kernels(path), None
    except (ValueError, KeyError, OSError) as exc:
        if spec is not None:
            raise
        return DEFAULT_KERNELS, f"ignored {path}: {exc}"


def entry_work(name: str, k: int, P: int) -> Tuple[float, float]:
    """Per-step work proportional to k (or P·k) of ``name``: (elements through a sort/top-k,
    priced at ``topk_s`` each; bytes of memory-bound scatters, at the copy bandwidth).

    Ok-Topk: the top-k of the staging rows (``stage_factor``·k), the sort and top-k of the
    received rows (≈ k each) and the top-k of the gathered slots (≈ k): 7k, and ~200 B per
    entry of cumsums, gathers and scatters over those rows. TopkA and Gaussiank
    scatter-add all P gathered sets into ``out`` (≈ 20 B per entry: int64 index, value,
    read-modify-write). gTop-k: a merge per round (argsort and top-k of 2k: 4k·log2 P, and ~300 B
    per entry of keys and concatenations). TopkDSA:
    the owner adds P·cap ≈ 1.25k entries. SparDL's block top-ks are in its pass over n."""
    lg = max(0, (P.bit_length() - 1))
    return {
        "dense": (0.0, 0.0),
        "oktopk": (7.0 * k, 200.0 * k),
        "topka": (1.0 * k, 20.0 * P * k),
        "gtopk": (1.0 * k + 4.0 * k * lg, 300.0 * k * lg),
        "spardl": (0.0, 20.0 * k),
        "topkdsa": (0.0, 20.0 * 1.25 * k),
        "gaussiank": (0.0, 20.0 * 1.5 * P * k),
    }[name]


def selection_time(name: str, n: int, kernels: KernelCosts, ranks_per_gpu: int = 1,
                   k: int = 0, P: int = 1) -> float:
    """Seconds of the passes over n one steady step of ``name`` makes (:data:`PASSES`) plus its
    work on the k selected entries (:func:`entry_work`, when k is given); ``ranks_per_gpu`` ranks
    sharing one GPU's memory bandwidth take that many times longer."""
    mem, fused, topk = PASSES[name]
    per = kernels.memory_s(mem) + fused * kernels.fused_select_s + topk * kernels.topk_s
    sort_elems, scatter_bytes = entry_work(name, k, P) if k else (0.0, 0.0)
    t = n * per + sort_elems * kernels.topk_s + kernels.memory_s(scatter_bytes)
    return t * ranks_per_gpu


# -- communication --------------------------------------------------------------------------------


def spec_time(spec, P: int, net: Network) -> Tuple[float, str]:
    """(seconds, the collective algorithm priced) of one call (see the module docstring)."""
    a, B = net.latency, net.bandwidth
    if P <= 1:
        return 0.0, "local"
    if spec.kind == "allreduce":
        ring = 2 * (P - 1) * a + spec.bytes_per_rank / B
        b = spec.bytes_per_rank * P / (2.0 * (P - 1))       # the message itself
        tree = 2 * _log2ceil(P) * (a + b / B)
        return (ring, "ring") if ring <= tree else (tree, "tree")
    if spec.kind == "allgather":
        return (P - 1) * a + spec.bytes_per_rank / B, "ring"
    if spec.kind == "alltoall":
        return (P - 1) * a + spec.bytes_per_rank / B, "pairwise"
    if spec.kind == "broadcast":
        b = spec.bytes_per_rank
        chain = (P - 1) * a + b / B
        tree = _log2ceil(P) * (a + b / B)
        return (chain, "chain") if chain <= tree else (tree, "binomial")
    if spec.kind == "send_recv":
        return spec.rounds * a + max(spec.bytes_per_rank, spec.received) / B, "p2p"
    raise ValueError(f"unknown collective kind {spec.kind!r}")


def comm_time(specs, P: int, net: Network) -> float:
    return sum(spec_time(s, P, net)[0] for s in specs)


def _fit_coefficients(spec, P: int, net: Network) -> Tuple[float, float]:
    """(latency count, bytes on the link) of the branch ``spec_time`` chose: time = c·α + b/β."""
    _, how = spec_time(spec, P, net)
    if spec.kind == "allreduce":
        if how == "ring":
            return 2 * (P - 1), spec.bytes_per_rank
        b = spec.bytes_per_rank * P / (2.0 * (P - 1))
        return 2 * _log2ceil(P), 2 * _log2ceil(P) * b
    if spec.kind in ("allgather", "alltoall"):
        return P - 1, spec.bytes_per_rank
    if spec.kind == "broadcast":
        if how == "chain":
            return P - 1, spec.bytes_per_rank
        return _log2ceil(P), _log2ceil(P) * spec.bytes_per_rank
    return spec.rounds, max(spec.bytes_per_rank, spec.received)


# -- schedules ------------------------------------------------------------------------------------
def _k(n: int, density: float) -> int:
    return max(1, min(n, int(round(density * n))))


def topkdsa_fill_factor(P: int) -> float:
    """Largest reduced region / cap, fitted to the LocalCluster collectives run (see above)."""
    return 0.74 + 0.465 * math.log2(max(P, 1))


def topkdsa_state(n: int, k: int, P: int, fill_factor: Optional[float] = None,
                  slack: float = 1.25, gather_slack: float = 1.25,
                  fill: float = 1.0 / 3.0) -> Dict[str, Any]:
    """TopkDSA's gather mode and cap2 after a decision, as its ``_decide`` takes them, for a
    largest region of ``fill_factor·cap`` entries (the fit when None; all regions alike)."""
    L = -(-n // P)
    cap = max(1, min(L, math.ceil(slack * k / P)))
    f = topkdsa_fill_factor(P) if fill_factor is None else float(fill_factor)
    mx = min(L, max(1, int(round(f * cap))))
    cap2 = max(1, min(L, math.ceil(gather_slack * mx)))
    if P * mx > fill * n or 1 + 2 * cap2 >= L:
        return {"mode": "dense", "cap2": None}
    return {"mode": "sparse", "cap2": cap2}


def algorithm_schedule(name: str, n: int, k: int, P: int, check_finite: str = "skip",
                       dtype: str = "fp32", topkdsa_fill: Optional[float] = None,
                       topkdsa_bytes: Optional[float] = None, wire_format: str = "fp32"):
    """The schedule the projection prices. TopkDSA: its gather from the fill model, or (when
    ``topkdsa_bytes``, a measured total per step, is given) the cap2 that reproduces it (both
    in fp32 words). ``wire_format``: the sparse algorithms' (dense ignores it)."""
    from .algorithms.schedule import schedule_of
    opts: Dict[str, Any] = {"check_finite": check_finite}
    if name == "dense":
        opts["dtype"] = dtype
    elif wire_format != "fp32":
        opts["wire_format"] = wire_format
    if name == "topkdsa" and P > 1 and k < n:
        if topkdsa_bytes is not None:
            bound = schedule_of(name, n, k, P, **opts)
            static = sum(s.bytes_per_rank for s in bound[:-1])
            chunk = (topkdsa_bytes - static) / (P - 1) / 4.0        # words of the gathered slot
            L = -(-n // P)
            if chunk >= L:
                opts.update(mode="dense")
            else:
                opts.update(mode="sparse", cap2=max(1, min(L, int(round((chunk - 1) / 2)))))
        else:
            opts.update(topkdsa_state(n, k, P, topkdsa_fill))
    return schedule_of(name, n, k, P, **opts)


def step_time(name: str, n: int, density: float, P: int, net: Network, kernels: KernelCosts,
              ranks_per_gpu: int = 1, sync_every: int = 1, overlap: bool = False,
              **schedule_kw) -> Dict[str, Any]:
    """One step of ``name`` priced: communication + selection, in ms.

    ``sync_every=H`` (local steps; sparse algorithms only, dense is always priced per step):
    the algorithm's step at ``density`` (the density of one sync) happens every H steps, so
    its time and bytes per step are divided by H. ``overlap``: that sync could run behind the
    next H steps' compute (recorded on the row; :func:`time_to_loss` then charges
    ``max(compute, step)`` instead of ``compute + step``). The library's sync blocks: overlap
    prices what a pipelined outer step would give, not what ships."""
    H = 1 if name == "dense" else sync_every
    if H < 1:
        raise ValueError(f"sync_every: expected an integer >= 1, got {sync_every!r}")
    k = _k(n, density)
    specs = algorithm_schedule(name, n, k, P, **schedule_kw)
    comm = comm_time(specs, P, net) / H
    sel = selection_time(name, n, kernels, ranks_per_gpu, k, P) / H
    return {"algorithm": name, "P": P, "n": n, "k": k, "comm_ms": 1e3 * comm,
            "select_ms": 1e3 * sel, "step_ms": 1e3 * (comm + sel),
            "bytes_per_rank": sum(s.bytes_per_rank for s in specs) / H,
            "messages": sum(s.rounds for s in specs), "calls": len(specs),
            "sync_every": H, "overlap": bool(overlap and H > 1),
            "collectives": [dataclasses.asdict(s) | {"algorithm_priced": spec_time(s, P, net)[1]}
                            for s in specs]}


def project(n: int, density: float, world_sizes: Sequence[int], net: Network,
            kernels: KernelCosts, algorithms: Sequence[str] = ALGORITHMS,
            sync_every: int = 1, overlap: bool = False,
            **schedule_kw) -> List[Dict[str, Any]]:
    return [step_time(a, n, density, P, net, kernels, sync_every=sync_every, overlap=overlap,
                      **schedule_kw)
            for P in world_sizes for a in algorithms]


def fastest_ranges(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Consecutive world sizes with the same fastest algorithm: [{P_from, P_to, algorithm,
    speedup_vs_dense: (min, max) or None}]."""
    out: List[Dict[str, Any]] = []
    for P in sorted({r["P"] for r in rows}):
        here = [r for r in rows if r["P"] == P]
        best = min(here, key=lambda r: r["step_ms"])
        dense = next((r for r in here if r["algorithm"] == "dense"), None)
        sp = dense["step_ms"] / best["step_ms"] if dense else None
        if out and out[-1]["algorithm"] == best["algorithm"]:
            out[-1]["P_to"] = P
            if sp is not None:
                lo, hi = out[-1]["speedup_vs_dense"]
                out[-1]["speedup_vs_dense"] = (min(lo, sp), max(hi, sp))
        else:
            out.append({"P_from": P, "P_to": P, "algorithm": best["algorithm"],
                        "speedup_vs_dense": (sp, sp) if sp is not None else None})
    return out


def describe_ranges(ranges: List[Dict[str, Any]]) -> str:
    parts = []
    for r in ranges:
        span = f"P={r['P_from']}" if r["P_from"] == r["P_to"] else f"P={r['P_from']}-{r['P_to']}"
        sp = r["speedup_vs_dense"]
        extra = ""
        if sp and r["algorithm"] != "dense":
            extra = (f" ({sp[0]:.1f}x dense)" if abs(sp[0] - sp[1]) < 0.05
                     else f" ({sp[0]:.1f}-{sp[1]:.1f}x dense)")
        parts.append(f"{span}: {r['algorithm']}{extra}")
    return "; ".join(parts)




# -- validation -----------------------------------------------------------------------------------
def _result_name(r: Dict[str, Any]) -> str:
    return str(r.get("name", r.get("algorithm", ""))).lower()


def _ranks_per_gpu(d: Dict[str, Any], P: int, override: Optional[int]) -> int:
    if override:
        return int(override)
    for src in (d, d.get("config", {})):
        if src.get("ranks_per_gpu"):
            return int(src["ranks_per_gpu"])
    gpus = d.get("machine", {}).get("gpus")
    if gpus:
        return max(1, math.ceil(P / len(gpus)))
    return P          # the one-GPU benchmark: every rank on the one GPU


def _lstsq2(rows: List[Tuple[float, float, float]]) -> Tuple[float, float]:
    """Least squares of t = c·α + b·x (x = 1/β) with relative weights (1/t)."""
    s_cc = s_cb = s_bb = s_ct = s_bt = 0.0
    for c, b, t in rows:
        w = 1.0 / max(t, 1e-12) ** 2
        s_cc += w * c * c
        s_cb += w * c * b
        s_bb += w * b * b
        s_ct += w * c * t
        s_bt += w * b * t
    det = s_cc * s_bb - s_cb * s_cb
    if abs(det) < 1e-300 * max(1.0, s_cc * s_bb):
        raise ValueError("fit: the probes do not separate latency from bandwidth (need a small "
                         "and a large allreduce)")
    alpha = (s_ct * s_bb - s_bt * s_cb) / det
    x = (s_cc * s_bt - s_cb * s_ct) / det
    return alpha, x


def fit_network(d: Dict[str, Any], use_dense: bool = True, kernels: KernelCosts = DEFAULT_KERNELS,
                ranks_per_gpu: Optional[int] = None, stat: str = "ms_mean",
                only_P: Optional[int] = None) -> Dict[str, Any]:
    """α and β from the allreduce probes and (``use_dense``) the dense steps of a collectives
    JSON (only those at ``only_P`` when given), under the same model the projection uses (the
    ring/tree branch of each point is re-chosen with the current α, β until it no longer
    changes). Relative least squares: every point weighs the same, small or large."""
    from .algorithms.schedule import allreduce
    points = []          # (P, [specs], measured seconds, what, fixed seconds)
    for p in d.get("probes", []):
        if str(p.get("op", "")).lower() != "allreduce" or p.get(stat) is None:
            continue
        P = int(p["P"])
        if only_P is not None and P != only_P:
            continue
        points.append((P, [allreduce(int(p["bytes"]), P)], float(p[stat]) * 1e-3,
                       f"allreduce {int(p['bytes'])} B", 0.0))
    if use_dense:
        rstat = "step_ms_mean" if stat == "ms_mean" else "step_ms_min"
        for r in d.get("results", []):
            if _result_name(r) != "dense" or r.get(rstat) is None:
                continue
            P, n = int(r["P"]), int(r["n"])
            if only_P is not None and P != only_P:
                continue
            specs = algorithm_schedule("dense", n, int(r.get("k") or _k(n, 0.01)), P,
                                       check_finite=d.get("config", {}).get("check_finite", "skip"))
            fixed = selection_time("dense", n, kernels, _ranks_per_gpu(d, P, ranks_per_gpu), 1, P)
            points.append((P, specs, float(r[rstat]) * 1e-3, f"dense step n={n}", fixed))
    if len(points) < 2:
        raise ValueError("fit: need at least two allreduce probes / dense results")
    # start: α from the smallest message, β from the largest
    small = min(points, key=lambda p: sum(s.bytes_per_rank for s in p[1]))
    large = max(points, key=lambda p: sum(s.bytes_per_rank for s in p[1]))
    alpha = max(small[2] - small[4], 1e-9) / max(1, 2 * _log2ceil(small[0]))
    beta = sum(s.bytes_per_rank for s in large[1]) / max(large[2] - large[4], 1e-12)
    net = Network(beta, alpha)
    for _ in range(50):
        rows = []
        for P, specs, t, _, fixed in points:
            c = b = 0.0
            for s in specs:
                ci, bi = _fit_coefficients(s, P, net)
                c += ci
                b += bi
            rows.append((c, b, t - fixed))
        a_new, x = _lstsq2(rows)
        if x <= 0 or a_new < 0:
            raise ValueError(f"fit: no positive solution (alpha={a_new:.3g} s, 1/beta={x:.3g})")
        new = Network(1.0 / x, a_new)
        if math.isclose(new.latency, net.latency, rel_tol=1e-12) and \
                math.isclose(new.bandwidth, net.bandwidth, rel_tol=1e-12):
            net = new
            break
        net = new
    resid = []
    for P, specs, t, what, fixed in points:
        pred = comm_time(specs, P, net) + fixed
        resid.append({"P": P, "what": what, "measured_ms": 1e3 * t, "fitted_ms": 1e3 * pred,
                      "error_pct": 100.0 * (pred - t) / t})
    return {"network": Network(net.bandwidth, net.latency, "fitted"), "points": resid}


def validate(d: Dict[str, Any], kernels: KernelCosts = DEFAULT_KERNELS,
             world_sizes: Sequence[int] = (4, 8), ranks_per_gpu: Optional[int] = None,
             use_dense: bool = True, stat: str = "mean", target_pct: float = 25.0,
             fit: str = "per-P") -> Dict[str, Any]:
    """Fit α, β (:func:`fit_network`), then predict every algorithm's measured step at the
    world sizes asked for. TopkDSA's data-dependent gather is sized from the measured bytes.

    ``fit="per-P"`` (default): one (α, β) per world size, from that world size's probes and dense
    step: on one box the P ranks share the host's loopback and CPU, so the bandwidth per rank
    falls with P (docs/research/gpu-measurements.md: 3.0 GB/s per rank at P=4, 1.9 at P=8 for the
    dense allreduce); a world size without two usable points falls back to the global fit.
    ``fit="global"``: one (α, β) for all, as on a cluster whose links do not depend on P."""
    if fit not in ("per-P", "global"):
        raise ValueError(f"validate: fit must be 'per-P' or 'global', got {fit!r}")
    glob_fit = fit_network(d, use_dense, kernels, ranks_per_gpu, "ms_" + stat)
    fits: Dict[Optional[int], Dict[str, Any]] = {None: glob_fit}
    if fit == "per-P":
        for P in world_sizes:
            try:
                fits[P] = fit_network(d, use_dense, kernels, ranks_per_gpu, "ms_" + stat, P)
            except ValueError:
                fits[P] = glob_fit
    cf = d.get("config", {}).get("check_finite", "skip")
    rows = []
    for r in d.get("results", []):
        name, P = _result_name(r), int(r["P"])
        if P not in world_sizes or name not in PASSES or r.get("step_ms_" + stat) is None:
            continue
        net = fits.get(P, glob_fit)["network"]
        n = int(r["n"])
        k = int(r.get("k") or _k(n, float(d.get("config", {}).get("density", 0.01))))
        measured_bytes = r.get("mb_sent_per_rank")
        kw: Dict[str, Any] = {"check_finite": cf}
        if name == "topkdsa" and measured_bytes is not None:
            kw["topkdsa_bytes"] = float(measured_bytes) * 1e6
        specs = algorithm_schedule(name, n, k, P, **kw)
        rpg = _ranks_per_gpu(d, P, ranks_per_gpu)
        comm = comm_time(specs, P, net)
        sel = selection_time(name, n, kernels, rpg, k, P)
        meas = float(r["step_ms_" + stat])
        pred = 1e3 * (comm + sel)
        rows.append({"algorithm": name, "P": P, "n": n, "k": k, "ranks_per_gpu": rpg,
                     "alpha_s": net.latency, "beta_Bps": net.bandwidth,
                     "measured_ms": meas, "predicted_ms": pred, "comm_ms": 1e3 * comm,
                     "select_ms": 1e3 * sel, "error_pct": 100.0 * (pred - meas) / meas,
                     "schedule_mb": sum(s.bytes_per_rank for s in specs) / 1e6,
                     "measured_mb": measured_bytes})
    within = [abs(x["error_pct"]) <= target_pct for x in rows]

    def net_json(f, P):
        net = f["network"]
        return {"P": P, "bandwidth_Bps": net.bandwidth, "latency_s": net.latency,
                "describe": net.describe(), "points": f["points"],
                "fallback_to_global": P is not None and f is glob_fit}
    return {"synthetic": bool(d.get("synthetic")), "synthetic_from": d.get("synthetic_from"),
            "note": d.get("note"), "fit": fit,
            "networks": [net_json(f, P) for P, f in fits.items()],
            "rows": rows, "target_pct": target_pct,
            "all_within_target": bool(rows) and all(within),
            "kernels": {"source": kernels.source, "device": kernels.device}}


def synthetic_collectives(net: Network, kernels: KernelCosts = DEFAULT_KERNELS,
                          world_sizes: Sequence[int] = (4, 8),
                          n_of: Optional[Dict[int, int]] = None,
                          density: float = 0.01, noise: float = 0.0, seed: int = 0,
                          topkdsa_fill: Optional[float] = None) -> Dict[str, Any]:
    """A collectives JSON in the schema of ``oktopk-bench collectives --backend nccl`` (probes and
    results), generated from the model with a known α, β (``net``) and P ranks on one GPU, with
    optional multiplicative noise (uniform in ±noise). Marked ``"synthetic": true``."""
    import random
    from .algorithms.schedule import allreduce
    rnd = random.Random(seed)
    n_of = n_of or {4: 1 << 26, 8: 1 << 25}

    def jitter(x):
        return x * (1.0 + rnd.uniform(-noise, noise)) if noise else x

    probes, results = [], []
    for P in world_sizes:
        n = n_of.get(P, 1 << 24)
        for b in (4, 4 * n):
            t = 1e3 * comm_time([allreduce(b, P)], P, net)
            probes.append({"P": P, "op": "allreduce", "bytes": b, "ms_mean": jitter(t),
                           "ms_min": t})
        for name in ALGORITHMS:
            r = step_time(name, n, density, P, net, kernels, ranks_per_gpu=P,
                          topkdsa_fill=topkdsa_fill)
            results.append({"name": name, "P": P, "n": n, "k": r["k"],
                            "step_ms_mean": jitter(r["step_ms"]), "step_ms_min": r["step_ms"],
                            "mb_sent_per_rank": r["bytes_per_rank"] / 1e6})
    return {"benchmark": "collectives", "synthetic": True,
            "synthetic_from": {"bandwidth_Bps": net.bandwidth, "latency_s": net.latency,
                               "noise": noise, "kernels": kernels.source},
            "note": "SYNTHETIC: generated by oktopk_triton.bench.project.synthetic_collectives "
                    "from a known network, not measured",
            "config": {"backend": "nccl", "density": density, "check_finite": "skip",
                       "ranks_per_gpu": None},
            "machine": {"gpus": ["synthetic GPU"]},
            "probes": probes, "results": results}


# -- time to a loss -------------------------------------------------------------------------------


def steps_ratio(dense_steps: List[float], dense_loss: List[float], run_steps: float,
                final_loss: float) -> Dict[str, Any]:
    """How many times dense's steps this run needed to reach its final loss.

    ``run_steps`` divided by the step at which dense's (mean) validation curve first reaches
    ``final_loss``, linearly interpolated between evaluations. 1.0 = no slower than dense. When
    dense never gets that low the ratio is clamped to run_steps / dense's last step (a lower bound
    on how much faster dense is: reported as ``clamped: "never"``); when dense's first evaluation
    is already at or below it, the crossing is clamped to that first step (``clamped: "first"``;
    a first evaluation at step 0, before any training, gives ``inf``: a run that ended no better
    than an untrained model, a diverged one).
    """
    if len(dense_steps) != len(dense_loss) or not dense_steps:
        raise ValueError(f"steps_ratio: expected equal, non-empty step and loss lists, got "
                         f"{len(dense_steps)} and {len(dense_loss)}")
    if dense_loss[0] <= final_loss:
        ratio = run_steps / dense_steps[0] if dense_steps[0] > 0 else float("inf")
        return {"ratio": ratio, "dense_step": dense_steps[0], "clamped": "first"}
    for i in range(1, len(dense_steps)):
        lo, hi = dense_loss[i - 1], dense_loss[i]
        if hi <= final_loss:   # first crossing: interpolate between evaluations i-1 and i
            t = (lo - final_loss) / (lo - hi)
            step = dense_steps[i - 1] + t * (dense_steps[i] - dense_steps[i - 1])
            return {"ratio": run_steps / step, "dense_step": step, "clamped": None}
    return {"ratio": run_steps / dense_steps[-1], "dense_step": dense_steps[-1],
            "clamped": "never"}


def mean_curve(runs: Iterable[dict]) -> Optional[tuple]:
    """(steps, mean validation loss) over runs evaluated at the same steps, or None."""
    curves = [r["val_curve"] for r in runs]
    if not curves:
        return None
    steps = [s for s, _ in curves[0]]
    if any([s for s, _ in c] != steps for c in curves):
        raise ValueError("the runs were evaluated at different steps; cannot average them")
    return steps, [sum(c[i][1] for c in curves) / len(curves) for i in range(len(steps))]


def ratios_from_train(report: Dict[str, Any],
                      density: Optional[float] = None) -> Dict[str, Dict[str, Any]]:
    """Per algorithm of a ``oktopk-bench train --model gpt`` report (its ``runs``): the steps
    ratio of its mean final validation loss against dense's mean curve, and its mean bytes per
    step. Needs dense among the runs. ``density``: only the runs at that density (and dense);
    without it, a report that holds an algorithm at two densities is refused."""
    runs = [r for r in report.get("runs", []) if "val_curve" in r]
    if density is not None:
        runs = [r for r in runs if r["algorithm"] == "dense"
                or math.isclose(float(r.get("density", -1)), density)]
    else:
        for alg in {r["algorithm"] for r in runs} - {"dense"}:
            ds = sorted({r.get("density") for r in runs if r["algorithm"] == alg})
            if len(ds) > 1:
                raise ValueError(f"{alg} ran at densities {ds}: expected one density, or the "
                                 f"projection's --density to choose")
    dense = mean_curve(r for r in runs if r["algorithm"] == "dense")
    if dense is None:
        raise ValueError("the train report has no dense run with a validation curve: its "
                         "steps ratios need dense's curve")
    out: Dict[str, Dict[str, Any]] = {}
    for alg in dict.fromkeys(r["algorithm"] for r in runs):
        rs = [r for r in runs if r["algorithm"] == alg]
        final = sum(r["final_val_loss"] for r in rs) / len(rs)
        res = steps_ratio(dense[0], dense[1], rs[0]["steps"], final)
        res.update(final_val_loss=final, seeds=[r["seed"] for r in rs],
                   bytes_per_step=sum(r["bytes_per_step"] for r in rs) / len(rs))
        out[alg] = res
    return out


def time_to_loss(rows: List[Dict[str, Any]], ratios: Dict[str, float],
                 compute_ms: float = 0.0) -> List[Dict[str, Any]]:
    """Per (P, algorithm) with a ratio: ``(step_ms + compute_ms) × ratio``, the projected time to
    reach the loss the algorithm ends at, in units of dense steps' time, and whether it is first
    at its P. A row with ``overlap`` (local steps whose sync runs behind the next steps'
    compute) costs ``max(step_ms, compute_ms)`` a step instead of the sum."""
    def total(r):
        return (max(r["step_ms"], compute_ms) if r.get("overlap")
                else r["step_ms"] + compute_ms)
    out = [{"P": r["P"], "algorithm": r["algorithm"], "ratio": ratios[r["algorithm"]],
            "step_ms": total(r), "time_ms": total(r) * ratios[r["algorithm"]]}
           for r in rows if r["algorithm"] in ratios]
    for P in {r["P"] for r in out}:
        here = [r for r in out if r["P"] == P]
        best = min(here, key=lambda r: r["time_ms"])
        for r in here:
            r["first"] = r is best
    return out


