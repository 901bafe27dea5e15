r"""Do the influence scores from the streamed factors find the training examples that matter?

Usage: ``python benchmarks/influence_quality.py [--seeds 0 1 2] ...``; ``--quick`` is a smoke
run (tiny sizes, one seed, well under a minute) that writes nothing. Writes
``benchmarks/results/influence_quality.json`` and the section of ``benchmarks/RESULTS.md``
between the ``influence-quality`` markers.

Everything is read from the machine (Python's reference documentation, ``pydoc_data.topics``)
and every model is built from a config: nothing is downloaded.

Part 1, planted facts. A byte-level GPT-2 (``tiny_gpt2``: ``--layers`` × ``--width``, 256
byte tokens) is trained from scratch by a real ``transformers.Trainer`` with one
`KFACStreamCallback` (the default `KFACConfig` but for ``output_dir``, one snapshot at the end
and ``seed``) on ``--real`` windows of ``--seq`` bytes of the documentation plus planted
sequences: ``--facts`` invented facts ("the volrek code is 4332": a made-up key of two
syllables, in no documentation text and sharing no syllable with another key, and a random
4-digit value), each written into ``--plants`` training sequences: the fact's sentence, in one
of the `PLANT_TEMPLATES` wordings in turn (``The volrek code is 4332.``, ``volrek code =
4332;``, ``Code for volrek: 4332.``), followed by a documentation window and cut to ``--seq``
bytes. The query of a fact (`QUERY_TEMPLATE`) is its statement alone, ``The volrek code is
4332``, in the wording of its first plant (the plant continues with documentation text; the
fact's other plants are worded otherwise), labelled on the value's digits only; the
paraphrase ``volrek code: 4332`` (`PARAPHRASE_TEMPLATE`, a wording no sequence has) is scored
too and reported beside. Whether the model learnt the facts is measured apart from any score:
the query NLL against the same model untrained, and how often the fact's own value is the
likeliest of all the facts' values after the query's prompt (chance: 1 / facts); with
``--control`` also the query NLL of a run without the plants.

Tuning (seed 0, on whether the model learns the facts, i.e. the value top-1 above; the
influence outcome was not a criterion). Tried in turn:

1. the fact spliced into the middle of a documentation window, three wordings all "... the
   {key} code is {value}.", keys of 2-3 syllables from a list of 20 (keys sharing syllables),
   query ``{key} code: {value}``, 1000 steps at lr 1e-3: value top-1 5% (chance) for the query;
2. the same with 2000 steps at 1e-3, 1000 and 2000 steps at 3e-3, 500 windows: 5-30% in the
   plants' wording, 0-15% for the query;
3. keys of unshared syllables, still spliced, 2000 steps at 3e-3: 5% in the plants' wording at
   every 250 steps (the model, which fits its training windows, predicts the value from the
   window's text before the fact, not from the key); width 256: 5% after 750 steps (stopped);
4. the fact opening the sequence (this design): 45% in the plants' wording after 1500 steps
   at 3e-3, 15% for ``{key} code: {value}``;
5. three different wordings (this design), 2000 steps at 3e-3: 80% in the first plant's
   wording, 20% for ``{key} code: {value}``; at 5e-3 and 1500 steps 40%, and 5% for both
   ``{key} code: {value}`` and ``{key} code is {value}`` (the first wording without its
   article).

So the model learns a fact in a wording it was trained on and not in a paraphrase: the query
takes the first plant's wording, and the paraphrase is reported for what it shows (the
scores still find the plants when the model cannot answer it).

For each query, every training sequence is ranked by

* ``influence_scores`` with ``damping="heuristic"`` (the default) and ``damping="prior"``
  (τ by the posterior's marginal likelihood, ``LaplacePosterior(..., "marglik")``);
* the gradient dot product ``∇L_qᵀ ∇L_n`` over the same layers, from the same per-example
  gradients without preconditioning (``Influence.gradients``);
* a random ranking: the expected top-10 hit rate is computed exactly,
  ``1 − C(N − p, 10) / C(N, 10)`` for a fact with ``p`` plants among ``N`` sequences.

A hit: at least one of the fact's own planted sequences in the top 10. Also shown: the share
of queries whose top 10 holds one of the fact's plants worded otherwise than the query (not the
query's own wording), the share whose top 10 holds a plant of ANY fact, and the median rank of
the fact's best-ranked plant.

Part 2, leave-out retraining, on a smaller instance of the same task (``--lo-*``: fewer
windows and facts, a narrower model, fewer steps). Per seed:
train, score every training sequence for the queries (heuristic damping), sum the scores over
the queries (the influence on the summed query loss), remove the 10 top-scored (most helpful)
sequences and retrain from the same initialisation and seed; against removing 10 random ones
(``--lo-draws`` draws). The figure is the mean query loss (mean over queries of the mean NLL
of the value's digits) after retraining minus that of the full-data retraining. So that a
removal changes nothing but the data, the order of the training sequences is fixed per seed:
every epoch is a seeded permutation of the full set from which the removed sequences are
dropped (the others keep their relative order; a plain ``RandomSampler`` would draw a new
order for a set of another size). The retraining runs carry no tracker; the full-data
retraining is checked to reproduce the tracked run's weights.

Seeds (``--seeds``, default 0 1 2): each changes the facts, the documentation windows, the
data order, the initialisation, the Trainer's seed and the tracker's ``seed``.

Acceptance: in every seed a planted sequence is in the top 10 for ≥ 80% of the
queries (heuristic damping), and at least as often as with the gradient dot product; in every
seed, removing the 10 top-scored sequences raises the mean query loss more than removing 10
random ones (their mean over the draws).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import shlex
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from kfac_stream import (
    Influence,
    KFACConfig,
    KFACStreamCallback,
    LaplacePosterior,
    Snapshot,
    influence_scores,
)
from kfac_stream.app import data as app_data
from kfac_stream.app.models import tiny_gpt2

from _common import machine, write_json, write_section

BEGIN, END = "<!-- influence-quality:begin -->", "<!-- influence-quality:end -->"
TOP = 10
#: How a fact is written into its training sequences (one template per plant, in turn).
PLANT_TEMPLATES = ("The {key} code is {value}.", "{key} code = {value};",
                   "Code for {key}: {value}.")
#: How a query asks for it: the fact's statement alone, in the wording of its first plant
#: (the plant has it followed by documentation text; its other plants word it otherwise).
#: Labels on ``{value}`` only. The acceptance is on these queries. The tiny byte-level model
#: learns a fact only in the wordings it was trained on (docstring, "Tuning").
QUERY_TEMPLATE = PLANT_TEMPLATES[0].removesuffix(".")
#: A paraphrase no training sequence has, which the model does not learn to answer from the
#: plants: reported beside, not part of the acceptance.
PARAPHRASE_TEMPLATE = "{key} code: {value}"
#: The query forms scored: ``{name: template}``.
FORMS = {"query": QUERY_TEMPLATE, "paraphrase": PARAPHRASE_TEMPLATE}
#: Invented keys are two syllables consonant-vowel-consonant, no syllable in two keys.
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"


# -- data -----------------------------------------------------------------------------------------

def doc_text() -> bytes:
    return "\n\n".join(app_data.pydoc_documents()).encode("utf-8")


def invent_facts(n: int, rng: random.Random, text: bytes) -> list[tuple[str, str]]:
    """``n`` ``(key, value)``: keys of two made-up syllables (consonant-vowel-consonant; no
    syllable in two keys) that occur nowhere in ``text``, values distinct 4-digit numbers."""
    keys: list[str] = []
    used: set[str] = set()
    while len(keys) < n:
        syl = ["".join((rng.choice(CONSONANTS), rng.choice(VOWELS), rng.choice(CONSONANTS)))
               for _ in range(2)]
        key = "".join(syl)
        if used & set(syl) or syl[0] == syl[1] or key.encode() in text:
            continue
        used |= set(syl)
        keys.append(key)
    values = rng.sample(range(1000, 10000), n)
    return [(k, str(v)) for k, v in zip(keys, values)]


def lm_example(ids: list[int]) -> dict[str, torch.Tensor]:
    x = torch.tensor(ids, dtype=torch.long)
    return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}


def plant(sentence: str, filler: bytes) -> list[int]:
    """``sentence`` followed by a documentation window (``filler``), cut to the window's
    length: the fact opens the sequence, so that what comes before its value is the template
    and the key alone (spliced into the middle of a window, the fact's value is predicted from
    the window's own text before it, which a model that fits its training text memorises,
    and the key is not learnt: tried, see the docstring)."""
    return list((sentence.encode() + b" " + filler)[:len(filler)])


def build_task(seed: int, n_real: int, n_facts: int, plants: int, seq: int) -> dict:
    """The training set and the queries of one seed.

    Returns ``{"train": [examples], "owner": [N] fact of each sequence (-1: documentation),
    "template": [N] its plant template (-1: documentation),
    "facts": [(key, value)], "queries": {form: [(prompt, value)]} (`FORMS`),
    "no_plants": [examples]}``: the
    training sequences in a seeded order (documentation windows drawn at random from all the
    non-overlapping ``seq``-byte windows; the plants' filler windows are others), and the
    same documentation windows without the plants."""
    rng = random.Random(seed)
    text = doc_text()
    starts = list(range(0, len(text) - seq + 1, seq))
    picked = rng.sample(starts, n_real + n_facts * plants)
    facts = invent_facts(n_facts, rng, text)
    items = [(list(text[s:s + seq]), -1, -1) for s in picked[:n_real]]
    fill = iter(picked[n_real:])
    t = 0
    for f, (key, value) in enumerate(facts):
        for _ in range(plants):
            s = next(fill)
            j = t % len(PLANT_TEMPLATES)
            t += 1
            items.append((plant(PLANT_TEMPLATES[j].format(key=key, value=value),
                                text[s:s + seq]), f, j))
    rng.shuffle(items)
    queries = {form: prompts(facts, t) for form, t in FORMS.items()}
    return {"train": [lm_example(ids) for ids, _, _ in items], "owner": [o for _, o, _ in items],
            "template": [j for _, _, j in items], "facts": facts, "queries": queries,
            "no_plants": [lm_example(ids) for ids, o, _ in items if o < 0]}


def prompts(facts: list[tuple[str, str]], template: str) -> list[tuple[str, str]]:
    """``[(prompt, value)]``: ``template`` filled in and cut before the value."""
    out = []
    for key, value in facts:
        q = template.format(key=key, value=value)
        out.append((q[:len(q) - len(value)], value))
    return out


def completion_batch(pairs: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + completion`` byte sequences, labels on the completion only."""
    seqs = [(list(p.encode()), list(c.encode())) for p, c in pairs]
    T = max(len(p) + len(c) for p, c in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(c)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def stack(examples: list[dict[str, torch.Tensor]], size: int) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.stack([e[k] for e in examples[i:i + size]]) for k in examples[0]}
            for i in range(0, len(examples), size)]


