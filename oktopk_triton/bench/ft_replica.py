"""One torchft replica group (one process) for the fault tests and ``oktopk-bench faults``.

    python -m oktopk_triton.bench.ft_replica '{"replica": 0, "lighthouse": "http://...", ...}'

``mode``: ``sparse`` (:class:`SparseDiLoCo`), ``dense`` (torchft's ``DiLoCo``), ``reference`` (the
same local steps on plain torch.distributed: ``world`` ranks at ``master_port``, no torchft),
``local`` (the inner steps alone) or ``fsdp`` (:class:`SparseGradients` every step, FSDP2 over
``group_world`` ranks of one replica group, its store at ``group_port``). ``model``: ``mlp`` (a
small MLP on a synthetic task), ``digits`` (the digits CNN) or ``gpt`` (the byte-level GPT of
``size``, :mod:`.ft_gpt`); another ``width`` is another model, whose heal is refused. The run
ends when the Manager has committed ``syncs`` syncs. Faults: ``die`` (``{"sync": k,
"collective": i}``: SIGKILL itself at the i-th collective of its k-th sync attempt; ``{"step":
s}``: before inner step s), ``fail`` (that collective raises instead), ``retry`` (sync again at
once after a sync that did not commit), ``hold`` (``[{"at": k, "file": path}]``: having
committed k syncs, wait, bounded, until ``path`` exists). Every key and its default:
:data:`DEFAULTS`. It writes ``result.ready`` once its Manager is up, ``result`` (JSON: history,
losses, evals ``(committed syncs, test loss)`` with ``eval_steps``, ``heals``, ``bytes``, the
Manager's step, the final weights' file: with fragments the common ones, each fragment's anchor),
after every committed sync ``result.progress``, and before each inner step that syncs
``result.syncing`` (its inner step count). In ``dense`` mode ``history`` has one record per sync
attempt, its bytes those of a ring allreduce of every fp32 parameter, ``2(P-1)/P * 4n``, or with
``should_quantize`` of torchft's quantized allreduce (a failed attempt counted whole).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any, Dict, List, Tuple

import torch

from .ft_gpt import lr_at

DEFAULTS: Dict[str, Any] = dict(
    mode="sparse", model="mlp", syncs=6, sync_every=2, density=0.1, algorithm="oktopk",
    options={}, seed=0, lr=0.05, outer_lr=1.0, outer_momentum=0.0, audit=True, width=32,
    batch=16, min_replicas=1, timeout=5.0, quorum_timeout=60.0, die=None, fail=None,
    retry=False, world=0, master_port=0, eval_every=1, inner="sgd", hold=(), group_rank=0,
    group_world=1, group_port=0, fragments=1, fragment_sync_delay=0, link_delay_ms=0.0,
    size="1m", eval_sequences=256, schedule="constant", preset=None, preset_bytes=None,
    should_quantize=False)


def fragments_of(model: torch.nn.Module, count: int) -> List[torch.nn.Module]:
    """The model's children that hold parameters, in ``count`` contiguous groups (Streaming
    DiLoCo's fragments); ``[model]`` for one."""
    if count <= 1:
        return [model]
    parts = [c for c in model.children() if any(True for _ in c.parameters())]
    if len(parts) < count:
        raise ValueError(f"ft_replica: {count} fragments of a model with {len(parts)} parts")
    cuts = [round(i * len(parts) / count) for i in range(count + 1)]
    return [torch.nn.ModuleList(parts[a:b]) for a, b in zip(cuts, cuts[1:])]


