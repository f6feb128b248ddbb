"""The smallest complete example: data-parallel training with a sparse gradient allreduce.

    torchrun --standalone --nproc_per_node 4 examples/train_digits.py [oktopk] [0.01] [10]

Each rank trains the same small CNN (same seed => same initial weights) on its own shard of
scikit-learn's digits; ``SparseAllreduce`` averages the gradients over the ranks, sending only
about ``density`` of them per step and keeping the rest in a residual (error feedback).
"""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import oktopk_triton
from oktopk_triton import SparseAllreduce
from oktopk_triton.config import as_config

algorithm = sys.argv[1] if len(sys.argv) > 1 else "oktopk"
density = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 10

torch.set_num_threads(1)
use_cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if use_cuda else "gloo")
rank, P = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")

d = load_digits()
X = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1).div(16).to(device)
y = torch.tensor(d.target).to(device)
perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0)).to(device)
test, train = perm[:450], perm[450:]
shard = train[rank::P]                      # this rank's part of the training set

torch.manual_seed(0)                        # identical initial weights on every rank
model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Flatten(), nn.Linear(1024, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
# momentum correction: the reducer applies the momentum before it sparsifies (an entry sent late
# carries the momentum it would have had), so the optimizer itself runs without momentum
sar = SparseAllreduce(model.parameters(), density=density,
                      algorithm=as_config(algorithm).replace(momentum=0.9))
opt = torch.optim.SGD(model.parameters(), lr=0.05)

for epoch in range(epochs):
    for i in range(0, len(shard) - 15, 16):
        idx = shard[i:i + 16]
        opt.zero_grad()
        loss = F.cross_entropy(model(X[idx]), y[idx])
        loss.backward()
        sar.reduce_gradients()              # averages .grad over ranks (sparse, error feedback)
        opt.step()
    with torch.no_grad():
        acc = (model(X[test]).argmax(1) == y[test]).float().mean().item()
    if rank == 0:
        print(f"epoch {epoch + 1}: loss {loss.item():.3f}  test acc {100 * acc:.1f}%  "
              f"{sar.stats['bytes_sent']} bytes sent by this rank in the last step", flush=True)
# barrier, destroy the group, leave before interpreter shutdown (where torch 2.13's gloo teardown
# can abort with SIGABRT and make torchrun report a finished job as failed)
oktopk_triton.shutdown(exit_code=0)