class FixedOrder(torch.utils.data.IterableDataset):
    """``steps × batch`` training examples in a fixed order: epoch ``e`` is a permutation of
    all ``len(examples)`` indices (seeded by ``(seed, e)``) with the ``removed`` ones dropped,
    so that a removal leaves every other example's relative order as it was."""

    def __init__(self, examples: list[dict], total: int, seed: int,
                 removed: frozenset[int] = frozenset()):
        self.examples, self.total, self.seed, self.removed = examples, total, seed, removed

    def __iter__(self):
        n, e = 0, 0
        while True:
            order = torch.randperm(len(self.examples),
                                   generator=torch.Generator().manual_seed(
                                       self.seed * 100_003 + e)).tolist()
            for i in order:
                if i in self.removed:
                    continue
                if n == self.total:
                    return
                yield self.examples[i]
                n += 1
            e += 1


# -- training -------------------------------------------------------------------------------------

def new_model(a, seed: int, width: int | None = None):
    """``tiny_gpt2`` of ``--layers`` × ``width`` (``--width``), byte tokens, initialised from
    ``seed``."""
    return tiny_gpt2(n_layer=a.layers, n_embd=width or a.width, n_head=4, seq_len=a.seq,
                     seed=seed)


def train(examples: list[dict], a, seed: int, out: str, *, steps: int,
          removed: frozenset[int] = frozenset(), track: bool = True,
          width: int | None = None, lr: float | None = None):
    """One Trainer run from `new_model` ``(a, seed, width)`` over `FixedOrder` data (batch
    ``--batch``, learning rate ``lr`` or ``--lr``, cosine, 5% warm-up, no weight decay) with
    one `KFACStreamCallback` (``track``); returns ``(model in eval mode, the snapshot
    directory or None, seconds)``."""
    model = new_model(a, seed, width)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=a.batch,
                             learning_rate=lr or a.lr, lr_scheduler_type="cosine",
                             warmup_steps=max(steps // 20, 1), weight_decay=0.0,
                             logging_steps=max(steps // 4, 1), save_strategy="no",
                             report_to="none", disable_tqdm=True, use_cpu=True, seed=seed)
    cb = None
    if track:
        cb = KFACStreamCallback(KFACConfig(output_dir=os.path.join(out, "kfac"),
                                           snapshot_every=10 * steps, seed=seed))
    data = FixedOrder(examples, steps * a.batch, seed, removed)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=None if cb is None else [cb])
    t0 = time.perf_counter()
    trainer.train()
    model.eval()
    return model, None if cb is None else os.path.join(out, "kfac"), time.perf_counter() - t0


