"""The tuned posterior of the mid-size Llama, after ``Snapshot.load`` (CPU).

Method: a ``transformers`` Llama built from a ``LlamaConfig`` (hidden 1024, intermediate 2816,
4 layers, 16 heads, byte vocabulary 256, random init, no download: 28 tracked layers, 44
factors, ~1.2e8 factor entries), trained ``--steps`` (12) steps of 4 x 128 bytes of real
English text (CPython's ``pydoc_data`` topics, as ``tests/support/models.py``'s ``text_examples``)
with ``KFACStreamCallback(KFACConfig(update_every=2, min_window_sequences=0))``; its final
snapshot is then, in this one process with the machine's default threads:

(a) loaded: ``Snapshot.load`` (read, streamed sha256, finiteness; median of ``--reps``);
(b) ``LaplacePosterior(model, snap, prior_precision="marglik")`` on a freshly loaded snapshot
    (median of ``--reps``; target <= 2 s);
(c) unless ``--no-old``: the same with the code of ``git show OLD_REV:`` (``--old-rev``;
    default: main before the eigenvalue-only ``τ`` search and lazy loading) of
    ``kfac_stream/query/laplace.py`` and ``kfac_stream/snapshot/snapshot.py`` imported as
    temporary modules (once: the old posterior takes about a minute here), with the old and
    new tuned ``τ`` and the exact log evidence at both.

Prints the figures and writes ``benchmarks/results/posterior_scale.json``. ``--quick`` is a
tiny smoke run (hidden 64, 2 layers, 4 steps) that writes nothing unless ``--out`` is given.

Usage: ``python benchmarks/posterior_scale.py [--reps 3] [--steps 12] [--no-old]``
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot

from _common import MID_LLAMA, QUICK_LLAMA, mid_llama_run_args

#: Main before the eigenvalue-only tau search and lazy loading: the "old code" figures.
OLD_REV = "e9313ca"

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MID = dict(MID_LLAMA, vocab_size=256)
QUICK = dict(QUICK_LLAMA, vocab_size=256)
TARGET_S = 2.0


class _Text(Dataset):
    """Byte windows of real English text (CPython's ``pydoc_data`` topics)."""

    def __init__(self, n: int, seq: int, seed: int):
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
        rng = random.Random(seed)
        offs = [rng.randrange(0, len(text) - seq) for _ in range(n)]
        self.ids = torch.tensor([list(text[o:o + seq]) for o in offs], dtype=torch.long)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def train(a, model_cfg: dict, tmp: str, seed: int = 0):
    """The trained model and the path of its final snapshot."""
    transformers.set_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**model_cfg))
    kfac = KFACStreamCallback(KFACConfig(update_every=2, min_window_sequences=0, seed=seed,
                                         output_dir=os.path.join(tmp, "kfac")))
    args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, learning_rate=1e-4,
                             seed=seed, per_device_train_batch_size=a.batch,
                             max_steps=a.steps, dataloader_num_workers=0)
    data = _Text(a.batch * a.steps, a.seq, seed)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[kfac]).train()
    model.eval()
    return model, kfac.snapshots[-1]


def old_modules(rev: str):
    """``(Snapshot, LaplacePosterior)`` of revision ``rev``, imported from ``git show`` as
    modules inside the package (so their relative imports resolve), or None."""
    out = []
    for rel, name in (("kfac_stream/snapshot/snapshot.py", "kfac_stream.snapshot._old_snapshot"),
                      ("kfac_stream/query/laplace.py", "kfac_stream.query._old_laplace")):
        try:
            src = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"old code unavailable ({e}); reporting the new figures only")
            return None
        fd, path = tempfile.mkstemp(suffix=".py")
        with os.fdopen(fd, "w") as fh:
            fh.write(src)
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        finally:
            os.remove(path)
        out.append(mod)
    return out[0].Snapshot, out[1].LaplacePosterior


def timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def measure(a, model, path: str) -> dict:
    load_s, post_s, taus = [], [], []
    for _ in range(a.reps):
        gc.collect()
        snap, t = timed(lambda: Snapshot.load(path, show_progress=False))
        load_s.append(t)
        post, t = timed(lambda s=snap: LaplacePosterior(model, s, prior_precision="marglik"))
        post_s.append(t)
        taus.append(post.prior_precision)
    pairs = 0
    for n in snap.layer_names:
        lf = snap[n]
        pairs += lf.A_eigvals.numel() * lf.G_eigvals.numel()
    entries = sum(t.numel() for n in snap.layer_names
                  for t in (snap[n].A_eigvecs, snap[n].G_eigvecs) if t is not None)
    out = {"layers": len(snap), "eigenvalue_pairs": pairs, "eigvec_entries": entries,
           "load_s": statistics.median(load_s), "posterior_s": statistics.median(post_s),
           "load_runs_s": load_s, "posterior_runs_s": post_s, "tau": taus[-1],
           "log_evidence": post.log_marginal_likelihood()}
    if not a.no_old:
        mods = old_modules(a.old_rev)
        if mods is not None:
            old_snapshot, old_posterior = mods
            gc.collect()
            _, t = timed(lambda: old_snapshot.load(path, show_progress=False))
            out["old_load_s"] = t
            old, t = timed(lambda: old_posterior(model, snap, prior_precision="marglik"))
            out["old_posterior_s"] = t
            out["old_tau"] = old.prior_precision
            out["tau_rel_diff"] = abs(out["tau"] / old.prior_precision - 1.0)
            out["log_evidence_at_old_tau"] = post.log_marginal_likelihood(old.prior_precision)
            del old
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mid_llama_run_args(p)
    p.add_argument("--no-old", action="store_true", help="skip the old code's figures")
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of the old code")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/posterior_scale.json; "
                        "--quick writes nothing unless given)")
    a = p.parse_args(argv)
    torch.set_flush_denormal(True)
    model_cfg = MID
    if a.quick:
        model_cfg, a.steps, a.batch, a.seq = QUICK, 4, 2, 16
    out = a.out or (None if a.quick else str(HERE / "results" / "posterior_scale.json"))
    with tempfile.TemporaryDirectory() as tmp:
        (model, path), train_s = timed(lambda: train(a, model_cfg, tmp))
        res = measure(a, model, path)
    res["train_and_snapshot_s"] = train_s
    print(f"\nLaplacePosterior(model, snap, 'marglik') after Snapshot.load, CPU, "
          f"{torch.get_num_threads()} threads, {res['layers']} layers, "
          f"{res['eigenvalue_pairs']:.3g} eigenvalue pairs, median of {a.reps}; "
          f"target <= {TARGET_S} s")
    print(f"  Snapshot.load        {res['load_s']:8.2f} s"
          + (f"   (old code: {res['old_load_s']:.2f} s)" if "old_load_s" in res else ""))
    print(f"  LaplacePosterior     {res['posterior_s']:8.2f} s"
          + (f"   (old code: {res['old_posterior_s']:.2f} s)" if "old_posterior_s" in res
             else ""))
    print(f"  tuned tau            {res['tau']:.6g}"
          + (f"   (old code: {res['old_tau']:.6g}, relative difference "
             f"{res['tau_rel_diff']:.2e})" if "old_tau" in res else ""))
    if "log_evidence_at_old_tau" in res:
        print(f"  log evidence at new / old tau: {res['log_evidence']:.10g} / "
              f"{res['log_evidence_at_old_tau']:.10g}")
    res["met"] = res["posterior_s"] <= TARGET_S
    if out is None:
        return
    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "machine": platform.machine(),
            "threads": torch.get_num_threads(), "model": model_cfg, "steps": a.steps,
            "batch": [a.batch, a.seq], "reps": a.reps, "target_s": TARGET_S,
            "quick": a.quick}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump({"info": info, "result": {k: v for k, v in res.items()
                                            if not isinstance(v, float) or math.isfinite(v)}},
                  fh, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
