"""What streaming the EK-FAC correction (``KFACConfig(ekfac=True)``, `kfac_stream.ekfac`) costs a
training step: a cost model for real configs, and a measured CPU ratio on a small model.

1. Cost model (no GPU here: the layouts of real configs built on the ``meta`` device, the
   tracker's own plan of factors). Per tracked layer and update step the correction of ``b``
   sequences of ``T`` tokens costs `kfac_stream.ekfac.correction_flops` (the cheaper of
   rotating ``g``, ``ā`` first, ``2·b·T·(d_out² + d_A²)``, or forming each sequence's gradient
   first, ``2·b·d_out·d_A·(d_out + d_A)``; plus ``2·b·T·d_out·d_A`` for the products and
   ``2·b·d_out·d_A`` for the squares; a diagonal factor is not rotated). At the defaults the
   update step's sequences are the MC replay's, ``b = mc_sequences·B·accumulation`` (its
   expectation: ``0.05 · 8 = 0.4`` per update at micro-batch 8), every ``update_every = 10``
   steps; with ``fisher="empirical"`` every sequence of the update step. A training step is
   ``6·P·B·T`` FLOPs (``P``: every parameter). In a 16-bit run the correction's GEMMs run in
   bf16 on tensor cores like the step's, so the FLOP ratio is the time ratio at equal
   efficiency (`EkfacState.compute_dtype`). Bytes (`correction_bytes`) and device memory (the
   bases in bf16, the float32 accumulators) are printed beside it.
2. Measured on this CPU: a small GPT-2 (``_common.MODEL``: 4 layers, 256 wide, batch 8 x 256
   tokens) trained by the HF Trainer with the callback; ONE run per configuration whose blocks
   of ``--block`` steps alternate the correction off and on (``tracker.capture.extensions``
   emptied and set back: the K-FAC tracking itself runs in both), a random orthonormal basis
   installed at train begin so that the correction runs from the first update. Step time is
   ``on_step_begin`` -> ``on_step_end``; per pair of blocks the ratio of their mean step, the
   median over ``--pairs`` pairs. Two configurations: the defaults (MC replay of 5% of an update
   step's sequences; ``min_window_sequences=0`` keeps the share of a long run) and a stress one
   (the empirical Fisher, every step an update step: the correction of every sequence), whose
   measured extra time is compared with the cost model's FLOP ratio for the same model.

Usage: ``python benchmarks/ekfac_cost.py [--pairs 5] [--block 10] [--threads 2] [--quick]``.
Writes ``benchmarks/results/ekfac_cost.json`` (``--quick``: a smoke run, writes nothing).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from kfac_stream import KFACConfig, KFACStreamCallback
from kfac_stream.ekfac import correction_bytes, correction_flops
from kfac_stream.tracking.tracker import plan_tracking

from _common import BATCH, MODEL, SEQ, machine, make_data, write_json

LLAMAS = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "Llama-3.2-1B": (2048, 8192, 16, 32, 8, 128256),
    "TinyLlama-1.1B": (2048, 5632, 22, 32, 4, 32000),
    "Llama-2-7B": (4096, 11008, 32, 32, 32, 32000),
}
FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "vocab_size")
DEFAULTS = KFACConfig()
MICRO_BATCH, TOKENS = 8, 2048  # sequences per micro-batch and tokens per sequence (model)


def model_cost(model: torch.nn.Module, seq: int, batch: int, accumulation: int = 1,
               cfg: KFACConfig = DEFAULTS) -> dict:
    """The cost model for ``model`` (any device, ``meta`` included) at ``cfg``."""
    specs, plan = plan_tracking(model, cfg)
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings()
    if embed is not None and embed.weight is not getattr(model.get_output_embeddings(),
                                                         "weight", None):
        params -= embed.weight.numel()  # a lookup, not a matmul: left out (conservative)
    tracked = sum(s.d_out * (s.d_in + s.has_bias) for s in specs.values())
    step = 6 * params * batch * accumulation * seq
    mc = float(cfg.mc_sequences) * batch * accumulation  # expected replayed sequences
    per_seq = acc = moved = 0
    for name in specs:
        a_key, g_key = plan.keys_of(name)
        (d_a, diag_a), (d_g, diag_g) = plan.dims[a_key], plan.dims[g_key]
        per_seq += correction_flops(d_g, d_a, seq, 1, not diag_g, not diag_a)
        moved += correction_bytes(d_g, d_a, mc, not diag_g, not diag_a)  # bf16 run
        acc += 4 * d_g * d_a
    basis = sum(2 * d * d for d, diag in plan.dims.values() if not diag)  # bf16, once per key
    every = cfg.update_every
    out = {
        "params": params, "tracked_params": tracked, "layers": len(specs),
        "factor_entries": sum(d * d if not diag else d for d, diag in plan.dims.values()),
        "seq": seq, "micro_batch": batch, "accumulation": accumulation,
        "step_flops": step,
        # the bytes at the HBM rate against the step at 40% of the bf16 peak (H100 SXM)
        "bytes_ratio_defaults_h100": moved / 3.35e12 / every / (step / (0.4 * 989e12)),
        "correction_flops_per_sequence": per_seq,
        # per token of a corrected sequence, relative to a training step's per token
        "rho": per_seq / (6 * params * seq),
        "mc_sequences_per_update": mc,
        "ratio_defaults": per_seq * mc / every / step,
        "ratio_empirical": per_seq * batch * accumulation / every / step,
        "ratio_empirical_every_step": per_seq * batch * accumulation / step,
        "mc_replay_ratio": (2 / 3) * mc / (batch * accumulation) / every,  # the factors' own
        "bytes_per_update_defaults": moved,
        "device_memory_bytes": basis + acc,
        "basis_bytes_bf16": basis, "accumulator_bytes": acc,
    }
    return out


def llama_costs() -> dict:
    out = {}
    for name, dims in LLAMAS.items():
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**dict(zip(FIELDS, dims, strict=True))))
        out[name] = model_cost(model, TOKENS, MICRO_BATCH)
    return out


# -- measured on this CPU ------------------------------------------------------------------------

class _Clock(TrainerCallback):
    """First and last in the callback list: toggles the correction per block (first) and
    times ``on_step_begin`` -> ``on_step_end`` (last)."""

    def __init__(self, kfac: KFACStreamCallback, schedule: list[str]):
        self.kfac, self.schedule = kfac, schedule
        self.times: list[float] = []
        self.first = _ClockStart(self)

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._t0)

    def start(self, step: int) -> None:
        tr = self.kfac.tracker
        tr.capture.extensions = tr.extensions if self.schedule[step] == "on" else []
        self._t0 = time.perf_counter()


class _ClockStart(TrainerCallback):
    def __init__(self, clock: _Clock):
        self.clock = clock

    def on_step_begin(self, args, state, control, **kw):
        self.clock.start(state.global_step)


class _RandomBasis(TrainerCallback):
    """After the K-FAC callback's train begin: a random orthonormal basis for every factor."""

    def __init__(self, kfac: KFACStreamCallback):
        self.kfac = kfac

    def on_train_begin(self, args, state, control, **kw):
        tr = self.kfac.tracker
        gen = torch.Generator().manual_seed(0)
        tr.extension("ekfac").state.set_basis(0, {k: None if diag else torch.linalg.qr(
            torch.randn(d, d, generator=gen))[0] for k, (d, diag) in tr.dims.items()})


