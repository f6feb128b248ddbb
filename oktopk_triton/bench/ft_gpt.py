"""The byte-level GPT as a torchft replica's task, and torchft's quantized allreduce on a CPU, for
``oktopk-bench diloco`` (:mod:`.ft_replica` with ``model="gpt"``).

* :func:`gpt_task`: the model of :data:`~oktopk_triton.bench.gpt.SIZES` (``size``), each replica
  drawing its own windows of the stdlib corpus (the train CLI's per-rank generator, replica for
  rank), the validation loss over ``eval_sequences`` fixed windows, and the train CLI's
  learning rate (warm-up over 20% of the steps, then cosine).
* :func:`cpu_quantized_allreduce`: torchft's ``allreduce_quantized`` runs Triton kernels on a
  CUDA stream. On a machine without one, ``DiLoCo(should_quantize=True)`` gets this stand-in
  (:func:`patch_quantized_allreduce`): the same arithmetic as torchft's kernels on a Hopper GPU
  (each row scaled by 448 / its largest magnitude and cast to fp8 e4m3; the rows summed in fp32
  after dequantizing; the sum quantized again the same way and dequantized), the sum carried by
  a gloo allreduce. :func:`quantized_allreduce_bytes` is what torchft's all-to-all and
  all-gather send: ``2(P-1)/P`` of one byte per entry and one fp32 scale per row.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Tuple

import torch

FP8_MAX = 448.0              # float8 e4m3 (torchft's type on compute capability 9.0 and above)
_CORPUS: Dict[str, Any] = {}


def corpus() -> Any:
    """The stdlib corpus, loaded once per process (a forked replica shares its parent's)."""
    if "c" not in _CORPUS:
        from .gpt import load_corpus
        _CORPUS["c"] = load_corpus()
    return _CORPUS["c"]


def gpt_task(cfg: Dict[str, Any]) -> Tuple[torch.nn.Module, Callable, Callable]:
    """(model, batch(step) -> (inputs, targets), eval() -> validation loss in nats/byte)."""
    from .gpt import GPT, SIZES, batch_at, val_starts
    gcfg = SIZES[cfg["size"]][0]
    torch.manual_seed(cfg["seed"])
    model = GPT(gcfg)
    data = corpus()
    L = gcfg.context + 1
    g = torch.Generator().manual_seed(1_000_003 * cfg["seed"] + 7919 * cfg["replica"] + 17)
    vstarts = val_starts(len(data.val), cfg["eval_sequences"], L)

    def batch(step: int):
        x = batch_at(data.train, torch.randint(0, len(data.train) - L, (cfg["batch"],),
                                               generator=g), L)
        return x[:, :-1], x[:, 1:]

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            total = sum(float(model.loss(batch_at(data.val, vstarts[i:i + 64], L))) *
                        len(vstarts[i:i + 64]) for i in range(0, len(vstarts), 64))
        model.train()
        return total / len(vstarts)
    return model, batch, evaluate


def lr_at(cfg: Dict[str, Any], index: int) -> float:
    """The inner learning rate at global inner step ``index`` of ``syncs x sync_every``:
    ``lr`` constant, or with ``schedule="cosine"`` a linear warm-up over 20% then cosine."""
    if cfg.get("schedule", "constant") != "cosine":
        return cfg["lr"]
    steps = cfg["syncs"] * cfg["sync_every"]
    warmup = int(round(0.2 * steps))
    i = min(index, steps - 1)
    if i < warmup:
        return cfg["lr"] * (i + 1) / warmup
    return cfg["lr"] * 0.5 * (1 + math.cos(math.pi * (i - warmup) / max(1, steps - warmup)))


def _fp8_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` quantized row by row as torchft's kernels do, then dequantized (fp32)."""
    rows = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1)
    amax = rows.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    q = (rows * scale).to(torch.float8_e4m3fn).to(torch.float32)
    return (q / scale).reshape(t.shape)


def cpu_quantized_allreduce(tensors: Iterable[torch.Tensor], op: Any, pg: Any,
                            _stream: Any = None) -> Any:
    """torchft's ``allreduce_quantized(tensors, SUM, pg)`` on the CPU: each rank's rows
    quantized, summed in fp32, the sum quantized again; returns the (completed) work."""
    from torch.distributed import AllreduceOptions, ReduceOp
    tensors = list(tensors)
    for t in tensors:
        t.copy_(_fp8_rows(t))
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    work = pg.allreduce(tensors, opts)
    work.wait()
    for t in tensors:
        t.copy_(_fp8_rows(t))
    return work


def patch_quantized_allreduce() -> None:
    """Where no accelerator is present, route torchft's Manager's quantized allreduce to
    :func:`cpu_quantized_allreduce` (this process only; a bench replica's)."""
    if torch.accelerator.is_available():
        return
    import torchft.manager as manager
    manager.IS_TRITON_AVAILABLE = True
    manager.allreduce_quantized = cpu_quantized_allreduce
    torch.accelerator.current_stream = lambda *a, **k: None      # what the Manager passes on


def quantized_allreduce_bytes(params: Iterable[torch.Tensor], P: int) -> int:
    """Bytes one replica sends in torchft's quantized allreduce of every parameter, one call per
    tensor (``DiLoCo``'s default): ``2(P-1)/P x (numel + 4 x rows)``."""
    if P <= 1:
        return 0
    per = sum(p.numel() + 4 * (p.shape[0] if p.dim() > 1 else 1) for p in params)
    return int(round(2 * (P - 1) / P * per))
