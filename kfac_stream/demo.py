"""`make demo`: train a small GPT-2 on Python's own reference docs with the callback.

Offline and CPU-only: the model is built from a config (byte-level vocabulary, no tokenizer
download), the text is ``pydoc_data.topics`` (ships with CPython). Prints the per-layer table
of the final snapshot. The Hydra main job (``kfac-stream train``) will replace this.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from . import KFACConfig, KFACStreamCallback, Snapshot
from .report import layer_table


def pydoc_text() -> bytes:
    """Python's reference documentation as bytes (on every machine with CPython)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def byte_windows(text: bytes, seq_len: int, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` consecutive windows of ``seq_len`` bytes as causal-LM examples."""
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    out = []
    for i in range(min(n, len(ids) // seq_len)):
        x = ids[i * seq_len:(i + 1) * seq_len]
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default="out/demo")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--token-fraction", type=float, default=0.05)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # x86 CPUs slow down ~10x on denormal floats, which a small model's training produces
    # (measured here: 5 s vs 0.4 s per step); flushing them is standard for CPU training.
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256,
                                       n_positions=128, bos_token_id=0, eos_token_id=0))
    data = byte_windows(pydoc_text(), 128, 8 * a.steps)
    # update_every=1: a small model whose every step is cheap to track (the library default,
    # 10, is for keeping the overhead of real models low; see benchmarks/RESULTS.md)
    cb = KFACStreamCallback(KFACConfig(token_fraction=a.token_fraction, update_every=1,
                                       snapshot_every=50))
    args = TrainingArguments(a.output_dir, per_device_train_batch_size=8, max_steps=a.steps,
                             learning_rate=1e-3, logging_steps=50, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=False)
    t0 = time.perf_counter()
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    wall = time.perf_counter() - t0
    snap = Snapshot.load(cb.snapshots[-1])
    print()
    print(layer_table(snap))
    c = snap.meta["counts"]
    print(f"\n{c['updates']} updates, {c['positions_sampled']} positions sampled of "
          f"{c['tokens_seen']} seen, {c['skipped_updates']} skipped; tracker time on the "
          f"training thread {c['tracker_seconds']:.2f} s of {wall:.1f} s training")
    print(f"snapshots: {', '.join(cb.snapshots)}")
    try:
        from .plot import plot_spectra

        png = os.path.join(os.path.dirname(snap.path), f"{os.path.basename(snap.path)}.spectra.png")
        print(f"spectra: {plot_spectra(snap, png)}")
    except ImportError as e:
        print(f"(no spectra plot: {e})")


if __name__ == "__main__":
    main()
