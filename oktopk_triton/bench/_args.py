"""argparse ``type=`` validators shared by every ``oktopk-bench`` subcommand.

A bad value is refused while the command line is parsed: one line naming the option, what was
given and what is expected, and exit status 2, before any rank starts (a bad density used to
surface as a traceback on every rank)."""
from __future__ import annotations

import argparse
import os


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None


def positive_int(text: str) -> int:
    v = _number(text, int)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return v


def nonneg_int(text: str) -> int:
    v = _number(text, int)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return v


def positive_float(text: str) -> float:
    v = _number(text, float)
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return v


def nonneg_float(text: str) -> float:
    v = _number(text, float)
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return v


def density(text: str) -> float:
    v = _number(text, float)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a density in (0, 1], got {text}")
    return v


def fraction(text: str) -> float:
    v = _number(text, float)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text}")
    return v


def out_path(text: str) -> str:
    """A file the command will write: its folder must be a folder (or creatable)."""
    parent = os.path.dirname(os.path.abspath(text))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {parent!r} is a file, not a "
                                         "folder")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file path, got the folder {text!r}")
    return text


def out_dir(text: str) -> str:
    """A folder the command will write into: a folder, or creatable (not a file)."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a folder, got the file {text!r}")
    out_path(os.path.join(text, "x"))        # its parents: folders, or creatable
    return text


def device(text: str) -> str:
    if text not in ("cpu", "cuda") and not text.startswith("cuda:"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    if text.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} asked for, but this machine has no CUDA "
                                             "device")
    return text


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")
