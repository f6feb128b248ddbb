"""A DistributedDataParallel communication hook that averages gradients with a sparse allreduce.

    from torch.nn.parallel import DistributedDataParallel as DDP
    from oktopk_triton.ddp import SparseAllreduceState, sparse_allreduce_hook

    model = DDP(model)
    state = SparseAllreduceState(density=0.01, algorithm="oktopk")
    model.register_comm_hook(state, sparse_allreduce_hook)
    # ... the ordinary loop: loss.backward() now reduces every bucket sparsely

Every rank must process the buckets in the same order, which DDP guarantees (buckets are
launched in index order).

Measured why: docs/research/design-notes.md, ``oktopk_triton/ddp.py``.
"""
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .comm.base import Communicator

from .checks import check_density
from .comm.base import ring_allreduce_bytes
from .config import AlgorithmConfig, as_config
from .deprecation import old_keywords

__all__ = ["SparseAllreduceState", "sparse_allreduce_hook"]


class _Layout:
    """The hook's element order, fixed by parameters rather than by DDP's buckets.

    DDP lays out a fresh instance's buckets in one order for its first iteration and rebuilds
    them in gradient-ready order after it. A residual kept in bucket order would therefore, on a
    resume whose first iteration runs before the rebuild, be applied to other parameters than
    those it was computed for (same length, no error). Here every parameter gets a *canonical
    index*: its position in the first iteration this state sees (a fresh DDP's first layout,
    identical for an uninterrupted run and for a resumed one), and every reducer reads and writes
    its vector in canonical order. ``groups`` (bucket mode) are the parameter sets of the
    reducers, fixed by the first sparse iteration's buckets and saved with the state.
    """

    __slots__ = ("index", "shapes", "groups", "group_of", "group_index", "expected")

    def __init__(self) -> None:
        self.index: Dict[int, int] = {}            # id(parameter) -> canonical index
        self.shapes: List[Tuple[int, ...]] = []     # canonical index -> shape
        self.groups: Optional[List[Tuple[int, ...]]] = None
        self.group_of: Dict[int, int] = {}
        self.group_index: Dict[Tuple[int, ...], int] = {}
        self.expected: Optional[List[Tuple[int, ...]]] = None   # shapes of a loaded state

    def indices(self, params: List[torch.Tensor]) -> List[int]:
        """Canonical indices of a bucket's parameters, assigning new ones on first sight."""
        out = []
        for p in params:
            c = self.index.get(id(p))
            if c is None:
                c = len(self.shapes)
                self.index[id(p)] = c
                self.shapes.append(tuple(p.shape))
                if self.expected is not None and (c >= len(self.expected)
                                                  or self.expected[c] != self.shapes[c]):
                    raise ValueError(
                        "sparse_allreduce_hook: the loaded state was saved for other parameters "
                        f"(parameter {c} has shape {self.shapes[c]}, the saved state expects "
                        f"{self.expected[c] if c < len(self.expected) else 'no such parameter'}); "
                        "load a state saved from this model")
            out.append(c)
        return out

    def check_complete(self) -> None:
        if self.expected is not None and len(self.shapes) != len(self.expected):
            raise ValueError(f"sparse_allreduce_hook: the loaded state was saved for "
                             f"{len(self.expected)} parameters, this model has {len(self.shapes)}")

    def set_groups(self, groups: List[Tuple[int, ...]]) -> None:
        self.groups = [tuple(g) for g in groups]
        self.group_of = {c: gi for gi, g in enumerate(self.groups) for c in g}
        self.group_index = {g: gi for gi, g in enumerate(self.groups)}

    def known_shapes(self) -> List[Tuple[int, ...]]:
        """The canonical shapes: those seen, else those of a loaded state (not yet seen)."""
        return self.shapes if self.shapes or self.expected is None else self.expected

    def state_dict(self) -> Dict[str, Any]:
        return {"shapes": [list(s) for s in self.known_shapes()],
                "groups": None if self.groups is None else [list(g) for g in self.groups]}

    def load(self, sd: Dict[str, Any]) -> None:
        # a state saved before the hook saw any parameter constrains none
        self.expected = [tuple(s) for s in sd["shapes"]] or None
        if self.expected is None:
            return
        if self.shapes:      # already seen: check now
            for c, s in enumerate(self.shapes):
                if c >= len(self.expected) or self.expected[c] != s:
                    raise ValueError("SparseAllreduceState.load_state_dict: the state was saved "
                                     f"for other parameters (parameter {c}: shape {s} here, "
                                     f"{self.expected[c] if c < len(self.expected) else 'none'} "
                                     "saved)")
        if sd.get("groups") is not None:
            self.set_groups([tuple(g) for g in sd["groups"]])


