"""A classifier walkthrough (docs/classification.md): track K-FAC curvature while a BERT-style
encoder classifier trains, fit the prior precision on the eval set, then calibrated class
probabilities and a "don't know" score for kinds of text the model never saw.

    python examples/sequence_classification.py --out out/classification [--steps 400] [--seed 0]

Offline: is a 64-byte window Python source (the standard library's modules), prose (Python's
reference documentation, shipped with CPython) or a license text (/usr/share/common-licenses)?
Out of domain: shell scripts (/usr/bin, /usr/sbin) and base64 text. A 2-layer encoder (hidden
64) built from a config reads the bytes after a [CLS] token; its pooled head
(`bert.pooler.dense`, then `classifier`) sees one vector per sequence. Prints a table and writes
every figure, with the test probabilities and the scores, to <out>/results.json.
"""

import argparse
import base64
import json
import os
import random
import sysconfig
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot
from kfac_stream.query import metrics

p = argparse.ArgumentParser()
p.add_argument("--out", default="out/classification")
p.add_argument("--steps", type=int, default=400)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()
start = time.time()
torch.manual_seed(args.seed)

# 1. data: 64-byte windows of three kinds of file, each read after a [CLS]-like token; a
# train / eval / test split per class, and windows of two more kinds, never trained on
WINDOW, CLS = 64, 256  # bytes are the ids 0-255; 256 is the token whose state the pooler reads
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def windows(texts: list[bytes]) -> list[bytes]:
    return [t[i:i + WINDOW] for t in texts for i in range(0, len(t) - WINDOW + 1, WINDOW)]


def read(paths, shebang: tuple[bytes, ...] = ()) -> list[bytes]:
    """The files' bytes (unreadable ones skipped); with ``shebang`` only the scripts whose
    first line starts with one of them."""
    out = []
    for path in sorted(paths):
        try:
            with open(path, "rb") as f:
                if shebang and not f.read(64).split(b"\n")[0].startswith(shebang):
                    continue
                f.seek(0)
                out.append(f.read())
        except OSError:
            continue
    return out


licenses = read(Path("/usr/share/common-licenses", n)
                for n in ("GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic"))
if not licenses:  # not Debian: Python's own license (a shorter text)
    print("no /usr/share/common-licenses: the license class is Python's LICENSE.txt")
    licenses = read([STDLIB / "LICENSE.txt"])
CLASSES = ("python", "prose", "license")
modules = read(STDLIB.glob("*.py"))  # the standard library's top-level modules
pools = [windows(modules),
         windows([text.encode() for text in topics.values()]),  # the reference docs' prose
         windows(licenses)]
scripts = windows(read((p for d in ("/usr/bin", "/usr/sbin") if os.path.isdir(d)
                        for p in Path(d).iterdir() if p.is_file()),
                       shebang=(b"#!/bin/sh", b"#!/bin/bash", b"#!/usr/bin/env sh",
                                b"#!/usr/bin/env bash")))
rng = random.Random(args.seed)
SIZES = {"test": 100, "eval": 100, "train": 300}  # per class (a short pool shortens train)
split = {k: [] for k in SIZES}
for c, pool in enumerate(pools):
    items = rng.sample(pool, min(len(pool), sum(SIZES.values())))
    for k, n in SIZES.items():
        split[k] += [(w, c) for w in items[:n]]
        items = items[n:]
# out of domain, 150 windows each: shell scripts (code, but not Python) and base64 text (mail
# attachments, certificates) of the standard library's modules
ood = {"shell scripts": rng.sample(scripts, min(len(scripts), 150)),
       "base64 text": rng.sample(windows([base64.encodebytes(t) for t in modules[:50]]), 150)}
if len(ood["shell scripts"]) < 50:  # a machine without them
    print(f"{len(ood.pop('shell scripts'))} windows of shell scripts: left out")


def example(window: bytes, label: int) -> dict:
    ids = torch.tensor([CLS, *window])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor(label)}


def batch(items: list[bytes]) -> dict:
    ids = torch.tensor([[CLS, *w] for w in items])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


train, evalset = ([example(*x) for x in split[k]] for k in ("train", "eval"))
(eval_batch, eval_y), (test, y) = ((batch([w for w, _ in split[k]]),
                                    torch.tensor([c for _, c in split[k]]))
                                   for k in ("eval", "test"))

# 2. train with the callback: K-FAC factors of the blocks' layers (rows: token positions) and
# of the pooled head, bert.pooler.dense and classifier (rows: sequences); the Trainer has an
# eval set, so at the end of training the callback fits the prior precision tau and the link on
# it (the default, HeldoutConfig(prior_precision="auto")), stores them beside the snapshot and
# logs its verdict: the eval NLL of MAP and of the chosen posterior
model = BertForSequenceClassification(BertConfig(
    vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=256, max_position_embeddings=WINDOW + 1, num_labels=len(CLASSES),
    pad_token_id=0))
kfac = KFACStreamCallback(KFACConfig(
    include=[r"encoder\.layer\.", r"pooler\.dense$", r"^classifier$"], token_fraction=0.25,
    update_every=5, mc_sequences=8))
trainer = Trainer(
    model=model, train_dataset=train, eval_dataset=evalset, callbacks=[kfac],
    args=TrainingArguments(args.out, max_steps=args.steps, per_device_train_batch_size=32,
                           learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                           seed=args.seed))
trainer.train()
model.eval()

