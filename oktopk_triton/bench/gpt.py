"""A small GPT and its corpus for ``oktopk-bench train --model gpt``.

Why a language model: the digits CNN has 85k parameters, so at density 0.1% a step moves k = 85
entries. Users of sparse allreduce train transformers, where k/P is in the thousands and the
gradient is shaped by embeddings, attention and layer norms. This is the smallest such model
that every machine can train with no download:

* **Corpus**: the Python standard library's own ``.py`` files, found through
  ``sysconfig.get_paths()["stdlib"]``. Site-packages and the test suites (``test``, ``tests``,
  ``idle_test``: Debian and others ship them separately, so they are not on every machine) are
  left out. The file list is sorted and split into training and validation **by file** with a
  fixed seed, so no validation file is ever seen in training. The corpus still depends on the
  Python version; its fingerprint (files, bytes, sha256 of names and sizes) goes into the JSON.
* **Model**: decoder-only transformer over bytes (vocabulary 256), pre-LayerNorm, learned
  positions, output layer tied to the byte embedding, causal ``scaled_dot_product_attention``,
  GPT-2 initialisation (projections into the residual stream scaled by 1/sqrt(2·layers)).
* **Sizes** (:data:`SIZES`): ``1m`` is the CPU default (4 gloo ranks on 2 shared cores finish a
  run in a few minutes); ``4m`` is 1m at twice the width (size trends); ``25m`` and ``100m`` are
  for a GPU (``--device cuda``); ``tiny`` is for tests.

Everything here is plain torch; the training loop is in :mod:`oktopk_triton.bench.lm_loop`.
"""
from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "SIZES", "GPT", "num_parameters", "batch_at", "val_starts", "ByteCorpus",
           "stdlib_files", "load_corpus"]

VOCAB = 256
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@dataclass(frozen=True)
class GPTConfig:
    d_model: int
    n_layer: int
    n_head: int
    context: int
    mlp_ratio: int = 4
    vocab: int = VOCAB

    def as_dict(self) -> Dict[str, int]:
        return asdict(self)

    def num_parameters(self) -> int:
        """Distinct parameters of :class:`GPT` with this config, without building it."""
        d, h = self.d_model, self.mlp_ratio * self.d_model
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        return self.vocab * d + self.context * d + self.n_layer * block + 2 * d


# the 1m preset's training defaults; 4m trains on the same tokens with a copy of them
_1M_TRAINING = dict(batch_size=8, steps=150, eval_sequences=256, lr=3e-3)

