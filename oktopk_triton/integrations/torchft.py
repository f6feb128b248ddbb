"""Sparse training that survives churn, on torchft: replicas die, rejoin and change P.

torchft (``pip install "oktopk-triton[torchft]"``) runs a lighthouse that forms a quorum of
replica groups at every sync and reconfigures one process group over them. Here the sparse
allreduce runs on that group (:class:`~oktopk_triton.comm.torchft.ManagerCommunicator`), in two
shapes:

* :class:`SparseDiLoCo`: torchft's ``DiLoCo`` (Streaming DiLoCo's fragments included) with the
  pseudo-gradient reduced sparsely, error feedback included. A DiLoCo user changes one line::

      with DiLoCo(manager, [model], inner_opt, outer_opt, sync_every=H) as diloco:
      with SparseDiLoCo(manager, [model], inner_opt, outer_opt, sync_every=H, preset="diloco"):

* :class:`SparseGradients`: every step's gradient reduced sparsely (``reduce()`` between
  ``backward()`` and ``optimizer.step()``).

Every sync: a quorum (a replica that joins or rejoins is healed from a peer: weights, optimizer
and this library's state; it owes nothing), the reducer reconfigured when the membership changed
(survivors keep what they owe), the sparse reduce, and ``manager.should_commit()``. A sync that
does not commit (a peer died inside it, a collective failed, too few replicas) **rolls back**:
what each replica owes, the reducer's state, the weights and the audit return to their state
before it, so the retry owes exactly what was owed and nothing is sent twice. See
``docs/fault-tolerance.md``.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional, Union

import torch

from ..algorithms import get_algorithm
from ..checkpoint import CheckpointError, fingerprint_differs, param_fingerprint
from ..config import AlgorithmConfig, as_config
from ..comm.base import CommError
from ..comm.torchft import ManagerCommunicator
from ..modes.flat_params import parse_params
from ..module import SparseAllreduce
from ..outer import serve_outer_optimizer
from .diloco_options import check_diloco_options, diloco_config

__all__ = ["SparseDiLoCo", "SparseGradients", "ReplicaSync", "STATE_KEY"]

# the key of this library's state among the Manager's state-dict functions (healing)
STATE_KEY = "oktopk"

log = logging.getLogger("oktopk_triton.integrations.torchft")


class ReplicaSync:
    """One replica's sparse reduce over a torchft Manager: quorum, reconfiguration, healing,
    commit or rollback. :class:`SparseDiLoCo` and :class:`SparseGradients` are built on it.

    Args:
        manager: a ``torchft.Manager`` with ``use_async_quorum=False``.
        params: the parameters whose ``.grad`` :meth:`reduce` reduces (a module or tensors).
        density, algorithm: the :class:`~oktopk_triton.SparseAllreduce` to run (a name or an
            algorithm object, e.g. ``OkTopk(wire_format="q2")``).
        audit: check conservation on every sync before it commits (an extra allreduce of
            ``2 numel`` fp64, not counted in the bytes; for tests and benchmarks).
        extra_state: called to save (``extra_state()``) this mode's replicated state for a
            healing peer; ``load_extra(sd)`` loads it; ``on_heal()`` is called when this
            replica is about to be healed, before anything of it is overwritten.
        fragments: ``params`` is a list of model fragments, one reducer each (Streaming
            DiLoCo): every quorum reconfigures them all; a sync reduces one
            (``fragment=``).

