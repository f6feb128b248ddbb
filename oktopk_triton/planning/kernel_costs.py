"""The selection kernels' share of a step: per-element costs of the passes over n
(:class:`KernelCosts`, the defaults or a ``gpu-kernels-*.json``), the passes each algorithm
makes (:data:`PASSES`) and its work on the selected entries (:func:`entry_work`), priced by
:func:`selection_time`."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Optional, Tuple


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
