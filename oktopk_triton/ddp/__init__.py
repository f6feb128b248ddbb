"""A DistributedDataParallel communication hook that averages gradients with a sparse allreduce.

    from torch.nn.parallel import DistributedDataParallel as DDP
    from oktopk_triton.ddp import SparseAllreduceState, sparse_allreduce_hook

    model = DDP(model)
    state = SparseAllreduceState(density=0.01, algorithm="oktopk")
    model.register_comm_hook(state, sparse_allreduce_hook)
    # ... the ordinary loop: loss.backward() now reduces every bucket sparsely

Every rank must process the buckets in the same order, which DDP guarantees (buckets are
launched in index order).

Measured why: docs/research/design-notes.md, ``oktopk_triton/ddp/``.
"""
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ..comm.base import Communicator

from ..checks import check_density
from ..comm.base import ring_allreduce_bytes
from ..config import AlgorithmConfig, front_config, front_density
from .bucket import BucketMode
from .flat import FLAT, FlatMode
from .layout import Layout, bucket_views, numel_of
from ..deprecation import old_keywords
from ..presets import Preset, for_hook, group_size as _world_size

__all__ = ["SparseAllreduceState", "sparse_allreduce_hook"]


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

    __slots__ = ("process_group", "density", "algorithm", "config", "start_iter", "options",
                 "comm", "iter", "reducers", "bytes_sent", "total_bytes_sent", "_iter_bytes",
                 "_pending_state", "mode", "_mode", "layout", "scaler", "_seen", "_used",
                 "_watched", "held_out", "_iter_held", "_model", "_carried")

    MODES = ("flat", "bucket")
    FLAT = FLAT   # the reducers key of the flat reducer

    @old_keywords("SparseAllreduceState", refuse_local_steps=(
        "SparseAllreduceState: the DDP hook cannot take local steps ({names}): it runs before "
        "the optimizer step; use SparseAllreduce.reduce_updates"))
    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 density: Optional[float] = None,
                 algorithm: Union[str, AlgorithmConfig, None] = None, start_iter: int = 1,
                 comm: Optional["Communicator"] = None, mode: str = "flat",
                 scaler: Optional["torch.amp.GradScaler"] = None, *,
                 check_finite: str = "skip", preset: Union[str, "Preset", None] = None) -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        if preset is not None:      # a per-step gradient preset (oktopk_triton.presets)
            density, algorithm = for_hook(preset, _world_size(process_group, comm),
                                          "SparseAllreduceState", density=density,
                                          algorithm=algorithm)
        density = front_density(density)
        self.config = front_config(algorithm)   # a clear error now for an unknown name
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
        self.layout = Layout()
        # the mode's component: flat.FlatMode or bucket.BucketMode
        self._mode = FlatMode() if mode == "flat" else BucketMode()
        self.scaler = scaler
        self._seen = 0                                  # iterations this instance has seen
        # parameters used (gradient accumulated) since the last synchronised backward, by
        # canonical index; fed by one post-accumulate-grad hook per parameter (see _watch)
        self._used: Set[int] = set()
        self._watched: Dict[int, Any] = {}              # canonical index -> hook handle
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
            from ..comm import TorchCommunicator
            if self.process_group is not None or device.type != "cuda":
                self.comm = TorchCommunicator(self.process_group)
            else:
                from ..comm import default_communicator
                self.comm = default_communicator(device)
        return self.comm

    def _scale(self) -> Any:
        """The loss scale of this iteration's gradients (a device tensor), or ``None``."""
        return None if self.scaler is None else getattr(self.scaler, "_scale", None)

    def _build(self, numel: int, device: torch.device):
        from ..algorithms import get_algorithm
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
            n = numel_of(shapes[m])
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
        from ..checkpoint import save_rank
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

        from ..checkpoint import gather_dist, load_rank, reshard_reducers
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
        result = state._mode.step(state, buf, canon, bucket_views(bucket, buf), last)
    if last:
        state.bytes_sent = state._iter_bytes
        state.total_bytes_sent += state._iter_bytes
        state._iter_bytes = 0
        state.iter += 1
        state._seen += 1
        state._used.clear()          # the next synchronised backward starts counting afresh
        state.held_out, state._iter_held = state._iter_held, 0
    return result
