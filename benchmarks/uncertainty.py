r"""Predictive uncertainty of the streamed K-FAC Laplace on real offline text,
over seeds.

What it does (``python benchmarks/uncertainty.py [--seeds 0 1 2]``; ``--quick`` = smoke run,
tiny sizes and the first two seeds, writes nothing; item 3,
``benchmarks/uncertainty_classification.py``, fine-tunes the LM this task saves in
``--base-model``; the data, training recipe and metrics both use are in
``benchmarks/_common.py``). Writes ``benchmarks/results/uncertainty.json`` (per-seed figures
under ``per_seed``, mean ± sample std under ``summary``, paired differences to MAP under
``vs_map``) and the section of ``benchmarks/RESULTS.md`` between the ``uncertainty`` markers.

Seeds (``--seeds``, default 0 1 2): everything below runs once per seed, and the seed sets the
train/held-out topic split (``split_documents(0.1, seed)``), the phase of the evenly spaced
evaluation windows (`_common.pick`), the model initialisation and the Trainer's seed (data
order), both trackers' ``KFACConfig.seed``, the KronLaplace fit windows and the Monte Carlo draws
of the predictive. Every figure is reported as mean ± sample std over the seeds; the verdict
compares each method with MAP by the per-seed (paired) differences. Base-LM cache: only the
seed-0 model is saved to ``--base-model`` (when 0 is among the seeds): it is the model
``uncertainty_classification.py`` would train itself with `_common.train_lm` (split seed 0,
init seed 0, Trainer seed 0), and that script uses one base for all of its seeds. Nothing is
ever loaded from the cache here: every seed trains its own LMs.

1. Trains the app's default small LM in-process: ``tiny_gpt2`` (2 layers x 128, byte tokens,
   seq_len 128, no dropout), a real ``transformers.Trainer`` with the app's trainer defaults
   (batch 8, lr 1e-3 cosine, 10 warm-up steps) on the training topics of Python's reference
   documentation (``pydoc_documents`` / ``split_documents(0.1, seed)``), twice from the same
   seed: once with a ``fisher="empirical"`` and once with a ``fisher="mc"``
   `KFACStreamCallback` (otherwise the KFACConfig defaults: token_fraction 0.05, ema_decay
   0.95, update_every 10). Two callbacks on ONE Trainer do not work: ``CaptureHooks`` removes
   the hooks it finds on the model as "stale", so only the last tracker records and the first
   ends with tokens_seen 0. The script checks that both runs end with identical weights (one
   MAP model, two posteriors) and stops otherwise.
2. Evaluation sets, each ``--seqs`` windows of 128 byte tokens (evenly spaced over all windows
   of the set, with the seed's phase) scored at ``--positions`` evenly spaced positions t
   (target = token t+1):
   ``val`` = half of the held-out pydoc topics (prior-precision grid search only), ``id`` =
   the other half (in-domain test), ``python_source`` = ``ood_documents()`` (stdlib source),
   ``licenses`` = ``license_documents()`` (/usr/share/common-licenses).
3. Methods, all on the same positions:

   * MAP: full-vocabulary softmax.
   * Laplace from the stream (`LaplacePosterior`, per fisher): the linearised predictive
     N(mu, Sigma) of the top-k MAP logits at each position (k = ``--top-k``, chosen per
     position from the MAP logits only, never from the label); the other 256-k logits are
     held at their MAP values. Probabilities = Monte Carlo: mean over ``--mc-samples`` draws of
     the full-vocabulary softmax with the top-k logits replaced by a draw from N(mu, Sigma)
     (generator seeded with the run's seed). Prior precision tau: (a)
     ``optimize_prior_precision()`` (Laplace marginal likelihood of the tracked weights), (b)
     the value of a log grid (plus the marglik value) with the lowest next-token NLL on
     ``val``. The Jacobian features are computed once per
     position and reused for every tau (``LaplacePosterior.predictive_covariances`` with the
     per-position top-k as per-row ``token_ids``).
   * Post-hoc laplace-torch ``KronLaplace`` (CurvlinopsEF = empirical Fisher, K-FAC expand)
     on the same trained weights and the same layers (the tracked Conv1D layers are converted
     to equivalent ``nn.Linear`` s in a copy, as curvlinops' KFAC supports only
     Linear/Conv2d; everything else frozen), fitted on ``--kron-fit`` training windows; its
     N is the number of *sequences* in its fit loader (laplace-torch's convention), tau from
     its own ``optimize_prior_precision(method="marglik")``. Same top-k / MC predictive.
   * MC dropout: n/a, the model has no dropout (resid/embd/attn pdrop = 0).

4. Metrics: next-token NLL (nats) and ECE (15 equal-width bins of top-1 confidence vs
   accuracy, full vocabulary) on ``id``, ``python_source`` and ``licenses``; ID-vs-OOD AUROC
   of per-sequence scores (mean over positions) — MAP softmax entropy, and the mean predictive
   variance of the top-k logits (diagonal of Sigma) of every Laplace variant; AUROC = P(score
   of a random OOD sequence > that of a random ID sequence), ties 1/2. Seconds each method
   needed beyond training (wall clock, this process).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from kfac_stream import LaplacePosterior, Snapshot

from _common import (
    SEQ_LEN,
    auroc,
    conv1d_to_linear,
    lm_datasets,
    mean_std,
    nll_ece,
    pick,
    run_uncertainty_benchmark,
    save_base_lm,
    train_lm,
)

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- uncertainty:begin -->", "<!-- uncertainty:end -->"
FISHERS = ("empirical", "mc")
EVAL_SETS = ("id", "python_source", "licenses")


def positions(n: int) -> list[int]:
    """Evenly spaced positions t in [16, T-2] (each predicts token t+1)."""
    return torch.linspace(16, SEQ_LEN - 2, n).round().long().tolist()


# -- MAP ------------------------------------------------------------------------------------------

@torch.no_grad()
def map_logits(model, ids: torch.Tensor, pos: list[int]):
    """``(logits [n*P, V] float64, targets [n*P])`` at the chosen positions, row = (seq, pos)."""
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.double()
    p = torch.tensor(pos)
    return logits[:, p].reshape(-1, logits.shape[-1]), ids[:, p + 1].reshape(-1)


# -- Laplace from the stream --------------------------------------------------------------------

def stream_covs(post, ids: torch.Tensor, pos: list[int], top: torch.Tensor, taus: list[float]):
    """Per sequence (batch = P copies, one position each): covariances of the top-k logits for
    every tau from one Jacobian pass. ``ids`` [n, T], ``top`` [n*P, K] (row = (seq, pos)).
    Returns ``{tau: [n*P, K, K]}`` float64."""
    P = len(pos)
    per_seq = []
    for i in range(ids.shape[0]):
        x = ids[i:i + 1].expand(P, -1)
        batch = {"input_ids": x, "attention_mask": torch.ones_like(x)}
        _, covs = post.predictive_covariances(batch, pos, top[i * P:(i + 1) * P],
                                              prior_precisions=taus)  # [len(taus), P, K, K]
        per_seq.append(covs)
    return dict(zip(taus, torch.cat(per_seq, dim=1), strict=True))


# -- laplace-torch KronLaplace (post-hoc peer) -----------------------------------------------------

class SeqLM(nn.Module):
    """laplace-torch view: ``input_ids [B, T] -> logits [B, V, T]``; with ``select = (pos [B],
    top [B, K])`` set: the chosen logits ``[B, K]``."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.select = None

    def forward(self, input_ids):
        logits = self.lm(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
        if self.select is None:
            return logits.permute(0, 2, 1)
        pos, top = self.select
        return logits[torch.arange(logits.shape[0]), pos].gather(1, top)


def fit_kron(model, layer_names, train_examples, n_fit: int, seed: int | None = None):
    import laplace
    from laplace.curvature import CurvlinopsEF

    lm = conv1d_to_linear(model, layer_names).eval()
    keep = {n + ".weight" for n in layer_names} | {n + ".bias" for n in layer_names}
    for n, p in lm.named_parameters():
        p.requires_grad_(n in keep)
    ids = pick([e["input_ids"] for e in train_examples], n_fit, seed=seed)
    y = torch.full_like(ids, -100)
    y[:, :-1] = ids[:, 1:]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, y), batch_size=8)
    wrapped = SeqLM(lm)
    t0 = time.perf_counter()
    la = laplace.KronLaplace(wrapped, "classification", prior_precision=1.0,
                             backend=CurvlinopsEF)
    la.fit(loader)
    t_fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    la.optimize_prior_precision(pred_type="glm", method="marglik")
    t_ml = time.perf_counter() - t0
    return la, wrapped, t_fit, t_ml


