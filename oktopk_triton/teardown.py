"""Ending a rank of a torch.distributed job without torch 2.13's gloo teardown abort.

A gloo job can end in SIGABRT (``terminate called without an active exception``) after its work
is done: process-group objects that are still referenced when the interpreter shuts down are
destroyed during finalisation, when their worker threads can no longer take the interpreter
lock (measured on torch 2.13, 2 gloo ranks: 6 of 30 runs of the README's example, 3 of 20 of a
plain torch.distributed script; an upstream fix, an atexit hook, was abandoned). torchrun then
reports the job failed. :func:`shutdown` releases everything while the interpreter is alive
and, with ``exit_code``, leaves before finalisation.
"""
from __future__ import annotations

import gc
import os
import sys
from typing import NoReturn, Optional


def shutdown(exit_code: Optional[int] = None) -> Optional[NoReturn]:
    """End this rank: wait for every rank (a barrier: no collective of ours is left in flight),
    destroy the default process group and collect garbage, so that no process-group object is
    left for interpreter shutdown. With ``exit_code`` (recommended as a script's last line),
    flush stdout and stderr and leave at once with ``os._exit(exit_code)``, skipping interpreter
    finalisation: close your files and join your threads first. Without a process group it
    only does the exit."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    gc.collect()
    if exit_code is None:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(exit_code))
