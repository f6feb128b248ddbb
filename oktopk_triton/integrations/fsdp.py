"""FSDP2 / HSDP: the cross-replica gradient reduce of hybrid sharding, made sparse.

HSDP shards the model inside a node (a reduce-scatter over the fast intra-node link) and keeps
one replica per node, whose gradient shards are then all-reduced across nodes: the inter-node
link carries a dense shard every step, and that is where a sparse allreduce pays. Torch's
``fully_shard`` offers one place to do it, ``FSDPModule.set_all_reduce_hook(hook)``:

* with **native HSDP** (``fully_shard(mesh=2-D mesh)``) the hook runs *after* torch's dense
  all-reduce across replicas, so it cannot replace it;
* with **1-D FSDP** (``fully_shard(mesh=mesh["shard"])``) the hook receives each FSDP unit's
  reduce-scatter output (this rank's gradient shard, flat, padded, in the reduce dtype) before
  it is written to the sharded ``.grad``, and modifies it in place: that is HSDP with the
  cross-replica step supplied by the hook. This module does that:

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    sparse = SparseReplicaReduce(mesh["replicate"].get_group(), density=0.01).install(model)

Measured why: docs/research/design-notes.md, ``oktopk_triton/integrations/fsdp.py``.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist

from ..algorithms.base import Algorithm
from ..checks import check_density
from ..comm.base import Communicator
from ..config import AlgorithmConfig, front_config, front_density
from ..deprecation import old_keywords
from ..presets import Preset, for_hook, group_size as _world_size

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError as e:     # pragma: no cover - torch < 2.6
    from . import missing
    raise missing("fsdp", "torch>=2.6 (FSDP2, fully_shard)", e) from e

__all__ = ["SparseReplicaReduce"]

log = logging.getLogger(__name__)


class SparseReplicaReduce:
    """Sparse cross-replica reduce for FSDP2, installed as every FSDP unit's all-reduce hook.

    Args:
        replicate_group: the process group of this rank's replicas (the ranks holding the same
            shard, e.g. ``mesh["replicate"].get_group()``).
        density: fraction of each shard's entries a step sends, in (0, 1].
        algorithm: an algorithm object of :mod:`oktopk_triton.config` (``OkTopk(momentum=0.9)``,
            ..., ``Dense()``) or a registered name (its defaults).
        comm: a :class:`~oktopk_triton.comm.Communicator` over ``replicate_group``; ``None``
            builds ``TorchCommunicator(replicate_group)``.
        scaler: a ``torch.amp.GradScaler`` whose scale the gradients carry (or ``None``).
        check_finite: ``"skip"`` (default), ``"raise"`` or ``"off"`` (see ``SparseAllreduce``).

    An algorithm's settings passed as keywords (``momentum=0.9``) still work for one version,
    with a ``DeprecationWarning`` naming the new spelling (:mod:`oktopk_triton.deprecation`).

    Attributes:
        reducers: ``{unit index: Algorithm}``, the units numbered in ``model.modules()`` order.
        total_bytes_sent: the bytes this rank sent across the replicas since creation.
    """

    @old_keywords("SparseReplicaReduce")
    def __init__(self, replicate_group: Optional[dist.ProcessGroup],
                 density: Optional[float] = None,
                 algorithm: Union[str, AlgorithmConfig, None] = None, *,
                 comm: Optional[Communicator] = None,
                 scaler: Optional[torch.amp.GradScaler] = None,
                 check_finite: str = "skip", preset: Union[str, Preset, None] = None) -> None:
        if preset is not None:      # a per-step gradient preset (oktopk_triton.presets)
            density, algorithm = for_hook(preset, _world_size(replicate_group, comm),
                                          "SparseReplicaReduce", density=density,
                                          algorithm=algorithm)
        density = front_density(density)
        self.config = front_config(algorithm)
        self.group = replicate_group
        self.density = check_density(density, "SparseReplicaReduce")
        self.algorithm = self.config.algorithm       # the name (saved with the state)
        self.comm = comm
        self.scaler = scaler
        self.options = {"check_finite": check_finite, **self.config.options()}
        self.reducers: Dict[int, Algorithm] = {}
        self.units = 0
        self.total_bytes_sent = 0
        self._pending: Dict[int, Dict[str, Any]] = {}

    # -- installing ---------------------------------------------------------------------------
    def install(self, model: torch.nn.Module) -> "SparseReplicaReduce":
        """Set the hook on every FSDP unit of ``model`` (after ``fully_shard``). Returns self."""
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not units:
            raise ValueError("SparseReplicaReduce.install: the model has no FSDP unit; call "
                             "fully_shard(..., mesh=mesh['shard']) first")
        for m in units:
            for p in m.parameters():
                mesh = getattr(p, "device_mesh", None)
                if mesh is not None and mesh.ndim > 1:
                    raise ValueError("SparseReplicaReduce.install: the model is sharded with a "
                                     f"{mesh.ndim}-D mesh (native HSDP), whose dense all-reduce "
                                     "runs before the hook; shard with the 1-D mesh "
                                     "fully_shard(..., mesh=mesh['shard']) instead")
        for i, m in enumerate(units):
            m.set_all_reduce_hook(functools.partial(self._hook, i))
        self.units = len(units)
        log.info("SparseReplicaReduce: installed on %d FSDP units (%s, density %g)", len(units),
                 self.algorithm, self.density)
        return self

    # -- the hook -----------------------------------------------------------------------------
    def reducer(self, key: int, shard: torch.Tensor) -> Algorithm:
        """Unit ``key``'s reducer, created for ``shard``'s size on first use."""
        red = self.reducers.get(key)
        if red is None:
            from ..algorithms import get_algorithm
            if self.comm is None:
                from ..comm import TorchCommunicator
                self.comm = TorchCommunicator(self.group)
            red = get_algorithm(self.algorithm)(shard.numel(), self.comm, self.density,
                                                device=shard.device, **self.options)
            if key in self._pending:
                red.load_state_dict(self._pending.pop(key))
            self.reducers[key] = red
        return red

    def _hook(self, key: int, reduce_output: torch.Tensor) -> None:
        red = self.reducer(key, reduce_output)
        scale = None if self.scaler is None else getattr(self.scaler, "_scale", None)
        out = red(reduce_output, scale=scale)
        reduce_output.copy_(out)
        self.total_bytes_sent += int(red.stats.get("bytes_sent", 0))

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Every unit's reducer state; a loaded unit not built yet (no backward since the load)
        is saved as it was loaded, so a save straight after a load keeps what it owes."""
        reducers = dict(self._pending)
        reducers.update({i: r.state_dict() for i, r in self.reducers.items()})
        return {"algorithm": self.algorithm, "density": self.density, "units": self.units,
                "reducers": reducers}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd.get("algorithm") != self.algorithm:
            raise ValueError(f"SparseReplicaReduce.load_state_dict: saved with algorithm="
                             f"{sd.get('algorithm')!r}, this one has {self.algorithm!r}")
        self._pending = {}
        for i, rsd in sd.get("reducers", {}).items():
            if int(i) in self.reducers:
                self.reducers[int(i)].load_state_dict(rsd)
            else:
                self._pending[int(i)] = rsd

    def fingerprint(self) -> Dict[str, Any]:
        fp: Dict[str, Any] = {"algorithm": self.algorithm,
                              "replicas": dist.get_world_size(self.group)}
        if self.units:
            fp["units"] = self.units
        numels = {i: int(sd["numel"]) for i, sd in self._pending.items()}
        numels.update({i: r.numel for i, r in self.reducers.items()})
        if numels:
            fp["shard_numels"] = [numels[i] for i in sorted(numels)]
        return fp

    def save(self, directory: str, name: str = "oktopk") -> str:
        """Write this rank's state to ``directory/{name}-rank{r}-of{P}.pt`` (every rank)."""
        from ..checkpoint import save_rank
        return save_rank(directory, "SparseReplicaReduce", dist.get_rank(),
                         dist.get_world_size(), self.fingerprint(), self.state_dict(), name)

    def load(self, directory: str, name: str = "oktopk") -> None:
        """Restore this rank's state (every rank, after :meth:`install`, before the first
        backward); a mismatch raises ``CheckpointError`` on every rank. Files saved with another
        number of replicas (the same sharding) are resharded across the replicas
        (``checkpoint.reshard_reducers``): global ranks are replica-major (``init_device_mesh``
        with ``("replicate", "shard")``), so new rank q takes the old ranks p ≡ q (mod P), the
        replicas of its own shard."""
        from ..checkpoint import gather_dist, load_rank, reshard_reducers
        f = load_rank(directory, "SparseReplicaReduce", dist.get_rank(), dist.get_world_size(),
                      self.fingerprint(), gather_dist(None), name,
                      reshard=functools.partial(reshard_reducers,
                                                rank=dist.get_rank(self.group),
                                                world_size=dist.get_world_size(self.group)))
        self.load_state_dict(f["state"])
