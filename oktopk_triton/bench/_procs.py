"""Pieces every multi-process launcher here shares (``oktopk-bench collectives`` and ``ddp``,
and the tests' ``run_gloo``): a free loopback port, environment variables set around the
spawning of ranks, and the way a rank process ends."""
from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Any, Dict, Iterator, NoReturn, Optional

__all__ = ["free_port", "environ", "exit_rank"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environ(changes: Dict[str, Optional[str]]) -> Iterator[None]:
    """Set the environment variables in ``changes`` (``None``: unset) for the block, e.g. while
    spawned children start and read them; restore the previous values afterwards."""
    saved = {k: os.environ.get(k) for k in changes}
    try:
        _apply(changes)
        yield
    finally:
        _apply(saved)


def _apply(values: Dict[str, Optional[str]]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def exit_rank(q: Any, code: int) -> NoReturn:
    """End a rank process: flush its result queue and stdio, then ``os._exit(code)``, skipping
    the process-group teardown, which can block on a dead peer."""
    try:
        q.close()
        q.join_thread()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
