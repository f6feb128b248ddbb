"""The language-model training loop of ``oktopk-bench train --model gpt``
(:func:`train_one_lm`): how a run reduces (:class:`_LMReducer`: a SparseAllreduce mode or one of
torch's DDP compression hooks), the per-layer counts of what the reduction applied
(:class:`_LayerCounter`) and the validation loss."""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List

from .loops import RunLog, _make_optimizer, optimizer_fused, sparse_setup, takes_local_steps
from .measure import replicas_identical


def _lm_eval(model, val, starts, length: int, device, batch: int = 64) -> float:
    """Mean next-byte cross entropy (nats) over the validation windows ``starts``; each rank
    evaluates every P-th window and one allreduce sums (the replicas are identical, so this is
    the loss of the one model, P times faster)."""
    import torch
    import torch.distributed as dist
    from .gpt import batch_at
    P, rank = dist.get_world_size(), dist.get_rank()
    mine = starts[rank::P]
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad(), _autocast(device):
        for i in range(0, len(mine), batch):
            x = batch_at(val, mine[i:i + batch].to(val.device), length)
            tot[0] += model.loss(x).double() * x.shape[0]
            tot[1] += x.shape[0]
    model.train()
    dist.all_reduce(tot)
    return float(tot[0] / tot[1])


def _autocast(device):
    """bf16 autocast on CUDA (how a GPU trains a transformer); nothing on CPU."""
    import contextlib
    import torch
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class _LayerCounter:
    """Per parameter tensor: how many entries of the reduced gradient are nonzero each step (the
    entries an algorithm applied), how many steps applied none (starved), and the squared norms
    of the local and the reduced gradient. Kept on the device (no host read per step); one
    segmented sum and one fused norm per step, no gradient-sized int64 temporaries."""

    def __init__(self, model, steps: int, device) -> None:
        import torch
        self.names, self.sizes = [], []
        for name, p in model.named_parameters():   # the order SparseAllreduce flattens in
            if p.requires_grad:
                self.names.append(name)
                self.sizes.append(p.numel())
        self.lengths = torch.tensor(self.sizes, device=device)

        def z(dt):
            return torch.zeros(len(self.sizes), dtype=dt, device=device)

        self.applied = z(torch.int64)
        self.starved = z(torch.int64)
        self.sq_local = z(torch.float64)
        self.sq_reduced = z(torch.float64)
        self.per_step = torch.zeros(steps, dtype=torch.int64, device=device)

    def start(self, params) -> None:
        """Remember the initial weights: a run's movement per tensor is the end minus these."""
        self.init = [p.detach().clone() for p in params]

    def moved(self, params) -> List[float]:
        import torch
        d = torch._foreach_sub([p.detach() for p in params], self.init)
        return [float(x) ** 2 for x in torch._foreach_norm(d)]

    def local(self, params) -> None:
        import torch
        norms = torch._foreach_norm([p.grad for p in params])
        self.sq_local += torch.stack(norms).double() ** 2

    def reduced(self, step: int, flat) -> None:
        import torch
        # fp32 sums of 0/1 are exact below 2^24 entries per tensor (the 100m preset's largest
        # tensor has 2.4M)
        per = torch.segment_reduce((flat != 0).float(), "sum", lengths=self.lengths)
        per = per.round().to(torch.int64)
        self.applied += per
        self.starved += (per == 0).to(torch.int64)
        self.per_step[step] = per.sum()
        views = list(flat.float().split(self.sizes))
        self.sq_reduced += torch.stack(torch._foreach_norm(views)).double() ** 2

    def report(self, steps: int, params) -> Dict[str, Any]:
        applied = self.applied.cpu().tolist()
        starved = self.starved.cpu().tolist()
        sl, sr = self.sq_local.cpu().tolist(), self.sq_reduced.cpu().tolist()
        mv = self.moved(params)
        layers = {n: {"numel": s, "applied_per_step": a / max(1, steps), "starved_steps": st,
                      "grad_sq_local": lo, "grad_sq_reduced": r, "moved_sq": m}
                  for n, s, a, st, lo, r, m in zip(self.names, self.sizes, applied, starved, sl,
                                                  sr, mv)}
        return {"layers": layers, "applied_curve": self.per_step.cpu().tolist()}


def resolve_reduce(cfg: Dict[str, Any], algorithm: str) -> str:
    """What a run reduces: ``gradients`` or ``updates`` (``--reduce auto``: updates for a sparse
    algorithm under AdamW, whose per-coordinate normalisation undoes error feedback's summed
    gradients; gradients for dense, the plain data-parallel baseline, and for SGD; updates
    whenever local steps are asked for, ``--option sync_every=H``: only reduce_updates takes
    them)."""
    mode = cfg.get("reduce", "auto") or "auto"
    if mode != "auto":
        return mode
    if takes_local_steps(cfg.get("options")):
        return "updates"
    return ("updates" if algorithm != "dense" and cfg.get("optimizer") == "adamw"
            else "gradients")


