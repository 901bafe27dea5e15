r"""Noisy-label detection on the LDS protocol's tasks (`influence_lds.py --part noisy`).

Per task and seed: the seed's split (`lds_tasks.split`), ``share`` (10%) of its training
examples corrupted (`corrupt`: digits and mnist: the label replaced by another class; text:
the window's bytes shuffled), one tracked run on the corrupted set (default `KFACConfig`, as
the scored runs), and the training examples ranked by each detector (higher = more suspect):

* ``loss``: the training loss at the final weights (the baseline every detector must beat);
* ``ours_self``: ``self_influence`` ``I(z, z)`` at the defaults;
* ``grad_norm``: the squared gradient norm of the tracked layers (gradient dot on itself);
* ``ours_heldout``: influence on held-out data, the question "whose removal lowers the
  validation loss most": ``−Σ_v I(v, z)`` over the split's (clean) validation queries, ours at
  the defaults (a harmful example has negative influence on them);
* ``ours_heldout_loss``: the rank average of ``ours_heldout`` and ``loss`` (two signals that
  need no retraining, combined without a tuned weight);
* dattri 0.3.0: TracIn's self-influence ``Σ_c η_c ‖g_c(z)‖²`` over the checkpoints and
  TRAK-1's diagonal at the final weights (`lds_peers.dattri_self_scores`), where they run.

Reported: the AUC for the corrupted ones and the share of them among the top 10% / 20%.
Results per task and seed: ``benchmarks/results/lds_noisy/<task>-seed<S>.json`` (committed).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch
from tasks import lds_tasks as T

from kfac_stream import Influence, LaplacePosterior, Snapshot, self_influence

NOISY_DIR = Path(__file__).resolve().parent / "results" / "lds_noisy"
#: (key, label) of the detectors, in the table's order
DETECTORS = (("loss", "training loss (baseline)"),
             ("ours_self", "ours: self_influence, defaults"),
             ("grad_norm", "squared gradient norm"),
             ("ours_heldout", "ours: −Σ influence on the validation queries"),
             ("ours_heldout_loss", "ours held-out + loss, rank average"),
             ("dattri_tracin_self", "dattri TracIn, self-influence"),
             ("dattri_trak1_self", "dattri TRAK-1, self-attribution"))


def corrupt(task: str, train: list[dict], share: float, seed: int
            ) -> tuple[list[dict], list[bool]]:
    """``(examples, noisy [N] bool)``: ``share`` of ``train`` corrupted (module docstring),
    drawn from ``seed``; the others unchanged."""
    rng = random.Random(f"lds-noise-{task}-{seed}")
    out, noisy = list(train), [False] * len(train)
    for i in sorted(rng.sample(range(len(train)), round(share * len(train)))):
        e = dict(train[i])
        if "input_ids" in e:
            ids = e["input_ids"].tolist()
            rng.shuffle(ids)
            e["input_ids"] = torch.tensor(ids)
            e["labels"] = e["input_ids"].clone()
        else:
            label = int(e["labels"])
            e["labels"] = torch.tensor(rng.choice([c for c in range(10) if c != label]))
        out[i], noisy[i] = e, True
    return out, noisy


def auc(score: torch.Tensor, positive: list[bool]) -> float:
    """P(score of a corrupted example > that of a clean one), ties 1/2."""
    pos = score[torch.tensor(positive)]
    neg = score[~torch.tensor(positive)]
    greater = (pos[:, None] > neg[None, :]).double().mean()
    ties = (pos[:, None] == neg[None, :]).double().mean()
    return float(greater + 0.5 * ties)


def recall_top(score: torch.Tensor, positive: list[bool], share: float) -> float:
    k = max(1, round(share * len(score)))
    top = score.argsort(descending=True)[:k]
    pos = torch.tensor(positive)
    return float(pos[top].sum() / pos.sum())


def ranks(x: torch.Tensor) -> torch.Tensor:
    """``[N]`` → ``[N]`` float64 ranks 0..N-1 (ties broken by position)."""
    r = torch.empty(len(x), dtype=torch.float64)
    r[x.argsort()] = torch.arange(len(x), dtype=torch.float64)
    return r


def grad_norms(post: LaplacePosterior, train_b: list[dict]) -> torch.Tensor:
    inf = Influence(post)
    return torch.cat([sum(g.double().flatten(1).square().sum(1)
                          for g in inf.gradients(b).values()) for b in train_b])


def detectors(task: str, run: dict, train: list[dict], val: list[dict]
              ) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, str]]:
    """``({detector: [N] float64}, {detector: seconds}, {detector: why it did not run})``."""
    model = run["model"]
    train_b = T.batches(train, T.RECIPES[task].batch)
    post = LaplacePosterior(model, Snapshot.latest(run["kfac_dir"]))
    sc, secs = {}, {}

    def timed(key, fn):
        t0 = time.perf_counter()
        sc[key] = fn().double()
        secs[key] = time.perf_counter() - t0

    timed("loss", lambda: T.example_losses(model, train))
    timed("ours_self", lambda: self_influence(post, train_b, show_progress=False))
    timed("grad_norm", lambda: grad_norms(post, train_b))
    timed("ours_heldout", lambda: -Influence(post).scores(
        T.batches(val, 64), train_b, show_progress=False).scores.double().sum(0))
    sc["ours_heldout_loss"] = (ranks(sc["ours_heldout"]) + ranks(sc["loss"])) / 2
    failed: dict[str, str] = {}
    try:
        import lds_peers

        ds, dsecs, failed = lds_peers.dattri_self_scores(task, run, train)
        sc.update({k: v.double() for k, v in ds.items()})
        secs.update(dsecs)
    except (ImportError, AttributeError) as e:
        failed = {k: f"{type(e).__name__}: {e}" for k in ("dattri_tracin_self",
                                                         "dattri_trak1_self")}
    return sc, secs, failed


def noisy_seed(task: str, seed: int, sizes: tuple[int, int, int], share: float, tmp: str,
               write: bool = True) -> dict:
    """One task and seed's detection results (module docstring), written to `NOISY_DIR`."""
    d = T.split(task, seed, *sizes)
    train, noisy = corrupt(task, d["train"], share, seed)
    run = T.train_tracked(task, train, seed, os.path.join(tmp, f"{task}-{seed}-noisy"))
    sc, secs, failed = detectors(task, run, train, d["val"])
    r = {"task": task, "seed": seed, "n_noisy": sum(noisy), "n_train": len(train),
         "train_s": run["train_s"], "score_seconds": secs, "failed": failed, "detect": {}}
    for key, _ in DETECTORS:
        if key in sc:
            r["detect"][key] = {"auc": auc(sc[key], noisy),
                                "recall_top10": recall_top(sc[key], noisy, 0.1),
                                "recall_top20": recall_top(sc[key], noisy, 0.2)}
    if write:
        NOISY_DIR.mkdir(parents=True, exist_ok=True)
        (NOISY_DIR / f"{task}-seed{seed}.json").write_text(json.dumps(r, indent=1))
    return r