def kron_covs(la, wrapped, ids, pos, top):
    P = len(pos)
    covs = []
    for i in range(ids.shape[0]):
        wrapped.select = (torch.tensor(pos), top[i * P:(i + 1) * P])
        try:
            Js, _ = la.backend.jacobians(ids[i:i + 1].expand(P, -1))
            covs.append(la.functional_variance(Js).detach().double())
        finally:
            wrapped.select = None
    return torch.cat(covs)


# -- metrics --------------------------------------------------------------------------------------

def mc_probs(logits: torch.Tensor, top: torch.Tensor, cov: torch.Tensor, n_samples: int,
             seed: int = 0) -> torch.Tensor:
    """Full-vocabulary predictive ``[n, V]``: top-k logits ~ N(MAP, cov), the rest at MAP."""
    gen = torch.Generator().manual_seed(seed)
    n, K = top.shape
    jitter = 1e-9 * cov.diagonal(dim1=1, dim2=2).mean(-1).clamp(min=1e-30)
    L = torch.linalg.cholesky(cov + jitter[:, None, None] * torch.eye(K, dtype=cov.dtype))
    probs = torch.zeros_like(logits)
    for chunk in torch.arange(n_samples).split(64):
        z = torch.randn(len(chunk), n, K, generator=gen, dtype=logits.dtype)
        f = logits.expand(len(chunk), -1, -1).clone()  # [S, n, V]
        mu = logits.gather(1, top)
        f.scatter_(2, top.expand(len(chunk), -1, -1), mu + torch.einsum("nkl,snl->snk", L, z))
        probs += torch.softmax(f, -1).sum(0)
    return probs / n_samples