class _LMReducer:
    """How one language-model run averages over ranks: a :class:`SparseAllreduce` mode
    (``gradients``, ``updates`` or ``adam``; dense is ``gradients`` at density 1), or one of
    torch's DDP compression hooks (``powersgd``, ``bf16``; bench/baselines.py), which average
    the gradients during backward. ``reduce()`` returns the flat vector applied this step."""

    def __init__(self, cfg, algorithm: str, model, params, comm, device) -> None:
        from ..module import SparseAllreduce, keywords
        from .baselines import BASELINES, HookBaseline, powersgd_rank_for
        self.params, self.model, self.hook = params, model, None
        self.numel = sum(p.numel() for p in params)
        if algorithm in BASELINES:
            # density: the one its bytes are matched to (its table in merged reports)
            self.mode, self.density, self.k = "gradients", cfg["density"], self.numel
            self.opt = _make_optimizer(cfg, model.parameters(), False)
            wire = (cfg.get("options") or {}).get("wire_format", "fp32")
            target = _oktopk_bytes(self.numel, cfg["density"], comm.world_size, wire)
            rank = powersgd_rank_for([p.shape for p in params], target, comm.world_size)
            start = cfg.get("powersgd_start") or max(2, round(0.02 * cfg["steps"]))
            self.hook = HookBaseline(model, algorithm, rank=rank, start_iter=start, device=device)
            self.powersgd = {"rank": rank, "start_iter": max(2, int(start)),
                             "target_bytes": target} if algorithm == "powersgd" else None
            return
        self.opt, options, self.density = sparse_setup(cfg, algorithm, model)
        mode = resolve_reduce(cfg, algorithm)
        if mode == "adam" and algorithm == "dense":
            mode = "gradients"   # the baseline stays plain data-parallel AdamW
        if mode == "adam":   # techniques.FrozenAdam: beta1 is the reducer's momentum correction
            options.update(adam="frozen", momentum=float(cfg.get("betas", (0.9, 0.95))[0]))
            options.setdefault("warmup_steps", max(1, int(round(0.2 * cfg["steps"]))))
        self.mode = mode
        self.sar = SparseAllreduce(params, comm=comm, density=self.density,
                                   **keywords(algorithm, options))
        self.numel, self.k = self.sar.numel, self.sar.k

    @property
    def stats(self):
        return self.hook.stats if self.hook else self.sar.stats

    @property
    def steps_optimizer(self) -> bool:
        """Whether the loop calls ``opt.step()`` after :meth:`reduce` (gradients reduced)."""
        return self.mode == "gradients"

    def loss(self, x):
        return self.hook.loss(x) if self.hook else self.model.loss(x)

    def reduce(self):
        if self.hook:
            self.hook.finish_step()
            return self.hook.averaged_gradient(self.params)
        if self.mode == "adam":
            return self.sar.reduce_adam(self.opt)
        if self.mode == "updates":
            # this rank's AdamW steps on its own gradient; the reducer averages the updates
            # (error feedback in update space) and sets the weights; RunLog.watch times the
            # optimizer's step apart from the reduction
            return self.sar.reduce_updates(self.opt)
        return self.sar.reduce_gradients()   # averages .grad over ranks, error feedback inside

    @property
    def synced(self) -> bool:
        """Whether this step's reduction applied anything (False on a local step)."""
        return self.hook is not None or bool(self.sar.stats.get("synced", True))

    @property
    def sync_every(self) -> int:
        """Calls per sync (local steps), 1 without them."""
        ls = None if self.hook else self.sar.local_steps
        return 1 if ls is None else ls.sync_every

    @property
    def optimizer_in_reduce(self) -> bool:
        """Whether the optimizer's update runs inside the reduction where no optimizer step can
        time it apart (``--reduce adam``: FrozenAdam replaces ``optimizer.step()``)."""
        return self.mode == "adam"

    def describe(self) -> Dict[str, Any]:
        if self.hook:
            return {"powersgd": self.powersgd} if self.powersgd else {}
        ls = self.sar.local_steps
        return {"local_steps": ls.describe()} if ls is not None else {}


def _oktopk_bytes(n: int, density: float, P: int, wire_format: str = "fp32") -> int:
    """Bytes per rank of a steady Ok-Topk step at this density (its static schedule) in the
    run's wire format (``--option wire_format=compact``: about half)."""
    from ..algorithms.schedule import schedule_of, total_bytes
    return total_bytes(schedule_of("oktopk", n, max(1, int(density * n)), P,
                                   wire_format=wire_format))


def lm_lr(cfg):
    """The learning rate at step ``i``: linear warm-up over ``warmup_fraction`` of the steps,
    then cosine decay (or constant)."""
    steps = cfg["steps"]
    warmup = int(round(cfg.get("warmup_fraction", 0.0) * steps))

    def lr_at(i):
        if cfg.get("schedule", "cosine") == "constant":
            return cfg["lr"]
        if i < warmup:
            return cfg["lr"] * (i + 1) / warmup
        return cfg["lr"] * 0.5 * (1 + math.cos(math.pi * (i - warmup) / max(1, steps - warmup)))
    return lr_at


