"""The two tasks of ``uncertainty_classification.py``: ``docstring-lora`` (4-way docstring →
package multiple choice, LoRA on the base LM; data and model pieces in `multiple_choice`) and
``manpage-section`` (which manual section is this man page from, a tiny GPT-2 classifier from
scratch, with out-of-distribution text; data in `tasks.classification_tasks`). The suite
(`tasks.suite_tasks`) adapts both; ``TASKS`` maps their names to them.
"""

from __future__ import annotations

import os

import torch
from kron_laplace import SeqClassifierHead, fit_kron, fit_kron_lora
from multiple_choice import (
    ANSWER_IDS,
    choice_splits,
    collate,
    lora_model,
    map_answer_logits,
    prompt_batch,
    stream_covs,
    train_example,
)
from transformers import Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback
from kfac_stream.app.data import ExampleDataset
from tasks import classification_tasks as ct

from _common import batches, train_and_collect


def tracker_config(overrides: dict, out: str, steps: int, seed: int) -> KFACConfig:
    """`KFACConfig` with only the run-size fields set (output_dir, snapshot_every: one snapshot
    at the end) and the run's seed, plus ``overrides``."""
    return KFACConfig(output_dir=os.path.join(out, "kfac"), snapshot_every=10 * steps,
                      seed=seed, **overrides)


def finetune(base, examples, a, out: str, overrides: dict, seed: int):
    """One LoRA fine-tuning run with one tracker (`tracker_config`); returns (model, snapshot
    dir, seconds, logged losses)."""
    model = lora_model(base, seed)
    args = TrainingArguments(output_dir=out, max_steps=a.ft_steps,
                             per_device_train_batch_size=a.batch, learning_rate=a.lr,
                             lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
                             save_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=True, seed=seed, logging_steps=max(a.ft_steps // 4, 1),
                             remove_unused_columns=False)
    cb = KFACStreamCallback(tracker_config(overrides, out, a.ft_steps, seed))
    trainer = Trainer(model=model, args=args, train_dataset=ExampleDataset(examples),
                      data_collator=collate, callbacks=[cb])
    return train_and_collect(trainer, model, cb)


class DocstringTask:
    """4-way docstring -> package multiple choice, LoRA on the item-2 LM (module docstring)."""

    name = "docstring-lora"
    title = "docstring → package, 4-way multiple choice with LoRA"
    answer_options = ANSWER_IDS  # the answer tokens: selective answering (`selective_answers`)

    def __init__(self, a, seed: int, base):
        self.a, self.seed, self.base = a, seed, base
        self.splits = choice_splits(a.train_per_class, a.val_per_class, a.test_per_class,
                                    seed=seed)
        self.train_items = [train_example(s, c) for s, c in self.splits["train"]]
        self.evals = {k: prompt_batch(self.splits[k]) for k in ("val", "test")}
        self.ood: dict[str, dict[str, torch.Tensor]] = {}

    def train(self, overrides: dict, out: str):
        return finetune(self.base, self.train_items, self.a, out, overrides, self.seed)

    def logits(self, model, batch):
        return map_answer_logits(model, batch)

    def covs(self, post, batch, taus):
        return stream_covs(post, batch, taus)

    def kron(self, model):
        return fit_kron_lora(model, self.splits["train"], self.a)

    def trainable(self, model) -> int:
        return sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


class ManpageTask:
    """Which manual section is this man page from (`classification_tasks`), a tiny GPT-2
    sequence classifier trained from scratch; OOD: German man pages, Python docs."""

    name = "manpage-section"
    title = "man page → section, 4-way, tiny GPT-2 classifier from scratch, with OOD text"

    def __init__(self, a, seed: int, base=None):
        self.a, self.seed = a, seed
        self.splits = ct.manpage_splits(a.man_train_per_class, a.man_val_per_class,
                                        a.man_test_per_class, seed=seed, pools=MAN_POOLS())
        self.train_items = [self.example(s, c) for s, c in self.splits["train"]]
        self.evals = {k: self.batch([s for s, _ in self.splits[k]], [c for _, c in
                                                                       self.splits[k]])
                      for k in ("val", "test")}
        n_ood = len(self.splits["test"]) // 2
        self.ood = {k: self.batch(v)[0] for k, v in ct.ood_snippets(n_ood, seed).items()}

    @staticmethod
    def example(s: bytes, c: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(list(s))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.tensor(c)}

    @staticmethod
    def batch(snips: list[bytes], labels: list[int] | None = None):
        ids = torch.tensor([list(s) for s in snips])
        b = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return b, None if labels is None else torch.tensor(labels)

    def model(self):
        from transformers import GPT2Config, GPT2ForSequenceClassification

        torch.manual_seed(self.seed)
        return GPT2ForSequenceClassification(GPT2Config(
            vocab_size=256, n_positions=ct.SNIPPET_BYTES, n_embd=self.a.man_width,
            n_layer=self.a.man_layers, n_head=4, num_labels=len(ct.SECTIONS), pad_token_id=0,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            summary_first_dropout=0.0))

    def train(self, overrides: dict, out: str):
        a = self.a
        model = self.model()
        args = TrainingArguments(output_dir=out, max_steps=a.man_steps,
                                 per_device_train_batch_size=a.batch, learning_rate=a.man_lr,
                                 lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
                                 save_strategy="no", report_to="none", disable_tqdm=True,
                                 use_cpu=True, seed=self.seed,
                                 logging_steps=max(a.man_steps // 4, 1))
        cb = KFACStreamCallback(tracker_config(overrides, out, a.man_steps, self.seed))
        trainer = Trainer(model=model, args=args, train_dataset=ExampleDataset(self.train_items),
                          callbacks=[cb])
        return train_and_collect(trainer, model, cb)

    @torch.no_grad()
    def logits(self, model, batch):
        return torch.cat([model(**b).logits.double() for b in batches(batch, 64)])

    def covs(self, post, batch, taus):
        covs = [post.predictive_covariances(b, -1, None, prior_precisions=taus)[1]
                for b in batches(batch, 64)]
        return dict(zip(taus, torch.cat(covs, dim=1), strict=True))

    def kron(self, model, layers: list[str]):
        head = SeqClassifierHead(model, layers)
        b, y = self.batch([s for s, _ in self.splits["train"]],
                          [c for _, c in self.splits["train"]])
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(b["input_ids"], y), batch_size=self.a.kron_batch)
        return fit_kron(head, loader)

    def trainable(self, model) -> int:
        return sum(p.numel() for p in model.parameters())

    def train_accuracy(self, model) -> float:
        b, y = self.batch([s for s, _ in self.splits["train"]],
                          [c for _, c in self.splits["train"]])
        return float((self.logits(model, b).argmax(-1) == y).double().mean())


_POOLS: dict = {}


def MAN_POOLS() -> dict:  # noqa: N802 - a cached constant
    """The man-page pools, read once per process."""
    if not _POOLS:
        _POOLS.update({s: ct.section_pool(s) for s in ct.SECTIONS})
    return _POOLS


TASKS = {"docstring-lora": DocstringTask, "manpage-section": ManpageTask}