class SparseAllreduceState:
    """The state of :func:`sparse_allreduce_hook` (pass it to ``model.register_comm_hook``).

    Args:
        process_group: the group DDP reduces over (``None``: the default group).
        density: fraction of each bucket's entries each step keeps, in (0, 1].
        algorithm: an algorithm object of :mod:`oktopk_triton.config` (``OkTopk(momentum=0.9)``,
            ``TopkA()``, ..., ``Dense()``) or a registered name (its defaults).
        start_iter: iterations reduced densely before the sparse reducers start (at least 1,
            because DDP rebuilds its buckets after the first iteration).
        mode: ``"flat"`` (default: one reducer over the whole iteration's gradient, run when the
            last bucket arrives) or ``"bucket"`` (one reducer per bucket).
        comm: a :class:`~oktopk_triton.comm.Communicator` over ``process_group``; ``None``
            builds one on first use (``TorchCommunicator(process_group)`` for a non-default
            group or gloo, else ``default_communicator(device)``, i.e. CuPy NCCL when
            available).
        scaler: a ``torch.amp.GradScaler`` whose scale the gradients carry (or ``None``); the
            residuals are kept in its current scale across its backoffs and growths, read from
            its device tensor (no host read). May also be set later (``state.scaler = ...``).
        check_finite: ``"skip"`` (default), ``"raise"`` or ``"off"`` (see ``SparseAllreduce``).

    An algorithm's settings passed as keywords (``momentum=0.9``) still work for one version,
    with a ``DeprecationWarning`` naming the new spelling (:mod:`oktopk_triton.deprecation`).

    Attributes:
        iter: completed iterations (counted on the last bucket).
        reducers: ``{group index: Algorithm}`` (``{-1: Algorithm}`` in flat mode), created
            lazily; a group is the parameters of one bucket of the first sparse iteration.
        layout: the canonical parameter order and groups (saved with the state).
        bytes_sent: bytes this rank sent in the last completed iteration (all buckets; the
            dense iterations are counted as a ring allreduce, 2(P-1)/P * bucket bytes).
        total_bytes_sent: bytes this rank sent since the state was created.
    """

    __slots__ = ("process_group", "density", "algorithm", "config", "start_iter", "options", "comm",
                 "iter", "reducers", "bytes_sent", "total_bytes_sent", "_iter_bytes",
                 "_pending_state", "mode", "_pending", "layout", "scaler", "_arrived",
                 "_reduced", "_new_groups", "_seen", "_used", "_watched", "_now",
                 "_relayout", "held_out", "_iter_held", "_model", "_carried")

    MODES = ("flat", "bucket")
    FLAT = -1   # the reducers key of the flat reducer

    @old_keywords("SparseAllreduceState", refuse_local_steps=(
        "SparseAllreduceState: the DDP hook cannot take local steps ({names}): it runs before "
        "the optimizer step; use SparseAllreduce.reduce_updates"))
    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, density: float = 0.01,
                 algorithm: Union[str, AlgorithmConfig] = "oktopk", start_iter: int = 1,
                 comm: Optional["Communicator"] = None, mode: str = "flat",
                 scaler: Optional["torch.amp.GradScaler"] = None, *,
                 check_finite: str = "skip") -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        self.config = as_config(algorithm)      # a clear error now for an unknown name
        if int(start_iter) < 1:
            raise ValueError("start_iter must be >= 1: DDP rebuilds its buckets after the first "
                             "iteration, so sparse reducers built then would be built for the "
                             "wrong buckets")
        self.process_group = process_group
        self.density = check_density(density)
        self.algorithm = self.config.algorithm       # the name (saved with the state)
        self.start_iter = int(start_iter)
        self.options: Dict[str, Any] = {"check_finite": check_finite, **self.config.options()}
        self.comm = comm
        self.iter = 0
        self.reducers: Dict[int, Any] = {}
        self.bytes_sent = 0
        self.total_bytes_sent = 0
        self._iter_bytes = 0
        self._pending_state: Dict[int, Dict[str, Any]] = {}
        self.mode = mode
        self._pending: List[Tuple[torch.Tensor, "torch.futures.Future[torch.Tensor]",
                                  Dict[int, torch.Tensor]]] = []
        self.layout = _Layout()
        self.scaler = scaler
        self._arrived: Dict[int, torch.Tensor] = {}    # bucket mode: this iteration's grads
        self._reduced: set = set()                      # bucket mode: groups reduced this iter
        self._new_groups = False
        self._seen = 0                                  # iterations this instance has seen
        # parameters used (gradient accumulated) since the last synchronised backward, by
        # canonical index; fed by one post-accumulate-grad hook per parameter (see _watch)
        self._used: Set[int] = set()
        self._watched: Dict[int, Any] = {}              # canonical index -> hook handle
        self._now: List[Tuple[int, ...]] = []           # bucket mode: this iteration's buckets
        self._relayout = False                          # bucket mode: DDP rebuilt its buckets
        self.held_out = 0                               # parameters held out, last iteration
        self._iter_held = 0
        self._model: Optional["weakref.ref"] = None     # the DDP model (see bind)
        # reconfigure: the reducers of the last group, taken over as the new group builds its own
        self._carried: Dict[int, Any] = {}

    # -- helpers -----------------------------------------------------------------------------
    def _world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def _get_comm(self, device: torch.device):
        if self.comm is None:
            from .comm import TorchCommunicator
            if self.process_group is not None or device.type != "cuda":
                self.comm = TorchCommunicator(self.process_group)
            else:
                from .comm import default_communicator
                self.comm = default_communicator(device)
        return self.comm

    def _scale(self) -> Any:
        """The loss scale of this iteration's gradients (a device tensor), or ``None``."""
        return None if self.scaler is None else getattr(self.scaler, "_scale", None)

    def _build(self, numel: int, device: torch.device):
        from .algorithms import get_algorithm
        comm = self._get_comm(device)
        return get_algorithm(self.algorithm)(numel, comm, self.density, device=device,
                                             **self.options)

    def reducer(self, index: int, buffer: torch.Tensor):
        """The reducer of group ``index`` (created on first use for ``buffer``'s size)."""
        red = self.reducers.get(index)
        if red is not None and red.numel != buffer.numel():
            warnings.warn(f"sparse_allreduce_hook: bucket {index} changed size from {red.numel} "
                          f"to {buffer.numel()} elements; its reducer (and residual) is rebuilt")
            red = None
        if red is None:
            red = self._build(buffer.numel(), buffer.device)
            if index in self._pending_state:
                red.load_state_dict(self._pending_state.pop(index))
            carried = self._carried.pop(index, None)
            if carried is not None and carried.numel == red.numel:
                red.take_owed(carried)
            self.reducers[index] = red
        return red

    def reconfigure(self, process_group: Optional[dist.ProcessGroup] = None, *,
                    comm: Optional["Communicator"] = None, joined: bool = False) -> None:
        """Switch to another group between iterations (a change of membership; every member
        calls it, then registers the state on a ``DistributedDataParallel`` over that group).
        The reducers are rebuilt for the new group when the hook next uses them, each taking
        over what its predecessor owed (``Algorithm.take_owed``: residual, velocity, step count,
        loss scale; the world-size state a fresh reducer's). ``joined=True``: this rank owes
        nothing (its reducers and any loaded state are dropped; the iteration count stays as
        it is). ``comm``: a communicator over the new group (``None``: built on first use)."""
        if joined not in (True, False):
            raise TypeError(f"SparseAllreduceState.reconfigure: joined must be True or False, "
                            f"got {joined!r}")
        if self._pending_state and not joined:
            raise ValueError("SparseAllreduceState.reconfigure: a loaded state is waiting for "
                             "its first backward; load it at the new world size instead (load "
                             "reshards)")
        self._carried = {} if joined else {**self._carried, **self.reducers}
        if joined:
            self._pending_state = {}
        self.reducers = {}
        self.process_group, self.comm = process_group, comm

    # -- which parameters a step used ----------------------------------------------------------
    def _watch(self, params: Sequence[torch.Tensor], canon: Sequence[int]) -> None:
        """Register one post-accumulate-grad hook per parameter not yet watched: it records
        that the parameter's gradient was accumulated (used) since the last synchronised
        backward. Host-side only; DDP's own hook on the same accumulator runs after it."""
        for p, c in zip(params, canon):
            if c in self._watched or not p.requires_grad:
                continue
            used = self._used
            self._watched[c] = p.register_post_accumulate_grad_hook(
                lambda _p, c=c: used.add(c))

    def bind(self, model: torch.nn.Module) -> None:
        """Remember the ``DistributedDataParallel`` model this state reduces (weakly), so that
        :meth:`residual` can place a loaded state's residuals before the first backward. The
        integrations and :meth:`load` with a DDP ``model`` call it; another module is ignored."""
        from torch.nn.parallel import DistributedDataParallel
        if isinstance(model, DistributedDataParallel):
            self._model = weakref.ref(model)

    def residual(self, param: torch.Tensor) -> torch.Tensor:
        """What this rank still owes ``param`` (fp32, ``param``'s shape): its slice of the
        residual of the reducer that holds it (a view once that reducer is built).

        Before any sparse step it is zeros, except after a load: then it is the loaded residual,
        placed by the bound DDP model's first bucket layout (:meth:`bind`; the integrations
        bind it, as does ``load(..., model=ddp_model)``) until the hook has seen a backward.
        Raises ``ValueError`` for a tensor that is not a parameter of the model, and for a
        loaded state with no DDP model bound before the first backward."""
        lay = self.layout
        c = lay.index.get(id(param))
        if c is None and lay.shapes:
            raise ValueError("SparseAllreduceState.residual: this tensor is not a parameter the "
                             "hook has seen (not a trainable parameter of the DDP model)")
        if c is None and lay.expected is None:       # nothing seen, nothing loaded
            return torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        if c is None:
            c = self._loaded_index(param)
        shapes = lay.known_shapes()
        key = SparseAllreduceState.FLAT if self.mode == "flat" else lay.group_of.get(c)
        members = (range(len(shapes)) if self.mode == "flat"
                   else (lay.groups[key] if key is not None else ()))
        red = self.reducers.get(key) if key is not None else None
        if red is not None:
            vec = red.residual
        elif key is not None and key in self._pending_state:
            vec = self._pending_state[key]["residual"].to(param.device)
        else:
            return torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        off = 0
        for m in members:
            n = _numel(shapes[m])
            if m == c:
                return vec[off:off + n].view(param.shape)
            off += n
        raise AssertionError("parameter not in its group")   # unreachable

    def _loaded_index(self, param: torch.Tensor) -> int:
        """``param``'s canonical index in a loaded state the hook has not seen yet: its place in
        the bound DDP model's current buckets (a fresh DDP's first layout, the one the hook
        will number the parameters by)."""
        ddp = None if self._model is None else self._model()
        if ddp is None:
            raise ValueError("SparseAllreduceState.residual: a loaded state places its "
                             "residuals at the first backward; before it, bind the DDP model "
                             "(state.bind(ddp_model), or load(..., model=ddp_model))")
        order = [p for b in ddp.reducer._get_zeros_like_grad_buckets() for p in b.parameters()]
        for c, p in enumerate(order):
            if p is param:
                if c >= len(self.layout.expected) or tuple(p.shape) != self.layout.expected[c]:
                    raise ValueError("SparseAllreduceState.residual: the loaded state was saved "
                                     f"for other parameters (parameter {c} has shape "
                                     f"{tuple(p.shape)} here)")
                return c
        raise ValueError("SparseAllreduceState.residual: this tensor is not a trainable "
                         "parameter of the bound DDP model")

    # -- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Iteration count, the parameter layout (shapes in canonical order, groups) and every
        reducer's state (residuals, thresholds, ...). Save it with the model and optimizer;
        load it into a fresh state before the first backward of the resumed run. A loaded state
        is saved as it was loaded until the hook builds its reducers (a save straight after a
        load keeps every residual)."""
        if self._carried:
            raise ValueError("SparseAllreduceState.state_dict: reconfigured, and the new group's "
                             "reducers are built at the next backward; save after it")
        reducers = dict(self._pending_state)      # loaded, not built yet: saved as loaded
        reducers.update({i: r.state_dict() for i, r in self.reducers.items()})
        return {"iter": self.iter, "algorithm": self.algorithm, "density": self.density,
                "mode": self.mode, "layout": self.layout.state_dict(), "reducers": reducers}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore; reducers not yet built load their state when they are. The saved parameter
        shapes are checked against the model's at the first backward (a state saved for other
        parameters raises ``ValueError`` there instead of being applied)."""
        for key, mine in (("algorithm", self.algorithm), ("mode", self.mode)):
            if sd.get(key, mine) != mine:
                raise ValueError(f"SparseAllreduceState.load_state_dict: saved with {key}="
                                 f"{sd.get(key)!r}, this state has {mine!r}")
        if "layout" not in sd:
            raise ValueError("SparseAllreduceState.load_state_dict: the state has no parameter "
                             "layout (saved by an older version); its residuals cannot be placed")
        self.layout.load(sd["layout"])
        self.iter = int(sd["iter"])
        self._pending_state = {}
        for i, rsd in sd.get("reducers", {}).items():
            if int(i) in self.reducers:
                self.reducers[int(i)].load_state_dict(rsd)
            else:
                self._pending_state[int(i)] = rsd

    def __repr__(self) -> str:
        return (f"SparseAllreduceState(algorithm={self.algorithm!r}, density={self.density:g}, "
                f"mode={self.mode!r}, start_iter={self.start_iter}, iter={self.iter}, "
                f"reducers={len(self.reducers)})")

    # -- per-rank files (oktopk_triton.checkpoint) --------------------------------------------
    def _file_rank(self) -> Tuple[int, int]:
        """(rank, world size) naming this rank's file: the global ones, so that several groups
        (e.g. HSDP's replica groups) save into one directory without clashing."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def fingerprint(self, model: Optional[torch.nn.Module] = None) -> Dict[str, Any]:
        """What a saved state must match: algorithm, mode, group size, and the parameters (their
        canonical layout once the hook has seen an iteration or a state was loaded; ``model``'s
        trainable parameters' numel and shapes, in any order, when given, with their names and
        shapes in the model's order, which only the error message uses)."""
        group = self._world_size() if dist.is_available() and dist.is_initialized() else 1
        fp: Dict[str, Any] = {"algorithm": self.algorithm, "mode": self.mode,
                              "group_size": group}
        shapes = [list(s) for s in self.layout.known_shapes()]
        names = None
        if model is not None:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            shapes = [list(p.shape) for _, p in named]
            names = [n for n, _ in named]
        if shapes:
            fp["numel"] = sum(int(torch.Size(s).numel()) for s in shapes)
            fp["sorted_shapes"] = sorted(shapes)
        if names is not None:      # for the error message only (a saved state has no names)
            fp["names"] = names
            fp["model_shapes"] = shapes
        return fp

    def save(self, directory: str, name: str = "oktopk") -> str:
        """Write this rank's state to ``directory/{name}-rank{r}-of{P}.pt`` (every rank calls
        it; each writes its own file, readable with ``torch.load(weights_only=True)``).
        Returns the path."""
        from .checkpoint import save_rank
        rank, world = self._file_rank()
        return save_rank(directory, "SparseAllreduceState", rank, world, self.fingerprint(),
                         self.state_dict(), name)

    def load(self, directory: str, model: Optional[torch.nn.Module] = None,
             name: str = "oktopk") -> None:
        """Restore this rank's state saved by :meth:`save` (every rank calls it, before the
        first backward of the resumed run). A missing file, another world size, algorithm or
        mode, or (with ``model``) other parameters raise ``CheckpointError`` (a ``ValueError``)
        on every rank; without ``model`` the parameters are checked at the first backward.
        A ``DistributedDataParallel`` ``model`` is also bound (:meth:`bind`). Files saved at
        another world size are resharded (``checkpoint.reshard_reducers``; the iteration count
        and layout from old rank 0)."""
        import functools

        from .checkpoint import gather_dist, load_rank, reshard_reducers
        if model is not None:
            self.bind(model)
        rank, world = self._file_rank()
        group = (dist.get_rank(self.process_group), self._world_size()) if world > 1 else (0, 1)
        f = load_rank(directory, "SparseAllreduceState", rank, world, self.fingerprint(model),
                      gather_dist(self.process_group), name,
                      reshard=functools.partial(reshard_reducers, rank=group[0],
                                                world_size=group[1]))
        self.load_state_dict(f["state"])


def _completed(t: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


def _bucket_views(bucket: dist.GradBucket, buf: torch.Tensor) -> List[torch.Tensor]:
    """The flat view of each parameter's gradient inside the bucket buffer (DDP packs them in
    ``bucket.parameters()`` order, back to back)."""
    views, off = [], 0
    flat = buf.reshape(-1)
    for p in bucket.parameters():
        views.append(flat[off:off + p.numel()])
        off += p.numel()
    if off != flat.numel():
        raise RuntimeError(f"sparse_allreduce_hook: bucket {bucket.index()} holds {flat.numel()} "
                           f"elements but its parameters {off}")
    return views


def sparse_allreduce_hook(state: SparseAllreduceState,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged over ranks with the sparse
    allreduce ``state.algorithm`` (dense for the first ``state.start_iter`` iterations)."""
    if isinstance(bucket, tuple):
        raise RuntimeError(
            "sparse_allreduce_hook: DDP called it once per parameter with (grad, param), as "
            "compiled autograd's Python reducer does (torch._dynamo.config.optimize_ddp = "
            "'python_reducer'); a sparse allreduce needs the whole gradient: use optimize_ddp="
            "'ddp_optimizer' (the default), or SparseAllreduce.reduce_gradients() after backward")
    buf = bucket.buffer()
    P = state._world_size()
    last = bucket.is_last()
    params = list(bucket.parameters())
    canon = state.layout.indices(params)
    state._watch(params, canon)
    if last:
        state.layout.check_complete()
    # bucket mode needs its groups from a rebuilt layout: a state that has none yet (saved before
    # its first sparse iteration) stays dense in the first iteration it sees, a fresh DDP's
    if state.iter < state.start_iter or (state.mode == "bucket" and state.layout.groups is None
                                         and state._seen == 0):
        # dense, exactly as DDP's default allreduce hook: divide, then sum
        t = buf.div_(P)
        fut = dist.all_reduce(t, group=state.process_group, async_op=True).get_future()
        state._iter_bytes += ring_allreduce_bytes(t.numel() * t.element_size(), P)
        result = fut.then(lambda f: f.value()[0])
    else:
        views = _bucket_views(bucket, buf)
        step = _group_step if state.mode == "bucket" else _flat_step
        result = step(state, buf, canon, views, last)
    if last:
        state.bytes_sent = state._iter_bytes
        state.total_bytes_sent += state._iter_bytes
        state._iter_bytes = 0
        state.iter += 1
        state._seen += 1
        state._used.clear()          # the next synchronised backward starts counting afresh
        state.held_out, state._iter_held = state._iter_held, 0
    return result


def _unused(state: SparseAllreduceState, members: List[int],
            grads: Dict[int, torch.Tensor]) -> List[int]:
    """Positions in ``members`` of the parameters this rank did not use since the last
    synchronised backward. Seen by the post-accumulate-grad hooks; in the first iteration an
    instance sees (hooks registered during it), a gradient slot that is exactly zero counts as
    unused (one host read, that iteration only: holding out a used parameter is always safe)."""
    if state._seen > 0:
        return [i for i, c in enumerate(members) if c not in state._used]
    nonzero = torch.stack([grads[c].ne(0).any() for c in members]).tolist()
    return [i for i, nz in enumerate(nonzero) if not nz]


def _hold_out(red, flat: torch.Tensor, spans: List[Tuple[int, int]]):
    """Set aside what ``red`` owes the entries ``spans`` ((offset, length) in ``flat``), and
    their gradient slots, so the step offers nothing of them (acc = 0 there: never selected)."""
    take = [(o, n, red.residual[o:o + n].clone(),
             None if red.velocity is None else red.velocity[o:o + n].clone(),
             flat[o:o + n].float()) for o, n in spans]
    for o, n, *_ in take:
        red.residual[o:o + n] = 0
        if red.velocity is not None:
            red.velocity[o:o + n] = 0
    flat_held = flat.clone()
    for o, n, *_ in take:
        flat_held[o:o + n] = 0
    scale = None if red.loss_scale is None else red.loss_scale.clone()
    return take, scale, flat_held


def _put_back(red, held) -> None:
    """Return what :func:`_hold_out` set aside: the residual and velocity (in the loss scale the
    step moved them to) plus the gradient slot (unless the step was non-finite, when every
    residual stays as it was)."""
    take, scale, _ = held
    ratio = None
    if scale is not None and red.loss_scale is not None:
        ratio = red.loss_scale / scale
    nonfinite = red.stats.get("nonfinite")
    for o, n, res, vel, g in take:
        if ratio is not None:
            res = res * ratio
            vel = None if vel is None else vel * ratio
        if isinstance(nonfinite, torch.Tensor):
            g = torch.where(nonfinite > 0, torch.zeros_like(g), g)
        red.residual[o:o + n] += res + g
        if vel is not None:
            red.velocity[o:o + n] += vel


def _reduce(state: SparseAllreduceState, key: int, members: List[int],
            grads: Dict[int, torch.Tensor]) -> None:
    """Reduce the parameters ``members`` (canonical indices) as one vector in canonical order
    with reducer ``key``; the result is written back into each parameter's gradient view.
    Parameters this rank did not use are held out (see the module docstring)."""
    flat = torch.cat([grads[c] for c in members])
    red = state.reducer(key, flat)
    unused = _unused(state, members, grads)
    held = None
    if unused:
        offs, off = [], 0
        for c in members:
            offs.append(off)
            off += grads[c].numel()
        held = _hold_out(red, flat, [(offs[i], grads[members[i]].numel()) for i in unused])
        flat = held[2]
        state._iter_held += len(unused)
    out = red(flat, scale=state._scale())
    if held is not None:
        _put_back(red, held)
    state._iter_bytes += int(red.stats.get("bytes_sent", 0))
    off = 0
    for c in members:
        g = grads[c]
        g.copy_(out[off:off + g.numel()])
        off += g.numel()


def _settle(pending: list, error: BaseException) -> None:
    for _, f, _ in pending:
        if not f.done():
            f.set_exception(error)


def _flat_step(state: SparseAllreduceState, buf: torch.Tensor, canon: List[int],
               views: List[torch.Tensor], last: bool) -> "torch.futures.Future[torch.Tensor]":
    """Flat mode: hold the buckets until the last one arrives, then reduce the whole gradient as
    one vector in canonical order and complete every held future (each with its own buffer:
    DDP re-points its views into the future's tensor with as_strided, which ignores a slice's
    storage offset)."""
    fut: torch.futures.Future = torch.futures.Future()
    state._pending.append((buf, fut, dict(zip(canon, views))))
    if not last:
        return fut
    pending, state._pending = state._pending, []
    try:
        grads: Dict[int, torch.Tensor] = {}
        for _, _, g in pending:
            grads.update(g)
        _reduce(state, SparseAllreduceState.FLAT, list(range(len(state.layout.shapes))), grads)
        for b, f, _ in pending:
            f.set_result(b)
    except BaseException as e:   # every held bucket fails, none is left waiting
        _settle(pending, e)
        raise
    return fut


def _group_step(state: SparseAllreduceState, buf: torch.Tensor, canon: List[int],
                views: List[torch.Tensor], last: bool) -> "torch.futures.Future[torch.Tensor]":
    """Bucket mode: one reducer per parameter group. The groups are the buckets of the first
    sparse iteration (saved with the state); a group is reduced as soon as all its parameters
    have arrived, and a bucket completes once all its parameters are reduced. In steady state
    the groups are DDP's buckets, so each bucket is reduced as it arrives.

    DDP's rebuild: groups seen in an instance's first two iterations are provisional (a fresh
    DDP's layout before its rebuild, which comes after the first iteration, or the second with
    ``static_graph``). From the third iteration on, a bucket that is not a group means DDP
    rebuilt its buckets: the buckets that are groups are reduced as they come, the others wait
    for the last bucket, where the groups become this iteration's buckets (:func:`_regroup`,
    every residual moved by parameter) and the rest is reduced."""
    lay = state.layout
    key = tuple(canon)
    if lay.groups is None:                    # the first sparse iteration: groups = its buckets
        state._new_groups = True
        lay.set_groups([])
    if state._new_groups:
        lay.set_groups(lay.groups + [key])
    elif state._seen >= 2 and key not in lay.group_index:
        state._relayout = True
    state._now.append(key)
    fut: torch.futures.Future = torch.futures.Future()
    state._pending.append((buf, fut, dict(zip(canon, views))))
    state._arrived.update(zip(canon, views))
    try:
        if state._relayout:                   # only buckets that are whole groups, as they come
            gi = lay.group_index.get(key)
            ready = [] if gi is None else [gi]
        else:
            ready = sorted({lay.group_of[c] for c in canon})
        for gi in ready:
            members = lay.groups[gi]
            if gi not in state._reduced and all(c in state._arrived for c in members):
                _reduce(state, gi, list(members), state._arrived)
                state._reduced.add(gi)
        if last and state._relayout:
            _regroup(state, state._now)
            for gi, members in enumerate(lay.groups):
                if gi not in state._reduced:
                    _reduce(state, gi, list(members), state._arrived)
                    state._reduced.add(gi)
        done = [p for p in state._pending if all(lay.group_of[c] in state._reduced for c in p[2])]
        done_ids = {id(f) for _, f, _ in done}
        state._pending = [p for p in state._pending if id(p[1]) not in done_ids]
        for b, f, _ in done:
            f.set_result(b)
        if last:
            if state._pending:
                raise RuntimeError("sparse_allreduce_hook: parameter groups left unreduced at "
                                   "the last bucket")
            _end_group_iteration(state)
    except BaseException as e:
        pending, state._pending = state._pending, []
        _end_group_iteration(state)
        _settle(pending, e)
        raise
    return fut


def _end_group_iteration(state: SparseAllreduceState) -> None:
    state._arrived, state._reduced, state._new_groups = {}, set(), False
    state._now, state._relayout = [], False


def _regroup(state: SparseAllreduceState, buckets: List[Tuple[int, ...]]) -> None:
    """Make ``buckets`` the groups. A group that was already one keeps its reducer (reduced
    this iteration under its new index); every other parameter's residual and velocity move
    from its old reducer into the reducer of its new group, which takes the step count and
    loss scale over (its thresholds start afresh: its first step calibrates). Nothing owed is
    lost; every rank regroups in the same iteration (DDP gives every rank the same buckets)."""
    lay = state.layout
    old_groups, old_reducers = lay.groups, state.reducers
    sizes = [_numel(s) for s in lay.shapes]
    res: Dict[int, torch.Tensor] = {}
    vel: Dict[int, torch.Tensor] = {}
    template = None
    for gi, members in enumerate(old_groups):
        red = old_reducers.get(gi)
        if red is None and gi in state._pending_state:    # loaded, never built: build it now
            first = state._arrived[members[0]]
            red = state.reducer(gi, torch.empty(sum(sizes[c] for c in members),
                                                device=first.device))
        if red is None:
            continue
        template = template or red
        off = 0
        for c in members:
            res[c] = red.residual[off:off + sizes[c]]
            if red.velocity is not None:
                vel[c] = red.velocity[off:off + sizes[c]]
            off += sizes[c]
    old_index = {g: gi for gi, g in enumerate(old_groups)}
    reduced = state._reduced
    new_reducers: Dict[int, Any] = {}
    new_reduced = set()
    for j, g in enumerate(buckets):
        gi = old_index.get(g)
        if gi is not None and gi in old_reducers:
            new_reducers[j] = old_reducers[gi]
            if gi in reduced:
                new_reduced.add(j)
            continue
        if template is None:
            continue                          # nothing built yet: reducers come on first use
        red = state._build(sum(sizes[c] for c in g), template.device)
        red.residual.copy_(torch.cat([res[c] if c in res else
                                      torch.zeros(sizes[c], device=template.device)
                                      for c in g]))
        if red.velocity is not None and vel:
            red.velocity.copy_(torch.cat([vel[c] if c in vel else
                                          torch.zeros(sizes[c], device=template.device)
                                          for c in g]))
        red.step_count = template.step_count
        if template.loss_scale is not None:
            red.loss_scale = template.loss_scale.clone()
            red._scale_host = template._scale_host
        new_reducers[j] = red
    state.reducers = new_reducers
    state._pending_state = {}
    lay.set_groups(list(buckets))
    state._reduced = new_reduced


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