def _lm_step(red: _LMReducer, counter: _LayerCounter, params, x, lr: float, step: int,
             run: RunLog, device):
    """One timed step: forward and backward, the reduction (and the optimizer when the loop
    steps it) at learning rate ``lr``, the per-layer counts. Returns the local loss."""
    opt = red.opt
    run.sync()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    with _autocast(device):
        loss = red.loss(x)
    loss.backward()
    counter.local(params)   # a baseline's hook has averaged them already
    for group in opt.param_groups:
        group["lr"] = lr
    run.sync()
    t1 = time.perf_counter()
    flat = red.reduce()          # an optimizer step inside (reduce_updates) is timed apart
    run.sync()
    t2 = time.perf_counter()
    if red.steps_optimizer:
        opt.step()
    run.sync()
    t3 = time.perf_counter()
    if red.synced:        # a local step applied nothing: count the syncs only
        counter.reduced(step, flat)
    run.record(t0, t1, t2, t3, red.stats)
    return loss


def train_one_lm(cfg, algorithm: str, seed: int, comm, device, data, log) -> Dict[str, Any]:
    """One run of the byte-level LM (``--model gpt``); the record mirrors
    :func:`oktopk_triton.bench.loops.train_one`'s with validation loss (nats/byte) and bits per
    byte in place of accuracy."""
    import torch
    import torch.distributed as dist
    from .gpt import GPT, GPTConfig, batch_at, val_starts

    train_bytes, val_bytes = data
    P, rank = dist.get_world_size(), dist.get_rank()
    gcfg = GPTConfig(**cfg["gpt"])
    L = gcfg.context + 1                      # a window: context inputs and their next bytes
    torch.manual_seed(seed)                    # the same init on every rank
    model = GPT(gcfg).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    red = _LMReducer(cfg, algorithm, model, params, comm, device)
    ledger = red.sar.audit() if red.hook is None else None   # conservation, checked at the end
    init_identical = replicas_identical(model)
    counter = _LayerCounter(model, cfg["steps"], device)
    assert sum(counter.sizes) == red.numel
    counter.start(params)

    steps, bs = cfg["steps"], cfg["batch_size"]
    lr_at = lm_lr(cfg)
    # this rank's windows: the same for every algorithm at a given seed, different per rank
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + 17)
    vstarts = val_starts(len(val_bytes), cfg["eval_sequences"], L)
    val_curve = [(0, _lm_eval(model, val_bytes, vstarts, L, device))]
    train_curve: List[tuple] = []
    run = RunLog(device, red.sync_every)
    run.watch(red.opt)
    loss_acc = torch.zeros((), dtype=torch.float64, device=device)
    since = 0
    eval_every = int(cfg["eval_every"])
    for step in range(steps):
        starts = torch.randint(0, len(train_bytes) - L, (bs,), generator=g)
        x = batch_at(train_bytes, starts.to(train_bytes.device), L)
        loss = _lm_step(red, counter, params, x, lr_at(step), step, run, device)
        loss_acc += loss.detach().double()
        since += 1
        done = step + 1
        if done % eval_every == 0 or done == steps:
            lt = (loss_acc / since).reshape(1)
            dist.all_reduce(lt)
            train_curve.append((done, float(lt) / P))
            loss_acc.zero_()
            since = 0
            val_curve.append((done, _lm_eval(model, val_bytes, vstarts, L, device)))
            if rank == 0 and log:
                print(f"  [{algorithm:>9} seed {seed}] step {done:>5}/{steps}  train "
                      f"{train_curve[-1][1]:.4f}  val {val_curve[-1][1]:.4f} nats/byte "
                      f"({val_curve[-1][1] / math.log(2):.3f} bits/byte)  "
                      f"{run.recent(eval_every, 7)}", flush=True)
    run.close()
    identical = replicas_identical(model) and init_identical
    rec = _lm_record(cfg, algorithm, seed, comm, device, red, run, counter.report(steps, params),
                     val_curve, train_curve, identical, P)
    rec["conservation"] = ledger.check() if ledger is not None else {
        "checked": False, "unchecked": "a DDP compression hook (no residual of the library's)"}
    return rec


def _lm_record(cfg, algorithm, seed, comm, device, red, run, layer_report, val_curve,
               train_curve, identical, P: int) -> Dict[str, Any]:
    """The record of one finished LM run (what rank 0 writes to the results file)."""
    final = val_curve[-1][1]
    return {
        "reduce": red.mode, **red.describe(),
        "algorithm": algorithm, "seed": seed, "density": red.density,
        "world_size": P, "numel": red.numel, "k": red.k, "steps": cfg["steps"],
        "final_val_loss": final, "final_val_bpb": final / math.log(2), "val_curve": val_curve,
        "final_train_loss": train_curve[-1][1], "train_curve": train_curve,
        **run.totals(), "optimizer_fused": optimizer_fused(red.opt),
        "optimizer_in_reduce": red.optimizer_in_reduce,
        "replicas_identical": bool(identical), "device": str(device),
        "stats_curve": run.stats_curve, "applied_curve": layer_report["applied_curve"],
        "layers": layer_report["layers"], "backend": type(comm).__name__,
    }