@torch.no_grad()
def query_losses(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[Q]``: each query's mean NLL (nats) over its labelled tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), labels.clamp(min=0),
                          reduction="none")
    keep = labels != -100
    return (nll * keep).sum(1) / keep.sum(1)


@torch.no_grad()
def value_accuracy(model, facts: list[tuple[str, str]], template: str) -> float:
    """Share of the facts whose own value is the likeliest of all the facts' values after the
    prompt ``template`` makes of the key (chance: 1 / facts)."""
    values = [v for _, v in facts]
    right = 0
    for i, (p, _) in enumerate(prompts(facts, template)):
        losses = query_losses(model, completion_batch([(p, v) for v in values]))
        right += int(losses.argmin()) == i
    return right / len(facts)


# -- scores ---------------------------------------------------------------------------------------

def grad_dot(post: LaplacePosterior, queries: dict, train_batches: list[dict]) -> torch.Tensor:
    """``[Q, N]`` float64: ``∇L_qᵀ ∇L_n`` summed over the posterior's layers, per-example
    gradients from `Influence.gradients` (no preconditioning)."""
    inf = Influence(post)
    q = {n: g.double().flatten(1) for n, g in inf.gradients(queries).items()}
    cols = []
    for b in train_batches:
        g = inf.gradients(b)
        cols.append(sum(q[n] @ g[n].double().flatten(1).T for n in q))
    return torch.cat(cols, 1)


