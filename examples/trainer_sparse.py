"""The Transformers Trainer with the sparse allreduce, resumable per rank.

    torchrun --standalone --nproc_per_node 2 examples/trainer_sparse.py      # CPU/gloo or GPUs

Trains a small classifier for 2 epochs with a checkpoint after each; run it again (any number of
times) and it resumes from the last checkpoint (every rank reads back what it still owed) for 2
more. Delete out/trainer-sparse to start afresh.
"""
import os

import torch
from transformers import Trainer, TrainerState, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import oktopk_triton
from oktopk_triton.integrations.transformers import SparseAllreduceCallback

OUT = "out/trainer-sparse"


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 10))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def main():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 20, generator=g)
    y = (x @ torch.randn(20, 10, generator=g)).argmax(1)
    data = [{"x": x[i], "labels": y[i]} for i in range(len(y))]
    last = get_last_checkpoint(OUT) if os.path.isdir(OUT) else None
    done = 0 if last is None else round(
        TrainerState.load_from_json(os.path.join(last, "trainer_state.json")).epoch)
    args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=32,
                             num_train_epochs=done + 2, learning_rate=0.1, optim="sgd",
                             lr_scheduler_type="constant", save_strategy="epoch",
                             logging_strategy="epoch", report_to=[], disable_tqdm=True,
                             ddp_backend=None if torch.cuda.is_available() else "gloo",
                             use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=Classifier(), args=args, train_dataset=data)
    cb = SparseAllreduceCallback(trainer, density=0.01)
    trainer.add_callback(cb)
    result = trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        print(f"loss {result.training_loss:.4f} after {cb.sparse_state.iter} iterations; "
              f"{cb.sparse_state.total_bytes_sent / 1e6:.2f} MB sent by rank 0"
              + (" (resumed)" if last else ""))


if __name__ == "__main__":
    main()
    oktopk_triton.shutdown(exit_code=0)  # barrier, destroy the group, leave (no gloo abort)
