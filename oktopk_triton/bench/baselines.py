"""What a user would pick instead of a sparse allreduce, in the same training loop: torch's own
DDP communication hooks, with the bytes counted the way this library's communicators count them.

* ``powersgd``: ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (rank-r
  factorisation with its own error feedback and warm start, dense allreduce for its first
  ``start_powerSGD_iter`` steps). Its rank is chosen so that a compressed step sends the bytes a
  1% (``--density``) Ok-Topk step sends (:func:`powersgd_rank_for`).
* ``bf16``: the gradient cast to bf16, divided by P, allreduced and cast back: what
  ``default_hooks.bf16_compress_hook`` does (that hook refuses to run outside NCCL, so this
  module carries the same few lines, :func:`bf16_compress_hook`).

Both reduce *gradients*: AdamW then steps on the averaged, decompressed gradient, as it does for
a user of these hooks. Bytes: every ``all_reduce`` the hook issues adds ``2(P-1)/P`` of the
tensor's bytes to ``bytes_sent`` (a ring allreduce's per-rank volume, as ``comm.base`` counts
``allreduce``), through a counting stand-in for ``torch.distributed`` inside the hook's module.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm.base import ring_allreduce_bytes

BASELINES = ("powersgd", "bf16")


class _CudaForCpuBuckets:
    """``torch.cuda`` as torch's PowerSGD hook sees it: ``synchronize(device)`` of a CPU device
    does nothing. The hook calls ``torch.cuda.synchronize(bucket.device)`` whenever CUDA is
    available, which raises for the CPU buckets of a gloo run on a machine with a GPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        if device is not None and torch.device(device).type == "cpu":
            return
        torch.cuda.synchronize(device)


class _TorchForPowerSGD:
    """``torch`` with ``cuda`` replaced by ``_CudaForCpuBuckets``, for the hook's module only."""
    cuda = _CudaForCpuBuckets()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def powersgd_module():
    """torch's ``powerSGD_hook`` module, made safe for CPU buckets where CUDA is available."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    if not isinstance(psgd.torch, _TorchForPowerSGD):
        psgd.torch = _TorchForPowerSGD()
    return psgd


class _CountingDist:
    """``torch.distributed`` with ``all_reduce`` counted into ``counter["bytes_sent"]``."""

    def __init__(self, counter: Dict[str, int]) -> None:
        self._counter = counter

    def all_reduce(self, tensor, *args, **kwargs):
        group = kwargs.get("group")
        P = dist.get_world_size(group) if group is not None else dist.get_world_size()
        self._counter["bytes_sent"] += ring_allreduce_bytes(tensor.numel() * tensor.element_size(),
                                                            P)
        return dist.all_reduce(tensor, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


def count_hook_bytes(counter: Dict[str, int]) -> None:
    """From now on, every ``all_reduce`` of torch's DDP hooks (``default_hooks``, PowerSGD's
    dense warm-up and its P and Q factors) adds its ring bytes to ``counter["bytes_sent"]``: the
    hooks' modules call torch.distributed through their module attribute ``dist``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    powersgd_module().dist = default_hooks.dist = _CountingDist(counter)


def powersgd_state(rank: int, start_iter: int, seed: int = 0):
    """torch's ``PowerSGDState`` as every run here uses it: rank ``rank``, error feedback and
    warm start on, dense allreduce for the first ``start_iter`` steps."""
    return powersgd_module().PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                           start_powerSGD_iter=start_iter,
                                           use_error_feedback=True, warm_start=True,
                                           random_seed=seed)


def _compressed(rows: int, cols: int, rank: int, min_rate: float) -> bool:
    """torch's PowerSGD rule: a matrix is factorised when
    (rows + cols)·rank·min_rate < rows·cols."""
    return (rows + cols) * rank * min_rate < rows * cols


def powersgd_bytes(shapes: Sequence[torch.Size], rank: int, P: int, min_rate: float = 2.0) -> int:
    """Bytes per rank of one compressed PowerSGD step over parameters of these shapes: the
    uncompressed tensors, then the P and Q factors, each allreduced in fp32."""
    words = 0
    for s in shapes:
        if len(s) > 1:
            rows = s[0]
            cols = math.prod(s[1:])
            if _compressed(rows, cols, rank, min_rate):
                words += (rows + cols) * rank
                continue
        words += math.prod(s)
    return ring_allreduce_bytes(4 * words, P)


def powersgd_rank_for(shapes: Sequence[torch.Size], target_bytes: float, P: int,
                      min_rate: float = 2.0) -> int:
    """The rank whose compressed step sends closest to ``target_bytes`` (at least 1)."""
    best, best_gap = 1, float("inf")
    for r in range(1, 257):
        gap = abs(powersgd_bytes(shapes, r, P, min_rate) - target_bytes)
        if gap < best_gap:
            best, best_gap = r, gap
    return best


def bf16_compress_hook(counting: "_CountingDist"):
    """A DDP hook: the bucket in bf16, divided by the group's size, allreduced (counted), and
    copied back into the fp32 bucket."""
    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buf = bucket.buffer()
        compressed = buf.to(torch.bfloat16).div_(group.size())
        fut = counting.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(f):
            buf.copy_(f.value()[0])
            return buf
        return fut.then(decompress)
    return hook


class _LossModule(nn.Module):
    """DDP hooks run on a module's forward; the GPT's loss is a method, so wrap it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.loss(x)


class HookBaseline:
    """A model in ``DistributedDataParallel`` with one of torch's compression hooks.

    ``loss(x)`` runs the forward through DDP; the hook averages the gradients during backward.
    ``stats["bytes_sent"]`` is the bytes of the last step; ``rank`` is PowerSGD's rank."""

    def __init__(self, model: nn.Module, kind: str, *, rank: int = 1, start_iter: int = 2,
                 device: torch.device = torch.device("cpu")) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP
        if kind not in BASELINES:
            raise ValueError(f"baseline must be one of {BASELINES}, got {kind!r}")
        self.kind, self.rank = kind, rank
        self._total = {"bytes_sent": 0}
        self._last = 0
        self.stats: Dict[str, int] = {"bytes_sent": 0}
        # one bucket: the chained allreduces PowerSGD issues for two buckets can interleave in a
        # different order on different gloo ranks (a collective size mismatch, seen at 4 ranks
        # on the 1m GPT); an explicit cap also applies to DDP's first bucket
        mb = 4.0 * sum(p.numel() for p in model.parameters()) / 2**20
        self.ddp = DDP(_LossModule(model), device_ids=None if device.type == "cpu" else [device],
                       bucket_cap_mb=max(25.0, 2.0 * mb))
        count_hook_bytes(self._total)
        if kind == "powersgd":
            self.ddp.register_comm_hook(powersgd_state(rank, max(2, int(start_iter))),
                                        powersgd_module().powerSGD_hook)
        else:
            self.ddp.register_comm_hook(None, bf16_compress_hook(_CountingDist(self._total)))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.ddp(x)

    def finish_step(self) -> None:
        """After backward: this step's bytes into ``stats``."""
        self.stats["bytes_sent"] = self._total["bytes_sent"] - self._last
        self._last = self._total["bytes_sent"]

    def averaged_gradient(self, params: List[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1).float() for p in params])
