"""Where an update step's time goes on a GPU: a torch.profiler trace of tracked steps.

Method: the ~1.1B Llama of ``gpu_check.py`` part 3a (TinyLlama's shapes from a config, fp32
weights with bf16 autocast, 4 x 1024 random tokens, gradient accumulation 2), trained with
``KFACConfig(update_every=1, min_window_sequences=0, snapshot_every=10**6)`` (every step an
update step at the long-run MC share), ``--steps`` steps; steps ``--from`` .. ``--steps - 1``
are profiled (CPU and CUDA activities, every thread: the training thread, the factor worker,
their streams). Prints the kernels and ops by device time and by host time, each step's
wall time, and the tracker's counters, and writes the tables to ``--out`` (a directory).

Without CUDA (``--dry-run``): the same on a 2-layer Llama on the CPU (the device path with the
CPU standing in for the device), to check the script.

Usage (GPU machine, docs/gpu.md): ``python3 benchmarks/probes/profile_update.py --out DIR``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from kfac_stream import KFACConfig, KFACStreamCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import RandomTokens  # noqa: E402

TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


class Profiled(TrainerCallback):
    """After the kfac callback: starts the profiler at step ``start``'s begin, stops it at
    the last step's end; records each step's wall time (synchronised at both ends)."""

    def __init__(self, start: int, cuda: bool):
        self.start, self.cuda, self.prof, self.walls, self._t = start, cuda, None, [], None

    def on_step_begin(self, args, state, control, **kw):
        if self.cuda:
            torch.cuda.synchronize()
        self._t = time.perf_counter()
        if state.global_step == self.start:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kw):
        if self.cuda:
            torch.cuda.synchronize()  # whole steps: the worker's kernels included
        self.walls.append((state.global_step, time.perf_counter() - self._t))
        if state.global_step == state.max_steps and self.prof is not None:
            self.prof.__exit__(None, None, None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--from", dest="start", type=int, default=5)
    p.add_argument("--out", default=None, help="directory for the tables")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    llama, batch, seq = (TINYLLAMA, 4, 1024) if cuda else (TINY, 2, 32)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**llama, max_position_embeddings=seq,
                                             use_cache=False))
    kfac = KFACStreamCallback(KFACConfig(
        update_every=1, min_window_sequences=0, snapshot_every=10**6,
        **({} if cuda else {"async_updates": True, "fold_on": "device"})))
    prof = Profiled(a.start, cuda)
    args = TrainingArguments(
        "/tmp/kfac-profile-update", per_device_train_batch_size=batch,
        gradient_accumulation_steps=2, max_steps=a.steps, learning_rate=1e-5,
        lr_scheduler_type="constant", report_to=[], use_cpu=not cuda, bf16=True,
        logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_pin_memory=False, max_grad_norm=0.0)
    data = RandomTokens(batch * 2 * a.steps, seq, llama["vocab_size"], pool=16)
    Trainer(model=model, args=args, train_dataset=data,
            callbacks=[kfac, prof]).train()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = prof.prof.key_averages()
    tables = {
        "by_device_time": events.table(sort_by=key, row_limit=40, max_name_column_width=70),
        "by_host_time": events.table(sort_by="self_cpu_time_total", row_limit=30,
                                     max_name_column_width=70),
    }
    walls = "\n".join(f"step {s}: {w * 1e3:.1f} ms" for s, w in prof.walls)
    c = kfac.tracker.read_counters()
    counters = (f"updates {c.updates}, fold {c.fold_seconds:.3f} s, waits {c.waits}, "
                f"tracker {c.tracker_seconds:.3f} s")
    for name, t in tables.items():
        print(f"== {name} (steps {a.start}..{a.steps - 1}) ==\n{t}")
    print(f"== step wall times (synchronised) ==\n{walls}\n{counters}")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, t in tables.items():
            (out / f"profile_{name}.txt").write_text(t)
        (out / "profile_steps.txt").write_text(walls + "\n" + counters + "\n")
    kfac.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