# 3. the final snapshot and its posterior: LaplacePosterior(model, snap) takes the stored
# held-out tau and link, MAP's own probabilities ("map" link) when the posterior did not beat
# them on the eval set beyond noise (without a fit: the marginal likelihood's tau, probit link)
snap = Snapshot.latest(f"{args.out}/kfac")
print(f"snapshot of step {snap.step}: {len(snap.layer_names)} layers")
post = LaplacePosterior(model, snap)
held = post.heldout  # the stored fit in use, or None (the callback logged why)
source = "held-out" if held is not None else "marginal likelihood"
print(f"posterior: {post.describe()}")
if held is not None:
    print(held.verdict())
N = post.layer_num_data  # per layer: its rows in the data set, token positions or sequences
for kind, unit in (("position", "token positions"), ("sequence", "sequences")):
    names = [n for n in N if (snap.manifest.layers[n].rows or "position") == kind]
    if names:  # the manifest says which rows each layer has
        shown = ", ".join(names) if len(names) <= 2 else f"{len(names)} layers ({names[0]}, ...)"
        print(f"N = {N[names[0]]:.0f} {unit} for {shown}")


# 4. on the test split: calibrated class probabilities (`predictive_probs`, the posterior's link)
# and the Gaussian of the logits (`predictive`), MAP's softmax beside them
def map_probs(b: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**b).logits.double().softmax(-1)  # [n, C]


laplace = f"Laplace, {source} tau {post.prior_precision:.3g} {post.link}"
rows = {"MAP softmax": map_probs(test), laplace: post.predictive_probs(test)}
if held is not None:  # the other choice of tau, for comparison, with the fit's posterior link
    post.prior_precision = held.marglik_tau
    rows[f"Laplace, marginal-lik. tau {held.marglik_tau:.3g} {held.link}"] = \
        post.predictive_probs(test, method=held.link)
    post.prior_precision = held.tau
reports = {k: metrics.classification_report(q, y) for k, q in rows.items()}
gap = metrics.confidence_gap(map_probs(eval_batch), eval_y)  # MAP on held-out data: the eval set


# 5. a "don't know" score per example, higher = less sure, on the test split and on text of a
# kind never trained on; AUROC: how well it tells the two apart (0.5 = chance, 1 = perfectly)
def entropy(q: torch.Tensor) -> torch.Tensor:
    return -(q * q.clamp_min(1e-300).log()).sum(-1)


def dont_know(b: dict, probs: torch.Tensor) -> dict[str, torch.Tensor]:
    _, cov = post.predictive(b)  # mean [n, C] (MAP's logits), covariance [n, C, C]
    return {"MAP entropy": entropy(map_probs(b)), "Laplace entropy": entropy(probs),
            # the logits' variance around their mean over classes, tr(cov) - sum(cov)/C: the
            # part that can move the probabilities (noise shared by every logit cannot)
            "logit variance": cov.diagonal(0, 1, 2).sum(-1) - cov.sum((1, 2)) / cov.shape[-1]}


score_in = dont_know(test, rows[laplace])
score_out, labelled = {}, {}
for name, windows_ in ood.items():
    b = batch(windows_)
    score_out[name] = dont_know(b, post.predictive_probs(b))
    labelled[name] = map_probs(b).argmax(-1).bincount(minlength=len(CLASSES)) / len(windows_)
auroc = {name: {k: metrics.auroc(score_in[k], s[k]) for k in score_in}
         for name, s in score_out.items()}

print(f"\ntest: {len(y)} windows of {', '.join(CLASSES)}")
print(f"{'':40}accuracy    NLL    ECE  conf-acc")
for k, r in reports.items():
    print(f"{k:40}{r['accuracy']:8.3f}{r['nll']:7.3f}{r['ece']:7.3f}{r['confidence_gap']:+10.3f}")
print(f"MAP on the eval set: confidence - accuracy = {gap:+.3f}, "
      + ("overconfident: a Laplace predictive can lower the NLL" if gap > 0 else
         "underconfident: no Laplace predictive can go below its NLL; rank with the variances"))
print("\ndon't know: AUROC, the test split vs kinds never trained on (150 windows each)")
print(f"{'score (higher = less sure)':40}" + "".join(f"{name:>16}" for name in auroc))
for k in score_in:
    print(f"{k:40}" + "".join(f"{a[k]:16.3f}" for a in auroc.values()))
for name, share in labelled.items():
    print(f"MAP labels {name}: " + ", ".join(f"{c} {v:.2f}" for c, v in zip(CLASSES, share)))

results = {
    "steps": snap.step, "classes": list(CLASSES), "ood": list(ood), "tau": post.prior_precision,
    "tau_source": source, "heldout_prior": None if held is None else held.to_dict(),
    "num_data": N, "eval_confidence_gap": gap, "auroc": auroc, "reports": reports,
    "ood_map_labels": {k: v.tolist() for k, v in labelled.items()},
    "test": {"labels": y.tolist(), **{k: q.tolist() for k, q in rows.items()}},
    "scores": {"test": {k: v.tolist() for k, v in score_in.items()},
               **{name: {k: v.tolist() for k, v in sc.items()} for name, sc in score_out.items()}},
    "seconds": round(time.time() - start, 1),
}
with open(f"{args.out}/results.json", "w") as f:
    json.dump(results, f)
print(f"\n{results['seconds']:.0f} s; the figures, the test probabilities and the scores: "
      f"{args.out}/results.json")
