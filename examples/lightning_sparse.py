"""Lightning with the sparse allreduce, resumable per rank.

    torchrun --standalone --nproc_per_node 2 examples/lightning_sparse.py      # CPU/gloo or GPUs

Trains a small classifier for 2 epochs, saving a checkpoint after each; run it again (any number
of times) and it resumes from the last one (every rank reads back what it still owed), then
trains 2 more. Delete out/lightning-sparse to start afresh.
"""
import os

import lightning.pytorch as pl
import torch

import oktopk_triton
from oktopk_triton.integrations.lightning import SparseDDPStrategy

OUT = "out/lightning-sparse"


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 10))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 20, generator=g)
    y = (x @ torch.randn(20, 10, generator=g)).argmax(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    last = os.path.join(OUT, "last.ckpt")
    resume = os.path.isfile(last)
    # the epochs already trained (the checkpoint's epoch is the last finished one, from 0)
    done = torch.load(last, map_location="cpu", weights_only=True)["epoch"] + 1 if resume else 0
    trainer = pl.Trainer(
        strategy=SparseDDPStrategy(density=0.01),     # algorithm="oktopk"
        accelerator="auto", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        max_epochs=done + 2, logger=False, enable_progress_bar=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=OUT, save_last=True)])
    trainer.fit(Classifier(), loader, ckpt_path=last if resume else None)
    state = trainer.strategy.sparse_state
    if trainer.is_global_zero:
        print(f"loss {float(trainer.callback_metrics['loss']):.4f} after {state.iter} "
              f"iterations; {state.total_bytes_sent / 1e6:.2f} MB sent by rank 0"
              + (" (resumed)" if resume else ""))


if __name__ == "__main__":
    main()
    oktopk_triton.shutdown(exit_code=0)  # barrier, destroy the group, leave (no gloo abort)