def hits(scores: torch.Tensor, owner: list[int], template: list[int], k: int = TOP) -> dict:
    """Per query ``q`` (fact ``q``): whether one of its plants is in the top ``k``
    (``hit``), one worded otherwise than `QUERY_TEMPLATE` (``hit_other_wording``), a plant of
    any fact (``any_plant``), and the rank (1 = top) of its best-ranked plant."""
    own, tpl = torch.tensor(owner), torch.tensor(template)
    order = scores.argsort(dim=1, descending=True)
    out: dict[str, list] = {"hit": [], "hit_other_wording": [], "any_plant": [], "best_rank": []}
    for q in range(scores.shape[0]):
        ranked, words = own[order[q]], tpl[order[q]]
        mine = ranked[:k] == q
        out["hit"].append(bool(mine.any()))
        out["hit_other_wording"].append(bool((mine & (words[:k] != 0)).any()))
        out["any_plant"].append(bool((ranked[:k] >= 0).any()))
        out["best_rank"].append(int((ranked == q).nonzero()[0, 0]) + 1)
    return out


def random_hit_rate(n: int, plants: list[int], k: int = TOP) -> float:
    """Expected share of queries with one of their ``plants[q]`` sequences in a uniformly random
    top ``k`` of ``n``: ``1 − C(n − p, k) / C(n, k)``."""
    return sum(1 - math.comb(n - p, k) / math.comb(n, k) for p in plants) / len(plants)


