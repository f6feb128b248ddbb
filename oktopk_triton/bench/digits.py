"""The digits classifier of ``oktopk-bench train --model cnn|mlp``: scikit-learn's bundled 8x8
digits (no download) split once into training and test sets, the CNN / MLP, and its test
accuracy. The training loop is :func:`oktopk_triton.bench.loops.train_one`."""
from __future__ import annotations


def make_model(kind: str, width: int = 32):
    """cnn (width 32): conv 1->32 ->64 (3x3), pool, fc 1024->64->10: 85,066 parameters;
    mlp (width 32): 64->256->256->10: 85,002 parameters."""
    import torch.nn as nn
    if kind == "cnn":
        w = width
        return nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * w * 16, 64), nn.ReLU(), nn.Linear(64, 10))
    if kind == "mlp":
        h = 8 * width
        return nn.Sequential(nn.Flatten(), nn.Linear(64, h), nn.ReLU(), nn.Linear(h, h),
                             nn.ReLU(), nn.Linear(h, 10))
    raise ValueError(f"unknown model {kind!r}")


def load_data(test_fraction: float = 0.25, train_subset: int = 0, split_seed: int = 0):
    """Digits as float tensors [N, 1, 8, 8] in [0, 1]; a fixed stratified-enough random split."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    d = load_digits()
    X = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.from_numpy(np.random.RandomState(split_seed).permutation(len(y)))
    n_test = int(round(test_fraction * len(y)))
    te, tr = perm[:n_test], perm[n_test:]
    if train_subset:
        tr = tr[:train_subset]
    return X[tr], y[tr], X[te], y[te]


def evaluate(model, X, y, batch: int = 512) -> float:
    import torch
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(y), batch):
            correct += (model(X[i:i + batch]).argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return correct / max(1, len(y))