def per_seq(x: torch.Tensor, P: int) -> torch.Tensor:
    return x.reshape(-1, P).mean(1)


# -- one seed -------------------------------------------------------------------------------------

def run_seed(a, seed: int) -> dict:
    """Every method on one seed: the split, the windows, the initialisation, the Trainer's and
    the trackers' seeds, the KronLaplace fit windows and the MC draws all follow ``seed``."""
    torch.manual_seed(seed)
    P, K = a.positions, a.top_k
    pos = positions(P)
    train_examples, sets = lm_datasets(a.seqs, seed=seed)
    print(f"[seed {seed}] sets: {{{', '.join(f'{k}: {tuple(v.shape)}' for k, v in sets.items())}}}"
          f"; {len(train_examples)} training windows; positions {pos}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {f: train_lm(train_examples, a.steps, os.path.join(tmp, f), f, seed=seed)
                for f in FISHERS}
        for f, (_, _, s, ls) in runs.items():
            print(f"[seed {seed}, {f}] trained {a.steps} steps in {s:.1f} s; loss {ls[0]:.3f} -> "
                  f"{ls[-1]:.3f}", flush=True)
        model, _, train_s, losses = runs["empirical"]
        if seed == 0:  # the base of the classification task is the seed-0 model
            save_base_lm(model, a.base_model, a.steps)
        same = all(torch.equal(v, runs["mc"][0].state_dict()[k])
                   for k, v in model.state_dict().items())
        print(f"[seed {seed}] empirical and mc runs end with identical weights: {same}",
              flush=True)
        if not same:
            raise SystemExit("the two training runs diverged: cannot share one MAP model")
        snaps = {f: Snapshot.load(r[1]) for f, r in runs.items()}
        train_s = {f: r[2] for f, r in runs.items()}
        counts = {f: s.meta["counts"] for f, s in snaps.items()}

        cost: dict[str, float] = {}
        t0 = time.perf_counter()
        mp = {k: map_logits(model, v, pos) for k, v in sets.items()}
        cost["MAP"] = time.perf_counter() - t0
        top = {k: lg.topk(K, -1).indices for k, (lg, _) in mp.items()}

        res: dict[str, dict] = {}   # method -> {set: [nll, ece]}
        scores: dict[str, dict] = {}  # method -> {set: per-sequence score}
        taus: dict[str, float] = {}
        for k, (lg, y) in mp.items():
            logp = torch.log_softmax(lg, -1)
            scores.setdefault("MAP entropy", {})[k] = per_seq(-(logp.exp() * logp).sum(-1), P)
            if k != "val":
                res.setdefault("MAP", {})[k] = nll_ece(logp.exp(), y)

        grid = [10.0 ** e for e in range(-2, 9, 2)]
        for fisher in FISHERS:
            post = LaplacePosterior(model, snaps[fisher], prior_precision=1.0)
            t0 = time.perf_counter()
            tau_ml = post.optimize_prior_precision()
            t_ml = time.perf_counter() - t0
            all_taus = sorted(set(grid) | {tau_ml})
            t0 = time.perf_counter()
            covs = {k: stream_covs(post, v, pos, top[k], all_taus) for k, v in sets.items()}
            t_feat = time.perf_counter() - t0
            t0 = time.perf_counter()
            val_nll = {t: nll_ece(mc_probs(mp["val"][0], top["val"], covs["val"][t],
                                           a.mc_samples, seed), mp["val"][1])[0]
                       for t in all_taus}
            t_grid = time.perf_counter() - t0
            tau_val = min(val_nll, key=val_nll.get)
            print(f"[seed {seed}, {fisher}] N={post.num_data:.4g}; tau marglik {tau_ml:.4g} "
                  f"({t_ml:.2f} s); val NLL per tau: "
                  + ", ".join(f"{t:.3g}: {v:.4f}" for t, v in val_nll.items())
                  + f" -> tau_val {tau_val:.4g}; features {t_feat:.1f} s", flush=True)
            n_feat_sets = len(sets)
            for label, tau, extra in ((f"Laplace {fisher}, tau=marglik", tau_ml, t_ml),
                                      (f"Laplace {fisher}, tau=val-NLL", tau_val, t_grid)):
                taus[label] = tau
                t0 = time.perf_counter()
                res[label] = {k: nll_ece(mc_probs(mp[k][0], top[k], covs[k][tau], a.mc_samples,
                                                  seed), mp[k][1]) for k in sets if k != "val"}
                t_mc = time.perf_counter() - t0
                scores[label] = {k: per_seq(covs[k][tau].diagonal(dim1=1, dim2=2).mean(-1), P)
                                 for k in sets}
                # features for the eval sets (val only counts for the grid search) + MC + tau
                cost[label] = (t_feat * (n_feat_sets - 1) / n_feat_sets + t_mc + extra
                               + (t_feat / n_feat_sets if "val" in label else 0.0))

        kron_note = None
        if not a.no_kron:
            layer_names = snaps["empirical"].layer_names
            la, wrapped, t_fit, t_ml = fit_kron(model, layer_names, train_examples, a.kron_fit,
                                                seed)
            tau_k = float(la.prior_precision.reshape(-1)[0])
            t0 = time.perf_counter()
            kc = {k: kron_covs(la, wrapped, v, pos, top[k]) for k, v in sets.items() if k != "val"}
            t_pred = time.perf_counter() - t0
            label = KRON
            taus[label] = tau_k
            t0 = time.perf_counter()
            res[label] = {k: nll_ece(mc_probs(mp[k][0], top[k], kc[k], a.mc_samples, seed),
                                     mp[k][1]) for k in kc}
            cost[label] = t_fit + t_ml + t_pred + time.perf_counter() - t0
            scores[label] = {k: per_seq(c.diagonal(dim1=1, dim2=2).mean(-1), P)
                             for k, c in kc.items()}
            kron_note = {"fit_s": t_fit, "marglik_s": t_ml, "predictive_s": t_pred,
                         "fit_sequences": a.kron_fit, "tau": tau_k}
            print(f"[seed {seed}, laplace-torch] fit {t_fit:.1f} s on {a.kron_fit} windows, "
                  f"marglik {t_ml:.1f} s (tau {tau_k:.4g}), predictive {t_pred:.1f} s",
                  flush=True)

    ood = [k for k in EVAL_SETS[1:] if k in sets]
    detect = {m: {k: auroc(s["id"], s[k]) for k in ood} for m, s in scores.items()}
    detect[MC_DROPOUT] = dict.fromkeys(ood)
    return {"seed": seed, "train_seconds": train_s, "identical_weights": same,
            "train_loss_first_last": [losses[0], losses[-1]],
            "counts": counts, "positions": pos, "calibration": res, "auroc": detect,
            "taus": taus, "cost_seconds": cost, "kron": kron_note,
            "sets": {k: list(v.shape) for k, v in sets.items()}}


