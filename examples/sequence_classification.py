"""Track K-FAC curvature while a sequence classifier trains; calibrated class probabilities.

    python examples/sequence_classification.py --out out/classification [--steps 150]

Offline: is a 64-byte snippet English prose from Python's documentation (label 0) or Python
source code from the standard library (label 1)? A small GPT-2 classifier built from a config.
"""

import argparse
import inspect
import json
import random
from pydoc_data.topics import topics

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot

p = argparse.ArgumentParser()
p.add_argument("--out", default="out/classification")
p.add_argument("--steps", type=int, default=150)
args = p.parse_args()


def snippets(text: str, label: int, n: int) -> list[dict]:
    data = text.encode("utf-8")
    starts = random.Random(label).sample(range(len(data) - 64), n)
    return [{"input_ids": torch.tensor(list(data[s:s + 64])),
             "attention_mask": torch.ones(64, dtype=torch.long), "labels": torch.tensor(label)}
            for s in starts]


# 1. data: prose vs code, 300 snippets each; 50 of each held out
prose = snippets("\n".join(topics.values()), 0, 300)
code = snippets(inspect.getsource(json.decoder) + inspect.getsource(random), 1, 300)
train, test = prose[:250] + code[:250], prose[250:] + code[250:]

# 2. train with the callback
model = GPT2ForSequenceClassification(GPT2Config(
    vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, num_labels=2,
    pad_token_id=0, bos_token_id=0, eos_token_id=0))
kfac = KFACStreamCallback(KFACConfig(token_fraction=0.25, update_every=5, snapshot_every=50))
trainer = Trainer(
    model=model, train_dataset=train, callbacks=[kfac],
    args=TrainingArguments(args.out, max_steps=args.steps, per_device_train_batch_size=16,
                           learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no"))
trainer.train()

# 3. posterior predictive over the two classes vs the trained model's softmax
snap = Snapshot.latest(f"{args.out}/kfac")
model.eval()
post = LaplacePosterior(model, snap, prior_precision="marglik")
batch = {k: torch.stack([e[k] for e in test]) for k in ("input_ids", "attention_mask")}
labels = torch.stack([e["labels"] for e in test])
with torch.no_grad():
    map_probs = model(**batch).logits.softmax(-1)  # [100, 2]
probs = post.predictive_probs(batch)  # [100, 2]: all classes of the head
for name, q in (("trained model", map_probs), ("Laplace", probs)):
    nll = -q[torch.arange(len(labels)), labels].clamp_min(1e-12).log().mean()
    acc = (q.argmax(-1) == labels).float().mean()
    print(f"{name:>13}: accuracy {acc:.3f}, NLL {nll:.3f}, mean confidence "
          f"{q.max(-1).values.mean():.3f}")
