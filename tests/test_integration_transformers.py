"""Transformers Trainer: SparseAllreduceCallback on 2 CPU gloo ranks against the real Trainer.
The hook is registered on trainer.model_wrapped, the replicas stay bitwise equal, every
checkpoint holds one file per rank, and resume_from_checkpoint into a fresh Trainer and model
continues bit for bit (against the same run, which saved after each epoch), also through a save
made straight after a load (a resume with nothing left to train) and a load of that save. Both
runs share one launch of the ranks (a launch imports the framework: ~8 s of CPU);
tests/test_examples.py resumes in fresh processes."""
import importlib.util
import os

import pytest
import torch

import integutil as U
from distutil import run_gloo

if importlib.util.find_spec("transformers") is None:      # imported in the ranks only
    pytest.skip("needs transformers", allow_module_level=True)

EPOCHS = 2    # 4 steps an epoch on each rank


class Classifier(torch.nn.Module):
    """What the Trainer calls: keyword inputs, a dict with the loss."""

    def __init__(self):
        super().__init__()
        self.net = U.net()

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def _trainer(tmp, **kw):
    from transformers import Trainer, TrainingArguments
    x, y = U.dataset()
    data = [{"x": x[i], "labels": y[i]} for i in range(len(y))]
    args = TrainingArguments(output_dir=tmp, use_cpu=True, ddp_backend="gloo",
                             per_device_train_batch_size=8, num_train_epochs=EPOCHS,
                             learning_rate=0.1, lr_scheduler_type="constant", optim="sgd",
                             weight_decay=0.0, save_strategy="epoch", logging_strategy="no",
                             report_to=[], disable_tqdm=True, seed=0, **kw)
    model = Classifier()
    return Trainer(model=model, args=args, train_dataset=data), model


def _run(comm, tmp, resume):
    U.launched_by_torchrun(comm)
    from oktopk_triton.integrations.transformers import SparseAllreduceCallback
    again = os.path.join(tmp, "again")
    if resume:
        # a Trainer that resumes with nothing left to train (max_steps reached) loads every
        # rank's state and saves it straight away (no step: saved as loaded) ...
        t, _ = _trainer(again, max_steps=4)
        cb = SparseAllreduceCallback(t, density=0.05,
                                     resume_from=os.path.join(tmp, "checkpoint-4"))
        t.add_callback(cb)
        t.train(resume_from_checkpoint=os.path.join(tmp, "checkpoint-4"))
        assert cb.sparse_state.iter == 4 and not cb.sparse_state.reducers
        t.callback_handler.on_save(t.args, t.state, t.control)
    trainer, model = _trainer(tmp)
    # ... and the resumed run reads the files of that save
    cb = SparseAllreduceCallback(trainer, density=0.05,
                                 resume_from=os.path.join(again, "checkpoint-4") if resume
                                 else None)
    trainer.add_callback(cb)
    trainer.train(resume_from_checkpoint=os.path.join(tmp, "checkpoint-4") if resume else None)
    wrapped = type(trainer.model_wrapped).__name__
    return U.flat(model), cb.sparse_state.iter, wrapped


def _owed(directory):
    return [torch.load(os.path.join(directory, "oktopk", f"oktopk-rank{r}-of2.pt"),
                       weights_only=True)["state"]["reducers"][-1]["residual"] for r in (0, 1)]


def _both(comm, tmp):
    """The first run, the rank files of its checkpoints and what they owed (as they were then),
    and the resumed run."""
    import torch.distributed as dist
    first = _run(comm, tmp, False)
    dist.barrier()
    saved = [sorted(os.listdir(os.path.join(tmp, f"checkpoint-{step}", "oktopk")))
             for step in (4, 8)]
    owed = _owed(os.path.join(tmp, "checkpoint-4"))
    dist.barrier()
    return first, saved, owed, _run(comm, tmp, True)


@pytest.mark.slow
def test_trainer_callback_trains_and_resumes_bit_for_bit(tmp_path):
    tmp = str(tmp_path)
    both = run_gloo(2, _both, tmp, timeout=300)
    first = [b[0] for b in both]
    for w, it, wrapped in first:
        assert it == EPOCHS * 4 and wrapped == "DistributedDataParallel"
        assert torch.equal(w, first[0][0])                      # replicas bitwise equal
    assert both[0][1] == [["oktopk-rank0-of2.pt", "oktopk-rank1-of2.pt"]] * 2
    owed = both[0][2]
    assert owed[0].abs().sum() > 0 and not torch.equal(owed[0], owed[1])
    for r, (w, it, _) in enumerate(b[3] for b in both):
        assert it == EPOCHS * 4
        assert torch.equal(w, first[r][0]), (w - first[r][0]).abs().max()
    # the save straight after the load wrote what each rank owed, as loaded
    for a, b in zip(_owed(os.path.join(tmp, "again", "checkpoint-4")), owed):
        assert torch.equal(a, b)