# -- over seeds ---------------------------------------------------------------------------------

KRON = "laplace-torch KronLaplace (EF), tau=marglik"
MC_DROPOUT = "MC dropout (8 samples)"


def summarise(per_seed: list[dict]) -> dict:
    """Mean ± sample std over seeds of every figure: ``{"calibration": {method: {set: {"nll":
    (m, s), "ece": (m, s)}}}, "auroc": {score: {set: (m, s) or None}}, "cost_seconds": {method:
    (m, s)}, "train_seconds": {fisher: (m, s)}, "taus": {method: [per seed]}}`` (taus spread
    over decades: listed, not averaged)."""
    first = per_seed[0]
    cal = {m: {k: {name: mean_std([r["calibration"][m][k][i] for r in per_seed])
                   for i, name in enumerate(("nll", "ece"))} for k in v}
           for m, v in first["calibration"].items()}
    auc = {m: {k: None if x is None else mean_std([r["auroc"][m][k] for r in per_seed])
               for k, x in v.items()} for m, v in first["auroc"].items()}
    return {"calibration": cal, "auroc": auc,
            "cost_seconds": {m: mean_std([r["cost_seconds"][m] for r in per_seed])
                             for m in first["cost_seconds"]},
            "train_seconds": {f: mean_std([r["train_seconds"][f] for r in per_seed])
                              for f in first["train_seconds"]},
            "taus": {m: [r["taus"][m] for r in per_seed] for m in first["taus"]}}


