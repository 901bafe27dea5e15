"""The tasks of `benchmarks/influence_lds.py`: two here with their one training recipe, and
``mnist`` (dattri's MNIST-10 logistic regression, `mnist_task`, its own recipe) behind the same
functions.

* ``digits``: scikit-learn's 8×8 digits (``sklearn.datasets.load_digits``, shipped inside the
  package), rows as tokens: 8 positions, each row's 8 pixel values / 16 as the first 8 of the
  ``width`` input features (``inputs_embeds``, the rest zero), through a GPT-2 sequence
  classifier (its last position's hidden state to 10 classes); `split` draws the training
  set and the queries of each seed from the 1,797 images.
* ``text``: a byte-level GPT-2 language model on non-overlapping windows of Python's reference
  documentation (``pydoc_data.topics``); training windows and query windows disjoint, drawn
  per seed by `split`; every next-byte position labelled.

The recipe (`Recipe`): AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), cosine schedule with
5% warm-up, gradient norm clipped at 1.0, ``epochs`` passes of batch ``batch`` over the
training examples in a fixed order per seed (`stream`: epoch ``e`` is a seeded permutation of
the whole training set from which the examples outside the subset are dropped, so a subset
keeps the others' relative order), i.e. ``ceil(epochs·n/batch)`` steps for ``n`` examples.
`train_tracked` runs it as a real ``transformers.Trainer`` (``optim="adamw_torch"``, the same
settings); `train_fast` is the same loop in plain torch (no Trainer), used for the
retrainings: on the full set it reproduces the Trainer's weights (checked by the benchmark).
No dropout anywhere; eager attention (dattri's IF-CG takes second derivatives, which the
CPU's fused attention kernel does not have).
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    get_scheduler,
)

from kfac_stream import KFACConfig, KFACStreamCallback
from kfac_stream.app import data as app_data
from tasks.lds_common import Checkpoints, batches, collate  # noqa: F401  (the tasks' API)

TASKS = ("digits", "text", "mnist")


@dataclass(frozen=True)
class Recipe:
    """One task's model and training recipe (module docstring)."""

    layers: int
    width: int
    heads: int
    batch: int
    lr: float
    epochs: int


#: Fixed by the models' held-out accuracy / loss (docstring of influence_lds.py), not by LDS.
RECIPES = {"digits": Recipe(layers=2, width=32, heads=4, batch=64, lr=5e-3, epochs=15),
           "text": Recipe(layers=2, width=32, heads=4, batch=32, lr=3e-3, epochs=10),
           # dattri's MNIST-10 logistic regression (`mnist_task`: plain SGD, no schedule)
           "mnist": Recipe(layers=0, width=784, heads=0, batch=32, lr=1e-2, epochs=20)}
TEXT_SEQ = 32


# -- data ---------------------------------------------------------------------------------------

@cache
def digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixels [1797, 8, 8] float in [0, 1], labels [1797])``."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (torch.tensor(x, dtype=torch.float32).view(-1, 8, 8) / 16.0,
            torch.tensor(y, dtype=torch.long))


def digits_example(pixels: torch.Tensor, label: int, width: int) -> dict[str, torch.Tensor]:
    return {"inputs_embeds": F.pad(pixels, (0, width - pixels.shape[-1])),
            "labels": torch.tensor(int(label))}


@cache
def text_windows(seq: int = TEXT_SEQ) -> list[bytes]:
    """Every non-overlapping ``seq``-byte window of the documentation, in order."""
    text = "\n\n".join(app_data.pydoc_documents()).encode("utf-8")
    return [text[s:s + seq] for s in range(0, len(text) - seq + 1, seq)]


def lm_example(ids: list[int]) -> dict[str, torch.Tensor]:
    x = torch.tensor(ids, dtype=torch.long)
    return {"input_ids": x, "labels": x.clone()}


def mnist():
    """`mnist_task`, imported when a task asks for it (its data come from a test peer)."""
    from tasks import mnist_task

    return mnist_task


