"""Lightning: SparseDDPStrategy on 2 CPU gloo ranks against the real Trainer. The hook is
registered on CPU (Lightning's own DDPStrategy skips it there), the replicas stay bitwise equal,
the precision plugin's GradScaler reaches the state, and fit(ckpt_path=...) with a fresh Trainer
and module continues bit for bit from the per-rank files, also through a checkpoint saved
straight after a load (nothing left to train) and a fit from that checkpoint. Both runs share one
launch of the ranks (a launch imports Lightning: ~20 s of CPU); tests/test_examples.py resumes
in fresh processes. Lightning is imported in the ranks only (importing it costs ~10 s of
CPU, which collecting this module in every test worker would pay)."""
import functools
import importlib.util
import os

import pytest
import torch

import integutil as U
from distutil import run_gloo

if importlib.util.find_spec("lightning") is None:
    pytest.skip("needs lightning", allow_module_level=True)

EPOCHS = 2     # 4 steps an epoch on each rank (64 samples, batch 8, 2 ranks)


@functools.cache
def _classifier_class():
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = U.net()

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
    return Classifier


def Classifier():
    return _classifier_class()()


def _trainer(epochs, **kw):
    import lightning.pytorch as pl

    from oktopk_triton.integrations.lightning import SparseDDPStrategy
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=2, strategy=SparseDDPStrategy(density=0.05),
                      max_epochs=epochs, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kw)


def _loader():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*U.dataset()),
                                       batch_size=8)


def _first(comm, tmp):
    U.launched_by_torchrun(comm)
    whole = Classifier()
    # ModelCheckpoint saves after each epoch (on every rank: Lightning's file on rank 0, the
    # rank files on each)
    from lightning.pytorch.callbacks import ModelCheckpoint
    every = ModelCheckpoint(dirpath=tmp, filename="{epoch}", save_top_k=-1)
    t = _trainer(EPOCHS, enable_checkpointing=True, callbacks=[every])
    t.fit(whole, _loader())
    hooked = t.strategy.sparse_state.iter       # iterations the hook saw
    owed = torch.load(os.path.join(tmp, "epoch=0.ckpt.oktopk", f"oktopk-rank{comm.rank}-of2.pt"),
                      weights_only=True)["state"]["reducers"][-1]["residual"]
    t.strategy.remove_checkpoint(os.path.join(tmp, "epoch=1.ckpt"))   # goes with its rank files
    t.strategy.barrier()
    # 16-mixed on CPU: the plugin's scaler is handed to the state
    from lightning.pytorch.plugins import MixedPrecision
    scaler = torch.amp.GradScaler("cpu")
    t = _trainer(1, max_steps=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    t.fit(Classifier(), _loader())
    return U.flat(whole), hooked, owed, t.strategy.sparse_state.scaler is scaler


def _resume(comm, tmp):
    U.launched_by_torchrun(comm)
    # load with nothing left to train (max_epochs reached), save straight away: the state is
    # saved as loaded; the resume then reads that save
    t = _trainer(1)
    t.fit(Classifier(), _loader(), ckpt_path=os.path.join(tmp, "epoch=0.ckpt"))
    assert t.strategy.sparse_state.iter == 4 and not t.strategy.sparse_state.reducers
    t.save_checkpoint(os.path.join(tmp, "again.ckpt"))
    m = Classifier()
    t = _trainer(EPOCHS)
    t.fit(m, _loader(), ckpt_path=os.path.join(tmp, "again.ckpt"))
    return U.flat(m), t.strategy.sparse_state.iter


def _both(comm, tmp):
    """The first run, the files it left (as listed then), and the resumed run."""
    first = _first(comm, tmp)
    torch.distributed.barrier()
    left = (sorted(os.listdir(tmp)), sorted(os.listdir(os.path.join(tmp, "epoch=0.ckpt.oktopk"))))
    torch.distributed.barrier()
    return first, left, _resume(comm, tmp)


@pytest.mark.slow
def test_lightning_strategy_trains_and_resumes_bit_for_bit(tmp_path):
    tmp = str(tmp_path)
    both = run_gloo(2, _both, tmp, timeout=300)
    first = [b[0] for b in both]
    for whole, hooked, owed, has_scaler in first:
        assert hooked == EPOCHS * 4 and has_scaler
        assert torch.equal(whole, first[0][0])                   # replicas bitwise equal
        assert owed.abs().sum() > 0                               # each rank owes something
    assert not torch.equal(first[0][2], first[1][2])              # and not the same thing
    assert both[0][1] == (["epoch=0.ckpt", "epoch=0.ckpt.oktopk"],
                          ["oktopk-rank0-of2.pt", "oktopk-rank1-of2.pt"])
    for r, (w, it) in enumerate(b[2] for b in both):
        assert it == EPOCHS * 4
        assert torch.equal(w, first[r][0]), (w - first[r][0]).abs().max()
        again = torch.load(os.path.join(tmp, "again.ckpt.oktopk", f"oktopk-rank{r}-of2.pt"),
                           weights_only=True)["state"]["reducers"][-1]["residual"]
        assert torch.equal(again, first[r][2])       # the save after the load kept it
