"""A training job with Trainer checkpoints that tests/runs/test_checkpoint_kills.py SIGKILLs and
resumes (the tracker state is never missing from a checkpoint the Trainer considers complete).

``python tests/support/checkpoint_job.py --out DIR [--resume CHECKPOINT|latest]
[--kill-after-state N]``

A real ``transformers.Trainer`` trains a tiny float32 GPT-2 with a `KFACStreamCallback`
(update every step, float32 storage: deterministic and bit-reproducible on CPU) for ``--steps``
steps, saving a checkpoint every ``--save-steps`` with ``save_total_limit=2`` (so the Trainer
rotates old checkpoints away while the job runs). The data order is sequential, so a resumed run
sees the same batches as an uninterrupted one.

``--kill-after-state N``: right after the Trainer writes the N-th ``trainer_state.json`` of this
process (the checkpoint is complete for the Trainer; ``on_save`` and the rotation have not run),
the process prints ``CKPT-JOB kill ...`` and SIGKILLs itself. The test also kills it from outside
at random moments.

Marker lines on stdout: ``CKPT-JOB ready pid=P step=S t=T`` (after ``on_train_begin``: the step
it resumed at, wall time), ``CKPT-JOB restored ...`` (the tracker's resume log line),
``CKPT-JOB saved step=S t=T`` (after each checkpoint), ``CKPT-JOB trained ... t=T``
(``on_train_end``), ``CKPT-JOB finished``.
At the end it writes ``DIR/final-<tag>.safetensors`` with the factors (``--tag``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import ListDataset, text_examples, tiny_gpt2  # noqa: E402


def say(event: str, **fields) -> None:
    line = " ".join([f"CKPT-JOB {event}"] + [f"{k}={v}" for k, v in fields.items()]) + "\n"
    sys.stdout.write(line)
    sys.stdout.flush()


class SayRestored(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "restored" in msg or "start from zero" in msg:
            say("restored" if "restored" in msg else "fresh", msg=repr(msg))


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default=None)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--kill-after-state", type=int, default=0)
    p.add_argument("--tag", default="run")
    opts = p.parse_args(argv)
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    from safetensors.torch import save_file
    from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments

    from kfac_stream import KFACConfig, KFACStreamCallback

    logging.getLogger("kfac_stream").addHandler(SayRestored())
    logging.getLogger("kfac_stream").setLevel(logging.INFO)
    if opts.kill_after_state:
        original, count = TrainerState.save_to_json, [0]

        def save_to_json(self, path):
            original(self, path)
            count[0] += 1
            if count[0] == opts.kill_after_state:
                say("kill", step=self.global_step, path=path)
                os.kill(os.getpid(), signal.SIGKILL)

        TrainerState.save_to_json = save_to_json

    # final_refresh off: a chain killed after its last checkpoint ends with that checkpoint's
    # tracker state, which a refresh at train end never touches
    # (`tests/unit/tracking/test_refresh.py`)
    cb = KFACStreamCallback(KFACConfig(update_every=1, token_fraction=0.5, ema_decay=0.9,
                                       storage_dtype="float32", snapshot_every=10**6, seed=0,
                                       fisher="empirical", final_refresh="off"))

    class Ready(TrainerCallback):  # after cb.on_train_begin (callbacks run in order)
        def on_train_begin(self, args, state, control, **kwargs):
            say("ready", pid=os.getpid(), step=state.global_step, t=time.time())

        def on_save(self, args, state, control, **kwargs):  # after cb.on_save
            say("saved", step=state.global_step, t=time.time())

        def on_train_end(self, args, state, control, **kwargs):
            say("trained", step=state.global_step, t=time.time())

    class SequentialTrainer(Trainer):
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    args = TrainingArguments(
        opts.out, per_device_train_batch_size=2, max_steps=opts.steps, learning_rate=0.05,
        optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        report_to=[], use_cpu=True, save_strategy="steps", save_steps=opts.save_steps,
        save_total_limit=2, logging_strategy="no", disable_tqdm=True, seed=0,
        dataloader_drop_last=True)
    trainer = SequentialTrainer(model=tiny_gpt2(torch.float32, attn_implementation="eager"),
                                args=args, train_dataset=ListDataset(text_examples(64, 16)),
                                callbacks=[cb, Ready()])
    # "latest": the Trainer's own choice (resume_from_checkpoint=True: the newest checkpoint-*)
    trainer.train(resume_from_checkpoint=True if opts.resume == "latest" else opts.resume)
    factors = {k: v.contiguous() for k, v in cb.tracker.store.values().items()}
    save_file(factors, os.path.join(opts.out, f"final-{opts.tag}.safetensors"),
              metadata={"updates": str(cb.tracker.counters.updates)})
    say("finished", updates=cb.tracker.counters.updates)


if __name__ == "__main__":
    main()
