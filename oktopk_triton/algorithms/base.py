"""The step contract every algorithm keeps (docs/algorithms.md §1), written once.

Error feedback, explained once: every rank keeps a ``residual``, the part of its past gradients
that has not reached ``out`` yet. A step forms ``acc = residual + grad``, the algorithm decides
what of ``acc`` each rank contributes, every rank receives the same dense ``out`` (the average
of the contributions), and ``residual`` afterwards holds exactly what of ``acc`` is not in
``out``. Hence the invariant the tests check on every step, for every algorithm and every P::

    sum_p acc_p == P * out + sum_p residual_p'        (up to float rounding)

Measured why: docs/research/design-notes.md, ``oktopk_triton/algorithms/base.py``.
"""
from __future__ import annotations

import abc
import math
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional, Union

import torch

from .. import kernels as K
from ..comm.base import Communicator, resolve_device
from ..checks import check_backend, check_density, check_options, refuse_unknown
from ._wire import check_wire_format
from .description import Description

__all__ = ["Algorithm", "FLOAT_DTYPES", "LossScale"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CHECK_FINITE = ("skip", "raise", "off")

if TYPE_CHECKING:
    from torch.amp import GradScaler

# what ``scale=`` accepts: a GradScaler (its device tensor is read), a one-element tensor, a
# positive number, or None (no loss scaling)
LossScale = Union["GradScaler", torch.Tensor, float, None]


class Algorithm(abc.ABC):
    """Base class: one sparse (or dense) allreduce with error feedback over a flat vector.

    Subclasses set ``description`` (:class:`~.description.Description`: its name, options with
    their defaults and rules, volume formula and cost entry; ``name``, ``OPTIONS`` and
    ``sparse`` are read from it) and implement :meth:`step`. A subclass without a description
    sets ``name`` and ``OPTIONS`` itself (its options then go unchecked). Extra state that
    must survive ``state_dict`` (thresholds, regions, capacities) is named in ``STATE``
    (attribute names; tensors are cloned, other values copied).
    """

    description: ClassVar[Optional[Description]] = None
    name: ClassVar[str] = "base"
    OPTIONS: ClassVar[Dict[str, Any]] = {}
    STATE: ClassVar[tuple] = ()
    sparse: ClassVar[bool] = True
    # attributes in the gradient's units (thresholds): rescaled with the residual when the loss
    # scale changes
    SCALED: ClassVar[tuple] = ()
    # True: step() receives the raw gradient and updates self.velocity itself (fused into its
    # selection pass), masking included; the dense warm-up steps still use the base's update
    fuses_velocity: ClassVar[bool] = False
    # True: a sparse step() receives ``out`` uninitialised (``torch.empty``) and writes every
    # element itself, NaN everywhere on a non-finite step (no memset, no NaN pass: one launch
    # where zeros + scatter + fill_if took three); the dense steps still get zeros
    fills_out: ClassVar[bool] = False
    # why ``wire_format="compact"`` cannot carry this algorithm's messages (None: it can; the
    # subclass then encodes its sparse messages with :mod:`._wire`)
    compact_refusal: ClassVar[Optional[str]] = "this algorithm does not implement it"
    # why the quantized wires (``"q2"``, ``"q4"``) cannot (None: it keeps each sent entry's
    # quantization error in a residual, from :func:`._wire.encode`'s ``return_wire``)
    quantized_refusal: ClassVar[Optional[str]] = "this algorithm does not implement it"

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        d = cls.__dict__.get("description")
        if d is not None:
            cls.name, cls.OPTIONS, cls.sparse = d.name, d.defaults(), d.sparse

    def __init__(self, numel: int, comm: Communicator, density: float = 0.01, *,
                 device: Optional[torch.device] = None, check_finite: str = "skip",
                 warmup_steps: int = 0, momentum: float = 0.0,
                 momentum_masking: Optional[bool] = None, wire_format: str = "fp32",
                 **options: Any) -> None:
        if not isinstance(numel, int) or numel < 1:
            raise ValueError(f"numel must be a positive int, got {numel!r}")
        check_density(density)
        if check_finite is True:
            check_finite = "skip"
        elif check_finite is False or check_finite is None:
            check_finite = "off"
        if check_finite not in _CHECK_FINITE:
            raise ValueError(f"check_finite must be one of {_CHECK_FINITE}, got {check_finite!r}")
        refuse_unknown(self.name, options, self.OPTIONS)
        # every setting's check: the common ones and the description's (as the settings objects)
        check_options(self.name, {**self.OPTIONS, **options, "warmup_steps": warmup_steps,
                                  "momentum": momentum, "wire_format": wire_format},
                      self.description)
        # compact: sparse entries as one word (bf16 value, 16-bit chunk-relative index)
        self.wire_format = wire_format
        # (q2 / q4 too: packed like compact, the values quantized; see _wire)
        self.compact = self.check_wire(wire_format)
        self.opts = {**self.OPTIONS, **options}
        self.numel = numel
        self.comm = comm
        self.P = comm.world_size
        self.rank = comm.rank
        self.device = resolve_device(device if device is not None else comm.device)
        self.density = float(density)
        self.k = max(1, min(numel, int(round(self.density * numel))))
        self.check_finite = check_finite
        self.warmup_steps = warmup_steps
        self.momentum = float(momentum)
        # None: mask after sparse steps (the class default; dense sends everything, so masking
        # would leave plain SGD there)
        self.momentum_masking = (type(self).sparse if momentum_masking is None
                                 else bool(momentum_masking))
        # momentum correction: the velocity is what gets accumulated and sparsified
        self.velocity = (torch.zeros(numel, dtype=torch.float32, device=self.device)
                         if self.momentum > 0 else None)
        self.step_count = 0
        # compact wire: the positions a step delivered whole but for the bf16 rounding kept in
        # the residual (bool [n], set by the step; the velocity mask reads it)
        self._wire_delivered: Optional[torch.Tensor] = None
        self.stats: Dict[str, Any] = {}
        self.residual = torch.zeros(numel, dtype=torch.float32, device=self.device)
        # the loss scale the residual (and velocity, thresholds) are in: None until a scale is
        # given; _scale_host is the last scale given as a Python number (no pass when equal)
        self.loss_scale: Optional[torch.Tensor] = None
        self._scale_host: Optional[float] = None
        self._check_numel_across_ranks()
        # the rounding error of a low-precision `out` goes to this rank's slice of the residual
        lo = numel * self.rank // self.P
        hi = numel * (self.rank + 1) // self.P
        self._own_slice = slice(lo, hi)

    # -- construction-time agreement ---------------------------------------------------------
    def _check_numel_across_ranks(self) -> None:
        if self.P == 1:
            return
        mine = torch.tensor([self.numel], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.P, dtype=torch.int64, device=self.device)
        self.comm.allgather(everyone, mine)
        sizes = everyone.tolist()  # construction time: a host read is fine here
        if len(set(sizes)) != 1:
            raise ValueError(f"{self.name}: gradient sizes differ across ranks: numel per rank = "
                             f"{sizes} (this is rank {self.rank} with {self.numel}); every rank "
                             "must reduce the same number of elements")

    # -- the step ------------------------------------------------------------------------------
    def check_input(self, grad: torch.Tensor) -> None:
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"{self.name}: expected a torch.Tensor gradient, "
                            f"got {type(grad).__name__}")
        if grad.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{self.name}: gradient dtype must be one of float32, bfloat16, "
                            f"float16; got {grad.dtype}")
        if grad.numel() != self.numel:
            raise ValueError(f"{self.name}: gradient has {grad.numel()} elements, expected "
                             f"{self.numel} (the size this reducer was built for)")
        if grad.device != self.device:
            raise ValueError(f"{self.name}: gradient is on {grad.device}, expected {self.device}")

    def __call__(self, grad: torch.Tensor, scale: LossScale = None) -> torch.Tensor:
        """Reduce ``grad`` (any shape with ``numel`` elements); returns ``out`` of the same shape,
        dtype and device, bitwise identical on every rank.

        ``scale``: the loss scale ``grad`` carries (a ``torch.amp.GradScaler``, its scale as a
        device tensor, or a number), or ``None`` (no loss scaling). The residual holds gradients
        owed in the units of the scale they were computed at; when the scale changes (GradScaler
        halves it after a skipped step and doubles it every ``growth_interval`` steps) everything
        owed is rescaled by new/old before it is accumulated, so what is delivered, unscaled, is
        what a run at a constant scale delivers (powers of two: exactly). Cost: a number equal to
        the last one costs nothing; a tensor (GradScaler's, read on the device, no host sync)
        costs one multiply over the residual (and velocity) per step."""
        self.check_input(grad)
        if scale is not None:
            self._follow_scale(scale)
        shape, dtype = grad.shape, grad.dtype
        flat = grad.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        bytes_before = self.comm.bytes_sent
        kernels_before = K.counters()
        colls_before = getattr(self.comm, "collectives_issued", None)

        nonfinite = None
        if self.check_finite != "off":
            nonfinite = K.nonfinite_flag(flat)         # one read of grad, no temporary
            if self.P > 1:
                self.comm.allreduce(nonfinite)
            nonfinite = nonfinite.reshape(())
            if self.check_finite == "raise" and int(nonfinite.item()) > 0:
                raise FloatingPointError(
                    f"{self.name}: non-finite gradient (NaN or Inf) on {int(nonfinite.item())} of "
                    f"{self.P} rank(s) at step {self.step_count}; residuals are unchanged")

        warmup = self.step_count < self.warmup_steps
        # density 1 (k = n): every entry is sent, and the dense allreduce is the cheapest way to
        # send them all (it is also exactly DDP's average)
        dense_now = warmup or self.k >= self.numel
        # an algorithm that fuses the velocity into its selection pass (fuses_velocity) gets the
        # raw gradient; dense steps always take the velocity here
        velocity_here = self.velocity is not None and (dense_now or not self.fuses_velocity)
        if velocity_here:
            # u = m·u + grad (two roundings; kept as it was on a non-finite step, like the residual)
            new_v = self.velocity * self.momentum + flat.float()
            if nonfinite is not None:
                new_v = torch.where(nonfinite > 0, self.velocity, new_v)
            self.velocity.copy_(new_v)
            flat = torch.where(nonfinite > 0, flat.float(), new_v) if nonfinite is not None \
                else new_v
        fills = self.fills_out and not dense_now
        out = (torch.empty(self.numel, dtype=torch.float32, device=self.device) if fills
               else K.dense_zeros(self.numel, self.device))
        if dense_now:
            self.dense_step(flat, out, nonfinite)      # momentum SGD: no masking
        else:
            self.step(flat, out, nonfinite)
            if velocity_here and self.momentum_masking:
                self._mask_velocity(nonfinite)
        self._wire_delivered = None
        self.step_count += 1

        if dtype != torch.float32:
            out_lp = out.to(dtype)
            s = self._own_slice
            err = (out[s] - out_lp[s].float()) * self.P
            if nonfinite is not None:
                err = torch.where(nonfinite > 0, torch.zeros_like(err), err)
            self.residual[s] += err
            out = out_lp
        if nonfinite is not None and not fills:
            K.fill_if(out, nonfinite, float("nan"))   # NaN everywhere only on a non-finite step
        self.stats["bytes_sent"] = self.comm.bytes_sent - bytes_before
        self.stats["warmup"] = self.step_count <= self.warmup_steps
        self.stats["nonfinite"] = nonfinite
        after = K.counters()
        self.stats["kernel_launches"] = after["launches"] - kernels_before["launches"]
        self.stats["kernel_bytes"] = after["bytes"] - kernels_before["bytes"]
        if colls_before is not None:
            self.stats["collectives"] = self.comm.collectives_issued - colls_before
        return out.reshape(shape)

    @abc.abstractmethod
    def step(self, grad: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        """One step of the algorithm.

        Args:
            grad: flat, contiguous, ``numel`` elements, fp32/bf16/fp16, on ``self.device``.
                Read only.
            out: fp32 zeros of ``numel`` (uninitialised where the class sets ``fills_out``:
                then write every element, NaN everywhere when ``nonfinite > 0``); fill it with
                the average over ranks of the
                contributions. It must be bitwise identical on every rank.
            nonfinite: ``None`` when the check is off, else a 0-dim int32 device tensor, the
                number of ranks whose gradient holds a NaN/Inf (identical on every rank). When it
                is > 0, ``self.residual`` must be left bit for bit as it was (decide on the
                device with ``torch.where``; never read it on the host). Communication may still
                happen: sizes are static.

        Update ``self.residual`` in place (fp32) and set in ``self.stats`` at least
        ``local_selected`` (entries this rank contributed), ``global_selected`` (nonzeros the step
        put in ``out``) and ``overflow`` (entries that did not fit a fixed-capacity buffer and
        stayed in a residual). Stats may be 0-dim device tensors: reading them is the caller's
        choice (and a host sync on a GPU).
        """

    def dense_step(self, grad: torch.Tensor, out: torch.Tensor,
                   nonfinite: Optional[torch.Tensor]) -> None:
        """A warm-up step: ``out`` = the average of every rank's whole ``acc`` (one dense
        allreduce) and the residual drops to zero, so the sparse steps that follow start from an
        empty residual. Same contract as :meth:`step`."""
        acc = self.accumulate(grad)
        buf = acc.clone()
        if self.P > 1:
            self.comm.allreduce(buf)
        out.copy_(buf.div_(self.P))
        self.commit_residual(torch.zeros_like(acc), nonfinite)
        self.stats.update(local_selected=self.numel, global_selected=self.numel, overflow=0)

    def _mask_velocity(self, nonfinite: Optional[torch.Tensor]) -> None:
        """Momentum factor masking: stop the velocity of the entries this step delivered.

        An entry whose residual is 0 after the step reached ``out`` whole (or never held
        anything), so its velocity restarts from 0; with the compact wire also the entries the
        step marked in ``_wire_delivered`` (their residual holds the bf16 rounding only).
        Decided on the device; a non-finite step keeps the velocity as it was."""
        delivered = self.residual == 0
        if self._wire_delivered is not None:   # residual = only the wire's rounding there
            delivered = delivered | self._wire_delivered
        if nonfinite is not None:
            delivered = delivered & (nonfinite == 0)
        self.velocity.masked_fill_(delivered, 0.0)

    def _follow_scale(self, scale: LossScale) -> None:
        """Put the residual, velocity and ``SCALED`` thresholds into the units of ``scale``."""
        if hasattr(scale, "_scale"):            # a GradScaler: its device tensor
            scale = scale._scale
            if scale is None:
                raise ValueError(f"{self.name}: the GradScaler has no scale yet; call "
                                 "scaler.scale(loss) before reducing")
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1:
                raise ValueError(f"{self.name}: scale must hold one number, got shape "
                                 f"{tuple(scale.shape)}")
            new = scale.reshape(()).to(device=self.device, dtype=torch.float32)
            host = None
        elif isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0 \
                and math.isfinite(scale):
            if self._scale_host == float(scale):
                return
            new = torch.tensor(float(scale), dtype=torch.float32, device=self.device)
            host = float(scale)
        else:
            raise ValueError(f"{self.name}: scale must be a GradScaler, a tensor or a positive "
                             f"finite number, got {scale!r}")
        if self.loss_scale is None:             # what is owed so far is in this scale
            self.loss_scale = new.clone()
        else:
            ratio = new / self.loss_scale
            self.residual.mul_(ratio)
            if self.velocity is not None:
                self.velocity.mul_(ratio)
            for key in self.SCALED:
                getattr(self, key).mul_(ratio)
            self.loss_scale.copy_(new)
        self._scale_host = host

    def persistent_bytes(self) -> int:
        """Bytes of the tensors this reducer keeps between steps (residual, velocity, buffers,
        thresholds; each storage once). Every algorithm keeps its residual (4n bytes) plus O(k)."""
        seen: set = set()

        def walk(obj: Any) -> int:
            if isinstance(obj, torch.Tensor):
                st = obj.untyped_storage()
                if st.data_ptr() in seen:
                    return 0
                seen.add(st.data_ptr())
                return st.nbytes()
            if isinstance(obj, (list, tuple)):
                return sum(walk(x) for x in obj)
            if isinstance(obj, dict):
                return sum(walk(x) for x in obj.values())
            return 0
        return walk([v for key, v in vars(self).items() if key not in ("comm", "stats")])

    # -- helpers for subclasses ----------------------------------------------------------------
    def mark_delivered(self, where: torch.Tensor, valid: Optional[torch.Tensor] = None) -> None:
        """Compact wire: the step delivered these entries whole but for the bf16 rounding it
        kept in the residual, so momentum factor masking stops their velocity too. ``where``:
        a bool mask [n], or positions (any int shape; ``valid`` marks the real ones). Costs
        nothing unless the wire is compact and the velocity is masked."""
        if not (self.compact and self.velocity is not None and self.momentum_masking):
            return
        n = self.numel
        if where.dtype == torch.bool:
            mask = where.reshape(-1)
        else:
            pos = where.reshape(-1).to(torch.int64)
            if valid is not None:
                pos = torch.where(valid.reshape(-1), pos, torch.full_like(pos, n))
            mask = torch.zeros(n + 1, dtype=torch.bool, device=self.device)
            mask[pos] = True             # duplicates write the same value
            mask = mask[:n]
        self._wire_delivered = mask if self._wire_delivered is None else \
            self._wire_delivered | mask

    @classmethod
    def check_wire(cls, wire_format: str) -> bool:
        """:func:`check_wire_format` with this class's refusals: True for a packed format, a
        one-line ValueError for one it cannot carry (the constructor, the schedule and the cost
        model's CLI ask here)."""
        return check_wire_format(cls.name, wire_format, cls.compact_refusal, cls.quantized_refusal)

    def kernel_backend(self) -> str:
        """The validated ``backend`` option of an algorithm that takes one (where its kernels
        run: ``auto`` | ``triton`` | ``torch``); a one-line error for anything else, or for
        ``triton`` without CUDA or the interpreter."""
        be = self.opts["backend"]
        check_backend(self.name, be)
        K.choose(be, self.device)
        return be

    def accumulate(self, grad: torch.Tensor) -> torch.Tensor:
        """``acc = residual + grad`` in fp32, as a new tensor (residual untouched)."""
        return self.residual + grad.float()

    def commit_residual(self, new_residual: torch.Tensor,
                        nonfinite: Optional[torch.Tensor]) -> None:
        """``residual = new_residual`` unless the step was non-finite (decided on the device)."""
        if nonfinite is None:
            self.residual.copy_(new_residual)
        else:
            self.residual.copy_(torch.where(nonfinite > 0, self.residual, new_residual))

    # -- state ----------------------------------------------------------------------------------
    def take_over(self, old: "Algorithm") -> None:
        """Continue where ``old`` (same numel, ranks and momentum; another density) stopped:
        its residual, velocity, step count and loss scale. Nothing owed is lost."""
        if old.P != self.P:
            raise ValueError(f"{self.name}: cannot take over from a reducer with numel "
                             f"{old.numel}, P {old.P}, momentum {old.momentum}")
        self.take_owed(old)

    def take_owed(self, old: "Algorithm", owed: bool = True) -> None:
        """Continue ``old``'s run (same numel and momentum, any world size) in this reducer:
        its step count and loss scale, and with ``owed`` what this rank owes (residual and
        velocity; Ok-Topk's sign EMA too), as they are. ``owed=False``: this rank owes nothing
        (a rank that joined a group). What depends on the world size (regions, capacities,
        thresholds) stays this reducer's own, a fresh reducer's. ``SparseAllreduce.reconfigure``
        and :meth:`take_over` use it."""
        if old.numel != self.numel or (old.velocity is None) != (self.velocity is None):
            raise ValueError(f"{self.name}: cannot take over from a reducer with numel "
                             f"{old.numel}, P {old.P}, momentum {old.momentum}")
        if owed:
            self.residual.copy_(old.residual)
            if self.velocity is not None:
                self.velocity.copy_(old.velocity)
        self.step_count = old.step_count
        self.loss_scale = None if old.loss_scale is None else old.loss_scale.clone()
        self._scale_host = old._scale_host

    def snapshot(self) -> Dict[str, Any]:
        """What a step changes, copied, for :meth:`restore` to put back: what is owed (the
        residual and velocity), the step count, the loss scale, the algorithm's own state
        (``STATE``: thresholds, regions; a sign EMA) and its last stats. A sync that does not
        commit (torchft's rollback) restores it, so the retry owes exactly what was owed."""
        return {"state": self.state_dict(), "stats": dict(self.stats)}

    def restore(self, snap: Dict[str, Any]) -> None:
        """Put back a :meth:`snapshot` of this reducer, in place (tensors keep their storage)."""
        self.load_state_dict(snap["state"])
        self.stats = dict(snap["stats"])

    def state_dict(self) -> Dict[str, Any]:
        sd: Dict[str, Any] = {"algorithm": self.name, "numel": self.numel, "world_size": self.P,
                              "rank": self.rank, "density": self.density,
                              "step": self.step_count, "residual": self.residual.clone()}
        if self.velocity is not None:
            sd["velocity"] = self.velocity.clone()
        if self.loss_scale is not None:
            sd["loss_scale"] = self.loss_scale.clone()
        for key in self.STATE:
            v = getattr(self, key)
            sd[key] = v.clone() if isinstance(v, torch.Tensor) else _copy(v)
        return sd

    # what a rank owes, in a state_dict: summed over old ranks and rescaled by reshard_state
    OWED: ClassVar[tuple] = ("residual", "velocity")

    @classmethod
    def reshard_state(cls, group: List[Dict[str, Any]], first: Dict[str, Any], rank: int,
                      world_size: int) -> Dict[str, Any]:
        """The state of rank ``rank`` of ``world_size`` from states saved at another world
        size P: ``group`` holds the old ranks p ≡ rank (mod world_size), in rank order (empty
        for a new rank above P), ``first`` old rank 0's. What is owed is summed over the group
        and rescaled, ``residual' = (world_size/P)·Σ_group residual_p`` (the velocity alike),
        so ``(1/P')·Σ_q residual'_q == (1/P)·Σ_p residual_p`` up to one fp32 sum's rounding;
        the step count and loss scale (the same on every rank) are ``first``'s; what depends on
        the world size (``STATE``: thresholds, regions) is left out, and :meth:`load_state_dict`
        keeps the loading reducer's own (a fresh reducer's: Ok-Topk calibrates afresh)."""
        P = int(first["world_size"])
        sd = {k: _copy(v) for k, v in first.items() if k not in cls.STATE and k not in cls.OWED}
        for key in cls.OWED:
            if first.get(key) is None:
                continue
            parts = [g[key].float() for g in group]
            total = torch.stack(parts).sum(0) if parts else torch.zeros_like(first[key])
            sd[key] = total.mul_(world_size / P)
        sd.update(world_size=int(world_size), rank=int(rank), resharded_from=P)
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        for key, mine in (("algorithm", self.name), ("numel", self.numel), ("world_size", self.P)):
            if sd.get(key) != mine:
                raise ValueError(f"{self.name}: state_dict has {key}={sd.get(key)!r}, this "
                                 f"reducer has {mine!r}")
        self.residual.copy_(sd["residual"].to(self.residual.device))
        if self.velocity is not None:
            if "velocity" not in sd:
                raise ValueError(f"{self.name}: this reducer has momentum={self.momentum} but the "
                                 "state_dict holds no velocity")
            self.velocity.copy_(sd["velocity"].to(self.velocity.device))
        self.step_count = int(sd["step"])
        ls = sd.get("loss_scale")
        self.loss_scale = None if ls is None else ls.clone().to(self.device)
        self._scale_host = None
        if sd.get("resharded_from") is not None:   # reshard_state: the world-size state is ours
            return
        for key in self.STATE:
            v = sd[key]
            cur = getattr(self, key, None)
            if isinstance(v, torch.Tensor):
                if isinstance(cur, torch.Tensor) and cur.shape == v.shape:
                    cur.copy_(v.to(cur.device))
                else:
                    setattr(self, key, v.clone().to(self.device))
            else:
                setattr(self, key, _copy(v))


def _copy(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_copy(x) for x in v)
    if isinstance(v, torch.Tensor):
        return v.clone()
    return v
