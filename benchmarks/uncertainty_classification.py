r"""Small-data multiple choice with LoRA: MAP vs Laplace from the stream vs post-hoc (issue 7,
item 3).

Usage: ``python benchmarks/uncertainty_classification.py [--lm-steps 1000] [--ft-steps 500]
...``; ``--quick`` is a smoke run that writes nothing. Writes ``benchmarks/results/
uncertainty_classification.json`` and the section of ``benchmarks/RESULTS.md`` between the
``uncertainty-classification`` markers.

Task (labelled data that ships with CPython, nothing downloaded): *which standard-library
package does this docstring come from?* as a 4-way multiple choice with answer tokens.

* Examples: the docstrings of the functions and classes (``ast``, test directories left out)
  of the packages ``asyncio`` (A), ``email`` (B), ``logging`` (C) and ``xml`` (D) of the
  running interpreter's standard library. First paragraph, whitespace collapsed, at least 40
  characters, cut to ``SNIPPET_BYTES`` UTF-8 bytes; snippets that occur in more than one
  package (or twice) are dropped. Shuffled with a fixed seed, then per class ``--train-per-class``
  for training, ``--val-per-class`` for the prior-precision grid and ``--test-per-class`` for the
  test set (balanced).
* Prompt (byte tokens of the base LM): ``<snippet>\nA asyncio B email C logging D xml? `` and
  the answer byte ``A``-``D``; the loss is the full-vocabulary next-token cross-entropy at the
  answer only (``labels = -100`` elsewhere), which is what the Trainer optimises. Predictions:
  the 4-way softmax over the answer tokens' logits at the last prompt position.
* Base model: the app's default tiny GPT-2 trained on Python's reference documentation with
  the recipe of item 2 (``benchmarks/uncertainty.py``; ``--lm-steps`` steps; cached in
  ``--base-model`` and reused when the LM task already wrote it there; the recipe is
  ``_common.train_lm``). Fine-tuning: PEFT LoRA (r 8, alpha 16, no dropout) on every
  ``c_attn``/``c_proj``/``c_fc`` of the blocks, everything else frozen; a real
  ``transformers.Trainer`` (batch ``--batch``, ``--ft-steps`` steps, lr ``--lr`` linear decay,
  no weight decay), with one `KFACStreamCallback` per run tracking the LoRA ``lora_A`` /
  ``lora_B`` layers. Each tracker setting gets its own run from the same seed; the script
  checks that all runs end with identical weights (one MAP model, several posteriors).
* Methods, all on the same test prompts:

  - MAP: 4-way softmax of the answer logits.
  - Laplace from the stream (`LaplacePosterior` on the last snapshot; N from the snapshot):
    linearised predictive N(mu, Sigma) of the 4 answer logits; probabilities = mean of the
    softmax over ``--mc-samples`` draws (fixed seed). tau by ``optimize_prior_precision()``
    (marginal likelihood) and by the lowest NLL on the validation prompts over a log grid
    (every candidate's covariance from one Jacobian pass: ``predictive_covariances``).
    Tracker settings: the defaults (empirical and MC Fisher: token_fraction 0.05,
    update_every 10, ema_decay 0.95) and empirical with token_fraction 1, update_every 1.
  - Post-hoc laplace-torch ``KronLaplace`` on the same LoRA weights after training, fitted on
    the whole training set (``CurvlinopsEF`` = empirical Fisher, and ``CurvlinopsGGN`` with
    ``stochastic=True`` = 1-sample MC Fisher, the two Fishers the stream offers; the exact
    GGN needs one backward per vocabulary entry, 27.7 s for 32 examples here),
    full-vocabulary likelihood at the answer position (the training loss), N = training
    examples (laplace-torch's convention), tau by its own marginal likelihood; the same
    4-logit MC predictive.

* Metrics on the test set: accuracy, NLL (nats) and ECE (15 equal-width bins of top-1
  confidence), and the seconds each method needed beyond training.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import random
import re
import shlex
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot
from kfac_stream.app.data import ExampleDataset
from kfac_stream.query.laplace import probs_from_gaussian

from _common import (
    lm_datasets,
    nll_ece,
    run_uncertainty_benchmark,
    save_base_lm,
    train_and_collect,
    train_lm,
)

HERE = Path(__file__).resolve().parent
BEGIN, END = ("<!-- uncertainty-classification:begin -->",
              "<!-- uncertainty-classification:end -->")
PACKAGES = ("asyncio", "email", "logging", "xml")
ANSWERS = "ABCD"
ANSWER_IDS = [ord(c) for c in ANSWERS]  # byte tokens
SNIPPET_BYTES = 80
SUFFIX = "\n" + " ".join(f"{c} {p}" for c, p in zip(ANSWERS, PACKAGES, strict=True)) + "? "
LORA_TARGETS = ("c_attn", "c_proj", "c_fc")
#: tracker settings, each its own training run: label -> KFACConfig overrides
TRACKERS = {
    "empirical": dict(fisher="empirical"),
    "mc": dict(fisher="mc"),
    "empirical, tf=1 k=1": dict(fisher="empirical", token_fraction=1.0, update_every=1),
}


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
    rng = random.Random(seed)
    need = train_per_class + val_per_class + test_per_class
    splits: dict[str, list[tuple[str, int]]] = {"train": [], "val": [], "test": []}
    for c, p in enumerate(PACKAGES):
        unique = [s for s in per[p] if count[s] == 1]
        if len(unique) < need:
            raise SystemExit(f"{p}: {len(unique)} unique docstrings, {need} needed")
        rng.shuffle(unique)
        cuts = (0, train_per_class, train_per_class + val_per_class, need)
        for name, lo, hi in zip(splits, cuts[:-1], cuts[1:], strict=True):
            splits[name] += [(s, c) for s in unique[lo:hi]]
    for v in splits.values():
        rng.shuffle(v)
    return splits


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
    seqs = [prompt_ids(s) for s, _ in items]
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}, torch.tensor([c for _, c in items])


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


def finetune(base, examples, a, out: str, overrides: dict):
    """One LoRA fine-tuning run with one tracker; returns (model, snapshot dir, seconds,
    logged losses)."""
    model = lora_model(base, a.seed)
    args = TrainingArguments(output_dir=out, max_steps=a.ft_steps,
                             per_device_train_batch_size=a.batch, learning_rate=a.lr,
                             lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
                             save_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=True, seed=a.seed, logging_steps=max(a.ft_steps // 4, 1),
                             remove_unused_columns=False)
    cb = KFACStreamCallback(KFACConfig(output_dir=os.path.join(out, "kfac"),
                                       snapshot_every=10 * a.ft_steps, **overrides))
    trainer = Trainer(model=model, args=args, train_dataset=ExampleDataset(examples),
                      data_collator=collate, callbacks=[cb])
    return train_and_collect(trainer, model, cb)


# -- predictives ----------------------------------------------------------------------------------

def batches(batch: dict[str, torch.Tensor], size: int):
    n = batch["input_ids"].shape[0]
    for i in range(0, n, size):
        yield {k: v[i:i + size] for k, v in batch.items()}


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


#: laplace-torch backends: label -> (backend class, backend_kwargs)
KRON_BACKENDS = {"EF": ("CurvlinopsEF", {}),
                 "MC": ("CurvlinopsGGN", {"stochastic": True})}  # 1-sample MC Fisher


def fit_kron(model, train_items, backend: str, a):
    """laplace-torch KronLaplace on the LoRA weights of a copy of ``model``; ``backend`` is a
    key of `KRON_BACKENDS`."""
    import laplace
    from laplace import curvature

    lm = copy.deepcopy(model).eval()
    for n, p in lm.named_parameters():
        p.requires_grad_("lora_" in n)
    batch, y = prompt_batch(train_items)
    targets = torch.tensor([ANSWER_IDS[c] for c in y.tolist()])
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(batch["input_ids"], targets), batch_size=a.batch)
    head = AnswerHead(lm)
    t0 = time.perf_counter()
    cls, kwargs = KRON_BACKENDS[backend]
    la = laplace.KronLaplace(head, "classification", prior_precision=1.0,
                             backend=getattr(curvature, cls), backend_kwargs=kwargs)
    la.fit(loader)
    t_fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    la.optimize_prior_precision(pred_type="glm", method="marglik")
    return la, head, t_fit, time.perf_counter() - t0


def kron_covs(la, head, batch, size: int = 4) -> torch.Tensor:
    """``[n, 4, 4]``: laplace-torch's GLM covariance of the answer logits. Its Jacobians come
    from ``torch.func.jacrev`` over the whole batch output (``B·4`` vector-Jacobian products
    of the whole batch each), so the cost grows with B²: small batches."""
    covs = []
    head.answers_only = True
    try:
        for b in batches(batch, size):
            Js, _ = la.backend.jacobians(b["input_ids"])
            covs.append(la.functional_variance(Js).detach().double())
    finally:
        head.answers_only = False
    return torch.cat(covs)


# -- the task -------------------------------------------------------------------------------------

def run(a) -> dict:
    torch.manual_seed(0)
    torch.set_flush_denormal(True)
    splits = choice_splits(a.train_per_class, a.val_per_class, a.test_per_class, seed=a.seed)
    print("examples: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items())
          + f"; classes {dict(zip(ANSWERS, PACKAGES, strict=True))}", flush=True)
    base, base_s = base_lm(a.base_model, a.lm_steps)
    train = [train_example(s, c) for s, c in splits["train"]]
    evals = {k: prompt_batch(splits[k]) for k in ("val", "test")}

    def probs(mean, cov):
        return probs_from_gaussian(mean, cov, "mc", n_samples=a.mc_samples, seed=0)

    def metrics(p: torch.Tensor, y: torch.Tensor) -> dict:
        nll, ece = nll_ece(p, y)
        return {"acc": float((p.argmax(-1) == y).double().mean()), "nll": nll, "ece": ece}

    res: dict[str, dict] = {}
    taus: dict[str, float] = {}
    cost: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {k: finetune(base, train, a, os.path.join(tmp, f"run{i}"), ov)
                for i, (k, ov) in enumerate(TRACKERS.items())}
        model = runs["empirical"][0]
        ref = model.state_dict()
        same = all(all(torch.equal(v, r[0].state_dict()[k]) for k, v in ref.items())
                   for r in runs.values())
        for k, (_, _, s, ls) in runs.items():
            print(f"[{k}] fine-tuned {a.ft_steps} steps in {s:.1f} s; loss {ls[0]:.3f} -> "
                  f"{ls[-1]:.3f}", flush=True)
        print(f"all runs end with identical weights: {same}", flush=True)
        if not same:
            raise SystemExit("the fine-tuning runs diverged: cannot share one MAP model")
        snaps = {k: Snapshot.load(r[1]) for k, r in runs.items()}

        t0 = time.perf_counter()
        mp = {k: map_answer_logits(model, b) for k, (b, _) in evals.items()}
        cost["MAP"] = time.perf_counter() - t0
        y_test = evals["test"][1]
        res["MAP"] = metrics(torch.softmax(mp["test"], -1), y_test)

        grid = [10.0 ** e for e in range(-4, 7)]
        for k, snap in snaps.items():
            post = LaplacePosterior(model, snap, prior_precision=1.0)
            t0 = time.perf_counter()
            tau_ml = post.optimize_prior_precision()
            t_ml = time.perf_counter() - t0
            all_taus = sorted(set(grid) | {tau_ml})
            t0 = time.perf_counter()
            covs = {s: stream_covs(post, evals[s][0], all_taus) for s in evals}
            t_feat = time.perf_counter() - t0
            t0 = time.perf_counter()
            val_nll = {t: nll_ece(probs(mp["val"], covs["val"][t]), evals["val"][1])[0]
                       for t in all_taus}
            t_grid = time.perf_counter() - t0
            tau_val = min(val_nll, key=val_nll.get)
            print(f"[{k}] N={post.num_data:.4g}; tau marglik {tau_ml:.4g}; val NLL per tau: "
                  + ", ".join(f"{t:.3g}: {v:.4f}" for t, v in val_nll.items())
                  + f" -> tau_val {tau_val:.4g}", flush=True)
            n_val, n_test = (evals[s][0]["input_ids"].shape[0] for s in ("val", "test"))
            t_test = t_feat * n_test / (n_val + n_test)  # features of the test prompts
            for label, tau, extra in ((f"Laplace stream ({k}), tau=marglik", tau_ml, t_ml),
                                      (f"Laplace stream ({k}), tau=val-NLL", tau_val,
                                       t_grid + t_feat - t_test)):
                taus[label] = tau
                t0 = time.perf_counter()
                res[label] = metrics(probs(mp["test"], covs["test"][tau]), y_test)
                cost[label] = t_test + extra + time.perf_counter() - t0
                res[label]["num_data"] = post.num_data

        kron = {}
        if not a.no_kron:
            for backend in KRON_BACKENDS:
                la, head, t_fit, t_ml = fit_kron(model, splits["train"], backend, a)
                t0 = time.perf_counter()
                label = f"laplace-torch KronLaplace ({backend}), tau=marglik"
                res[label] = metrics(probs(mp["test"], kron_covs(la, head, evals["test"][0])),
                                     y_test)
                cost[label] = t_fit + t_ml + time.perf_counter() - t0
                taus[label] = float(la.prior_precision.reshape(-1)[0])
                kron[backend] = {"fit_s": t_fit, "marglik_s": t_ml, "tau": taus[label]}
                print(f"[laplace-torch {backend}] fit {t_fit:.1f} s on {len(train)} examples, "
                      f"marglik {t_ml:.1f} s (tau {taus[label]:.4g})", flush=True)

    counts = {k: s.meta["counts"] for k, s in snaps.items()}
    return {"splits": {k: len(v) for k, v in splits.items()}, "identical_weights": same,
            "base_lm_train_seconds": base_s,
            "finetune_seconds": {k: r[2] for k, r in runs.items()},
            "finetune_loss_first_last": runs["empirical"][3][:1] + runs["empirical"][3][-1:],
            "lora_params": sum(p.numel() for n, p in model.named_parameters() if "lora_" in n),
            "tracked_layers": len(snaps["empirical"].layer_names),
            "counts": counts, "results": res, "taus": taus, "cost_seconds": cost, "kron": kron}


def report(r: dict, a, info: dict) -> str:
    rows = ["| method | tau | accuracy % | NLL | ECE % | s beyond training |",
            "|---|---|---|---|---|---|"]
    for m, v in r["results"].items():
        tau = r["taus"].get(m)
        rows.append(f"| {m} | {'–' if tau is None else f'{tau:.3g}'} | {100 * v['acc']:.1f} | "
                    f"{v['nll']:.4f} | {100 * v['ece']:.2f} | {r['cost_seconds'][m]:.1f} |")
    base = r["results"]["MAP"]
    best_nll = min(r["results"].items(), key=lambda kv: kv[1]["nll"])
    best_ece = min(r["results"].items(), key=lambda kv: kv[1]["ece"])
    c = r["counts"]
    s = r["splits"]
    return "\n".join([
        BEGIN,
        "## Small-data multiple choice with LoRA (`benchmarks/uncertainty_classification.py`)",
        "",
        f"- date: {info['date']}",
        f"- machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch threads); "
        f"torch {info['torch']}, transformers {info['transformers']}, peft {info['peft']}, "
        f"laplace-torch {info['laplace_torch']}, Python {info['python']}",
        f"- command: `{a.command}` (total wall time {r['total_seconds']:.0f} s)",
        "- data (offline, labelled by where it comes from): docstrings of the Python "
        f"{info['python']} standard library on this machine, first paragraph cut to "
        f"{SNIPPET_BYTES} bytes; the label is the package it is defined in: "
        + ", ".join(f"{c_} = `{p}`" for c_, p in zip(ANSWERS, PACKAGES, strict=True))
        + f". Prompt `<docstring>\\n{SUFFIX.strip()} ` → answer byte. {s['train']} training, "
        f"{s['val']} validation (tau grid only), {s['test']} test examples, balanced; "
        "snippets that occur in more than one package are dropped.",
        f"- model: the item-2 tiny GPT-2 (2x128, byte tokens; {a.lm_steps} steps on the pydoc "
        f"topics) + PEFT LoRA r 8 on c_attn/c_proj/c_fc ({r['lora_params']} trainable "
        f"weights, {r['tracked_layers']} tracked LoRA layers); `transformers.Trainer`, "
        f"{a.ft_steps} steps, batch {a.batch}, lr {a.lr:g} linear decay, loss at the answer "
        f"token only (loss {r['finetune_loss_first_last'][0]:.3f} → "
        f"{r['finetune_loss_first_last'][-1]:.3f}); one run per tracker setting from the same "
        f"seed, identical final weights ({r['identical_weights']}); "
        + "; ".join(f"{k}: {v['updates']} updates, {v['positions_sampled']} positions"
                    for k, v in c.items()),
        f"- predictive: linearised N(mu, Sigma) of the 4 answer logits, {a.mc_samples} Monte "
        "Carlo draws of the 4-way softmax. Stream tau: marginal likelihood, or the lowest "
        "validation NLL over {1e-4, ..., 1e6} ∪ {marglik}. laplace-torch: KronLaplace on the "
        "same LoRA weights after training, fitted on all training examples with the training "
        "likelihood (full-vocabulary softmax at the answer position), N = training examples, "
        "tau by its marginal likelihood. Seconds beyond training: Jacobian features of the test "
        "(and for val-NLL, validation) prompts, tau selection, sampling; laplace-torch "
        "includes its fit. Method: docstring of `benchmarks/uncertainty_classification.py`.",
        "",
        *rows,
        "",
        f"- verdict (as measured, one seed, {s['test']} test examples): MAP accuracy "
        f"{100 * base['acc']:.1f}%, NLL {base['nll']:.4f}, ECE {100 * base['ece']:.2f}%; "
        + "; ".join(spread(r["results"], prefix) for prefix in ("Laplace stream",
                                                                 "laplace-torch"))
        + f". Lowest NLL: {best_nll[0]} ({best_nll[1]['nll']:.4f}); lowest ECE: {best_ece[0]} "
        f"({100 * best_ece[1]['ece']:.2f}%).",
        END])


def spread(results: dict, prefix: str) -> str:
    """``"<prefix> (n variants): accuracy lo–hi%, NLL lo–hi, ECE lo–hi%"``."""
    group = [v for m, v in results.items() if m.startswith(prefix)]
    if not group:
        return f"{prefix}: not run"

    def rng(key, scale=1.0, fmt=".1f"):
        lo, hi = min(v[key] for v in group), max(v[key] for v in group)
        return f"{scale * lo:{fmt}}–{scale * hi:{fmt}}"

    return (f"{prefix} ({len(group)} variants): accuracy {rng('acc', 100)}%, NLL "
            f"{rng('nll', fmt='.4f')}, ECE {rng('ece', 100, '.2f')}%")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lm-steps", type=int, default=1000,
                   help="training steps of the base LM (benchmarks/uncertainty.py --steps)")
    p.add_argument("--base-model", default="out/bench/tiny_lm",
                   help="where benchmarks/uncertainty.py saved its trained LM (trained there "
                   "with the same recipe when missing or trained for other --lm-steps)")
    p.add_argument("--train-per-class", type=int, default=48)
    p.add_argument("--val-per-class", type=int, default=24)
    p.add_argument("--test-per-class", type=int, default=72)
    p.add_argument("--ft-steps", type=int, default=500, help="LoRA fine-tuning steps")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0, help="data split and LoRA initialisation")
    p.add_argument("--mc-samples", type=int, default=256)
    p.add_argument("--no-kron", action="store_true", help="skip laplace-torch")
    p.add_argument("--quick", action="store_true", help="smoke run; writes nothing")
    a = p.parse_args(argv)
    a.command = "python benchmarks/uncertainty_classification.py " + shlex.join(
        argv if argv is not None else sys.argv[1:])
    if a.quick:
        a.lm_steps, a.mc_samples = 30, 32
        a.train_per_class, a.val_per_class, a.test_per_class, a.ft_steps = 8, 4, 8, 4
    run_uncertainty_benchmark("uncertainty_classification", a, run, report, BEGIN, END)


if __name__ == "__main__":
    main()