def measure(cfg: dict, pairs: int, block: int, warmup: int, out_dir: str) -> dict:
    """One training run, blocks of ``block`` steps alternating the correction off and on."""
    schedule = ["on"] * warmup
    for i in range(pairs):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            schedule += [mode] * block
    model = GPT2LMHeadModel(GPT2Config(**MODEL))
    kfac = KFACStreamCallback(KFACConfig(ekfac=True, snapshot_every=10**6, **cfg),
                              background_snapshots=False, spectra_media=False)
    clock = _Clock(kfac, schedule)
    args = TrainingArguments(out_dir, per_device_train_batch_size=BATCH, max_steps=len(schedule),
                             learning_rate=1e-4, report_to=[], use_cpu=True,
                             logging_strategy="no", save_strategy="no", disable_tqdm=True,
                             seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=make_data(BATCH * len(schedule)),
                      callbacks=[clock.first, kfac, _RandomBasis(kfac), clock])
    trainer.train()
    times = clock.times[warmup:]
    means: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * pairs):
        means[schedule[warmup + i * block]].append(statistics.fmean(
            times[i * block:(i + 1) * block]))
    ratios = [on / off for on, off in zip(means["on"], means["off"])]
    return {"config": cfg, "ratio_median": statistics.median(ratios), "ratios": ratios,
            "step_seconds_off": statistics.median(means["off"]),
            "updates": kfac.tracker.counters.updates, "pairs": pairs, "block": block}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.pairs, a.block = 1, 2
    torch.set_num_threads(a.threads)
    import tempfile

    costs = llama_costs()
    print(f"cost model: micro-batch {MICRO_BATCH} x {TOKENS} tokens, defaults "
          f"(mc_sequences={DEFAULTS.mc_sequences}, update_every={DEFAULTS.update_every})")
    print("| model | params | tracked | factor entries | rho (per corrected token / 6P) | "
          "defaults: % of a step | empirical Fisher: % | MC replay itself: % | bytes/update | "
          "bytes at HBM rate: % of a step | device memory |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, c in costs.items():
        print(f"| {name} | {c['params'] / 1e9:.2f}e9 | {c['tracked_params'] / 1e9:.2f}e9 | "
              f"{c['factor_entries'] / 1e9:.2f}e9 | {c['rho']:.2f} | "
              f"{100 * c['ratio_defaults']:.2f}% | {100 * c['ratio_empirical']:.1f}% | "
              f"{100 * c['mc_replay_ratio']:.2f}% | {c['bytes_per_update_defaults'] / 1e9:.1f} GB"
              f" | {100 * c['bytes_ratio_defaults_h100']:.2f}% | "
              f"{c['device_memory_bytes'] / 2**30:.1f} GiB |")
    small = model_cost(GPT2LMHeadModel(GPT2Config(**MODEL)), SEQ, BATCH)
    configs = {"defaults": {"min_window_sequences": 0},
               "stress: empirical, update_every=1": {"fisher": "empirical",
                                                      "update_every": 1}}
    measured = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, cfg in configs.items():
            block = max(2, a.block // 2) if cfg.get("update_every", 10) == 1 else \
                max(a.block, 10) // 10 * 10  # whole update periods
            r = measure(cfg, a.pairs, block, warmup=block, out_dir=tmp)
            measured[label] = r
            print(f"measured on this CPU ({a.threads} threads), {label}: step with / without "
                  f"the correction {r['ratio_median']:.4f} (median of {a.pairs} pairs of "
                  f"{block}-step blocks; {' '.join(f'{x:.3f}' for x in r['ratios'])})")
    print(f"  cost model for this GPT-2: stress config "
          f"+{100 * small['ratio_empirical_every_step']:.1f}% of a step's FLOPs (rho "
          f"{small['rho']:.2f}), defaults +{100 * small['ratio_defaults']:.2f}%")
    if a.quick:
        return
    path = write_json("ekfac_cost", {
        "date": datetime.date.today().isoformat(), "machine": machine(),
        "cost_model": costs, "small_gpt2_model": small, "measured_cpu": measured,
        "command": f"python benchmarks/ekfac_cost.py --pairs {a.pairs} --block {a.block} "
                   f"--threads {a.threads}"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
