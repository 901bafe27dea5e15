"""Do two versions of the library write the same snapshots? (refactors: behaviour unchanged)

``--write DIR`` trains two fixed tiny runs on the CPU and writes everything the library
stores under ``DIR``:

- ``lm``: a float32 2-layer Llama from a config on real text (padded sequences), the MC Fisher
  at ``token_fraction=0.25``, EK-FAC on, ``update_every=2``, a snapshot every 4 steps and a
  Trainer checkpoint (with the tracker state) at step 4, 8 steps in all;
- ``cls``: a 1-layer GPT-2 classifier at the defaults (float16 factors) with an eval set, so
  the end of training fits the prior precision and link on it (the held-out sidecar).

``--compare A B`` compares two such trees file by file: every tensor of every safetensors file
bit for bit (same names, dtypes, shapes and bytes), every JSON file value by value after
flattening it to ``{leaf name path: value}`` (keys that only say when, where or which version
wrote, listed in ``VOLATILE``, are left out and named), and the set of files. Exit status 0 when
nothing differs. With ``--layout-free`` a JSON leaf is matched by its last key name and value
wherever it sits, for a manifest whose layout changed (printed as such).

Run the writer from each version's checkout (``PYTHONPATH=<checkout>``) into its own DIR, then
compare. The writer imports the test helpers (``harness``, ``models``) from the checkout's
``tests/support/`` itself: no ``PYTHONPATH`` entry is needed for them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: JSON keys whose values say when, where, which process or which version wrote: not the
#: content (a key ending in ``_seconds`` is a duration and left out too).
VOLATILE = frozenset(("created_unix", "run_id", "output_dir", "logging_dir", "format_version",
                      "version", "library_version", "transformers_version", "torch_version",
                      "seconds", "hostname", "pid", "finished_unix",
                      # a checkpoint file's hash and size cover its header's timings; its
                      # tensors and header values are compared themselves
                      "sha256", "bytes"))


def _lm_run(out: Path) -> None:
    import torch

    from harness import run
    from models import text_examples, tiny_llama

    torch.set_num_threads(1)
    model = tiny_llama(torch.float32, seed=0)
    examples = text_examples(16, 24, seed=1, lengths=[24 - (i % 5) for i in range(16)])
    cfg = dict(token_fraction=0.25, ema_decay=0.9, update_every=2, snapshot_every=4,
               fisher="mc", storage_dtype="float16", final_window=0.25,
               min_window_sequences=0, ekfac=True, output_dir=str(out / "kfac"))
    run(model, examples, cfg, batch=2, accum=2, steps=8, tmp_path=out, record=False,
        save_strategy="steps", save_steps=4)


def _cls_run(out: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainingArguments

    from kfac_stream import KFACConfig, KFACStreamCallback

    from models import ListDataset, text_examples

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=256, n_positions=64, num_labels=3,
        pad_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    examples = text_examples(24, 12, seed=2)
    for i, e in enumerate(examples):
        e["labels"] = torch.tensor(i % 3)
    cb = KFACStreamCallback(KFACConfig(token_fraction=1.0, update_every=1,
                                       snapshot_every=10**6, output_dir=str(out / "kfac")))
    args = TrainingArguments(str(out), per_device_train_batch_size=4, max_steps=8,
                             learning_rate=1e-2, report_to=[], logging_strategy="no",
                             disable_tqdm=True, seed=0, use_cpu=True, save_strategy="no")
    Trainer(model=model, args=args, train_dataset=ListDataset(examples[:16]),
            eval_dataset=ListDataset(examples[16:]), callbacks=[cb]).train()


def write(directory: Path) -> None:
    sys.path[:0] = [str(ROOT / "tests" / "support")]
    for name, job in (("lm", _lm_run), ("cls", _cls_run)):
        out = directory / name
        out.mkdir(parents=True, exist_ok=True)
        job(out)
        print(f"wrote {out}")


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        flat = {}
        for k, v in value.items():
            flat.update(_flatten(v, f"{prefix}/{k}"))
        return flat
    if isinstance(value, list) and value and all(isinstance(v, (dict, list)) for v in value):
        flat = {}
        for i, v in enumerate(value):
            flat.update(_flatten(v, f"{prefix}[{i}]"))
        return flat
    return {prefix: value}


def _volatile(path: str) -> bool:
    leaf = path.rsplit("/", 1)[-1].split("[", 1)[0]
    return leaf in VOLATILE or leaf.endswith("_seconds")


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _compare_json(a: Path, b: Path, layout_free: bool, skipped: Counter) -> list[str]:
    return _compare_values(json.loads(a.read_text()), json.loads(b.read_text()), layout_free,
                           skipped)


def _compare_values(va, vb, layout_free: bool = False, skipped: Counter | None = None
                    ) -> list[str]:
    fa, fb = _flatten(va), _flatten(vb)
    for flat in (fa, fb):
        for k in [k for k in flat if _volatile(k)]:
            if skipped is not None:
                skipped[k.rsplit("/", 1)[-1]] += 1
            del flat[k]
    if layout_free:
        def leaves(flat):
            return Counter((k.rsplit("/", 1)[-1], json.dumps(v, sort_keys=True))
                           for k, v in flat.items())
        la, lb = leaves(fa), leaves(fb)
        return [f"only in A: {k}={v}" for (k, v), n in (la - lb).items() for _ in range(n)] + \
            [f"only in B: {k}={v}" for (k, v), n in (lb - la).items() for _ in range(n)]
    out = [f"only in A: {k}" for k in fa.keys() - fb.keys()]
    out += [f"only in B: {k}" for k in fb.keys() - fa.keys()]
    out += [f"differs: {k}: {fa[k]!r} vs {fb[k]!r}" for k in fa.keys() & fb.keys()
            if not _same(fa[k], fb[k])]
    return sorted(out)


def _compare_tensors(a: Path, b: Path) -> list[str]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    meta = []
    for path in (a, b):
        with safe_open(str(path), "pt") as f:
            m = f.metadata() or {}
        meta.append({k: (json.loads(v) if v[:1] in "[{" else v) for k, v in m.items()})
    out = [f"tensor only in A: {k}" for k in ta.keys() - tb.keys()]
    out += [f"tensor only in B: {k}" for k in tb.keys() - ta.keys()]
    for k in sorted(ta.keys() & tb.keys()):
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{k}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        elif not _bitwise_equal(x, y):
            out.append(f"{k}: bytes differ")
    return out + [f"header {p}" for p in _compare_values(*meta, skipped=Counter())]


def _bitwise_equal(x, y) -> bool:
    import torch

    if x.numel() == 0:
        return True
    return torch.equal(x.contiguous().view(-1).view(torch.uint8),
                       y.contiguous().view(-1).view(torch.uint8))


def compare(a: Path, b: Path, layout_free: bool = False) -> int:
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    problems: list[str] = [f"file only in A: {p}" for p in sorted(files_a - files_b)]
    problems += [f"file only in B: {p}" for p in sorted(files_b - files_a)]
    skipped: Counter = Counter()
    tensors = jsons = 0
    for rel in sorted(files_a & files_b):
        if rel.suffix == ".safetensors":
            tensors += 1
            problems += [f"{rel}: {p}" for p in _compare_tensors(a / rel, b / rel)]
        elif rel.suffix == ".json":
            jsons += 1
            problems += [f"{rel}: {p}" for p in
                         _compare_json(a / rel, b / rel, layout_free, skipped)]
    how = " (layout-free: leaves matched by name and value)" if layout_free else ""
    print(f"compared {tensors} safetensors files bit for bit and {jsons} JSON files "
          f"value by value{how}; {len(files_a & files_b) - tensors - jsons} other files by "
          "name only")
    if skipped:
        print("left out (when/where/which, not content): " +
              ", ".join(f"{k} x{n}" for k, n in sorted(skipped.items())))
    for p in problems:
        print("  " + p)
    print(f"{len(problems)} difference(s)")
    return 1 if problems else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", type=Path, help="train the fixed runs and write them here")
    p.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"))
    p.add_argument("--layout-free", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.write:
        write(args.write)
    if args.compare:
        return compare(*args.compare, layout_free=args.layout_free)
    return 0


if __name__ == "__main__":
    sys.exit(main())
