"""Multiple choice with answer tokens on the small byte-level LM of the uncertainty benchmarks:
the docstring task's data (which standard-library package does this docstring come from?, one
answer byte per package), its prompts and batches, the base LM and its LoRA, and the answer
logits with their covariance under the stream posterior.

Used by ``uncertainty_classification.py`` and the suite (`tasks.uncertainty_tasks`,
`tasks.suite_tasks`, `tasks.finetune_tasks`, ``suite_default.py``).
"""

from __future__ import annotations

import ast
import copy
import random
import re
import sysconfig
import tempfile
from pathlib import Path

import torch
from tasks import classification_tasks as ct
from torch import nn
from transformers import GPT2LMHeadModel

from _common import batches, lm_datasets, save_base_lm, train_lm

PACKAGES = ("asyncio", "email", "logging", "xml")
ANSWERS = "ABCD"
ANSWER_IDS = [ord(c) for c in ANSWERS]  # byte tokens
SNIPPET_BYTES = 80
SUFFIX = "\n" + " ".join(f"{c} {p}" for c, p in zip(ANSWERS, PACKAGES, strict=True)) + "? "
LORA_TARGETS = ("c_attn", "c_proj", "c_fc")


# -- data -----------------------------------------------------------------------------------------

def docstring_snippets(package: str, stdlib: str | None = None) -> list[str]:
    """First-paragraph docstring snippets of one stdlib package: files in sorted order, each
    file breadth-first (``ast.walk``); deterministic for one Python version."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    path = root / package
    files = sorted(path.rglob("*.py")) if path.is_dir() else [root / f"{package}.py"]
    out = []
    for f in files:
        if any(part.startswith("test") for part in f.relative_to(root).parts[:-1]):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if not doc:
                    continue
                text = re.sub(r"\s+", " ", doc.split("\n\n")[0]).strip()
                if len(text) >= 40:
                    out.append(text.encode()[:SNIPPET_BYTES].decode(errors="ignore"))
    return out


def choice_splits(train_per_class: int, val_per_class: int, test_per_class: int, seed: int = 0
                  ) -> dict[str, list[tuple[str, int]]]:
    """``{"train"|"val"|"test": [(snippet, class index)]}``, balanced, disjoint snippets."""
    per = {p: docstring_snippets(p) for p in PACKAGES}
    count: dict[str, int] = {}
    for snippets in per.values():
        for s in snippets:
            count[s] = count.get(s, 0) + 1
    return ct.balanced_splits(per, count, (train_per_class, val_per_class, test_per_class),
                              random.Random(seed), "unique docstrings")


def prompt_ids(snippet: str) -> list[int]:
    return list((snippet + SUFFIX).encode())


def train_example(snippet: str, label: int) -> dict[str, torch.Tensor]:
    """Prompt + answer byte; the loss only at the answer (the model shifts the labels)."""
    ids = torch.tensor(prompt_ids(snippet) + [ANSWER_IDS[label]])
    labels = torch.full_like(ids, -100)
    labels[-1] = ids[-1]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def prompt_batch(items: list[tuple[str, int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded prompts (pad 0; byte 0 never occurs in a docstring) and the labels."""
    return padded_batch([prompt_ids(s) for s, _ in items], [c for _, c in items])


def padded_batch(seqs: list[list[int]], labels: list[int]
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``({"input_ids", "attention_mask"} [B, T], labels [B])``: ``seqs`` right-padded with 0."""
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}, torch.tensor(labels)


def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad a list of `train_example` s (pad 0, mask 0, label -100)."""
    T = max(len(b["input_ids"]) for b in batch)
    out = {k: torch.full((len(batch), T), -100 if k == "labels" else 0, dtype=torch.long)
           for k in ("input_ids", "attention_mask", "labels")}
    for i, b in enumerate(batch):
        for k in out:
            out[k][i, :len(b[k])] = b[k]
    return out


# -- models ---------------------------------------------------------------------------------------

def base_lm(path: str, steps: int):
    """The item-2 LM: loaded from ``path`` when a previous run saved it with the same number of
    steps, else trained with the same recipe (`_common.train_lm`, no tracker) and saved."""
    stamp = Path(path) / "lm_steps.txt"
    if stamp.exists() and stamp.read_text().strip() == str(steps):
        print(f"base LM: loaded from {path} ({steps} steps)", flush=True)
        return GPT2LMHeadModel.from_pretrained(path).float(), 0.0
    train_examples, _ = lm_datasets(1)
    with tempfile.TemporaryDirectory() as tmp:
        model, _, wall, _ = train_lm(train_examples, steps, tmp, None)
    save_base_lm(model, path, steps)
    print(f"base LM: trained {steps} steps in {wall:.0f} s, saved to {path}", flush=True)
    return model, wall


def lora_model(base, seed: int):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                     fan_in_fan_out=True, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(copy.deepcopy(base), cfg)


# -- answer logits and their covariance -----------------------------------------------------------

@torch.no_grad()
def map_answer_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[n, 4]`` float64 answer logits at the last prompt position."""
    logits = model(**batch).logits
    last = batch["attention_mask"].sum(1) - 1
    return logits[torch.arange(len(last)), last][:, ANSWER_IDS].double()


def stream_covs(post, batch, taus: list[float], size: int = 32) -> dict[float, torch.Tensor]:
    """``{tau: [n, 4, 4]}``: the answer logits' covariance for every tau, features once
    (`LaplacePosterior.predictive_covariances`, batches of ``size`` prompts)."""
    covs = [post.predictive_covariances(b, -1, ANSWER_IDS, prior_precisions=taus)[1]
            for b in batches(batch, size)]  # each [len(taus), b, 4, 4]
    return dict(zip(taus, torch.cat(covs, dim=1), strict=True))


class AnswerHead(nn.Module):
    """laplace-torch view of the LoRA model: right-padded ``input_ids [B, T]`` (pad 0) ->
    full-vocabulary logits at the last prompt position ``[B, V]``, or with ``answers_only``
    the 4 answer logits ``[B, 4]``."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.answers_only = lm, False

    def forward(self, input_ids):
        mask = (input_ids != 0).long()
        logits = self.lm(input_ids=input_ids, attention_mask=mask).logits
        rows = logits[torch.arange(input_ids.shape[0]), mask.sum(1) - 1]
        return rows[:, ANSWER_IDS] if self.answers_only else rows
