"""The digits training loop (:func:`train_one`, ``--model cnn|mlp``) and what every training
loop of ``oktopk-bench train`` shares: the optimizer and the per-step stats record. The
language-model loop is :mod:`oktopk_triton.bench.lm_loop`."""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional

from ._common import fmt_bytes as _fmt_bytes
from .digits import evaluate, make_model
from .measure import replicas_identical


class RunLog:
    """What a run records per step: its time and the split of it (compute: forward and backward;
    reduce; the optimizer, timed apart wherever it runs, inside ``reduce_updates`` too: see
    :meth:`watch`), whether the call synced (local steps), the bytes the reducer sent and its
    numeric stats. Averages (:meth:`totals`) skip the first ``warmup_steps(sync_every)`` steps
    (one-time set-up: calibration, compilation, NCCL connecting on first use); the first sync's
    times are reported apart."""

    def __init__(self, device, sync_every: int = 1) -> None:
        import torch
        self.sync_every = int(sync_every)
        self.step_times: List[float] = []
        self.compute_times: List[float] = []
        self.reduce_times: List[float] = []
        self.optimizer_times: List[float] = []
        self.synced: List[bool] = []
        self.bytes_curve: List[int] = []
        self.stats_curve: Dict[str, List[float]] = {}
        self._opt_spans: List[tuple] = []      # (start, end) of each optimizer step, this step
        self._opt_t0 = 0.0
        self._hooks: List[Any] = []
        cuda = device.type == "cuda"
        self.sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    # -- the optimizer, timed where it runs --------------------------------------------------------
    def watch(self, optimizer) -> None:
        """Time every ``optimizer.step()`` (step hooks that wait for the device before and after
        it): a step run inside the reduction (``reduce_updates``, local steps) is taken out of
        the reduce time and counted as the optimizer's. Timing only: nothing it computes
        changes."""
        self._hooks += [optimizer.register_step_pre_hook(self._opt_start),
                        optimizer.register_step_post_hook(self._opt_end)]

    def _opt_start(self, *_: Any) -> None:
        self.sync()
        self._opt_t0 = time.perf_counter()

    def _opt_end(self, *_: Any) -> None:
        self.sync()
        self._opt_spans.append((self._opt_t0, time.perf_counter()))

    def close(self) -> None:
        """Remove the optimizer's timing hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- one step ----------------------------------------------------------------------------------
    def record(self, t0: float, t1: float, t2: float, t3: float, stats: Dict[str, Any]) -> None:
        """One step: started at ``t0``, reduce from ``t1`` to ``t2``, the optimizer (when the loop
        steps it) from ``t2`` to ``t3``, the end. An optimizer step watched between ``t1`` and
        ``t2`` moves from the reduce time to the optimizer's."""
        inside = sum(e - s for s, e in self._opt_spans if s >= t1 and e <= t2)
        self._opt_spans = []
        self.step_times.append(t3 - t0)
        self.compute_times.append(t1 - t0)
        self.reduce_times.append(t2 - t1 - inside)
        self.optimizer_times.append(t3 - t2 + inside)
        self.synced.append(bool(stats.get("synced", True)))
        self.bytes_curve.append(int(stats["bytes_sent"]))
        _record_stats(self.stats_curve, stats)

    # -- averages ----------------------------------------------------------------------------------
    def warmup(self) -> int:
        """Steps left out of the averages: ``warmup_steps(sync_every)`` when the run has more,
        else none."""
        w = warmup_steps(self.sync_every)
        return w if len(self.step_times) > w else 0

    def ms(self, times: List[float], which: Optional[bool] = None) -> Optional[float]:
        """Mean ms of ``times`` over the timed steps (past :meth:`warmup`); ``which``: only the
        sync calls (True) or only the local ones (False). None where no step qualifies."""
        w = self.warmup()
        sel = [t for i, t in enumerate(times)
               if i >= w and (which is None or self.synced[i] == which)]
        return 1000 * sum(sel) / len(sel) if sel else None

    def recent(self, n: int, width: int = 6) -> str:
        """Bytes and ms per step over the last ``n`` steps, for a progress line."""
        recent = self.step_times[-n:]
        return (f"bytes/step {_fmt_bytes(sum(self.bytes_curve[-n:]) / len(recent)):>9}  "
                f"{1000 * sum(recent) / len(recent):{width}.1f} ms/step")

    def _calls(self, which: bool) -> Dict[str, Any]:
        w = self.warmup()
        return {"count": sum(1 for s in self.synced[w:] if s == which),
                "step_ms": self.ms(self.step_times, which),
                "compute_ms": self.ms(self.compute_times, which),
                "reduce_ms": self.ms(self.reduce_times, which),
                "optimizer_ms": self.ms(self.optimizer_times, which)}

    def _first_sync(self) -> Optional[Dict[str, Any]]:
        """The first sync call's times and what they exceed the timed syncs' means by (its
        one-time cost: calibration, compilation, connections)."""
        i = next((i for i, s in enumerate(self.synced) if s), None)
        if i is None:
            return None
        step, red = 1000 * self.step_times[i], 1000 * self.reduce_times[i]
        later_step, later_red = self.ms(self.step_times, True), self.ms(self.reduce_times, True)
        return {"step": i, "step_ms": step, "reduce_ms": red,
                "step_extra_ms": None if later_step is None else step - later_step,
                "reduce_extra_ms": None if later_red is None else red - later_red}

    def totals(self) -> Dict[str, Any]:
        """The run record's bytes and time fields (docs/results-format.md)."""
        def curve(ts):
            return [round(1000 * t, 4) for t in ts]
        w = self.warmup()
        return {"bytes_per_step": sum(self.bytes_curve) / len(self.bytes_curve),
                "bytes_curve": self.bytes_curve,
                "time_per_step_ms": self.ms(self.step_times),
                "compute_ms": self.ms(self.compute_times),
                "reduce_ms": self.ms(self.reduce_times),
                "optimizer_ms": self.ms(self.optimizer_times),
                "timing": {"warmup_steps": w, "timed_steps": len(self.step_times) - w,
                           "sync_calls": self._calls(True), "local_calls": self._calls(False),
                           "first_sync": self._first_sync()},
                "step_ms_curve": curve(self.step_times),
                "compute_ms_curve": curve(self.compute_times),
                "reduce_ms_curve": curve(self.reduce_times),
                "optimizer_ms_curve": curve(self.optimizer_times),
                "synced_curve": [int(s) for s in self.synced]}


