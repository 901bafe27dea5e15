"""Laplace-LoRA: a LoRA fine-tune on a multiple-choice task with the callback, then a posterior
over the adapters that answers in probabilities (walkthrough: docs/lora.md).

    python examples/lora.py --out out/lora [--steps 200] [--pretrain-steps 200]

Offline: a small Llama built from a config and a byte-level BPE tokenizer trained here, both
on four license texts (/usr/share/common-licenses). The base is first trained as a language
model on them (a stand-in for a pretrained LLM), then frozen; LoRA adapters (r=8) learn which
license an excerpt is from: 4 options, answered with one token, " A" … " D".
"""

import argparse
import random

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from kfac_stream import (
    HeldoutConfig,
    KFACConfig,
    KFACStreamCallback,
    LaplacePosterior,
    Snapshot,
    gather_model,
)

p = argparse.ArgumentParser()
p.add_argument("--out", default="out/lora")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--pretrain-steps", type=int, default=200)
args = p.parse_args()
torch.manual_seed(0)

# 1. text, tokenizer, the question format: an excerpt, " Answer:", then one of 4 answer tokens
LICENSES = ["Apache-2.0", "GPL-3", "MPL-2.0", "Artistic"]
OPTIONS = [" A", " B", " C", " D"]  # option k = LICENSES[k]
texts = [open(f"/usr/share/common-licenses/{name}").read() for name in LICENSES]
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(texts + ["".join(f" Answer:{o}" for o in OPTIONS)] * 50,
                        trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"],
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                            show_progress=False))
tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                              pad_token="<|endoftext|>")
option_ids = [tok(o)["input_ids"][0] for o in OPTIONS]
assert all(len(tok(o)["input_ids"]) == 1 for o in OPTIONS)  # one token each
tokens = [tok(t)["input_ids"] for t in texts]
rng = random.Random(0)


def question(k, length=16):
    """A random excerpt of license k: prompt ids, and the row that trains on its answer."""
    off = rng.randrange(len(tokens[k]) - length)
    prompt = tokens[k][off:off + length] + tok(" Answer:")["input_ids"]
    ids = torch.tensor(prompt + [option_ids[k]])
    labels = torch.full_like(ids, -100)
    labels[-1] = option_ids[k]  # the loss is taken at the answer token only
    return prompt, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


train = [question(i % 4)[1] for i in range(200)]
test = [question(i % 4) for i in range(80)]
test_labels = torch.tensor([i % 4 for i in range(80)])
test_batch = {"input_ids": torch.tensor([q for q, _ in test])}
test_batch["attention_mask"] = torch.ones_like(test_batch["input_ids"])

# 2. the base: a small Llama trained as a language model on the licenses (no callback)
base = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=128,
                                    pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
                                    eos_token_id=tok.eos_token_id))
windows = [torch.tensor(t[i:i + 64]) for t in tokens for i in range(0, len(t) - 64, 16)]
lm = [{"input_ids": w, "attention_mask": torch.ones_like(w), "labels": w} for w in windows]
Trainer(model=base, train_dataset=lm,
        args=TrainingArguments(f"{args.out}/pretrain", max_steps=args.pretrain_steps,
                               per_device_train_batch_size=8, learning_rate=3e-3, report_to=[],
                               use_cpu=True, save_strategy="no", disable_tqdm=True)).train()

# 3. LoRA fine-tune with the callback: only the adapters train, preset="lora" tracks them
model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                        target_modules=["q_proj", "v_proj", "down_proj"]))
kfac = KFACStreamCallback(KFACConfig(preset="lora", token_fraction=0.25, update_every=2,
                                     snapshot_every=100),
                          heldout=HeldoutConfig(answer_tokens=OPTIONS))
trainer = Trainer(model=model, train_dataset=train, callbacks=[kfac], processing_class=tok,
                  args=TrainingArguments(args.out, max_steps=args.steps,
                                         per_device_train_batch_size=8, learning_rate=3e-3,
                                         report_to=[], use_cpu=True, save_strategy="no",
                                         disable_tqdm=True))
trainer.train()

# 4. save adapter + base (out/lora/model, for `kfac-stream query --model` and from_pretrained)
model = gather_model(trainer, f"{args.out}/model").eval()
snap = Snapshot.latest(f"{args.out}/kfac")
print("tracked:", snap.layer_names[:2], f"... ({len(snap.layer_names)} layers)")
print("answer tokens:", snap.answer_tokens, snap.answer_texts)


def report(name, probs):
    nll = -probs[torch.arange(len(probs)), test_labels].clamp_min(1e-12).log().mean()
    acc = (probs.argmax(-1) == test_labels).double().mean()
    print(f"{name:<40} accuracy {acc:.3f}  NLL {nll:.3f}")


with torch.no_grad():
    logits = model(**test_batch).logits[:, -1, option_ids]
report("MAP (softmax over the 4 options)", torch.softmax(logits.double(), -1))

# 5. the posterior over the adapters; the answer is read at the last position of each prompt
post = LaplacePosterior(model, snap)  # the held-out tau and link when fitted, else marglik
print(f"N = {post.num_data:,.0f} token positions per epoch (every position of the "
      f"{len(train)} training questions); {post.describe()}")
probs = post.predictive_probs(test_batch, token_ids=option_ids)
report("Laplace (N = positions)", probs)
per_question = LaplacePosterior(model, snap, num_data=len(train), prior_precision="marglik")
report(f"Laplace (N = {len(train)} questions)",
       per_question.predictive_probs(test_batch, token_ids=option_ids))

# 6. reload in a fresh process's way: the base, then the adapter on it (same layer names)
reloaded = PeftModel.from_pretrained(
    AutoModelForCausalLM.from_pretrained(f"{args.out}/model/base"), f"{args.out}/model").eval()
again = LaplacePosterior(reloaded, snap, prior_precision=post.prior_precision)
diff = (again.predictive_probs(test_batch, token_ids=option_ids) - probs).abs().max()
print(f"reloaded from {args.out}/model: largest difference {diff:.1e}")
print("prompt 0:", repr(tok.decode(test[0][0])[-60:]))