A replica that is healed is either a newcomer (it never committed a sync: it owes nothing) or a
member that fell behind (its vote differed from its peers' on a sync): that one keeps what it
owes, so nothing it computed is lost.

    ``history``: one dict per sync (``step``, ``P``, ``rank``, ``committed``, ``healed``,
    ``reconfigured``, ``bytes``, ``relative_error`` with ``audit``, ``error``, ``time``).
    """

    def __init__(self, manager: Any, params: Any, density: float,
                 algorithm: Union[str, AlgorithmConfig], audit: bool = False,
                 extra_state: Any = None, load_extra: Any = None, on_heal: Any = None,
                 fingerprint: Optional[Dict[str, Any]] = None, fragments: bool = False) -> None:
        self.comm = ManagerCommunicator(manager)
        self.manager = manager
        # built at P = 1 (no collective); the first quorum reconfigures them to the group
        self.sars = [SparseAllreduce(t, comm=self.comm, density=density, algorithm=algorithm)
                     for t in (list(params) if fragments else [params])]
        self.sar = self.sars[0]
        self.fragment_params: List[List[torch.Tensor]] = [
            [s[0] for s in sar.param_slices()] for sar in self.sars]
        self.params: List[torch.Tensor] = [p for ps in self.fragment_params for p in ps]
        self.audit = bool(audit)
        self.history: List[Dict[str, Any]] = []
        self._extra_state, self._load_extra, self._on_heal = extra_state, load_extra, on_heal
        self.committed = 0                          # syncs this replica committed
        self._pending: Optional[Dict[str, Any]] = None
        self._fingerprint = fingerprint or {**param_fingerprint(self.params),
                                            "algorithm": self.sar.algorithm_name,
                                            "numel": sum(s.numel for s in self.sars)}
        if len(self.sars) > 1:
            self._fingerprint["fragments"] = [s.numel for s in self.sars]
        try:
            manager.register_state_dict_fn(STATE_KEY, self._heal_load, self._heal_save)
        except AssertionError:      # torchft refuses a key registered twice
            raise ValueError("ReplicaSync: this Manager already has a sparse reducer (one per "
                             "Manager: its state is what a healing peer receives)") from None
        # ours first: a peer of another model is refused before the user's weights are loaded.
        # torchft loads in registration order and has no public way to register first.
        fns = manager._load_state_dict_fns
        manager._load_state_dict_fns = {STATE_KEY: fns.pop(STATE_KEY), **fns}

    # -- healing ------------------------------------------------------------------------------
    def _heal_save(self) -> Dict[str, Any]:
        """What a peer that joins receives: the fingerprint, the step count, the mode's state
        (replicated on every replica). Never a residual: a new member owes nothing."""
        steps = [s.algorithm.step_count for s in self.sars]
        return {"fingerprint": self._fingerprint, "step": steps if len(steps) > 1 else steps[0],
                "extra": None if self._extra_state is None else self._extra_state()}

    def _heal_load(self, sd: Dict[str, Any]) -> None:
        theirs, mine = sd.get("fingerprint"), self._fingerprint
        if theirs != mine:
            why = fingerprint_differs(theirs or {}, mine) or "the fingerprints differ"
            raise CheckpointError(f"torchft heal refused: the peer's model is another one "
                                  f"({why})")
        if self._on_heal is not None:
            self._on_heal()
        self._pending = sd

    # -- one sync -----------------------------------------------------------------------------
    def quorum(self) -> Dict[str, Any]:
        """Start the quorum (healing this replica if it is behind) and reconfigure the reducer
        when the group changed: another P or rank, or a member that joined (asked of the group
        with one allreduce of one word). Returns the sync's record (also appended to
        ``history``); a failure is recorded in it and makes :meth:`reduce` vote against."""
        rec: Dict[str, Any] = {"step": None, "P": None, "rank": None, "committed": False,
                               "healed": False, "newcomer": False, "reconfigured": False,
                               "bytes": 0, "relative_error": None, "error": None}
        self.history.append(rec)
        self.manager.start_quorum()
        healed, self._pending = self._pending, None
        if healed is not None:
            rec.update(healed=True, newcomer=self.committed == 0)
            if self._load_extra is not None:
                self._load_extra(healed["extra"])
            steps = healed["step"] if len(self.sars) > 1 else [healed["step"]]
            for sar, step in zip(self.sars, steps):
                sar.algorithm.step_count = int(step)
        try:
            changed = self.comm.refresh()
            rec.update(step=self.manager.current_step(), P=self.comm.world_size,
                       rank=self.comm.rank)
            joined = torch.tensor([float(healed is not None)], device=self.comm.device)
            self.comm.allreduce(joined)
            if changed or float(joined) > 0:
                for sar in self.sars:
                    sar.reconfigure(self.comm, joined=rec["newcomer"])
                rec["reconfigured"] = True
        except CommError as exc:
            rec["error"] = " ".join(str(exc).split())[:300]
        return rec

    def reduce(self, rec: Dict[str, Any], flat: Optional[torch.Tensor] = None,
               residual_decay: float = 1.0, fragment: int = 0) -> Optional[torch.Tensor]:
        """Reduce the parameters' ``.grad`` (the caller wrote them; or ``flat``, for a reducer
        built from a length), check conservation with
        ``audit``, and vote (``manager.should_commit()``). Returns the flat reduced tensor when
        the sync commits (every ``.grad`` is then its view). On a failure or a vote against,
        everything the sync touched is rolled back (the reducer's state, what this replica
        owes, the audit; ``.grad`` holds this replica's own input again) and ``None`` is
        returned. ``residual_decay`` < 1 scales what this replica owes before the reduce
        (SparseLoCo's decayed error feedback; undone by a rollback). :meth:`begin` and
        :meth:`finish` split it: the reduce in flight while the caller goes on."""
        return self.finish(self.begin(rec, flat, residual_decay, fragment))

    def begin(self, rec: Dict[str, Any], flat: Optional[torch.Tensor] = None,
              residual_decay: float = 1.0, fragment: int = 0,
              background: bool = False) -> Dict[str, Any]:
        """Start a sync's reduce (after :meth:`quorum`): on a thread of its own with
        ``background`` (the caller must not use the Manager's group until :meth:`finish`)."""
        sar = self.sars[fragment]
        alg = sar.algorithm
        work: Dict[str, Any] = {"rec": rec, "sar": sar, "alg": alg, "out": None, "raised": None,
                                "fragment": fragment}
        if rec["error"] is not None:          # the quorum's own step failed
            return work
        work["grads"] = [] if flat is not None else [
            None if p.grad is None else p.grad.detach().clone()
            for p in self.fragment_params[fragment]]
        work["snap"] = alg.snapshot()
        if residual_decay != 1.0:
            alg.residual.mul_(residual_decay)
        if background:
            work["thread"] = threading.Thread(target=self._reduce_into, args=(work, flat),
                                              name="oktopk-sync", daemon=True)
            work["thread"].start()
        else:
            self._reduce_into(work, flat)
        return work

    def _reduce_into(self, work: Dict[str, Any], flat: Optional[torch.Tensor]) -> None:
        rec, sar = work["rec"], work["sar"]
        sent = self.comm.bytes_sent
        try:
            ledger = sar.audit() if self.audit else None
            work["out"] = sar.reduce_gradients() if flat is None else sar(flat)
            rec["bytes"] = self.comm.bytes_sent - sent
            if ledger is not None:
                rec["relative_error"] = ledger.check()["relative_error"]
                self.comm.bytes_sent = sent + rec["bytes"]     # the audit's bytes are not sent
        except CommError as exc:      # what went on the wire before it failed still counts
            rec["error"] = " ".join(str(exc).split())[:300]
            rec["bytes"] = self.comm.bytes_sent - sent
            work["out"] = None
        except BaseException as exc:  # noqa: BLE001 - raised again by finish, on the caller
            work["raised"] = exc

    def finish(self, work: Dict[str, Any]) -> Optional[torch.Tensor]:
        """Wait for a :meth:`begin` (bounded by the Manager's timeouts), vote, and commit or
        roll back as :meth:`reduce` says."""
        thread = work.get("thread")
        if thread is not None:
            thread.join(timeout=max(60.0, 20 * self.comm.timeout.total_seconds()))
            if thread.is_alive():
                raise CommError("ReplicaSync: a sync's reduce did not finish within its "
                                "bound; the Manager's timeout should have ended it")
        if work["raised"] is not None:
            raise work["raised"]
        rec, out = work["rec"], work["out"]
        ok = self.manager.should_commit()
        rec["committed"] = bool(ok and out is not None)
        rec["time"] = time.time()                 # when the vote came back (wall clock)
        if rec["committed"]:
            self.committed += 1
            return out
        if "snap" in work:
            work["sar"].algorithm = work["alg"]
            work["alg"].restore(work["snap"])
            for p, g in zip(self.fragment_params[work["fragment"]], work["grads"]):
                p.grad = g
        return None


class _OnReplica:
    """What the two shapes share: their :class:`ReplicaSync` (``self.replica``)."""

    replica: ReplicaSync

    @property
    def history(self) -> List[Dict[str, Any]]:
        """One record per sync attempt (see :class:`ReplicaSync`)."""
        return self.replica.history

    @property
    def reducer(self) -> SparseAllreduce:
        """The :class:`~oktopk_triton.SparseAllreduce` (``.residual``, ``.stats``, ...)."""
        return self.replica.sar


class SparseDiLoCo(_OnReplica):
    """torchft's ``DiLoCo`` with a sparse pseudo-gradient reduce (error feedback included).

    Same arguments as ``torchft.local_sgd.DiLoCo`` (its model fragments too), plus the sparse
    allreduce's. Advice:

    1. ``preset`` (default ``"diloco"`` when none of ``preset``, ``density`` and ``algorithm``
       is given): a DiLoCo preset (:data:`oktopk_triton.presets.DILOCO_PRESETS`, or
       :func:`~oktopk_triton.presets.recommend_diloco` for a byte budget as a fraction of
       DiLoCo's dense sync): the algorithm, its density for this model and the residual decay.
    2. ``density`` and ``algorithm`` instead of a preset: the density of each sync (raise it
       with ``sync_every`` to keep the bytes per step) and a name or an object with its
       settings, e.g. ``OkTopk(wire_format="q2")`` (see :mod:`oktopk_triton.config`).
    3. ``residual_decay`` (default 1: none): what each replica owes is scaled by it before each
       sync (SparseLoCo's decayed error feedback); a preset sets it.
    4. ``outer_optimizer``: an SGD (plain, momentum or Nesterov). With a sparse algorithm its
       momentum is served capped at 0.5, in one log line (:mod:`oktopk_triton.outer`: DiLoCo's
       Nesterov 0.9 diverged over error feedback); another optimizer needs
       ``algorithm="dense"``.
    5. ``should_quantize=True``: the 2-bit wire (``wire_format="q2"``), the sparse counterpart
       of torchft's quantized allreduce.
    6. ``audit`` (see :class:`ReplicaSync`): for tests and benchmarks.
    7. Streaming DiLoCo: several ``model_fragments`` (one reducer each; one fragment syncs every
       ``sync_every / F`` steps), ``fragment_sync_delay`` (its reduce runs on a thread while
       that many inner steps go on) and ``fragment_update_alpha`` (torchft's merge of the
       local weights), as torchft's ``DiLoCo`` takes them.

    ``backup_device``, ``pin_memory``, ``use_bucketization`` and ``bucket_cap_mb`` are accepted
    for a drop-in and change nothing (one flat vector is one bucket; the anchor stays on the
    parameters' device).

    Every ``sync_every``-th ``inner_optimizer.step()`` (a hook, inside the ``with`` block) syncs:
    a quorum, ``pseudo-gradient = weights - anchor`` reduced sparsely, and on commit the outer
    optimizer steps from the anchor with ``-out`` as the gradient (``SGD(lr=1)`` gives plain
    averaging, bitwise as ``SparseAllreduce(..., sync_every=H).reduce_updates``). A sync that
    does not commit keeps the local weights and rolls back what is owed: the next sync sends
    this interval's change with the next one. A replica that joins restarts from the anchor its
    healer sent, with the outer optimizer's state, and owes nothing. ``sync()`` syncs now.
    """

    def __init__(self, manager: Any, model_fragments: List[torch.nn.Module],
                 inner_optimizer: torch.optim.Optimizer, outer_optimizer: torch.optim.Optimizer,
                 sync_every: int, backup_device: Any = None, pin_memory: bool = True,
                 use_bucketization: bool = False, bucket_cap_mb: Optional[int] = None,
                 should_quantize: bool = False, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0, *, density: Optional[float] = None,
                 algorithm: Union[str, AlgorithmConfig, None] = None, preset: Any = None,
                 residual_decay: Optional[float] = None, audit: bool = False) -> None:
        check_diloco_options(model_fragments, sync_every, fragment_sync_delay,
                             fragment_update_alpha)
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError("SparseDiLoCo: inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        numel = sum(parse_params(m, None)[0] for m in model_fragments)
        density, algorithm, self.residual_decay = diloco_config(
            numel, density, algorithm, preset, residual_decay, should_quantize)
        serve_outer_optimizer(outer_optimizer, get_algorithm(algorithm.algorithm).sparse,
                              "SparseDiLoCo")
        self.sync_every = sync_every
        self.inner_optimizer, self.outer_optimizer = inner_optimizer, outer_optimizer
        # Streaming DiLoCo: one reducer per fragment, one fragment synced every H/F steps
        self.streaming = len(model_fragments) > 1 or fragment_sync_delay > 0 or \
            fragment_update_alpha > 0
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = float(fragment_update_alpha)
        self.replica = ReplicaSync(
            manager, model_fragments if self.streaming else model_fragments[0], density,
            algorithm, audit, extra_state=self._state, load_extra=self._load,
            on_heal=self._keep_change, fragments=self.streaming)
        self.params = self.replica.params
        with torch.no_grad():
            self.anchor = [p.detach().clone() for p in self.params]
        sizes = [len(ps) for ps in self.replica.fragment_params]
        self._spans = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        self.local_step = 0
        self._hooks: List[Any] = []
        self._unsynced: Optional[List[torch.Tensor]] = None
        self._work: Optional[Dict[str, Any]] = None

    def __enter__(self) -> "SparseDiLoCo":
        self._hooks.append(self.inner_optimizer.register_step_post_hook(self._after_step))
        return self

    def __exit__(self, *exc: Any) -> bool:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._work is not None:        # a fragment's sync in flight: finish it
            self._perform()
        return False

    def _after_step(self, *_: Any) -> None:
        self.local_step += 1
        if not self.streaming:
            if self.local_step >= self.sync_every:
                self.sync()
            return
        interval = self.sync_every // len(self._spans)
        if self.local_step == interval - self.fragment_sync_delay:
            self._prepare()
        if self.local_step >= interval:
            self.local_step = 0
            self._perform()

    # -- the replicated state a healing peer receives -----------------------------------------
    def _state(self) -> Dict[str, Any]:
        return {"anchor": [a.clone() for a in self.anchor],
                "outer_optimizer": self.outer_optimizer.state_dict()}

    @torch.no_grad()
    def _keep_change(self) -> None:
        """Before a heal overwrites the weights: a member that fell behind keeps its change
        since the last anchor, to owe it (a newcomer's change from its own start is not)."""
        if self.replica.committed:
            self._unsynced = [torch.cat([(p.detach() - a).reshape(-1).float() for p, a in zip(
                self.params[lo:hi], self.anchor[lo:hi])]) for lo, hi in self._spans]

    def _load(self, sd: Dict[str, Any]) -> None:
        with torch.no_grad():
            for a, s in zip(self.anchor, sd["anchor"]):
                a.copy_(s)
        self.outer_optimizer.load_state_dict(sd["outer_optimizer"])

    @torch.no_grad()
    def _restart_healed(self) -> None:
        """A healed replica restarts every fragment from the common weights; a member that
        fell behind owes what it had not synced."""
        torch._foreach_copy_(self.params, self.anchor)
        if self._unsynced is not None:
            for sar, change in zip(self.replica.sars, self._unsynced):
                sar.residual.add_(change)
        self._unsynced = None

    @torch.no_grad()
    def sync(self) -> bool:
        """Sync now (with fragments: the next fragment): returns whether the sync committed
        (``history[-1]`` describes it)."""
        self.local_step = 0
        if self.streaming:
            if self._work is None:
                self._prepare()
            return self._perform()
        rec = self.replica.quorum()
        if rec["healed"]:                 # a joiner restarts from the common weights
            self._restart_healed()
        for p, a in zip(self.params, self.anchor):
            p.grad = p.detach() - a
        out = self.replica.reduce(rec, residual_decay=self.residual_decay)
        if out is None:                   # rolled back: the local weights go on
            self._drop_grads()
            return False
        if not bool(torch.isfinite(out).all()):      # dropped on every replica alike
            rec["nonfinite"] = True
            torch._foreach_copy_(self.params, self.anchor)
            self._drop_grads()
            return True
        torch._foreach_copy_(self.params, self.anchor)
        out.neg_()                        # torchft's sign: the outer gradient is anchor - local
        self.outer_optimizer.step()
        torch._foreach_copy_(self.anchor, self.params)
        self._drop_grads()
        return True

    def _drop_grads(self) -> None:
        for p in self.params:
            p.grad = None

    # -- Streaming DiLoCo: one fragment at a time, its reduce overlapping the inner steps ------
    @torch.no_grad()
    def _prepare(self) -> None:
        """The quorum, then the fragment's pseudo-gradient reduced on a thread of its own while
        the inner steps go on (``fragment_sync_delay`` of them); the fragment is the Manager's
        step modulo the fragments, as torchft chooses it (a failed sync retries it)."""
        rec = self.replica.quorum()
        if rec["healed"]:
            self._restart_healed()
        f = self.replica.manager.current_step() % len(self._spans)
        rec["fragment"] = f
        lo, hi = self._spans[f]
        flat = torch.cat([(p.detach() - a).reshape(-1).float()
                          for p, a in zip(self.params[lo:hi], self.anchor[lo:hi])])
        self._work = self.replica.begin(rec, flat, self.residual_decay, fragment=f,
                                        background=self.fragment_sync_delay > 0)

    @torch.no_grad()
    def _perform(self) -> bool:
        """Wait for the fragment's reduce and vote; on commit the outer step from the
        fragment's anchor, then ``fragment_update_alpha`` of the local weights mixed back in
        (torchft's merge). Rolled back, the local weights go on."""
        work, self._work = self._work, None
        if work is None:                  # nothing prepared (a sync() just ran)
            return False
        out = self.replica.finish(work)
        if out is None:
            return False
        lo, hi = self._spans[work["fragment"]]
        params, anchor = self.params[lo:hi], self.anchor[lo:hi]
        if not bool(torch.isfinite(out).all()):      # dropped on every replica alike
            work["rec"]["nonfinite"] = True
            torch._foreach_copy_(params, anchor)
            return True
        local = [p.detach().clone() for p in params] if self.fragment_update_alpha else None
        torch._foreach_copy_(params, anchor)
        for p, o in zip(params, out.split([p.numel() for p in params])):
            p.grad = o.neg().view_as(p).to(p.dtype)      # torchft's sign: anchor - local
        self.outer_optimizer.step()
        torch._foreach_copy_(anchor, params)
        self._drop_grads()
        if local is not None:
            torch._foreach_lerp_(params, local, self.fragment_update_alpha)
        return True


class SparseGradients(_OnReplica):
    """Each step's gradient reduced sparsely over a torchft Manager (error feedback included)::

        ft = SparseGradients(manager, model, density=0.01)
        loss.backward()
        if ft.reduce():           # quorum, sparse reduce, should_commit
            optimizer.step()
        optimizer.zero_grad()

    Arguments as :class:`ReplicaSync`. With FSDP2 inside each replica group (parameters that are
    ``DTensor`` shards), this rank's shards are reduced with the same shards of the other
    replica groups (torchft gives every group rank its own process group across the replicas):
    HSDP with a sparse, fault-tolerant cross-replica step. A step that does not commit rolls back
    what is owed (the gradient is dropped on every replica, as torchft drops a failed step). A
    replica that joins is healed by the Manager (the user's state: weights and optimizer) and
    sends nothing that step; this library's state carries the step count.
    """

    def __init__(self, manager: Any, params: Any, density: float = 0.01,
                 algorithm: Union[str, AlgorithmConfig] = "oktopk", *,
                 audit: bool = False) -> None:
        plist = list(params.parameters()) if isinstance(params, torch.nn.Module) \
            else list(params)
        self.shards = [p for p in plist if p.requires_grad] if any(
            _is_dtensor(p) for p in plist) else None
        target, fp = params, None
        if self.shards is not None:
            local = [p.to_local() for p in self.shards]
            target = sum(t.numel() for t in local)
            fp = {**param_fingerprint(local), "algorithm": as_config(algorithm).name,
                  "numel": target}
        self.replica = ReplicaSync(manager, target, density, algorithm, audit, fingerprint=fp)

    @torch.no_grad()
    def reduce(self) -> bool:
        """One step's quorum, sparse reduce and vote: True when the optimizer may step (every
        ``.grad`` then holds the reduced gradient)."""
        rec = self.replica.quorum()
        params = self.shards if self.shards is not None else self.replica.params
        if rec["healed"]:
            for p in params:
                p.grad = None
        if self.shards is None:
            return self.replica.reduce(rec) is not None
        for p in self.shards:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        local = [p.grad.to_local() for p in self.shards]
        out = self.replica.reduce(rec, torch.cat([g.reshape(-1).float() for g in local]))
        if out is None:
            return False
        torch._foreach_copy_(local, [o.view(g.shape) for o, g in zip(
            out.split([g.numel() for g in local]), local)])
        return True


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:     # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)