# -- the task ------------------------------------------------------------------------------------
def make_task(cfg: Dict[str, Any]) -> Tuple[torch.nn.Module, Any, Any]:
    """(model, batch(step) -> (x, y), eval() -> test loss), identical weights on every replica."""
    torch.manual_seed(cfg["seed"])
    if cfg["model"] == "gpt":
        from .ft_gpt import gpt_task
        return gpt_task(cfg)
    if cfg["model"] == "digits":
        from .digits import load_data, make_model
        model = make_model("cnn", width=cfg["width"] // 4 or 8)
        Xtr, ytr, Xte, yte = load_data()
        shard = torch.arange(cfg["replica"] % 4, len(ytr), 4)
        Xs, ys = Xtr[shard], ytr[shard]
    else:
        w = cfg["width"]
        model = torch.nn.Sequential(torch.nn.Linear(16, w), torch.nn.Tanh(),
                                    torch.nn.Linear(w, 4))
        g = torch.Generator().manual_seed(1234)
        teacher = torch.randn(16, 4, generator=g)
        gd = torch.Generator().manual_seed(100 + cfg["replica"])
        Xs = torch.randn(512, 16, generator=gd)
        ys = (Xs @ teacher).argmax(1)
        Xte = torch.randn(256, 16, generator=g)
        yte = (Xte @ teacher).argmax(1)
    loss_fn = torch.nn.functional.cross_entropy
    b = cfg["batch"]

    def batch(step: int):
        i = (step * b) % (len(ys) - b + 1)
        return Xs[i:i + b], ys[i:i + b]

    def evaluate() -> float:
        with torch.no_grad():
            return float(loss_fn(model(Xte), yte))
    return model, batch, evaluate


def algorithm(cfg: Dict[str, Any]) -> Any:
    """The algorithm object: ``algorithm`` (a name) with ``options`` (its settings)."""
    from ..config import CONFIGS
    return CONFIGS[cfg["algorithm"]](**cfg["options"])


def reduce_options(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """SparseDiLoCo's reduce: ``preset`` (a DiLoCo preset's name), ``preset_bytes``
    (:func:`~oktopk_triton.presets.recommend_diloco` at that fraction of DiLoCo's dense sync), or
    ``density`` with the algorithm."""
    if cfg["preset_bytes"] is not None:
        from ..presets import recommend_diloco
        return {"preset": recommend_diloco(float(cfg["preset_bytes"]))}
    if cfg["preset"] is not None:
        return {"preset": cfg["preset"]}
    return {"density": cfg["density"], "algorithm": algorithm(cfg)}


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the model's logits (``[..., classes]``) against ``y``."""
    out = model(x)
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def inner_optimizer(cfg: Dict[str, Any], model: torch.nn.Module) -> torch.optim.Optimizer:
    if cfg["inner"] == "adamw":         # the train CLI's language-model recipe
        return torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95),
                                 weight_decay=0.0)
    if cfg["inner"] == "adam":
        return torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    return torch.optim.SGD(model.parameters(), lr=cfg["lr"])


# -- faults --------------------------------------------------------------------------------------
def inject(cfg: Dict[str, Any], replica: Any) -> None:
    """Wrap the communicator's primitives: die or fail at the configured collective; with
    ``link_delay_ms`` each primitive waits that long first, as over a slow link."""
    comm, orig = replica.comm, replica.comm._run
    delay = float(cfg.get("link_delay_ms") or 0.0) / 1000.0
    count = {"n": 0, "attempt": 0}
    n_hist = {"len": 0}

    def run(what: str, issue):
        if len(replica.history) != n_hist["len"]:          # a new sync attempt
            n_hist["len"] = len(replica.history)
            count["n"] = 0
        k, i = len(replica.history), count["n"]
        count["n"] += 1
        if cfg["die"] and (k, i) == (cfg["die"].get("sync"), cfg["die"].get("collective")):
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg["fail"] and (k, i) == (cfg["fail"]["sync"], cfg["fail"]["collective"]):
            def issue():
                raise RuntimeError("injected: this collective failed")
        if delay:
            time.sleep(delay)
        return orig(what, issue)
    comm._run = run


# -- the modes -----------------------------------------------------------------------------------
def make_manager(cfg: Dict[str, Any], state: Dict[str, Any]):
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from .ranks import free_port
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    t = timedelta(seconds=cfg["timeout"])
    m = Manager(pg=ProcessGroupGloo(timeout=t),
                load_state_dict=lambda sd: _load_user(state, sd),
                state_dict=lambda: {"model": state["model"].state_dict(),
                                    "optim": state["optim"].state_dict()},
                min_replica_size=cfg["min_replicas"], use_async_quorum=False, rank=0,
                world_size=1, store_addr="127.0.0.1", store_port=port,
                lighthouse_addr=cfg["lighthouse"], replica_id=f"replica_{cfg['replica']}",
                hostname="127.0.0.1", timeout=t,
                quorum_timeout=timedelta(seconds=cfg["quorum_timeout"]),
                connect_timeout=timedelta(seconds=10), init_sync=False)
    return m, store


def _dense_record(history: List[Dict[str, Any]], manager: Any, state: Dict[str, Any],
                  sent: Any) -> None:
    """The record of the sync attempt torchft's ``DiLoCo`` just made (dense mode; ``sent(P)``:
    the bytes of one sync over P replicas)."""
    P = int(manager.num_participants())
    done = manager.current_step()
    prev = history[-1] if history else {"step": 0, "heals": 0}
    history.append({"step": done, "P": P, "rank": None, "committed": done > prev["step"],
                    "healed": state["heals"] > prev["heals"], "heals": state["heals"],
                    "bytes": sent(P),
                    "relative_error": None, "error": None})