def paired(base: list[float], other: list[float]) -> dict:
    """``other - base`` per seed (the same seed shares the model, split and windows): its mean
    ± sample std, how many seeds are lower / higher, and ``call``: ``"lower"`` / ``"higher"``
    when every seed has that sign AND |mean| > the std of the differences, else ``"noise"``
    (``"one seed"`` with one seed)."""
    d = [o - b for b, o in zip(base, other, strict=True)]
    m, s = mean_std(d)
    lower, higher = sum(x < 0 for x in d), sum(x > 0 for x in d)
    if len(d) < 2:
        call = "one seed"
    elif lower == len(d) and abs(m) > s:
        call = "lower"
    elif higher == len(d) and abs(m) > s:
        call = "higher"
    else:
        call = "noise"
    return {"diffs": d, "mean": m, "std": s, "lower": lower, "higher": higher, "call": call}


def comparisons(per_seed: list[dict]) -> dict:
    """Paired differences (`paired`) over seeds: ``{"calibration": {method: {set: {"nll": ...,
    "ece": ...}}}}`` against MAP, ``{"auroc": {score: {ood set: ...}}}`` against MAP entropy."""
    first = per_seed[0]
    cal = {m: {k: {name: paired([r["calibration"]["MAP"][k][i] for r in per_seed],
                                [r["calibration"][m][k][i] for r in per_seed])
                   for i, name in enumerate(("nll", "ece"))} for k in v}
           for m, v in first["calibration"].items() if m != "MAP"}
    auc = {m: {k: paired([r["auroc"]["MAP entropy"][k] for r in per_seed],
                         [r["auroc"][m][k] for r in per_seed]) for k, x in v.items()
               if x is not None}
           for m, v in first["auroc"].items() if m != "MAP entropy"}
    return {"calibration": cal, "auroc": {m: v for m, v in auc.items() if v}}


def run(a) -> dict:
    torch.set_flush_denormal(True)
    per_seed = []
    for seed in a.seeds:
        t0 = time.perf_counter()
        per_seed.append({**run_seed(a, seed), "seconds": time.perf_counter() - t0})
        print(f"[seed {seed}] done in {per_seed[-1]['seconds']:.0f} s", flush=True)
    return {"seeds": list(a.seeds), "base_model_saved": 0 in a.seeds,
            "positions": per_seed[0]["positions"], "sets": per_seed[0]["sets"],
            "summary": summarise(per_seed), "vs_map": comparisons(per_seed),
            "per_seed": per_seed}


# -- report ---------------------------------------------------------------------------------------

def _pm(ms, scale: float = 1.0, fmt: str = ".4f") -> str:
    m, s = ms
    return f"{scale * m:{fmt}} ± {scale * s:{fmt}}"


