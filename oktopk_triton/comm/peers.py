"""Which peer was lost: each rank's (host, pid), and a liveness check of the processes on this host.

Neither gloo ("Connection closed by peer [127.0.0.1]:41234") nor NCCL ("remote process exited or
there was a network error") says *which rank* went away when a process dies. Every communicator
therefore records each rank's identity (host name and process id) when it is built, and when a
collective fails it asks the operating system which of the peers on this host no longer run (a
process that no longer exists, or a zombie). The result names the lost rank(s) in the error:

    rank 0: allreduce: Connection closed by peer [...]; lost peer: rank 1 (pid 4242 on host h,
    no longer running)

Peers on other hosts cannot be checked from here; they are listed as "not checked".

Exchange of identities:

* torch.distributed: every rank writes ``oktopk_triton/peer/<global rank>`` = ``host:pid`` into the
  default group's store when its communicator is built (not a collective: a communicator built
  on a subset of ranks, or lazily in a DDP hook, never waits), and reads the others' entries when
  it first needs them (after its first completed primitive, or at the first failure). When the
  store itself is unreachable at the failure, the rank that hosts it (global rank 0 for the
  ``tcp://`` and ``env://`` rendezvous) has gone: the error says so.
* ``NcclCommunicator.from_torch_distributed`` gathers them with the unique id (one exchange).
"""
from __future__ import annotations

import os
import socket
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["PeerIdentity", "my_identity", "process_alive", "lost_peers", "describe_lost",
           "StorePeerTable", "STORE_PREFIX"]

STORE_PREFIX = "oktopk_triton/peer/"

# (host, pid)
PeerIdentity = Tuple[str, int]


def my_identity() -> PeerIdentity:
    return socket.gethostname(), os.getpid()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs. A zombie (killed, not yet reaped by its
    parent) counts as gone: it will never answer again."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            stat = f.read()
        # "pid (comm) state ...": comm may contain spaces and parentheses; the state follows
        # the last ')'
        state = stat[stat.rindex(")") + 2:].split()[0]
        return state not in ("Z", "X", "x")
    except FileNotFoundError:
        return False
    except (OSError, ValueError, IndexError):
        pass
    try:  # no /proc (macOS): signal 0 only checks existence
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lost_peers(peers: Dict[int, PeerIdentity], me: int,
               alive=process_alive, host: Optional[str] = None) -> Tuple[List[int], List[int]]:
    """``(lost, unchecked)``: ranks of ``peers`` (rank -> (host, pid)) on this host whose process no
    longer runs, and ranks on other hosts that cannot be checked from here."""
    host = socket.gethostname() if host is None else host
    lost, unchecked = [], []
    for r in sorted(peers):
        if r == me:
            continue
        h, pid = peers[r]
        if h != host:
            unchecked.append(r)
        elif not alive(pid):
            lost.append(r)
    return lost, unchecked


def describe_lost(peers: Dict[int, PeerIdentity], lost: Sequence[int],
                  unchecked: Sequence[int] = (), me: Optional[int] = None) -> str:
    """The sentence appended to a communication error."""
    parts = []
    if lost:
        who = ", ".join(f"rank {r} (pid {peers[r][1]} on host {peers[r][0]})" for r in lost)
        parts.append(f"lost peer{'s' if len(lost) > 1 else ''}: {who}, no longer running")
    elif len(peers) - len(unchecked) - (me in peers) > 0:
        parts.append("every peer process on this host is still running")
    if unchecked:
        parts.append(f"ranks {list(unchecked)} on other hosts not checked")
    return "; ".join(parts)


class StorePeerTable:
    """Identities of the ranks of a torch.distributed world, through the default group's store.

    Args:
        store: a ``torch.distributed.Store`` (``None``: the default group's store, looked up at
            each use and never kept: a table that outlived ``destroy_process_group`` would keep
            torch's store alive into interpreter shutdown, where gloo's teardown can abort).
        ranks: ``{group rank: global rank}`` of the peers of interest.
        my_global_rank: this process's global rank.
    """

    def __init__(self, ranks: Dict[int, int], my_global_rank: int, store=None) -> None:
        self.ranks = dict(ranks)
        self.my_global_rank = int(my_global_rank)
        self._given_store = store
        self.table: Dict[int, PeerIdentity] = {}
        self.store_error: Optional[str] = None
        self.store   # records store_error when there is none

    @property
    def store(self):
        if self._given_store is not None:
            return self._given_store
        try:
            from torch.distributed import distributed_c10d
            return distributed_c10d._get_default_store()
        except Exception as exc:  # noqa: BLE001 - best effort: the errors only lose detail
            self.store_error = f"no store ({exc})"
            return None

    def publish(self) -> None:
        store = self.store
        if store is None:
            return
        host, pid = my_identity()
        try:
            store.set(f"{STORE_PREFIX}{self.my_global_rank}", f"{host}:{pid}")
        except Exception as exc:  # noqa: BLE001
            self.store_error = f"store unreachable ({exc})"

    def fetch(self) -> bool:
        """Read the entries that are there (never waits for a missing one). True when complete."""
        store = self.store
        if store is None:
            return False
        missing = {r: g for r, g in self.ranks.items() if r not in self.table}
        try:
            for r, g in missing.items():
                key = f"{STORE_PREFIX}{g}"
                if not store.check([key]):
                    continue
                host, _, pid = store.get(key).decode().rpartition(":")
                self.table[r] = (host, int(pid))
        except Exception as exc:  # noqa: BLE001
            self.store_error = f"store unreachable ({type(exc).__name__}: {exc})"
            return False
        self.store_error = None
        return len(self.table) == len(self.ranks)

    def diagnose(self, me: int, alive=process_alive, grace: float = 1.0) -> Tuple[List[int], str]:
        """``(lost ranks, text)`` for an error message; fetches what is missing first.

        A killed process closes its sockets before the kernel marks it a zombie, so a peer that
        sees the connection drop can look before the process is gone: when no peer looks lost,
        look again for up to ``grace`` seconds."""
        if len(self.table) < len(self.ranks):
            self.fetch()
        lost, unchecked = _lost_with_grace(self.table, me, alive, grace)
        text = describe_lost(self.table, lost, unchecked, me)
        unknown = sorted(set(self.ranks) - set(self.table) - {me})
        if self.store_error is not None:
            host_rank = _store_host_rank(self.ranks)
            if host_rank is not None and host_rank not in lost:
                lost.append(host_rank)
                text = "; ".join(x for x in (
                    text, f"lost peer: rank {host_rank} (it hosts the rendezvous store, which is "
                          f"unreachable: {self.store_error})") if x)
            else:
                text = "; ".join(x for x in (text, self.store_error) if x)
        elif unknown:
            text = "; ".join(x for x in (text, f"ranks {unknown} never registered") if x)
        return sorted(lost), text


def _lost_with_grace(peers, me, alive, grace):
    deadline = time.monotonic() + grace
    while True:
        lost, unchecked = lost_peers(peers, me, alive=alive)
        if lost or time.monotonic() >= deadline or len(unchecked) + 1 >= len(peers):
            return lost, unchecked
        time.sleep(0.02)


def _store_host_rank(ranks: Dict[int, int]) -> Optional[int]:
    """The group rank of global rank 0 (which hosts the TCPStore of tcp:// and env://)."""
    for r, g in ranks.items():
        if g == 0:
            return r
    return None


def peers_from_list(items: Iterable[PeerIdentity]) -> Dict[int, PeerIdentity]:
    return {r: (str(h), int(p)) for r, (h, p) in enumerate(items)}
