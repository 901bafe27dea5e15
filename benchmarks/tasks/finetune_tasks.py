"""The suite's fine-tune tasks: a small model PRE-TRAINED on one corpus, then
fine-tuned BRIEFLY on a new task, the regime users bring most, where MAP is calibrated or
underconfident. Three of them, each built as a user builds it, on text of this machine:

* ``ft-encoder`` — a BERT-style encoder (2 × 64, BERT's dropout 0.1) pre-trained by masked
  language modelling on Python's reference documentation (pydoc), then fine-tuned as a
  ``BertForSequenceClassification`` (pooled head, pooler and classifier new) on *what kind of
  file is this 64-byte window from?* (Python, C header, license, Perl, JSON, HTML), 6-way.
* ``ft-lora-mc`` — a tiny Llama (``LlamaConfig``, 2 × 64, grouped-query attention) pre-trained as
  a causal LM on pydoc, then LoRA (r 8 on every projection of the blocks) on a 4-way multiple
  choice with one answer token each: *which section of the manual is this man page from?*
  (``... A commands B calls C files D admin? `` + answer byte).
* ``ft-seq2seq`` — a tiny T5 (``T5ForConditionalGeneration``, 2 + 2 layers × 64, ByT5-style
  byte ids) pre-trained on the standard library's source (the encoder reads 48 bytes, the
  decoder writes the next 16), then fine-tuned to emit one label token at the first decoder
  position (``labels = [label token, </s>]``): *what kind of file is this 64-byte window
  from?* (pydoc text, sh script, CSS, glibc locale), 4-way. Its logits are the 4 label
  tokens' logits at decoder position 0; the stream posterior reads them from the batch's
  labels (each row's first labelled decoder position).

Pre-training runs once (seed 0, a plain AdamW loop) and is cached under
``tempfile.gettempdir()/kfac_suite_cache/<task>-<hash of its settings>``: every seed fine-tunes
the same base. A seed changes the fine-tune's data split, the new head's (or LoRA's)
initialisation and the Trainer's and tracker's seed.

How the fine-tunes were sized (from the MAP model alone, before any posterior figure; the
figures are in each task's docstring): the data sizes were fixed first (val and test 200-300
examples), then the number of steps and the learning rate were chosen so that MAP's mean
confidence on the VALIDATION set is at or below its accuracy (brief fine-tuning), with at
least ~20 factor updates at the tracker's default ``update_every``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import kron_laplace as kl
import multiple_choice as mc
import torch
from torch import nn

from kfac_stream.app import data as app_data
from tasks import uncertainty_tasks as ut
from tasks.pools import file_kind_pools, file_windows, split_pools, windows

from _common import batches

CACHE = Path(tempfile.gettempdir()) / "kfac_suite_cache"


def _quiet_transformers() -> None:
    """No "newly initialised weights" warnings: a fine-tune's new head is expected."""
    from transformers.utils import logging

    logging.set_verbosity_error()


def cached_base(name: str, settings: dict, build, load):
    """The pre-trained base of task ``name``: loaded from the cache when a run with the same
    ``settings`` saved it, else ``build()`` (returns the model) saved there first. Returns
    ``load(path)``."""
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = CACHE / f"{name}-{key}"
    if not (path / "settings.json").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        model, loss = build()
        tmp = Path(tempfile.mkdtemp(dir=CACHE))
        model.save_pretrained(tmp)
        (tmp / "settings.json").write_text(json.dumps({**settings, "final_loss": loss,
                                                       "seconds": time.perf_counter() - t0}))
        try:
            os.rename(tmp, path)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"[{name}] pre-trained in {time.perf_counter() - t0:.0f} s (loss {loss:.3f}), "
              f"cached in {path}", flush=True)
    return load(path)