def tables(r: dict) -> str:
    sets = [k for k in EVAL_SETS if k in r["sets"]]
    ood = sets[1:]
    s = r["summary"]
    head = ("| method | tau per seed | " + " | ".join(f"{k} NLL | {k} ECE %" for k in sets)
            + " | s beyond training |")
    lines = [f"Next-token NLL (nats) and ECE (15 bins, top-1), full 256-byte vocabulary; mean ± "
             f"sample std over {len(r['seeds'])} seeds:", "",
             head, "|" + "---|" * (2 * len(sets) + 3)]
    for m, v in s["calibration"].items():
        tau = s["taus"].get(m)
        cells = " | ".join(f"{_pm(v[k]['nll'])} | {_pm(v[k]['ece'], 100, '.2f')}" for k in sets)
        lines.append(f"| {m} | {'–' if tau is None else ', '.join(f'{t:.3g}' for t in tau)} | "
                     f"{cells} | {_pm(s['cost_seconds'][m], 1, '.1f')} |")
    lines += ["", "ID-vs-OOD AUROC of a per-sequence score (mean over positions); 0.5 = chance; "
              "mean ± std over seeds:", "",
              "| score | " + " | ".join(f"id vs {k}" for k in ood) + " |",
              "|" + "---|" * (len(ood) + 1)]
    for m, v in s["auroc"].items():
        plain = m == "MAP entropy" or m.startswith("MC dropout")
        name = m if plain else f"{m}: top-k logit variance"
        cells = " | ".join("n/a: no dropout" if v[k] is None else _pm(v[k], 1, ".3f")
                           for k in ood)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def _diff(c: dict, scale: float = 1.0, fmt: str = "+.4f", unit: str = "") -> str:
    n = len(c["diffs"])
    tag = {"lower": "lower beyond noise", "higher": "higher beyond noise",
           "noise": "within noise", "one seed": "one seed"}[c["call"]]
    return (f"{scale * c['mean']:{fmt}} ± {scale * c['std']:.2g}{unit} (lower in "
            f"{c['lower']}/{n}; {tag})")


def verdict(r: dict) -> str:
    """From the per-seed numbers: each method's paired difference to MAP (NLL, ECE) and each
    Laplace variance's AUROC difference to MAP entropy, called beyond noise only when every
    seed has the same sign and |mean| exceeds the std of the differences."""
    n = len(r["seeds"])
    cmp = r["vs_map"]
    out = [f"  - rule: Δ = method − MAP per seed (same seed = same model, split and windows), "
           f"mean ± sample std over the {n} seeds; *beyond noise* = the same sign in every seed "
           f"and |mean Δ| > std of Δ. With {n} seeds that is a description, not a significance "
           f"test (with no true difference and symmetric noise, one sign in all {n} happens 1 "
           f"time in {2 ** (n - 1)})."]
    better, worse = [], []
    for m, v in cmp["calibration"].items():
        parts = []
        for k, c in v.items():
            parts.append(f"{k}: NLL Δ {_diff(c['nll'])}, "
                         f"ECE Δ {_diff(c['ece'], 100, '+.2f', ' pts')}")
            for name, x in c.items():
                (better if x["call"] == "lower" else worse if x["call"] == "higher"
                 else []).append(f"{m} {k} {name.upper()}")
        out.append(f"  - {m}: " + "; ".join(parts))
    out.append("  - beyond noise, better than MAP (lower): " + (", ".join(better) or "none")
               + "; worse than MAP (higher): " + (", ".join(worse) or "none")
               + "; everything else is within the seed noise.")
    s = r["summary"]["auroc"]
    ood = [k for k in EVAL_SETS[1:] if k in r["sets"]]
    det = []
    for k in ood:
        cands = {m: v[k] for m, v in s.items() if m != "MAP entropy" and v[k] is not None}
        best = max(cands, key=lambda m: cands[m][0])
        c = cmp["auroc"][best][k]
        tag = {"lower": "below MAP entropy beyond noise", "higher": "above MAP entropy beyond "
               "noise", "noise": "within noise of MAP entropy", "one seed": "one seed"}[c["call"]]
        det.append(f"id vs {k}: MAP entropy {_pm(s['MAP entropy'][k], 1, '.3f')}, best Laplace "
                   f"variance by mean {_pm(cands[best], 1, '.3f')} ({best}; Δ "
                   f"{c['mean']:+.3f} ± {c['std']:.2g}, {tag})")
    out.append("  - detection: " + "; ".join(det))
    return "\n".join(out)


