"""Track K-FAC curvature while a causal LM trains, then ask what the model does not know.

    python examples/causal_lm.py --out out/causal_lm [--steps 200]

Offline: a small GPT-2 built from a config, byte-level tokens, Python's reference
documentation (shipped with CPython) as training text.
"""

import argparse
from pydoc_data.topics import topics

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot, gather_model

p = argparse.ArgumentParser()
p.add_argument("--out", default="out/causal_lm")
p.add_argument("--steps", type=int, default=200)
args = p.parse_args()

# 1. data: 64-byte windows of the Python docs; the labels are the inputs (the model shifts)
ids = torch.tensor(list("\n\n".join(topics.values()).encode("utf-8")))
windows = ids[: len(ids) // 64 * 64].view(-1, 64)[:2000]
train = [{"input_ids": w, "attention_mask": torch.ones_like(w), "labels": w} for w in windows]

# 2. train with the callback: K-FAC factors of every Linear/Conv1D in the blocks, streamed
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2,
                                   n_head=4, bos_token_id=0, eos_token_id=0))
kfac = KFACStreamCallback(KFACConfig(token_fraction=0.05, update_every=10, snapshot_every=100))
trainer = Trainer(
    model=model, train_dataset=train, callbacks=[kfac],
    args=TrainingArguments(args.out, max_steps=args.steps, per_device_train_batch_size=8,
                           learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no"))
trainer.train()

# 3. the newest snapshot: factors, eigenbases, counts
snap = Snapshot.latest(f"{args.out}/kfac")
print(f"snapshot of step {snap.step}: {len(snap.layer_names)} layers, "
      f"{snap.manifest.counts.tokens_seen} tokens seen")
name = snap.layer_names[0]
print(name, "A", tuple(snap[name].A.shape), "G", tuple(snap[name].G.shape))

# 4. Laplace posterior over the tracked weights. The default call takes the prior precision
# and link fitted on the Trainer's eval set when one was given (here none: tau by marginal
# likelihood, the probit link; post.describe() says which). gather_model saves the trained
# model (for `kfac-stream query --model`) and returns it; after DeepSpeed ZeRO-3 (weights
# partitioned across ranks) a whole copy on the main process, None on the other ranks.
model = gather_model(trainer, f"{args.out}/model")
if model is None:
    raise SystemExit
model.eval()
post = LaplacePosterior(model, snap)
print(f"posterior: {post.describe()}")
prompt = torch.tensor([list(b"def f(x):\n    return")])
batch = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
next_ids = [ord(c) for c in " x(1"]  # logits of four candidate next bytes
mean, cov = post.predictive(batch, positions=-1, token_ids=next_ids)  # [1, 4], [1, 4, 4]
probs = post.predictive_probs(batch, positions=-1, token_ids=next_ids)  # the posterior's link
for k, i in enumerate(next_ids):
    print(f"next {chr(i)!r}: logit {mean[0, k]:.2f} ± {cov[0, k, k].sqrt():.2f}, "
          f"p {probs[0, k]:.3f} (among the four)")