def warmup_steps(sync_every: int = 1) -> int:
    """Steps a run's time averages leave out: ``max(2, 2 * sync_every)`` (with local steps the
    first two intervals: the first sync calibrates, compiles and connects)."""
    return max(2, 2 * int(sync_every))


def sparse_setup(cfg, algorithm: str, model):
    """(optimizer, SparseAllreduce options, density) of a run. Momentum correction: the sparse
    reducers keep the velocity (with DGC's masking) and the optimizer runs without momentum;
    dense stays the plain momentum SGD baseline (at density 1 the masking would remove every
    entry's momentum)."""
    corrected = bool(cfg.get("momentum_correction")) and algorithm != "dense"
    opt = _make_optimizer(cfg, model.parameters(), corrected)
    # dense takes only the local-step options (dense pseudo-gradients: the family's floor)
    options = (dict(cfg.get("options") or {}) if algorithm != "dense"
               else local_step_options(cfg.get("options")))
    if corrected:
        options["momentum"] = cfg["momentum"]
    density = cfg["density"] if algorithm != "dense" else 1.0
    return opt, options, density


def local_step_options(options) -> Dict[str, Any]:
    """The ``--option`` entries that configure local steps (``SparseAllreduce(sync_every=...)``,
    oktopk_triton/modes/local_steps.py), ``{}`` when none is given."""
    from ..modes.local_steps import OPTIONS
    return {k: v for k, v in (options or {}).items() if k in OPTIONS}


def takes_local_steps(options) -> bool:
    """Whether ``options`` turn local steps on (any value other than the defaults)."""
    from ..modes.local_steps import LocalSteps
    return LocalSteps.build(**local_step_options(options)) is not None


def _digits_lr(cfg, steps_per_epoch: int):
    """The learning rate after ``i`` steps: linear warm-up, then cosine decay (or constant)."""
    total_steps = steps_per_epoch * cfg["epochs"]
    warmup = int(round(cfg.get("warmup_epochs", 0) * steps_per_epoch))

    def lr_at(i):  # i = steps done so far
        if cfg.get("schedule", "constant") == "constant":
            return cfg["lr"]
        if i < warmup:
            return cfg["lr"] * (i + 1) / warmup
        t = (i - warmup) / max(1, total_steps - warmup)
        return cfg["lr"] * 0.5 * (1 + math.cos(math.pi * t))
    return lr_at


def _digits_step(model, opt, sar, x, y, lr: float, run: RunLog):
    """One timed step: forward and backward, the sparse allreduce of the gradients, the
    optimizer at learning rate ``lr``. Returns the local loss."""
    import torch.nn.functional as F
    run.sync()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    run.sync()
    t1 = time.perf_counter()
    sar.reduce_gradients()   # averages .grad over ranks, error feedback inside
    run.sync()
    t2 = time.perf_counter()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    run.sync()
    t3 = time.perf_counter()
    run.record(t0, t1, t2, t3, sar.stats)
    return loss


