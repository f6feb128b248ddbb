"""The selection kernels' share of a step: per-element costs of the passes over n
(:class:`KernelCosts`, the defaults or a ``gpu-kernels-*.json``), the passes each algorithm
makes (:data:`PASSES`) and its work on the selected entries (:func:`entry_work`), priced by
:func:`selection_time`."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Iterator, Mapping, Optional, Tuple


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

class _Passes(Mapping):
    """Per algorithm, one steady step: (bytes per element of its memory-bound passes over n,
    fused select passes, torch.topk passes over n in fp32 units: a top-k of int64 keys counts 2,
    twice the radix digits), read from its description's ``passes`` (counted op by op from each
    algorithm's code, with check_finite="skip": every algorithm pays the non-finite check (read
    grad: 4) and the zeroed output (4); commit_residual under the check is a where (12) and a
    copy (8)). Every registered algorithm with a description is priced."""

    def __getitem__(self, name: str) -> Tuple[float, float, float]:
        from ..algorithms import find_description
        d = find_description(name)
        if d is None:
            raise KeyError(name)
        return d.passes

    def __iter__(self) -> Iterator[str]:
        from ..algorithms import descriptions
        return iter(descriptions())

    def __len__(self) -> int:
        return sum(1 for _ in self)


PASSES: Mapping[str, Tuple[float, float, float]] = _Passes()


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
    priced at ``topk_s`` each; bytes of memory-bound scatters, at the copy bandwidth), from its
    description's ``entry_work`` (each algorithm's file says what it counts)."""
    from ..algorithms import description_of
    return description_of(name).entry_work(k, P)


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