def summary(h: dict) -> dict:
    ranks = sorted(h["best_rank"])
    return {"hit_rate": sum(h["hit"]) / len(h["hit"]),
            "hit_other_wording_rate": sum(h["hit_other_wording"]) / len(h["hit"]),
            "any_plant_rate": sum(h["any_plant"]) / len(h["any_plant"]),
            "median_best_rank": ranks[len(ranks) // 2], **h}


# -- part 1 ---------------------------------------------------------------------------------------

def planted_seed(a, seed: int, tmp: str) -> dict:
    task = build_task(seed, a.real, a.facts, a.plants, a.seq)
    forms = list(FORMS)
    qb = completion_batch([q for f in forms for q in task["queries"][f]])
    rows = {f: slice(i * a.facts, (i + 1) * a.facts) for i, f in enumerate(forms)}
    out = os.path.join(tmp, f"planted-{seed}")
    model, snap_dir, train_s = train(task["train"], a, seed, out, steps=a.steps)
    untrained = new_model(a, seed).eval()
    loss, loss0 = query_losses(model, qb), query_losses(untrained, qb)
    r: dict = {"seed": seed, "n_train": len(task["train"]),
               "facts": [f"{k}: {v}" for k, v in task["facts"]], "train_s": train_s}
    for f in forms:
        r[f] = {"query_loss": float(loss[rows[f]].mean()),
                "query_loss_untrained": float(loss0[rows[f]].mean()),
                "value_accuracy": value_accuracy(model, task["facts"], FORMS[f])}
    if a.control:  # the same run without the plants: what the model knows from the text alone
        ctrl, _, _ = train(task["no_plants"], a, seed, out + "-ctrl", steps=a.steps, track=False)
        lc = query_losses(ctrl, qb)
        for f in forms:
            r[f]["query_loss_no_plants"] = float(lc[rows[f]].mean())
    snap = Snapshot.latest(snap_dir)
    batches = stack(task["train"], a.score_batch)
    scores = {}
    for damping in ("heuristic", "prior"):
        post = LaplacePosterior(model, snap, "marglik" if damping == "prior" else 1.0)
        t0 = time.perf_counter()
        scores[damping] = influence_scores(post, qb, batches, damping=damping,
                                           show_progress=False).scores
        r[f"score_s_{damping}"] = time.perf_counter() - t0
        if damping == "prior":
            r["tau_marglik"] = float(post.prior_precision)
    post = LaplacePosterior(model, snap, 1.0)
    t0 = time.perf_counter()
    scores["grad_dot"] = grad_dot(post, qb, batches)
    r["score_s_grad_dot"] = time.perf_counter() - t0
    # the gradient dot product against a huge damping: (F + λ)⁻¹ ≈ I/λ, so λ·scores ≈ it
    big = 1e12
    far = Influence(post, damping=big).scores(qb, batches[:1], show_progress=False).scores
    ref = scores["grad_dot"][:, :far.shape[1]]
    r["grad_dot_vs_damping_1e12_rel_err"] = float((far * big - ref).abs().max()
                                                  / ref.abs().max())
    plants = [task["owner"].count(q) for q in range(len(task["facts"]))]
    for f in forms:
        for method, sc in scores.items():
            r[f][method] = summary(hits(sc[rows[f]], task["owner"], task["template"]))
        r[f]["random"] = {"hit_rate": random_hit_rate(len(task["owner"]), plants),
                          "any_plant_rate": random_hit_rate(len(task["owner"]), [sum(plants)])}
    return r


# -- part 2 ---------------------------------------------------------------------------------------

def leave_out_seed(a, seed: int, tmp: str) -> dict:
    task = build_task(seed, a.lo_real, a.lo_facts, a.lo_plants, a.seq)
    qb = completion_batch(task["queries"]["query"])
    out = os.path.join(tmp, f"leave-out-{seed}")
    kw = dict(steps=a.lo_steps, width=a.lo_width, lr=a.lo_lr)
    model, snap_dir, _ = train(task["train"], a, seed, out, **kw)
    post = LaplacePosterior(model, Snapshot.latest(snap_dir), 1.0)
    s = influence_scores(post, qb, stack(task["train"], a.score_batch), show_progress=False)
    total = s.scores.sum(0)  # the influence on the summed query loss
    top = frozenset(total.argsort(descending=True)[:TOP].tolist())

    def retrain(removed):
        m, _, _ = train(task["train"], a, seed, out + "-re", removed=removed, track=False, **kw)
        return m

    full = retrain(frozenset())
    with torch.no_grad():
        same = max(float((p - q).abs().max())
                   for p, q in zip(full.parameters(), model.parameters()))
    base = float(query_losses(full, qb).mean())
    r = {"seed": seed, "n_train": len(task["train"]), "base_loss": base,
         "value_accuracy": value_accuracy(full, task["facts"], QUERY_TEMPLATE),
         "retrain_reproduces_tracked_run_max_abs_diff": same,
         "top_plants_removed": sum(task["owner"][i] >= 0 for i in top),
         "top_loss": float(query_losses(retrain(top), qb).mean())}
    r["top_delta"] = r["top_loss"] - base
    rng = random.Random(10_000 + seed)
    r["random_deltas"], r["random_plants_removed"] = [], []
    for _ in range(a.lo_draws):
        drop = frozenset(rng.sample(range(len(task["train"])), TOP))
        r["random_deltas"].append(float(query_losses(retrain(drop), qb).mean()) - base)
        r["random_plants_removed"].append(sum(task["owner"][i] >= 0 for i in drop))
    r["random_delta_mean"] = sum(r["random_deltas"]) / len(r["random_deltas"])
    return r


# -- report ---------------------------------------------------------------------------------------

def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def verdicts(r: dict) -> list[tuple[str, bool]]:
    p1 = [s["query"] for s in r["planted"]]
    out = [("a fact's planted sequence in the top 10 (heuristic damping) for ≥ 80% of the queries "
            "in every seed", all(s["heuristic"]["hit_rate"] >= 0.8 for s in p1)),
           ("... and at least as often as with the gradient dot product in every seed",
            all(s["heuristic"]["hit_rate"] >= s["grad_dot"]["hit_rate"] for s in p1))]
    if r.get("leave_out"):
        out.append(("removing the 10 top-scored sequences raises the mean query loss more than "
                    "removing 10 random ones (mean over draws) in every seed",
                    all(s["top_delta"] > s["random_delta_mean"] for s in r["leave_out"])))
    return out


METHODS = (("heuristic", "influence, heuristic damping"), ("prior", "influence, prior damping"),
           ("grad_dot", "gradient dot product"))


def report(r: dict, a, info: dict) -> str:
    L = [BEGIN, "## Influence quality (`benchmarks/influence_quality.py`)", "",
         f"- date: {info['date']}",
         f"- machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch "
         f"threads); torch {info['torch']}, transformers {info['transformers']}, "
         f"Python {info['python']}",
         f"- command: `{a.command}`; total {r['total_seconds']:.0f} s",
         f"- planted facts: byte-level GPT-2 {a.layers}×{a.width} from scratch, "
         f"{a.real} documentation windows of {a.seq} bytes + {a.facts} invented facts × "
         f"{a.plants} planted sequences (the fact's sentence, then a documentation window; "
         "one template each: " + ", ".join(f"`{t}`" for t in PLANT_TEMPLATES)
         + f"), {a.steps} steps of batch {a.batch} (lr {a.lr}, cosine) with the tracker at "
         "`KFACConfig()` defaults (one snapshot at the end). Queries: "
         f"`{QUERY_TEMPLATE}` (the acceptance) and the paraphrase `{PARAPHRASE_TEMPLATE}`, "
         "labels on the value. A hit: one of the fact's own plants among the 10 top-scored of "
         "all training sequences. Gradient dot product: `Influence.gradients` of the same "
         "layers, no preconditioning. Method: docstring of the script.", "",
         "Did the model learn the facts? Mean NLL of the value's digits (nats per byte) and how "
         "often the fact's own value is the likeliest of the "
         f"{a.facts} values after the prompt (chance {100 / a.facts:.0f}%):", "",
         "| seed | query NLL: untrained → trained | paraphrase NLL: untrained → trained | "
         "value top-1: query / paraphrase | train s |",
         "|---|---|---|---|---|"]
    for s in r["planted"]:
        q, pq = s["query"], s["paraphrase"]
        L.append(f"| {s['seed']} | {q['query_loss_untrained']:.2f} → {q['query_loss']:.2f} | "
                 f"{pq['query_loss_untrained']:.2f} → {pq['query_loss']:.2f} | "
                 f"{pct(q['value_accuracy'])} / "
                 f"{pct(pq['value_accuracy'])} | {s['train_s']:.0f} |")
    L += ["", "Top-10 hit rate per seed (a plant of the fact worded otherwise than the query in "
          "the top 10; a plant of any fact in the top 10; median rank of the fact's best-ranked "
          "plant):", "",
          "| queries | method | " + " | ".join(f"seed {s['seed']}" for s in r["planted"]) + " |",
          "|---|---|" + "---|" * len(r["planted"])]
    for form in FORMS:
        for m, name in METHODS:
            cells = [f"**{pct(s[form][m]['hit_rate'])}** "
                     f"({pct(s[form][m]['hit_other_wording_rate'])}; "
                     f"{pct(s[form][m]['any_plant_rate'])}; {s[form][m]['median_best_rank']})"
                     for s in r["planted"]]
            L.append(f"| {form} | {name} | " + " | ".join(cells) + " |")
        cells = [f"{100 * s[form]['random']['hit_rate']:.1f}% "
                 f"({100 * s[form]['random']['any_plant_rate']:.0f}%)" for s in r["planted"]]
        L.append(f"| {form} | random (exact expectation) | " + " | ".join(cells) + " |")
    err = max(s["grad_dot_vs_damping_1e12_rel_err"] for s in r["planted"])
    L += ["", f"- gradient dot product vs 10¹² × the influence at damping 10¹² (first batch): "
          f"max relative difference {err:.1e}; prior damping's τ by marginal likelihood: "
          + ", ".join(f"{s['tau_marglik']:.3g}" for s in r["planted"])
          + "; scoring seconds (heuristic / prior / gradient dot, all queries of both forms): "
          + ", ".join(f"{s['score_s_heuristic']:.0f} / {s['score_s_prior']:.0f} / "
                      f"{s['score_s_grad_dot']:.0f}" for s in r["planted"])]
    if r.get("leave_out"):
        L += ["", f"Leave-out retraining: GPT-2 {a.layers}×{a.lo_width}, {a.lo_real} windows + "
              f"{a.lo_facts} facts × {a.lo_plants} plants, {a.lo_steps} steps (lr {a.lo_lr}); "
              f"queries: the {a.lo_facts} facts (`{QUERY_TEMPLATE}`); remove the 10 top-scored "
              "(scores summed over the queries, heuristic damping) or 10 random "
              f"({a.lo_draws} draws) and retrain from the same init, seed and data order "
              "(mean query NLL minus the full-data retraining's):", "",
              "| seed | full data: query NLL (value top-1) | Δ removing top 10 (plants among "
              "them) | Δ removing 10 random: mean [min, max] (plants among them, mean) | "
              "full retrain = tracked run (max abs weight diff) |", "|---|---|---|---|---|"]
        for s in r["leave_out"]:
            d = s["random_deltas"]
            L.append(f"| {s['seed']} | {s['base_loss']:.3f} ({pct(s['value_accuracy'])}) | "
                     f"{s['top_delta']:+.3f} ({s['top_plants_removed']}) | "
                     f"{s['random_delta_mean']:+.3f} [{min(d):+.3f}, {max(d):+.3f}] "
                     f"({sum(s['random_plants_removed']) / len(d):.1f}) | "
                     f"{s['retrain_reproduces_tracked_run_max_abs_diff']:.1e} |")
    L.append("")
    for text, ok in verdicts(r):
        L.append(f"- {text}: {'met' if ok else 'NOT met'}")
    L.append(END)
    return "\n".join(L)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--real", type=int, default=1000)
    p.add_argument("--facts", type=int, default=20)
    p.add_argument("--plants", type=int, default=3)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--score-batch", type=int, default=32)
    p.add_argument("--control", action="store_true",
                   help="also train without the plants (the query NLL from the text alone)")
    p.add_argument("--lo-real", type=int, default=300)
    p.add_argument("--lo-facts", type=int, default=8)
    p.add_argument("--lo-plants", type=int, default=3)
    p.add_argument("--lo-steps", type=int, default=600)
    p.add_argument("--lo-width", type=int, default=64)
    p.add_argument("--lo-lr", type=float, default=3e-3)
    p.add_argument("--lo-draws", type=int, default=3)
    p.add_argument("--skip-leave-out", action="store_true")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: the tiny models run fastest on one, and the machine "
                   "is shared)")
    p.add_argument("--quick", action="store_true", help="smoke run; writes nothing")
    p.add_argument("--no-write", action="store_true", help="print only, write nothing")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    a.command = "python benchmarks/influence_quality.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    if a.quick:
        a.seeds, a.real, a.facts, a.steps, a.control = a.seeds[:1], 60, 4, 30, False
        a.lo_real, a.lo_facts, a.lo_steps, a.lo_draws = 40, 2, 20, 1
    info = dict(machine(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"))
    t0 = time.perf_counter()
    r: dict = {"planted": [], "leave_out": []}
    with tempfile.TemporaryDirectory(prefix="kfac-influence-") as tmp:
        for seed in a.seeds:
            r["planted"].append(planted_seed(a, seed, tmp))
            s = r["planted"][-1]
            q = s["query"]
            print(f"seed {seed}: planted: hit heuristic {pct(q['heuristic']['hit_rate'])}, "
                  f"prior {pct(q['prior']['hit_rate'])}, grad-dot "
                  f"{pct(q['grad_dot']['hit_rate'])}; value accuracy "
                  f"{pct(q['value_accuracy'])}; train {s['train_s']:.0f} s", flush=True)
            if not a.skip_leave_out:
                r["leave_out"].append(leave_out_seed(a, seed, tmp))
                s = r["leave_out"][-1]
                print(f"seed {seed}: leave-out: top {s['top_delta']:+.3f}, random "
                      f"{s['random_delta_mean']:+.3f}", flush=True)
    r["total_seconds"] = time.perf_counter() - t0
    r["verdicts"] = [{"criterion": t, "met": ok} for t, ok in verdicts(r)]
    section = report(r, a, info)
    print(section, flush=True)
    if a.quick or a.no_write:
        return
    write_json("influence_quality", {"machine": info, "command": a.command, "args": vars(a), **r})
    write_section(BEGIN, END, section)


if __name__ == "__main__":
    main()