def split(task: str, seed: int, n_train: int, n_val: int, n_test: int) -> dict:
    """``{"train", "val", "test": [examples]}``: the LDS protocol's split of seed ``seed``,
    disjoint, drawn from the task's pool by ``random.Random(seed)`` (digits: the 1,797 images;
    text: the documentation's windows; mnist: `mnist_task.split`, seed 0 dattri's), a different
    split per seed. ``val``: the validation queries every tunable setting is chosen on;
    ``test``: the queries the table reports."""
    if task == "mnist":
        return mnist().split(seed, n_train, n_val, n_test)
    rng = random.Random(seed)
    need = n_train + n_val + n_test
    if task == "digits":
        x, y = digits_arrays()
        if need > len(y):
            raise SystemExit(f"digits: {n_train} + {n_val} + {n_test} > {len(y)} images")
        picked = rng.sample(range(len(y)), need)
        width = RECIPES["digits"].width
        exs = [digits_example(x[i], int(y[i]), width) for i in picked]
    elif task == "text":
        wins = text_windows()
        exs = [lm_example(list(wins[i])) for i in rng.sample(range(len(wins)), need)]
    else:
        raise ValueError(task)
    return {"train": exs[:n_train], "val": exs[n_train:n_train + n_val],
            "test": exs[n_train + n_val:]}




# -- models -------------------------------------------------------------------------------------