def load_noisy(task: str, seeds: list[int]) -> list[dict]:
    out = []
    for s in seeds:
        p = NOISY_DIR / f"{task}-seed{s}.json"
        if p.exists():
            out.append(json.loads(p.read_text()))
    return out


def noisy_table(task: str, results: list[dict]) -> list[str]:
    """The markdown rows of one task's detection table (mean over seeds, per seed bracketed)."""
    if not results:
        return []
    L = ["", f"{task}, noisy labels ({results[0]['n_noisy']} of {results[0]['n_train']} "
         "corrupted; mean over seeds, per seed in brackets):", "",
         "| detector | AUC | recall in top 10% | recall in top 20% |", "|---|---|---|---|"]
    for key, label in DETECTORS:
        if not all(key in r["detect"] for r in results):
            why = "; ".join(sorted({r["failed"].get(key, "not run") for r in results
                                    if key not in r["detect"]}))
            L.append(f"| {label} | did not run: {why} | | |")
            continue
        cells = []
        for m in ("auc", "recall_top10", "recall_top20"):
            v = [r["detect"][key][m] for r in results]
            cells.append(f"{sum(v) / len(v):.3f} (" + ", ".join(f"{x:.2f}" for x in v) + ")")
        L.append(f"| {label} | " + " | ".join(cells) + " |")
    return L
