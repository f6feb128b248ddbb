"""Accelerate with the sparse allreduce, resumable per rank.

    torchrun --standalone --nproc_per_node 2 examples/accelerate_sparse.py   # or accelerate launch

Trains a small classifier for 2 epochs and saves the state; run it again (any number of times)
and ``accelerator.load_state`` restores every rank's residual, then it trains 2 more epochs.
Delete out/accelerate-sparse to start afresh.
"""
import os

import torch
from accelerate import Accelerator

import oktopk_triton
from oktopk_triton.integrations.accelerate import register

OUT = "out/accelerate-sparse"


def main():
    accelerator = Accelerator(cpu=not torch.cuda.is_available())   # CPU: gloo processes
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 20, generator=g)
    y = (x @ torch.randn(20, 10, generator=g)).argmax(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = register(accelerator, model, density=0.01)      # after prepare
    resume = os.path.isdir(OUT)
    if resume:
        accelerator.load_state(OUT)
    for _ in range(2):
        for xb, yb in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            opt.step()
    accelerator.save_state(OUT)          # every rank also writes OUT/oktopk/oktopk-rank{r}-of{P}.pt
    loss = accelerator.reduce(loss.detach(), "mean")
    if accelerator.is_main_process:
        print(f"loss {float(loss):.4f} after {state.iter} iterations; "
              f"{state.total_bytes_sent / 1e6:.2f} MB sent by rank 0"
              + (" (resumed)" if resume else ""))
    accelerator.end_training()


if __name__ == "__main__":
    main()
    # barrier, destroy the group, leave before interpreter shutdown (where torch 2.13's gloo
    # teardown can abort a finished rank with SIGABRT)
    oktopk_triton.shutdown(exit_code=0)