def new_model(task: str, seed: int) -> torch.nn.Module:
    """The task's GPT-2 (`RECIPES`; mnist: dattri's logistic regression), initialised from
    ``seed``, float32, train mode."""
    if task == "mnist":
        return mnist().new_model(seed).train()
    r = RECIPES[task]
    common = dict(n_embd=r.width, n_layer=r.layers, n_head=r.heads, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if task == "digits":
        cfg = GPT2Config(vocab_size=1, n_positions=8, pad_token_id=0, num_labels=10, **common)
        cls = GPT2ForSequenceClassification
    else:
        cfg = GPT2Config(vocab_size=256, n_positions=TEXT_SEQ, **common)
        cls = GPT2LMHeadModel
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    return model.float().train()


def tracked_layers(model: torch.nn.Module) -> list[str]:
    """The Conv1D layers inside the blocks (kfac_stream's default selection); a model without
    blocks (mnist's logistic regression): its Linear layers."""
    inside = [n for n, m in model.named_modules()
              if ".h." in n and type(m).__name__ in ("Conv1D", "Linear")]
    return inside or [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def example_losses(model: torch.nn.Module, examples: list[dict], size: int = 256
                   ) -> torch.Tensor:
    """``[n]`` float64: each example's loss, the classifier's cross-entropy or the LM's summed
    next-byte NLL (kfac_stream's per-example loss)."""
    out = []
    was = model.training
    model.eval()
    with torch.no_grad():
        for b in batches(examples, size):
            if "inputs_embeds" in b:
                logits = model(inputs_embeds=b["inputs_embeds"]).logits
                out.append(F.cross_entropy(logits.double(), b["labels"], reduction="none"))
            else:
                logits = model(input_ids=b["input_ids"]).logits[:, :-1]
                nll = F.cross_entropy(logits.transpose(1, 2).double(), b["labels"][:, 1:],
                                      reduction="none")
                out.append(nll.sum(1))
    model.train(was)
    return torch.cat(out)


def accuracy(model: torch.nn.Module, examples: list[dict]) -> float:
    """Digits: share of correct top-1 classes; text: mean next-byte accuracy."""
    model.eval()
    with torch.no_grad():
        b = collate(examples)
        if "inputs_embeds" in b:
            return float((model(inputs_embeds=b["inputs_embeds"]).logits.argmax(1)
                          == b["labels"]).float().mean())
        logits = model(input_ids=b["input_ids"]).logits[:, :-1]
        return float((logits.argmax(-1) == b["labels"][:, 1:]).float().mean())


# -- the recipe ---------------------------------------------------------------------------------

def steps_for(task: str, n: int) -> int:
    if task == "mnist":
        return mnist().steps_for(n)
    r = RECIPES[task]
    return math.ceil(r.epochs * n / r.batch)


def stream(n_all: int, subset: list[int] | None, total: int, seed: int) -> list[int]:
    """The first ``total`` indices of the training stream (module docstring)."""
    keep = None if subset is None else set(subset)
    out: list[int] = []
    e = 0
    while len(out) < total:
        order = torch.randperm(n_all, generator=torch.Generator().manual_seed(
            seed * 100_003 + e)).tolist()
        out += [i for i in order if keep is None or i in keep]
        e += 1
    return out[:total]


class StreamDataset(torch.utils.data.IterableDataset):
    def __init__(self, examples: list[dict], order: list[int]):
        self.examples, self.order = examples, order

    def __iter__(self):
        return (self.examples[i] for i in self.order)


def train_fast(task: str, examples: list[dict], subset: list[int] | None, seed: int,
               init_seed: int | None = None) -> torch.nn.Module:
    """The recipe in plain torch on ``examples[subset]`` (None: all), model initialised from
    ``init_seed`` (default ``seed``), data order from ``seed``; returns the model (eval)."""
    if task == "mnist":
        return mnist().train_fast(examples, subset, seed, init_seed)
    r = RECIPES[task]
    n = len(examples) if subset is None else len(subset)
    steps = steps_for(task, n)
    order = stream(len(examples), subset, steps * r.batch, seed)
    model = new_model(task, seed if init_seed is None else init_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    sched = get_scheduler("cosine", opt, num_warmup_steps=max(steps // 20, 1),
                          num_training_steps=steps)
    for s in range(steps):
        b = collate([examples[i] for i in order[s * r.batch:(s + 1) * r.batch]])
        if "input_ids" in b:  # as the Trainer does: the loss's sum over the labelled tokens
            b["num_items_in_batch"] = (b["labels"][:, 1:] != -100).sum()
        model(**b).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()



def train_tracked(task: str, examples: list[dict], seed: int, out: str, *,
                  ekfac: bool = False, snapshots: int = 4) -> dict:
    """The recipe as a real ``transformers.Trainer`` run with one `KFACStreamCallback`
    (default `KFACConfig` but for ``output_dir``, ``seed``, ``snapshot_every`` = ⌈steps /
    ``snapshots``⌉ and ``ekfac``; no spectra PNG per snapshot) and a copy of the weights at
    each snapshot step. Returns ``{"model" (eval), "kfac_dir", "ckpt": Checkpoints,
    "train_s", "steps", "snapshot_every"}``."""
    if task == "mnist":
        return mnist().train_tracked(examples, seed, out, ekfac=ekfac, snapshots=snapshots)
    r = RECIPES[task]
    steps = steps_for(task, len(examples))
    every = max(math.ceil(steps / snapshots), 1)
    model = new_model(task, seed)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=r.batch,
                             learning_rate=r.lr, lr_scheduler_type="cosine",
                             warmup_steps=max(steps // 20, 1), weight_decay=0.0,
                             optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999,
                             adam_epsilon=1e-8, max_grad_norm=1.0,
                             logging_steps=max(steps // 4, 1), save_strategy="no",
                             report_to="none", disable_tqdm=True, use_cpu=True, seed=seed,
                             dataloader_num_workers=0)
    kdir = os.path.join(out, "kfac")
    cb = KFACStreamCallback(KFACConfig(output_dir=kdir, snapshot_every=every, seed=seed,
                                       ekfac=ekfac), spectra_media=False)
    ck = Checkpoints(model, set(range(every, steps + 1, every)) | {steps})
    data = StreamDataset(examples, stream(len(examples), None, steps * r.batch, seed))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ck, cb])
    t0 = time.perf_counter()
    trainer.train()
    model.eval()
    return {"model": model, "kfac_dir": kdir, "ckpt": ck, "train_s": time.perf_counter() - t0,
            "steps": steps, "snapshot_every": every}
