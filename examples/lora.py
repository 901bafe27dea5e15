"""Track K-FAC curvature of LoRA adapters while they train (PEFT); a posterior over the adapters.

    python examples/lora.py --out out/lora [--steps 100]

Offline: a small GPT-2 built from a config gets LoRA adapters on its attention projections and
is fine-tuned on Python's reference documentation (byte-level). Only the adapters are trainable,
so only they are tracked (the default tracks every trainable Linear/Conv1D in the blocks).
"""

import argparse
from pydoc_data.topics import topics

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot

p = argparse.ArgumentParser()
p.add_argument("--out", default="out/lora")
p.add_argument("--steps", type=int, default=100)
args = p.parse_args()

ids = torch.tensor(list("\n\n".join(topics.values()).encode("utf-8")))
windows = ids[: len(ids) // 64 * 64].view(-1, 64)[:1000]
train = [{"input_ids": w, "attention_mask": torch.ones_like(w), "labels": w} for w in windows]

base = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2,
                                  n_head=4, bos_token_id=0, eos_token_id=0))
model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                        fan_in_fan_out=True, lora_dropout=0.0))
kfac = KFACStreamCallback(KFACConfig(token_fraction=0.1, update_every=5, snapshot_every=50))
trainer = Trainer(
    model=model, train_dataset=train, callbacks=[kfac],
    args=TrainingArguments(args.out, max_steps=args.steps, per_device_train_batch_size=8,
                           learning_rate=3e-3, report_to=[], use_cpu=True, save_strategy="no"))
trainer.train()

snap = Snapshot.latest(f"{args.out}/kfac")
print("tracked:", snap.layer_names)  # the lora_A / lora_B Linears of every c_attn

model.eval()
post = LaplacePosterior(model, snap, prior_precision="marglik")
prompt = torch.tensor([list(b"The for statement")])
batch = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
next_ids = [ord(c) for c in " ei"]
mean, cov = post.predictive(batch, positions=-1, token_ids=next_ids)
for k, i in enumerate(next_ids):
    print(f"next {chr(i)!r}: logit {mean[0, k]:.2f} ± {cov[0, k, k].sqrt():.3f}")
with post.sampled_weights(seed=0):  # one posterior sample of the adapters, restored on exit
    with torch.no_grad():
        sample = model(**batch).logits[0, -1, next_ids]
print("one posterior sample of those logits:", [round(float(v), 2) for v in sample])