def pretrain(model: nn.Module, batch_fn, steps: int, lr: float, seed: int = 0) -> float:
    """``steps`` AdamW steps (weight decay 0.01, 5% linear warm-up, linear decay) on
    ``batch_fn(rng)`` batches; returns the mean loss of the last 20 steps."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(1, steps - warm))))
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(**batch_fn(rng)).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss))
    model.eval()
    return sum(losses[-20:]) / len(losses[-20:])


def pydoc_windows(n: int) -> list[bytes]:
    """``n``-byte windows of Python's reference documentation (whitespace collapsed)."""
    text = b" ".join(" ".join(app_data.pydoc_documents()).encode().split())
    return windows(text, n)


def source_windows(n: int) -> list[bytes]:
    """``n``-byte windows of stdlib source (whitespace collapsed; tests left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for p in ("asyncio", "email", "json", "http", "logging", "xml", "unittest",
                         "importlib", "concurrent") for f in sorted((root / p).rglob("*.py"))]
    return file_windows(files, n, cap=40_000)


def _eval_mean(model, batch, fn, size: int = 64) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([fn(model, b) for b in batches(batch, size)])


class _Task:
    """What the three tasks share: the Trainer settings and the training batch."""

    scheduler, warmup, collate = "linear", 0, None

    def train_batch(self):
        return self.batch(self.splits["train"])


# -- (a) encoder ----------------------------------------------------------------------------------

CLS, MASK = 256, 257


class FtEncoder(_Task):
    """Pre-trained BERT-style encoder, fine-tuned briefly: 64-byte window → the kind of file
    it is from, 6-way (Python source, C header, license text, Perl module, JSON, HTML:
    `tasks.pools.file_kind_pools`' windows, whitespace collapsed), ``[CLS]`` + 64 bytes.

    Pre-training (once, cached): ``BertForMaskedLM`` (2 × 64, 4 heads, dropout 0.1) on pydoc's
    64-byte windows, BERT's masking (15%: 80% [MASK], 10% random, 10% kept), 400 steps at
    batch 32, lr 1e-3. Fine-tune: ``BertForSequenceClassification.from_pretrained`` (pooler
    and classifier new, seeded), 40 / 40 / 40 windows per class (train / val / test: 240 val
    and test), 200 steps at batch 16, lr 1e-3, linear decay.

    Chosen from MAP alone (validation), seed 0: a first
    build on 6 licenses (lr 5e-4, 200 steps) stayed near chance (val acc 0.21, conf 0.30,
    overconfident), so the data became 6 file kinds; 150 steps at lr 1e-3: val acc 0.583 conf
    0.455; 200 steps at lr 1e-3 (kept: 20 factor updates): val acc 0.613 conf 0.524, test acc
    0.617 conf 0.527 NLL 1.089 (underconfident). Seeds 1, 2 not yet measured."""

    name = "ft-encoder"
    title = ("64-byte window → kind of file, 6-way: BERT encoder (2×64) MLM-pre-trained on "
             "pydoc, fine-tuned briefly (pooled head, 240 sequences)")
    steps, batch_size, lr = 200, 16, 1e-3
    KINDS = (0, 1, 2, 4, 6, 9)  # of `file_kind_pools`: Python, C header, license, Perl,
    # JSON, HTML
    SIZES = (40, 40, 40)
    PRE = {"v": 1, "arch": "bert", "hidden": 64, "layers": 2, "heads": 4, "ffn": 256,
           "vocab": 258, "positions": 65, "corpus": "pydoc-64", "steps": 400, "batch": 32,
           "lr": 1e-3}

    def __init__(self, seed: int):
        self.seed = seed
        pools = file_kind_pools(64)
        self.splits = split_pools([pools[k] for k in self.KINDS], self.SIZES, seed)
        self.n_classes = len(self.KINDS)
        self.train_items = [self.example(s, c) for s, c in self.splits["train"]]
        self.evals = {k: self.batch(self.splits[k]) for k in ("val", "test")}
        self.base_path = cached_base(self.name, self.PRE, self.pretrain, lambda p: p)

    def config(self):
        from transformers import BertConfig

        p = self.PRE
        return BertConfig(vocab_size=p["vocab"], hidden_size=p["hidden"],
                          num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                          intermediate_size=p["ffn"], max_position_embeddings=p["positions"],
                          pad_token_id=0)

    def pretrain(self):
        from transformers import BertForMaskedLM

        torch.manual_seed(0)
        model = BertForMaskedLM(self.config())
        data = torch.tensor([[CLS, *w] for w in pydoc_windows(64)])

        def batch(rng):
            ids = data[torch.tensor(rng.sample(range(len(data)), self.PRE["batch"]))].clone()
            pick = torch.rand(ids.shape) < 0.15
            pick[:, 0] = False
            labels = torch.where(pick, ids, torch.full_like(ids, -100))
            r = torch.rand(ids.shape)
            ids[pick & (r < 0.8)] = MASK
            rand = pick & (r >= 0.8) & (r < 0.9)
            ids[rand] = torch.randint(1, 256, (int(rand.sum()),))
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

        return model, pretrain(model, batch, self.PRE["steps"], self.PRE["lr"])

    @staticmethod
    def example(s: bytes, c: int):
        ids = torch.tensor([CLS, *s])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.tensor(c)}

    @staticmethod
    def batch(items):
        ids = torch.tensor([[CLS, *s] for s, _ in items])
        return ({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                torch.tensor([c for _, c in items]))

    def model(self) -> nn.Module:
        from transformers import BertForSequenceClassification

        _quiet_transformers()
        torch.manual_seed(self.seed)
        return BertForSequenceClassification.from_pretrained(self.base_path,
                                                             num_labels=self.n_classes)

    def logits(self, model, batch):
        return _eval_mean(model, batch, lambda m, b: m(**b).logits.double())

    def covs(self, post, batch, taus):
        covs = [post.predictive_covariances(b, -1, None, prior_precisions=taus)[1]
                for b in batches(batch, 64)]
        return dict(zip(taus, torch.cat(covs, dim=1), strict=True))

    def kron(self, model, layers):
        head = kl.SeqClassifierHead(model, layers)
        b, y = self.train_batch()
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(b["input_ids"], y), batch_size=32)
        return kl.fit_kron(head, loader)

    def kron_covs(self, la, head, batch):
        return kl.kron_covs(la, head, batch, size=1)


class FtEncoderMan(FtEncoder):
    """The same pre-trained encoder (`FtEncoder`'s cached base) fine-tuned on other text from
    this machine: man page → manual section, 4-way (1 user commands, 2 system calls, 5 file
    formats, 8 administration: `classification_tasks`' pools), ``[CLS]`` + the first 64
    bytes of the page's description; 40 / 40 / 60 pages per class (train / val / test), batch
    16, lr 1e-3, linear decay, 50 steps (5 epochs).

    The second encoder fine-tune where MAP is calibrated or underconfident, chosen from MAP
    alone (validation, seed 0, no posterior scored): `FtEncoder`'s 200 steps left MAP
    overconfident (val acc 0.456, conf 0.692); the rule then fixed: the first of 100, 50
    steps with val confidence ≤ accuracy: 100 steps acc 0.519 conf 0.527 (over by 0.008),
    50 steps acc 0.381 conf 0.309 (kept)."""

    name = "ft-encoder-man"
    title = ("man page → section, 4-way: BERT encoder (2×64) MLM-pre-trained on pydoc, "
             "fine-tuned briefly (pooled head, 160 sequences, 50 steps)")
    steps = 50
    SIZES = (40, 40, 60)

    def __init__(self, seed: int):
        from tasks import classification_tasks as ct

        self.seed = seed
        cut = ct.manpage_splits(*self.SIZES, seed=seed, pools=ut.MAN_POOLS())
        self.splits = {k: [(s[:64], c) for s, c in v] for k, v in cut.items()}
        self.n_classes = len(ct.SECTIONS)
        self.train_items = [self.example(s, c) for s, c in self.splits["train"]]
        self.evals = {k: self.batch(self.splits[k]) for k in ("val", "test")}
        self.base_path = cached_base(FtEncoder.name, self.PRE, self.pretrain, lambda p: p)


# -- (b) LoRA multiple choice on a tiny Llama -----------------------------------------------------

MC_SUFFIX = b"\nA commands B calls C files D admin? "
MC_SNIPPET = 96


def mc_prompt(snippet: bytes) -> list[int]:
    return [*snippet[:MC_SNIPPET], *MC_SUFFIX]


class FtLoraMC(_Task):
    """Pre-trained tiny Llama, LoRA multiple choice, fine-tuned briefly: *which section of the
    manual is this man page from?* (1 user commands, 2 system calls, 5 file formats,
    8 administration: `classification_tasks`' pools), the first 96 bytes of the page's
    description + ``\\nA commands B calls C files D admin? `` and the answer byte; the loss at
    the answer only (full-vocabulary softmax); predictions: the 4 answer tokens' logits.

    Pre-training (once, cached): ``LlamaForCausalLM`` (byte vocabulary 256, 2 layers × 64, 4
    query / 2 key-value heads, SwiGLU 176) on pydoc's 128-byte windows, 400 steps at batch 16,
    lr 2e-3. Fine-tune: PEFT LoRA (r 8, alpha 16) on q/k/v/o/gate/up/down of both blocks (the
    tracker's default layers: the LoRA A/B), 32 / 40 / 60 pages per class (train / val / test:
    160 val, 240 test), 150 steps at batch 16, lr 5e-3, linear decay.

    Chosen from MAP alone (validation), seed 0: 150 steps at lr
    2e-3: val acc 0.319 conf 0.454 (near chance, overconfident); 150 steps at lr 5e-3 (kept
    for now): val acc 0.475 conf 0.522, test acc 0.517 conf 0.538 NLL 1.265 — still 0.05
    above on val (0.02 on test), train acc 0.97: fewer steps to try (open)."""

    name = "ft-lora-mc"
    title = ("man page → section as 4-way multiple choice with answer tokens: LoRA on a tiny "
             "Llama (2×64, GQA) pre-trained on pydoc, fine-tuned briefly")
    steps, batch_size, lr = 150, 16, 5e-3
    collate = staticmethod(mc.collate)
    SIZES = (32, 40, 60)
    PRE = {"v": 1, "arch": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2,
           "ffn": 176, "vocab": 256, "positions": 256, "corpus": "pydoc-128", "steps": 400,
           "batch": 16, "lr": 2e-3}
    TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, seed: int):
        from tasks import classification_tasks as ct

        self.seed = seed
        self.splits = ct.manpage_splits(*self.SIZES, seed=seed, pools=ut.MAN_POOLS())
        self.train_items = [self.example(s, c) for s, c in self.splits["train"]]
        self.evals = {k: self.batch(self.splits[k]) for k in ("val", "test")}
        from transformers import LlamaForCausalLM

        self.base = cached_base(self.name, self.PRE, self.pretrain,
                                lambda p: LlamaForCausalLM.from_pretrained(p).float())

    def pretrain(self):
        from transformers import LlamaConfig, LlamaForCausalLM

        p = self.PRE
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["ffn"],
            num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
            num_key_value_heads=p["kv_heads"], max_position_embeddings=p["positions"],
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None))
        data = torch.tensor([list(w) for w in pydoc_windows(128)])

        def batch(rng):
            ids = data[torch.tensor(rng.sample(range(len(data)), p["batch"]))]
            return {"input_ids": ids, "labels": ids}

        return model, pretrain(model, batch, p["steps"], p["lr"])

    @staticmethod
    def example(s: bytes, c: int):
        ids = torch.tensor([*mc_prompt(s), mc.ANSWER_IDS[c]])
        labels = torch.full_like(ids, -100)
        labels[-1] = ids[-1]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    @staticmethod
    def batch(items):
        return mc.padded_batch([mc_prompt(s) for s, _ in items], [c for _, c in items])

    def model(self):
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(self.TARGETS),
                         task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return get_peft_model(copy.deepcopy(self.base), cfg)

    def logits(self, model, batch):
        return _eval_mean(model, batch, mc.map_answer_logits, 32)

    def covs(self, post, batch, taus):
        return mc.stream_covs(post, batch, taus)

    def kron(self, model, layers):
        lm = copy.deepcopy(model).eval()
        for n, p in lm.named_parameters():
            p.requires_grad_("lora_" in n)
        b, y = self.train_batch()
        targets = torch.tensor([mc.ANSWER_IDS[c] for c in y.tolist()])
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(b["input_ids"], targets), batch_size=32)
        return kl.fit_kron(mc.AnswerHead(lm), loader)

    def kron_covs(self, la, head, batch):
        return kl.kron_covs(la, head, batch, size=1)


# -- (c) seq2seq classifier on a tiny T5 ----------------------------------------------------------

PAD, EOS, BYTE0 = 0, 1, 3  # ByT5's ids: pad, </s>, unk; byte b is id b + 3


def t5_ids(s: bytes) -> list[int]:
    return [b + BYTE0 for b in s]


class T5LabelHead(nn.Module):
    """laplace-torch view of the T5 classifier: ``input_ids [B, T]`` (pad 0) -> the
    full-vocabulary logits at decoder position 0 ``[B, V]`` (from the decoder start token), or
    with ``answers_only`` the K label tokens' ``[B, K]``; a copy whose only weights with
    gradients are the tracked layers'."""

    def __init__(self, model, layers: list[str], label_ids: list[int]):
        super().__init__()
        self.m = copy.deepcopy(model).eval()
        keep = {f"{name}.{p}" for name in layers for p in ("weight", "bias")}
        for n, p in self.m.named_parameters():
            p.requires_grad_(n in keep)
        self.label_ids, self.answers_only = label_ids, False

    def forward(self, input_ids):
        dec = torch.full((input_ids.shape[0], 1), self.m.config.decoder_start_token_id,
                         dtype=torch.long, device=input_ids.device)
        out = self.m(input_ids=input_ids, attention_mask=(input_ids != PAD).long(),
                     decoder_input_ids=dec, use_cache=False).logits[:, 0]
        return out[:, self.label_ids] if self.answers_only else out


class FtSeq2Seq(_Task):
    """Pre-trained tiny T5, fine-tuned briefly as a seq2seq classifier: 64-byte window → the
    kind of file it is from, 4-way (pydoc text, ``/bin/sh`` script, CSS, glibc locale:
    `tasks.pools.file_kind_pools`' windows), the label as ONE token at decoder position 0
    (``labels = [label, </s>]``, padded with -100 to the input's 65 positions: the tracker
    needs the decoder as long as the input; label tokens the bytes ``d s y l``).

    Pre-training (once, cached): ``T5ForConditionalGeneration`` (ByT5 byte ids, vocabulary
    259, d_model 64, 2 encoder + 2 decoder layers, 4 heads, d_ff 256, dropout 0.1) on 64-byte
    windows of stdlib source: the encoder reads the first 48 bytes + ``</s>``, the decoder
    writes the last 16 + ``</s>``; 400 steps at batch 32, lr 2e-3. Fine-tune: all weights,
    40 / 60 / 60 windows per class (train / val / test: 240 each), 150 steps at batch 16, lr 1e-3,
    linear decay.

    Chosen from MAP alone (validation), seed 0: 150 steps at lr
    1e-3: val acc 0.796 conf 0.871, test acc 0.804 conf 0.880 NLL 0.733 — overconfident
    by 0.075 on val, outside the target regime: fewer steps / a lower lr to try (open)."""

    name = "ft-seq2seq"
    title = ("64-byte window → kind of file, 4-way, one label token at decoder position 0: "
             "tiny T5 (2+2×64) pre-trained on stdlib source, fine-tuned briefly")
    steps, batch_size, lr = 150, 16, 1e-3
    KINDS = (3, 5, 7, 8)  # of `file_kind_pools`: pydoc, sh, CSS, locale
    LABELS = b"dsyl"
    SIZES = (40, 60, 60)
    PRE = {"v": 1, "arch": "t5", "d_model": 64, "layers": 2, "heads": 4, "d_kv": 16,
           "d_ff": 256, "vocab": 259, "corpus": "stdlib-source-64 48->16", "steps": 400,
           "batch": 32, "lr": 2e-3}

    def __init__(self, seed: int):
        self.seed = seed
        pools = file_kind_pools(64)
        self.splits = split_pools([pools[k] for k in self.KINDS], self.SIZES, seed)
        self.label_ids = [b + BYTE0 for b in self.LABELS]
        self.train_items = [self.example(s, c) for s, c in self.splits["train"]]
        self.evals = {k: self.batch(self.splits[k]) for k in ("val", "test")}
        self.base_path = cached_base(self.name, self.PRE, self.pretrain, lambda p: p)

    def config(self):
        from transformers import T5Config

        p = self.PRE
        return T5Config(vocab_size=p["vocab"], d_model=p["d_model"], d_kv=p["d_kv"],
                        d_ff=p["d_ff"], num_layers=p["layers"], num_decoder_layers=p["layers"],
                        num_heads=p["heads"], dropout_rate=0.1, pad_token_id=PAD,
                        eos_token_id=EOS, decoder_start_token_id=PAD)

    def pretrain(self):
        from transformers import T5ForConditionalGeneration

        torch.manual_seed(0)
        model = T5ForConditionalGeneration(self.config())
        data = torch.tensor([t5_ids(w) for w in source_windows(64)])
        eos = torch.full((self.PRE["batch"], 1), EOS)

        def batch(rng):
            w = data[torch.tensor(rng.sample(range(len(data)), self.PRE["batch"]))]
            ids = torch.cat([w[:, :48], eos], 1)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                    "labels": torch.cat([w[:, 48:], eos], 1)}

        return model, pretrain(model, batch, self.PRE["steps"], self.PRE["lr"])

    def example(self, s: bytes, c: int):
        ids = torch.tensor([*t5_ids(s), EOS])
        labels = torch.full_like(ids, -100)  # the tracker needs decoder length = input length
        labels[:2] = torch.tensor([self.label_ids[c], EOS])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    def batch(self, items):
        """Eval batches hold the labels as training does: the posterior reads the answer at
        each row's first labelled decoder position (0), whose logits see only the start
        token."""
        ids = torch.tensor([[*t5_ids(s), EOS] for s, _ in items])
        y = torch.tensor([c for _, c in items])
        labels = torch.full_like(ids, -100)
        labels[:, 0], labels[:, 1] = torch.tensor(self.label_ids)[y], EOS
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}, y

    def model(self):
        from transformers import T5ForConditionalGeneration

        torch.manual_seed(self.seed)  # fine-tunes every weight: no new head, dropout seeded
        return T5ForConditionalGeneration.from_pretrained(self.base_path)

    def logits(self, model, batch):
        def fn(m, b):
            dec = torch.full((b["input_ids"].shape[0], 1), PAD, dtype=torch.long)
            out = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                    decoder_input_ids=dec, use_cache=False).logits[:, 0]
            return out[:, self.label_ids].double()

        return _eval_mean(model, batch, fn)

    def covs(self, post, batch, taus):
        covs = [post.predictive_covariances(b, None, self.label_ids, prior_precisions=taus)[1]
                for b in batches(batch, 64)]
        return dict(zip(taus, torch.cat(covs, dim=1), strict=True))

    def kron(self, model, layers):
        head = T5LabelHead(model, layers, self.label_ids)
        b, y = self.train_batch()
        targets = torch.tensor(self.label_ids)[y]
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(b["input_ids"], targets), batch_size=32)
        return kl.fit_kron(head, loader)

    def kron_covs(self, la, head, batch):
        return kl.kron_covs(la, head, batch, size=1)


TASKS = {t.name: t for t in (FtEncoder, FtEncoderMan, FtLoraMC, FtSeq2Seq)}