def _load_user(state: Dict[str, Any], sd: Dict[str, Any]) -> None:
    state["heals"] = state.get("heals", 0) + 1
    state["model"].load_state_dict(sd["model"])
    state["optim"].load_state_dict(sd["optim"])


def run_torchft(cfg: Dict[str, Any], out: Dict[str, Any]) -> None:
    model, batch, evaluate = make_task(cfg)
    opt = inner_optimizer(cfg, model)
    outer = torch.optim.SGD(model.parameters(), lr=cfg["outer_lr"],
                            momentum=cfg["outer_momentum"], nesterov=cfg["outer_momentum"] > 0)
    state = {"model": model, "optim": opt, "heals": 0}
    manager, _store = make_manager(cfg, state)
    if cfg["mode"] == "sparse":
        from ..integrations.torchft import SparseDiLoCo
        diloco = SparseDiLoCo(manager, fragments_of(model, cfg["fragments"]), opt, outer,
                              sync_every=cfg["sync_every"],
                              fragment_sync_delay=cfg["fragment_sync_delay"],
                              should_quantize=cfg["should_quantize"], audit=cfg["audit"],
                              **reduce_options(cfg))
        inject(cfg, diloco.replica)
        history = diloco.history
    else:
        from torchft.local_sgd import DiLoCo
        from .ft_gpt import patch_quantized_allreduce, quantized_allreduce_bytes
        if cfg["should_quantize"]:
            patch_quantized_allreduce()
        diloco = DiLoCo(manager, [model], opt, outer, sync_every=cfg["sync_every"],
                        should_quantize=cfg["should_quantize"])
        history = []
        params = list(model.parameters())
        n = sum(p.numel() for p in params)

        def sent(P: int) -> int:
            from ..comm import ring_allreduce_bytes
            if cfg["should_quantize"]:
                return quantized_allreduce_bytes(params, P)
            return ring_allreduce_bytes(4 * n, P) if P > 1 else 0
    losses: List[float] = []
    evals: List[Tuple[int, float]] = []
    eval_steps: List[int] = []
    step, last = 0, -1
    step_times: List[float] = [time.monotonic()]
    _write(cfg["result"] + ".ready", "1")
    try:
        with diloco:
            while manager.current_step() < cfg["syncs"]:
                _hold(cfg, manager.current_step())
                if cfg["die"] and cfg["die"].get("step") == step:      # between syncs
                    os.kill(os.getpid(), signal.SIGKILL)
                if (step + 1) % (cfg["sync_every"] // cfg["fragments"]) == 0:   # it syncs
                    _write(cfg["result"] + ".syncing", str(step + 1))
                x, y = batch(step)
                every = cfg["sync_every"] // cfg["fragments"]
                for group in opt.param_groups:
                    group["lr"] = lr_at(cfg, manager.current_step() * every + step % every)
                loss = loss_of(model, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                step += 1
                step_times.append(time.monotonic())
                losses.append(float(loss.detach()))
                if cfg["mode"] != "sparse" and step % cfg["sync_every"] == 0:
                    _dense_record(history, manager, state, sent)
                if cfg["retry"] and history and not history[-1]["committed"] \
                        and history[-1]["error"] is not None and diloco.local_step == 0:
                    diloco.sync()
                done = manager.current_step()
                if done != last:
                    last = done
                    if done % cfg["eval_every"] == 0:
                        evals.append((done, evaluate()))
                        eval_steps.append(step)
                    _write(cfg["result"] + ".progress", str(done))
    finally:
        out.update(history=history, losses=losses, evals=evals, eval_steps=eval_steps,
                   step=manager.current_step(), local_steps=step, rank=None,
                   heals=state["heals"], step_times=step_times)
        if cfg["mode"] == "sparse":
            out["bytes"] = diloco.reducer.comm.bytes_sent
            out["residual_sum"] = float(diloco.reducer.residual.double().sum())
        else:
            out["bytes"] = sum(h["bytes"] for h in history)
        manager.shutdown(wait=False)
    if cfg["mode"] == "sparse" and diloco.streaming:
        # the common weights: a fragment not synced last holds local progress by design
        path = cfg["result"] + ".weights.pt"
        torch.save({f"anchor.{i}": a.clone() for i, a in enumerate(diloco.anchor)}, path)
        out["weights"] = path
    else:
        out["weights"] = _save_weights(cfg, model)


def run_local(cfg: Dict[str, Any], out: Dict[str, Any]) -> None:
    """The inner steps alone, no Manager and no sync: what an interval costs without
    communication (``step_times``)."""
    model, batch, _ = make_task(cfg)
    opt = inner_optimizer(cfg, model)
    step_times = [time.monotonic()]
    for step in range(cfg["syncs"] * cfg["sync_every"] // cfg["fragments"]):
        x, y = batch(step)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        step_times.append(time.monotonic())
    out.update(step_times=step_times, history=[], step=0)


def run_reference(cfg: Dict[str, Any], out: Dict[str, Any]) -> None:
    """The same local steps on plain torch.distributed (gloo, ``world`` ranks), no torchft."""
    import torch.distributed as dist
    from ..comm import TorchCommunicator
    from ..config import LocalSteps
    from ..module import SparseAllreduce
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['master_port']}",
                            rank=cfg["replica"], world_size=cfg["world"])
    model, batch, _ = make_task(cfg)
    opt = inner_optimizer(cfg, model)
    sar = SparseAllreduce(model, comm=TorchCommunicator(), density=cfg["density"],
                          algorithm=algorithm(cfg),
                          local_steps=LocalSteps(sync_every=cfg["sync_every"]))
    for step in range(cfg["syncs"] * cfg["sync_every"]):
        x, y = batch(step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        sar.reduce_updates(opt)
        opt.zero_grad()
    out["weights"] = _save_weights(cfg, model)
    dist.destroy_process_group()


def _hold(cfg: Dict[str, Any], done: int) -> None:
    for h in cfg["hold"]:
        deadline = time.monotonic() + 120
        while done == h["at"] and not os.path.exists(h["file"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"held at sync {done} for 120 s: {h['file']} never came")
            time.sleep(0.02)


def run_fsdp(cfg: Dict[str, Any], out: Dict[str, Any]) -> None:
    """One rank of a replica group of ``group_world`` ranks: FSDP2 inside the group, the sparse
    reduce of this rank's shards across the replica groups (:class:`SparseGradients`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from ..integrations.torchft import SparseGradients
    gr, gw, port = cfg["group_rank"], cfg["group_world"], cfg["group_port"]
    store = TCPStore("127.0.0.1", port, gw, is_master=gr == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=gr, world_size=gw)
    model, batch, _ = make_task(cfg)
    fully_shard(model, mesh=init_device_mesh("cpu", (gw,)))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    t = timedelta(seconds=cfg["timeout"])
    manager = Manager(pg=ProcessGroupGloo(timeout=t), load_state_dict=None, state_dict=None,
                      min_replica_size=cfg["min_replicas"], use_async_quorum=False, rank=gr,
                      world_size=gw, store_addr="127.0.0.1", store_port=port,
                      lighthouse_addr=cfg["lighthouse"], replica_id=f"replica_{cfg['replica']}",
                      hostname="127.0.0.1", timeout=t,
                      quorum_timeout=timedelta(seconds=cfg["quorum_timeout"]),
                      connect_timeout=timedelta(seconds=10), init_sync=False)
    ft = SparseGradients(manager, model, density=cfg["density"], algorithm=algorithm(cfg),
                         audit=cfg["audit"])
    _write(cfg["result"] + ".ready", "1")
    step = 0
    try:
        while manager.current_step() < cfg["syncs"]:
            _hold(cfg, manager.current_step())
            x, y = batch(2 * step + gr)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if ft.reduce():
                opt.step()
            opt.zero_grad()
            step += 1
    finally:
        out.update(history=ft.history, step=manager.current_step(), local_steps=step)
        manager.shutdown(wait=False)
    path = cfg["result"] + ".weights.pt"
    torch.save({k: v.to_local().detach().clone() for k, v in model.state_dict().items()}, path)
    out["weights"] = path
    dist.destroy_process_group()


def _save_weights(cfg: Dict[str, Any], model: torch.nn.Module) -> str:
    path = cfg["result"] + ".weights.pt"
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
    return path


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: List[str]) -> int:
    cfg = {**DEFAULTS, **json.loads(argv[0])}
    torch.set_num_threads(1)
    out: Dict[str, Any] = {"config": cfg, "error": None, "started": time.time()}
    code = 0
    try:
        run = {"reference": run_reference, "fsdp": run_fsdp,
               "local": run_local}.get(cfg["mode"], run_torchft)
        run(cfg, out)
    except Exception as exc:  # noqa: BLE001 - reported in one line, as a user sees it
        out["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        print(f"replica {cfg['replica']}: error: {out['error']}", file=sys.stderr, flush=True)
        code = 1
    out["finished"] = time.time()
    _write(cfg["result"], json.dumps(out, default=str))
    return code


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)     # the result is written: skip the Manager's threads' slow teardown