# name -> (model, training defaults). The training defaults are what ``--size`` sets unless the
# command line overrides them (batch per rank, steps, eval sequences, lr).
SIZES: Dict[str, Tuple[GPTConfig, Dict[str, Any]]] = {
    # tests: a few thousand parameters, a few ms per step
    "tiny": (GPTConfig(d_model=32, n_layer=1, n_head=2, context=32),
             dict(batch_size=4, steps=20, eval_sequences=16, lr=3e-3)),
    # CPU default, 1.04M parameters. Budget: 4 gloo ranks on 2 cores shared with other jobs.
    # fwd+bwd of 8 x 128 bytes is ~0.17 s on one idle core; a dense run of 150 steps took 1.5-2.5
    # min there, an Ok-Topk run ~2.5x that (its CPU reduce is torch ops over the whole vector).
    # 150 steps x 4 ranks x 1024 bytes (0.6M bytes seen) take dense from 5.5 (uniform) to ~2.5
    # nats/byte (unigram entropy 3.29) with 20% warm-up; with 5% it sat at ~2.8 (a plateau).
    "1m": (GPTConfig(d_model=128, n_layer=5, n_head=4, context=128), _1M_TRAINING),
    # the 1m recipe at twice the width, 4.0M parameters (3.9x): the model-size trend of a
    # campaign compares dense and sparse on it at 1m's tokens (same batch, steps and lr)
    "4m": (GPTConfig(d_model=256, n_layer=5, n_head=4, context=128), dict(_1M_TRAINING)),
    # a second family that no campaign tuned, 0.48M parameters: another width, depth, context,
    # lr and betas. The presets (oktopk_triton.presets) are checked on it beside the 4m GPT
    "480k": (GPTConfig(d_model=96, n_layer=4, n_head=3, context=64),
             dict(batch_size=8, steps=400, eval_sequences=256, lr=1e-3, betas=(0.9, 0.99))),
    # GPU presets (--device cuda): GPT-2-like shapes
    "25m": (GPTConfig(d_model=512, n_layer=8, n_head=8, context=512),
            dict(batch_size=32, steps=3000, eval_sequences=512, lr=1e-3)),
    "100m": (GPTConfig(d_model=768, n_layer=14, n_head=12, context=1024),
             dict(batch_size=16, steps=3000, eval_sequences=512, lr=6e-4)),
}


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h = self.n_head
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, h, D // h).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level decoder-only transformer; ``forward(idx)`` returns logits [B, T, 256]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of n_head {cfg.n_head}")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight          # weight tying: one tensor, one gradient
        self.apply(self._init)
        for b in self.blocks:                        # GPT-2: residual projections scaled down
            for lin in (b.proj, b.out):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.context:
            raise ValueError(f"sequence of {T} bytes is longer than the context {self.cfg.context}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross entropy (nats) of ``idx[:, 1:]`` given ``idx[:, :-1]``."""
        logits = self(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               idx[:, 1:].reshape(-1))


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (the tied embedding counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ------------------------------------------------------------------------------------------
# corpus
# ------------------------------------------------------------------------------------------
def stdlib_files(root: Optional[str] = None) -> List[str]:
    """The standard library's ``.py`` files (paths relative to ``root``), sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for dp, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dp, f), root))
    return sorted(out)


@dataclass
class ByteCorpus:
    """Training and validation bytes (uint8 tensors, files concatenated) and where they came
    from."""
    train: torch.Tensor
    val: torch.Tensor
    info: Dict[str, object]

    def unigram_entropy(self) -> float:
        """Entropy (nats/byte) of the training bytes' frequencies, evaluated on validation: the
        cross entropy of the best model that ignores context (what "learned something" beats)."""
        p = torch.bincount(self.train.long(), minlength=VOCAB).double() + 1.0
        p = p / p.sum()
        q = torch.bincount(self.val.long(), minlength=VOCAB).double()
        return float(-(q * p.log()).sum() / q.sum())


def load_corpus(val_fraction: float = 0.1, split_seed: int = 0, root: Optional[str] = None,
                max_train_bytes: int = 0) -> ByteCorpus:
    """Read the stdlib ``.py`` files and split them by file (a fixed permutation of the sorted
    list: the first ``val_fraction`` of files are validation)."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = stdlib_files(root)
    if len(files) < 10:
        raise RuntimeError(f"found only {len(files)} .py files under {root}")
    g = torch.Generator().manual_seed(split_seed)
    perm = torch.randperm(len(files), generator=g).tolist()
    n_val = max(1, int(round(val_fraction * len(files))))
    val_set = set(perm[:n_val])
    chunks: Dict[str, List[bytes]] = {"train": [], "val": []}
    h = hashlib.sha256()
    total = 0
    for i, rel in enumerate(files):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        h.update(f"{rel}\0{len(data)}\n".encode())
        total += len(data)
        chunks["val" if i in val_set else "train"].append(data)
    train = b"".join(chunks["train"])
    if max_train_bytes:
        train = train[:max_train_bytes]
    val = b"".join(chunks["val"])
    import sys
    info = dict(root=root, python=sys.version.split()[0], files=len(files), bytes=total,
                val_files=n_val, train_bytes=len(train), val_bytes=len(val),
                split_seed=split_seed, sha256=h.hexdigest()[:16],
                skipped_dirs=sorted(SKIP_DIRS))
    return ByteCorpus(train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
                      val=torch.frombuffer(bytearray(val), dtype=torch.uint8), info=info)


def batch_at(data: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """[len(starts), length] int64 windows of ``data`` beginning at ``starts``."""
    idx = starts.reshape(-1, 1) + torch.arange(length, device=starts.device).reshape(1, -1)
    return data[idx].long()


def val_starts(n_bytes: int, sequences: int, length: int) -> torch.Tensor:
    """Evenly spaced validation windows over the whole validation text (deterministic)."""
    last = n_bytes - length
    if last < 0:
        raise ValueError(f"validation text ({n_bytes} bytes) shorter than one window ({length})")
    return torch.linspace(0, last, sequences).round().long()