def report(r: dict, a, info: dict) -> str:
    per = r["per_seed"]
    s = r["summary"]
    loss0 = mean_std([p["train_loss_first_last"][0] for p in per])
    loss1 = mean_std([p["train_loss_first_last"][1] for p in per])
    counts = "; ".join(
        f"{f}: " + ", ".join(f"{p['counts'][f]['updates']} updates / "
                             f"{p['counts'][f]['positions_sampled']} positions" for p in per)
        for f in FISHERS)
    return "\n".join([
        BEGIN,
        "## Predictive uncertainty on real text (`benchmarks/uncertainty.py`)",
        "",
        f"- date: {info['date']}",
        f"- machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch threads); "
        f"torch {info['torch']}, transformers {info['transformers']}, laplace-torch "
        f"{info['laplace_torch']}, Python {info['python']}",
        f"- command: `{a.command}` (total wall time {r['total_seconds']:.0f} s; per seed "
        + ", ".join(f"{p['seconds']:.0f}" for p in per) + " s)",
        f"- seeds: {r['seeds']}; each seed sets the train/held-out topic split "
        "(`split_documents` seed), the evaluation windows' sampling phase, the model "
        "initialisation and the Trainer's seed (data order), the trackers' `KFACConfig.seed`, "
        "the KronLaplace fit windows and the Monte Carlo draws; every figure is mean ± sample "
        "std over the seeds (per-seed values in `results/uncertainty.json`)",
        f"- model/training: app default tiny GPT-2 (2x128, byte tokens, seq 128, no dropout), "
        f"`transformers.Trainer`, {a.steps} steps, batch 8, lr 1e-3 cosine, on the training "
        f"pydoc topics (loss {_pm(loss0, 1, '.3f')} → {_pm(loss1, 1, '.3f')}); per seed two "
        "runs from that seed, one `KFACStreamCallback` each (two callbacks on one Trainer: only "
        "the last one records, the first ends with tokens_seen 0), ending with identical "
        f"weights (per seed: {[p['identical_weights'] for p in per]}); training seconds "
        + ", ".join(f"{f} {_pm(v, 1, '.0f')}" for f, v in s["train_seconds"].items())
        + f"; token_fraction 0.05, ema_decay 0.95, update_every 10: {counts}",
        f"- evaluation: {a.seqs} windows per set x {a.positions} positions {r['positions']}; "
        "id = held-out pydoc topics (odd half), val = the other half (only for the tau grid), "
        "python_source = stdlib source, licenses = /usr/share/common-licenses",
        f"- Laplace predictive: linearised N(mu, Sigma) of the top-{a.top_k} MAP logits per "
        f"position (other logits at MAP); probabilities by Monte Carlo ({a.mc_samples} draws, "
        "full-vocabulary softmax). tau: `optimize_prior_precision()` (marglik) or the lowest "
        "val NLL over {1e-2, 1, 1e2, 1e4, 1e6, 1e8} ∪ {marglik}. laplace-torch: KronLaplace + "
        "CurvlinopsEF on "
        f"{a.kron_fit} training windows (its N = those sequences), tau by its marglik; Conv1D "
        "converted to Linear in a copy (curvlinops KFAC supports Linear/Conv2d). Seconds beyond "
        "training include the Jacobian features, tau selection and MC sampling on this machine. "
        "Method in the script's docstring.",
        "",
        tables(r),
        "",
        f"- verdict (as measured, {len(r['seeds'])} seeds, one tiny model):",
        verdict(r),
        END])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=1000, help="LM training steps")
    p.add_argument("--base-model", default="out/bench/tiny_lm",
                   help="where to save the seed-0 trained LM for benchmarks/uncertainty_"
                   "classification.py (which trains it there with the same recipe when "
                   "missing); written only when 0 is among --seeds")
    p.add_argument("--seqs", type=int, default=32, help="windows per evaluation set")
    p.add_argument("--positions", type=int, default=8, help="scored positions per window")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--mc-samples", type=int, default=256)
    p.add_argument("--kron-fit", type=int, default=32, help="training windows for KronLaplace")
    p.add_argument("--no-kron", action="store_true", help="skip laplace-torch")
    p.add_argument("--quick", action="store_true",
                   help="smoke run (tiny sizes, the first two seeds); writes nothing")
    a = p.parse_args(argv)
    a.command = "python benchmarks/uncertainty.py " + shlex.join(argv if argv is not None
                                                                 else sys.argv[1:])
    if a.quick:
        a.steps, a.seqs, a.positions, a.kron_fit, a.mc_samples = 30, 4, 3, 8, 32
        a.seeds = a.seeds[:2]
    run_uncertainty_benchmark("uncertainty", a, run, report, BEGIN, END)


if __name__ == "__main__":
    main()
