"""How many torch ops an update step adds to a plain training step: host work on the training
thread and the factor worker.

Each op costs host time (Python, dispatch, a kernel launch on a GPU: ~5-10 µs) whatever its
size; on a GPU an update step's ops ran at host speed (docs/gpu.md), so their count is the
update step's host cost that a CPU can measure. Counted here: every aten op that reaches the
dispatcher (a ``TorchDispatchMode``; view and metadata ops included, so the figures are upper
bounds of the profiler's "top-level" ones), on every thread that does the update's work:
the worker runs inline (``async_updates=False``, the same ops it issues on its own thread) and
a CPU backward runs on the training thread, so one thread-local mode sees them all.

Method: TinyLlama's layer structure (22 layers: 154 tracked layers, 242 factors; hidden 64
so that it runs on a CPU: the op count does not depend on the widths), every step an update
step (``update_every=1``), the device path with the CPU standing in for the device
(``fold_on="device"``). A plain run (no callback) and a tracked run of the same model, data
and seed; per phase: the step's own ops (forward, backward, optimizer; in the tracked run the
capture hooks and the tracker's end-of-step work too), the update's collection
(`tracking.collect`) and the worker's fold (`FactorUpdater._apply`). Steady state: the steps
after the first update (which makes the groups) and before the last (the final window and
the end-of-run snapshot). Prints the figures and writes ``benchmarks/results/worker_ops.json``.

Usage: ``python benchmarks/worker_ops.py [--quick]``
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import kfac_stream.tracking.factor_updates as factor_updates
import kfac_stream.tracking.tracker as tracker_module
from kfac_stream import KFACConfig, KFACStreamCallback

from _common import RandomTokens, log, machine, write_json

LAYERS = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=22,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
STEPS = 7


class PhaseOps(TorchDispatchMode):
    """Counts aten ops by the phase named in ``phase`` when each ran."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.phase][str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def during(self, obj, name: str, phase: str):
        """Wrap ``obj.name`` so that the ops of its ``k``-th call count as ``"phase:k"``;
        returns the undo."""
        real = getattr(obj, name)
        calls = iter(range(10**9))

        def counted(*args, **kwargs):
            before, self.phase = self.phase, f"{phase}:{next(calls)}"
            try:
                return real(*args, **kwargs)
            finally:
                self.phase = before

        setattr(obj, name, counted)
        return lambda: setattr(obj, name, real)


class _StepPhase(TrainerCallback):
    def __init__(self, mode: PhaseOps) -> None:
        self.mode = mode

    def on_step_begin(self, args, state, control, **kwargs):
        self.mode.phase = f"step{state.global_step}"


def _run(layers: dict, kfac: KFACConfig | None, steps: int) -> dict[str, collections.Counter]:
    mode = PhaseOps()
    undo = [mode.during(factor_updates.FactorUpdater, "_apply", "worker"),
            mode.during(tracker_module.Tracker, "_collect", "collect")]
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**layers, max_position_embeddings=64))
        callbacks = [_StepPhase(mode)] + ([KFACStreamCallback(kfac)] if kfac else [])
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(tmp, per_device_train_batch_size=4, max_steps=steps,
                                     report_to=[], use_cpu=True, save_strategy="no",
                                     logging_strategy="no", disable_tqdm=True)
            with mode:
                Trainer(model=model, args=args, train_dataset=RandomTokens(4 * steps, 64, 256),
                        callbacks=callbacks).train()
    finally:
        for u in undo:
            u()
    return mode.ops


def count_update_ops(layers: dict = LAYERS, fisher: str = "empirical", steps: int = STEPS
                     ) -> dict:
    """Per-update-step op counts of a tracked run against a plain one (see the module
    docstring): ``{"plain_step", "added", "added_by_phase": {"step", "collect", "worker"},
    "worker_per_update": [...], "first_update_worker", "most_frequent_added": [...]}``
    (medians over the steady updates)."""
    plain = _run(layers, None, steps)
    kfac = _run(layers, KFACConfig(
        update_every=1, min_window_sequences=0, fisher=fisher, fold_on="device",
        async_updates=False, snapshot_every=10**6, final_window=0.0), steps)
    steady = [f"step{i}" for i in range(1, steps - 1)]  # updates 2 .. steps-1
    per_call = {ph: [sum(kfac[f"{ph}:{k}"].values()) for k in range(1, steps - 1)]
                for ph in ("collect", "worker")}
    step_added = [sum(kfac[s].values()) - sum(plain[s].values()) for s in steady]
    added_ops = collections.Counter()
    for k, s in enumerate(steady, start=1):
        for part in (kfac[s], kfac[f"collect:{k}"], kfac[f"worker:{k}"]):
            added_ops.update(part)
        added_ops.subtract(plain[s])
    by_phase = {"step": statistics.median(step_added),
                "collect": statistics.median(per_call["collect"]),
                "worker": statistics.median(per_call["worker"])}
    return {"plain_step": statistics.median(sum(plain[s].values()) for s in steady),
            "added": sum(by_phase.values()), "added_by_phase": by_phase,
            "worker_per_update": per_call["worker"],
            "first_update_worker": sum(kfac["worker:0"].values()),
            "most_frequent_added": [(k, v // len(steady)) for k, v in
                                    added_ops.most_common(12) if v > 0]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 layers, writes nothing")
    a = p.parse_args(argv)
    layers = dict(LAYERS, num_hidden_layers=2) if a.quick else LAYERS
    out = {}
    for fisher in ("empirical", "mc"):
        r = count_update_ops(layers, fisher)
        out[fisher] = r
        ph = r["added_by_phase"]
        log(f"{fisher} Fisher: a plain step {r['plain_step']:.0f} ops; an update step adds "
            f"{r['added']:.0f} (step: hooks and end of step {ph['step']:.0f}, collect "
            f"{ph['collect']:.0f}, worker {ph['worker']:.0f}); most frequent added: "
            + ", ".join(f"{k} {v}" for k, v in r["most_frequent_added"][:6]))
    if not a.quick:
        write_json("worker_ops", {"machine": machine(), "layers": layers, "steps": STEPS,
                                  "counted": "aten ops at the dispatcher, all threads",
                                  **out})


if __name__ == "__main__":
    main()
