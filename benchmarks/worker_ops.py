"""How many torch ops the factor worker issues per update: host work that holds the GIL.

Each op costs host time (Python, dispatch, a kernel launch on a GPU: ~5-10 µs) whatever its
size, and the worker thread holds the GIL while it issues them, which the training thread needs
to launch its own kernels. On an H200 an update step of the ~1.1B Llama cost +93-132 ms
(docs/gpu.md); this counts what a CPU can count of it.

Method: TinyLlama's layer structure (22 layers: 242 factors; hidden 64 so that it runs on a CPU:
the op count does not depend on the widths), every step an update step with the whole
micro-batch replayed (``update_every=1``, ``mc_sequences=1.0``), the device path with the CPU
standing in for the device (``fold_on="device"``), the worker inline; a ``TorchDispatchMode``
around ``FactorUpdater._apply`` counts the aten ops of each update. Prints ops per update and per
factor and the most frequent ops, and writes ``benchmarks/results/worker_ops.json``.

Usage: ``python benchmarks/worker_ops.py [--quick]``
"""

from __future__ import annotations

import argparse
import collections
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import kfac_stream.tracking.factor_updates as factor_updates
from kfac_stream import KFACConfig, KFACStreamCallback

from _common import RandomTokens, log, machine, write_json

LAYERS = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=22,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 layers, writes nothing")
    a = p.parse_args(argv)
    layers = dict(LAYERS, num_hidden_layers=2) if a.quick else LAYERS
    counts: list[collections.Counter] = []
    real = factor_updates.FactorUpdater._apply

    def counted(self, job):
        with OpCount() as c:
            out = real(self, job)
        counts.append(c.ops)
        return out

    factor_updates.FactorUpdater._apply = counted
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**layers, max_position_embeddings=64))
        kfac = KFACStreamCallback(KFACConfig(
            update_every=1, min_window_sequences=0, mc_sequences=1.0, fold_on="device",
            async_updates=False, snapshot_every=10**6))
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(tmp, per_device_train_batch_size=4, max_steps=6,
                                     report_to=[], use_cpu=True, save_strategy="no",
                                     logging_strategy="no", disable_tqdm=True)
            Trainer(model=model, args=args, train_dataset=RandomTokens(24, 64, 256),
                    callbacks=[kfac]).train()
    finally:
        factor_updates.FactorUpdater._apply = real
    factors = len(kfac.tracker.dims)
    steady = counts[1:] or counts  # the first update also plans residency and probes
    per_update = [sum(c.values()) for c in steady]
    top = sum(steady, collections.Counter()).most_common(10)
    log(f"{factors} factors: {max(per_update)} ops per update at most "
        f"({max(per_update) / factors:.1f} per factor), updates after the first; most "
        f"frequent over {len(steady)} updates: " + ", ".join(f"{k} {v}" for k, v in top))
    if not a.quick:
        write_json("worker_ops", {"machine": machine(), "layers": layers, "factors": factors,
                                  "ops_per_update": per_update,
                                  "first_update_ops": sum(counts[0].values()),
                                  "most_frequent": top})


if __name__ == "__main__":
    main()