def train_one(cfg, algorithm: str, seed: int, comm, device, data, log) -> Dict[str, Any]:
    """One run of the digits classifier (``--model cnn|mlp``): ``cfg["epochs"]`` epochs, each
    rank on its shard of a per-epoch permutation, test accuracy after every epoch (and every
    ``eval_every`` steps)."""
    import torch
    import torch.distributed as dist
    from ..module import SparseAllreduce, keywords

    Xtr, ytr, Xte, yte = data
    P, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)  # the same init on every rank
    model = make_model(cfg["model"], cfg["width"]).to(device)
    opt, options, density = sparse_setup(cfg, algorithm, model)
    sar = SparseAllreduce(model.parameters(), comm=comm, density=density,
                          **keywords(algorithm, options))
    ledger = sar.audit()       # conservation over the run, checked at the end
    numel = sum(p.numel() for p in model.parameters())
    init_identical = replicas_identical(model)

    per_rank, bs = len(ytr) // P, cfg["batch_size"]
    steps_per_epoch = max(1, math.ceil(per_rank / bs))
    g = torch.Generator().manual_seed(10007 * seed + 17)
    acc_curve = [(0, evaluate(model, Xte, yte))]
    run, epoch_losses = RunLog(device), []
    lr_at = _digits_lr(cfg, steps_per_epoch)
    step = 0
    eval_every = int(cfg.get("eval_every") or 0)
    for epoch in range(cfg["epochs"]):
        perm = torch.randperm(len(ytr), generator=g)     # same on every rank
        shard = perm[rank::P][:per_rank]                  # this rank's part of the epoch
        loss_sum = torch.zeros((), dtype=torch.float64)
        for b in range(steps_per_epoch):
            idx = shard[b * bs:(b + 1) * bs]
            x, y = Xtr[idx].to(device), ytr[idx].to(device)
            loss = _digits_step(model, opt, sar, x, y, lr_at(step), run)
            step += 1
            loss_sum += float(loss.detach())
            if eval_every and step % eval_every == 0 and b != steps_per_epoch - 1:
                acc_curve.append((step, evaluate(model, Xte, yte)))
        # mean training loss over ranks and batches of the epoch (one tiny allreduce)
        lt = (loss_sum / steps_per_epoch).to(torch.float32).reshape(1).to(device)
        dist.all_reduce(lt)
        epoch_losses.append(float(lt) / P)
        acc_curve.append((step, evaluate(model, Xte, yte)))
        if rank == 0 and log:
            print(f"  [{algorithm:>9} seed {seed}] epoch {epoch + 1:>2}/{cfg['epochs']}  "
                  f"step {step:>4}  loss {epoch_losses[-1]:.4f}  test acc "
                  f"{100 * acc_curve[-1][1]:6.2f}%  {run.recent(steps_per_epoch)}", flush=True)
    identical = replicas_identical(model) and init_identical
    return {
        "algorithm": algorithm, "seed": seed, "density": density,
        "world_size": P, "numel": numel, "k": max(1, int(round(density * numel))), "steps": step,
        "final_test_acc": acc_curve[-1][1], "acc_curve": acc_curve,
        "final_train_loss": epoch_losses[-1], "train_loss_per_epoch": epoch_losses,
        **run.totals(), "optimizer_fused": optimizer_fused(opt),
        "replicas_identical": bool(identical), "device": str(device),
        "stats_curve": run.stats_curve,
        "backend": type(comm).__name__, "conservation": ledger.check(),
    }


def _make_optimizer(cfg, params, corrected: bool):
    """The run's optimizer; AdamW fused (one kernel set for all tensors) on CUDA where torch
    offers it, as users run it (see :func:`optimizer_fused`)."""
    import torch
    params = list(params)
    if cfg.get("optimizer", "sgd") == "adamw":
        fused = ({"fused": True} if params and params[0].device.type == "cuda"
                 and _offers_fused(torch.optim.AdamW) else {})
        return torch.optim.AdamW(params, lr=cfg["lr"], betas=tuple(cfg.get("betas", (0.9, 0.95))),
                                 weight_decay=cfg["weight_decay"], **fused)
    return torch.optim.SGD(params, lr=cfg["lr"], momentum=0.0 if corrected else cfg["momentum"],
                           weight_decay=cfg["weight_decay"])


def _offers_fused(cls) -> bool:
    import inspect
    return "fused" in inspect.signature(cls).parameters


def optimizer_fused(opt) -> bool:
    """Whether the run's optimizer is torch's fused implementation (the record says so)."""
    return bool(opt.defaults.get("fused") or False)


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
