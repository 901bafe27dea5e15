"""The Lanczos spectrum estimator against exact eigenvalues, on the mid-size Llama's factors.

Method: a ``transformers`` Llama built from a ``LlamaConfig`` (`MID_LLAMA`: hidden 1024,
intermediate 2816, 4 layers, vocabulary 4096, random init, no download: 44 dense factors of
sides 1024 and 2816), trained ``--steps`` (6) steps of ``--batch`` x ``--seq`` (4 x 128)
random tokens with ``KFACStreamCallback(KFACConfig(token_fraction=1.0, update_every=1,
fisher="empirical", final_window=0))`` (every token in every update: 3072 tokens, the
factors near full rank). From its final snapshot's stored factors (fp16 + scale), per factor:
`kfac_stream.stats.lanczos.estimate_spectrum` (``--device``: float64 on the CPU, float32 on a
CUDA device) against ``torch.linalg.eigvalsh`` of the float64 factor on the CPU (the
reference; its time is the "exact" time on the CPU, and on ``--device cuda`` a float32
``eigvalsh`` there is timed as well). Prints per factor the λ_max relative error, the eff_rank
relative error, the log10 1-Wasserstein distance of the densities (decades) and the seconds of
both; writes ``benchmarks/results/lanczos_accuracy.json`` (per factor, max over factors and
medians). Bounds (the test's): λ_max 1e-3, eff_rank 2%, W1 0.1 decades.

``--quick``: the tiny Llama (hidden 64, 2 layers), 2 steps of 2 x 16 tokens; writes nothing.

Usage: ``python benchmarks/probes/lanczos_accuracy.py [--steps 6] [--device cpu|cuda] [--quick]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from kfac_stream import HeldoutConfig, KFACConfig, KFACStreamCallback
from kfac_stream.stats.lanczos import (
    LANCZOS_PROBES,
    LANCZOS_STEPS,
    estimate_spectrum,
    log10_wasserstein,
)
from kfac_stream.stats.spectrum import spectrum_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import MID_LLAMA, QUICK_LLAMA, RandomTokens, machine, write_json  # noqa: E402

MID = dict(MID_LLAMA, vocab_size=4096)
QUICK = dict(QUICK_LLAMA, vocab_size=256)
BOUNDS = {"max_rel": 1e-3, "eff_rank_rel": 0.02, "w1_decades": 0.1}


def stored_factors(model_cfg: dict, a, tmp: str) -> list[tuple[str, torch.Tensor, float]]:
    """Train the model and return its final snapshot's ``(key, data, scale)`` factors."""
    from safetensors.torch import load_file

    transformers.set_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**model_cfg))
    kfac = KFACStreamCallback(KFACConfig(
        token_fraction=1.0, update_every=1, fisher="empirical", final_window=0.0,
        min_window_sequences=0, output_dir=f"{tmp}/kfac"),
        heldout=HeldoutConfig(prior_precision=False))
    args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, learning_rate=1e-4,
                             seed=0, per_device_train_batch_size=a.batch, max_steps=a.steps)
    data = RandomTokens(a.batch * a.steps, a.seq, model_cfg["vocab_size"], pool=a.batch * a.steps)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[kfac]).train()
    tensors = {}
    for shard in sorted(Path(kfac.snapshots[-1]).glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return [(k, v, float(tensors[f"{k}.scale"])) for k, v in sorted(tensors.items())
            if f"{k}.scale" in tensors and v.dim() == 2]


def _timed(fn, device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def measure(key: str, data: torch.Tensor, scale: float, device: str) -> dict:
    """One factor's errors and times."""
    f = data.double() * scale  # [d, d]
    ev, exact_s = _timed(lambda: torch.linalg.eigvalsh((f + f.T) * 0.5), "cpu")  # [d]
    est, est_s = _timed(lambda: estimate_spectrum(data, scale, device=device), device)
    ref = spectrum_stats(ev.clamp(min=0.0))
    row = {"factor": key, "d": f.shape[0], "max_rel": abs(est.max - ref["max"]) / ref["max"],
           "max_bound_rel": est.max_bound / ref["max"],
           "eff_rank": ref["eff_rank"], "eff_rank_est": est.eff_rank,
           "eff_rank_rel": abs(est.eff_rank - ref["eff_rank"]) / ref["eff_rank"],
           "w1_decades": log10_wasserstein(est.nodes, est.weights, ev),
           "estimate_s": est_s, "eigvalsh_cpu_f64_s": exact_s, "exact": est.exact}
    if device.startswith("cuda"):
        g = data.to(device).float() * scale
        _, row["eigvalsh_device_f32_s"] = _timed(lambda: torch.linalg.eigvalsh(g), device)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--device", default="cpu", help="where the estimator runs: cpu or cuda")
    p.add_argument("--quick", action="store_true", help="tiny smoke run, writes nothing")
    a = p.parse_args(argv)
    model_cfg = MID
    if a.quick:
        model_cfg, a.steps, a.batch, a.seq = QUICK, 2, 2, 16
    with tempfile.TemporaryDirectory() as tmp:
        stored = stored_factors(model_cfg, a, tmp)
    if a.device.startswith("cuda"):  # warm-up: kernels, cuSOLVER handles
        estimate_spectrum(stored[0][1], stored[0][2], device=a.device)
    rows = []
    for key, data, scale in stored:
        rows.append(measure(key, data, scale, a.device))
        r = rows[-1]
        print(f"{key:42s} d={r['d']:5d} max {r['max_rel']:.1e} eff_rank {r['eff_rank_rel']:.1e}"
              f" ({r['eff_rank']:.0f}) W1 {r['w1_decades']:.4f} est {r['estimate_s']:.3f} s "
              f"eigvalsh {r['eigvalsh_cpu_f64_s']:.3f} s", flush=True)
    cols = ("max_rel", "eff_rank_rel", "w1_decades", "estimate_s", "eigvalsh_cpu_f64_s")
    worst = {c: max(r[c] for r in rows) for c in cols}
    med = {c: statistics.median(r[c] for r in rows) for c in cols}
    met = all(worst[k] <= v for k, v in BOUNDS.items())
    print(f"\n{len(rows)} dense factors, estimator on {a.device} ({LANCZOS_STEPS} block steps x "
          f"{LANCZOS_PROBES} probes), {torch.get_num_threads()} threads")
    print("max:    " + ", ".join(f"{c}={worst[c]:.3g}" for c in cols))
    print("median: " + ", ".join(f"{c}={med[c]:.3g}" for c in cols))
    print(f"bounds {BOUNDS}: {'met' if met else 'NOT met'}")
    if a.quick:
        return
    path = write_json("lanczos_accuracy", {
        "machine": machine(), "model": model_cfg, "steps": a.steps, "batch": [a.batch, a.seq],
        "device": a.device, "lanczos": {"steps": LANCZOS_STEPS, "probes": LANCZOS_PROBES},
        "bounds": BOUNDS, "met": met, "max": worst, "median": med, "factors": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
