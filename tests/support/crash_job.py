"""A training job that tests/runs/test_crash.py kills with SIGKILL (crash safety of snapshots).

``python tests/support/crash_job.py --out DIR [--kill-at MOMENT --kill-snapshot N --kill-rank R]``
(one process) or
``accelerate launch --config_file launch/cpu_ddp.yaml tests/support/crash_job.py ...``
(2 processes). A real ``transformers.Trainer`` trains a tiny float32 GPT-2 with a
`KFACStreamCallback` that writes a snapshot every step into ``DIR/kfac``, for ``--steps``
optimizer steps (many by default: the job is meant to be killed while it runs).

``--kill-at MOMENT`` makes rank ``--kill-rank`` print a ``CRASH-JOB kill ...`` line and send
itself SIGKILL at a chosen point of the ``--kill-snapshot``-th snapshot this process writes
(counted from 1, per process; with N ≥ 2 at least one snapshot of this run is complete):

* ``shard-start``      – the temporary directory exists, the shard is not written yet;
* ``shard-partial``    – the shard is written and then truncated to half its size on disk
  (what a crash in the middle of writing it leaves);
* ``shard-written``    – the shard is complete and fsynced, rank 0 has not verified it;
* ``manifest-start``   – rank 0 entered ``_finish`` (every shard is on disk), no manifest;
* ``manifest-partial`` – half of ``manifest.json`` is written (and fsynced);
* ``rename-before``    – the manifest is complete, ``os.replace(tmp, final)`` not called yet;
* ``rename-after``     – right after ``os.replace(tmp, final)``, before the fsync of the
  parent directory;
* ``replace-stale``    – re-snapshot of a step whose directory exists (a second run in the
  same output directory): the old directory is renamed away to ``.step-*.tmp-replaced``,
  the new one is not renamed in yet.

These are monkeypatches inside this process only (of ``kfac_stream.snapshot.writer``'s
``write_shard``, ``_finish`` and ``json``, and of ``os.replace``); the files are real.

Marker lines on stdout (flushed; one ``write`` each, so 2 ranks sharing a log do not mix):

* ``CRASH-JOB ready rank=R pid=P leftovers=[...]`` – after the callback's ``on_train_begin``
  (which removed stale temporary directories on rank 0): the ``.step-*.tmp-*`` entries left;
* ``CRASH-JOB snapshot-start rank=R n=N step=S`` – the N-th snapshot of this process enters
  the write protocol (its eigendecomposition is done); ``snapshot-done`` – it is written;
* ``CRASH-JOB kill rank=R moment=M n=N step=S`` – just before the self-inflicted SIGKILL;
* ``CRASH-JOB finished rank=R`` – training ended normally.

The test kills one rank from outside by the ``pid`` of its ``ready`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepspeed_cpu import skip_deepspeed_op_probe  # noqa: E402

from models import ListDataset, text_examples, tiny_gpt2  # noqa: E402

MOMENTS = ("shard-start", "shard-partial", "shard-written", "manifest-start",
           "manifest-partial", "rename-before", "rename-after", "replace-stale")
TMP_RE = re.compile(r"^\.step-\d{8}\.tmp-.+$")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--n-seq", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--kill-at", choices=MOMENTS, default=None)
    p.add_argument("--kill-snapshot", type=int, default=2,
                   help="the N-th snapshot written by this process (from 1)")
    p.add_argument("--kill-rank", type=int, default=0)
    return p.parse_args(argv)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def say(event: str, **fields) -> None:
    text = " ".join([f"CRASH-JOB {event}", f"rank={rank()}",
                     *(f"{k}={v}" for k, v in fields.items())])
    os.write(1, (text + "\n").encode())  # one write: lines of 2 ranks never interleave


def leftovers(root: str) -> list[str]:
    return sorted(e for e in (os.listdir(root) if os.path.isdir(root) else [])
                  if TMP_RE.match(e))


class Killer:
    """Counts the snapshots this process writes and kills it at the chosen moment."""

    def __init__(self, moment: str | None, nth: int, kill_rank: int) -> None:
        self.moment = moment if kill_rank == rank() else None
        self.nth = nth
        self.n = 0  # index of the snapshot being written (one at a time: the worker thread)
        self.step = -1
        self.lock = threading.Lock()

    def at(self, moment: str) -> None:
        if self.moment == moment and self.n == self.nth:
            say("kill", moment=moment, n=self.n, step=self.step)
            os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        import kfac_stream.snapshot.sequence as sequence
        import kfac_stream.snapshot.writer as writer

        real_write_snapshot = sequence.write_snapshot  # the callback's, via finish_snapshot

        def write_snapshot(root, step, *args, **kwargs):
            with self.lock:
                self.n += 1
                self.step = step
            say("snapshot-start", n=self.n, step=step)
            path = real_write_snapshot(root, step, *args, **kwargs)
            say("snapshot-done", n=self.n, step=step)
            return path

        sequence.write_snapshot = write_snapshot

        real_write_shard = writer.write_shard

        def write_shard(tmp_dir, tensors, r, world_size):
            self.at("shard-start")
            if self.moment == "shard-partial" and self.n == self.nth:
                info = real_write_shard(tmp_dir, tensors, r, world_size)
                path = os.path.join(tmp_dir, info["file"])
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.ftruncate(fd, os.path.getsize(path) // 2)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self.at("shard-partial")
            info = real_write_shard(tmp_dir, tensors, r, world_size)
            self.at("shard-written")
            return info

        writer.write_shard = write_shard

        real_finish = writer._finish

        def _finish(*args, **kwargs):
            self.at("manifest-start")
            return real_finish(*args, **kwargs)

        writer._finish = _finish

        killer = self

        class HalfJson:  # writer.json: ``dump`` writes the manifest (``dumps`` only checks it)
            def __getattr__(self, name):
                return getattr(json, name)

            @staticmethod
            def dump(obj, f, **kwargs):
                if killer.moment == "manifest-partial" and killer.n == killer.nth:
                    text = json.dumps(obj, **kwargs)
                    f.write(text[: len(text) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                    killer.at("manifest-partial")
                return json.dump(obj, f, **kwargs)

        writer.json = HalfJson()

        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            s, d = os.path.basename(os.fspath(src)), os.path.basename(os.fspath(dst))
            into_final = TMP_RE.match(s) and re.match(r"^step-\d{8}$", d)
            out_of_final = re.match(r"^step-\d{8}$", s) and d.endswith(".tmp-replaced")
            if into_final:
                self.at("rename-before")
            result = real_replace(src, dst, *args, **kwargs)
            if into_final:
                self.at("rename-after")
            if out_of_final:
                self.at("replace-stale")
            return result

        os.replace = replace


def main(argv=None) -> None:
    opts = parse(argv)
    skip_deepspeed_op_probe()
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from kfac_stream import KFACConfig, KFACStreamCallback

    killer = Killer(opts.kill_at, opts.kill_snapshot, opts.kill_rank)
    killer.install()
    model = tiny_gpt2(torch.float32, attn_implementation="eager")
    cfg = KFACConfig(snapshot_every=1, update_every=1, token_fraction=0.5,
                     storage_dtype="float32", seed=0, fisher="empirical")
    # earlier_runs="keep": the chains reuse one directory across killed runs on purpose (a run
    # re-snapshotting a step an earlier one wrote is one of the moments killed at)
    cb = KFACStreamCallback(cfg, earlier_runs="keep")
    root = os.path.join(opts.out, "kfac")

    class Ready(TrainerCallback):  # runs after cb.on_train_begin (callbacks run in order)
        def on_train_begin(self, *a, **k):
            say("ready", pid=os.getpid(), leftovers=json.dumps(leftovers(root),
                                                                separators=(",", ":")))

    args = TrainingArguments(
        opts.out, per_device_train_batch_size=opts.batch, gradient_accumulation_steps=1,
        max_steps=opts.steps, learning_rate=0.01, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, seed=0, dataloader_drop_last=True)
    trainer = Trainer(model=model, args=args,
                      train_dataset=ListDataset(text_examples(opts.n_seq, opts.seq_len)),
                      callbacks=[cb, Ready()])
    trainer.train()
    say("finished", snapshots=killer.n)


if __name__ == "__main__":
    main()
