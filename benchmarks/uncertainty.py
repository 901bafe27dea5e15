r"""Predictive uncertainty of the streamed K-FAC Laplace on real offline text (issue 7, item 2).

What it does (``python benchmarks/uncertainty.py``; ``--quick`` = smoke run, writes nothing;
item 3, ``benchmarks/uncertainty_classification.py``, fine-tunes the LM this task saves in
``--base-model``; the data, training recipe and metrics both use are in
``benchmarks/_common.py``):

1. Trains the app's default small LM in-process: ``tiny_gpt2`` (2 layers x 128, byte tokens,
   seq_len 128, no dropout), a real ``transformers.Trainer`` with the app's trainer defaults
   (batch 8, lr 1e-3 cosine, 10 warm-up steps) on the training topics of Python's reference
   documentation (``pydoc_documents`` / ``split_documents(0.1, seed=0)``), twice from the same
   seed: once with a ``fisher="empirical"`` and once with a ``fisher="mc"``
   `KFACStreamCallback` (otherwise the KFACConfig defaults: token_fraction 0.05, ema_decay
   0.95, update_every 10). Two callbacks on ONE Trainer do not work: ``CaptureHooks`` removes
   the hooks it finds on the model as "stale", so only the last tracker records and the first
   ends with tokens_seen 0. The script checks that both runs end with identical weights (one
   MAP model, two posteriors) and stops otherwise.
2. Evaluation sets, each ``--seqs`` windows of 128 byte tokens (evenly spaced over all windows
   of the set) scored at ``--positions`` evenly spaced positions t (target = token t+1):
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
     (fixed seed). Prior precision tau: (a) ``optimize_prior_precision()`` (Laplace marginal
     likelihood of the tracked weights), (b) the value of a log grid (plus the marglik value)
     with the lowest next-token NLL on ``val``. The Jacobian features are computed once per
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


def fit_kron(model, layer_names, train_examples, n_fit: int):
    import laplace
    from laplace.curvature import CurvlinopsEF

    lm = conv1d_to_linear(model, layer_names).eval()
    keep = {n + ".weight" for n in layer_names} | {n + ".bias" for n in layer_names}
    for n, p in lm.named_parameters():
        p.requires_grad_(n in keep)
    ids = pick([e["input_ids"] for e in train_examples], n_fit)
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


# -- main -----------------------------------------------------------------------------------------

def run(a) -> dict:
    torch.manual_seed(0)
    torch.set_flush_denormal(True)
    P, K = a.positions, a.top_k
    pos = positions(P)
    train_examples, sets = lm_datasets(a.seqs)
    print(f"sets: {{{', '.join(f'{k}: {tuple(v.shape)}' for k, v in sets.items())}}}; "
          f"{len(train_examples)} training windows; positions {pos}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {f: train_lm(train_examples, a.steps, os.path.join(tmp, f), f) for f in FISHERS}
        for f, (_, _, s, ls) in runs.items():
            print(f"[{f}] trained {a.steps} steps in {s:.1f} s; loss {ls[0]:.3f} -> "
                  f"{ls[-1]:.3f}", flush=True)
        model, _, train_s, losses = runs["empirical"]
        save_base_lm(model, a.base_model, a.steps)  # the base of the classification task
        same = all(torch.equal(v, runs["mc"][0].state_dict()[k])
                   for k, v in model.state_dict().items())
        print(f"empirical and mc runs end with identical weights: {same}", flush=True)
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

        res: dict[str, dict] = {}   # method -> {set: {nll, ece}}
        scores: dict[str, dict] = {}  # method -> {set: per-sequence score}
        taus: dict[str, float] = {}
        for k, (lg, y) in mp.items():
            logp = torch.log_softmax(lg, -1)
            scores.setdefault("MAP entropy", {})[k] = per_seq(-(logp.exp() * logp).sum(-1), P)
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
                                           a.mc_samples), mp["val"][1])[0] for t in all_taus}
            t_grid = time.perf_counter() - t0
            tau_val = min(val_nll, key=val_nll.get)
            print(f"[{fisher}] N={post.num_data:.4g}; tau marglik {tau_ml:.4g} "
                  f"({t_ml:.2f} s); val NLL per tau: "
                  + ", ".join(f"{t:.3g}: {v:.4f}" for t, v in val_nll.items())
                  + f" -> tau_val {tau_val:.4g}; features {t_feat:.1f} s", flush=True)
            n_feat_sets = len(sets)
            for label, tau, extra in ((f"Laplace {fisher}, tau=marglik", tau_ml, t_ml),
                                      (f"Laplace {fisher}, tau=val-NLL", tau_val, t_grid)):
                taus[label] = tau
                t0 = time.perf_counter()
                res[label] = {k: nll_ece(mc_probs(mp[k][0], top[k], covs[k][tau], a.mc_samples),
                                         mp[k][1]) for k in sets if k != "val"}
                t_mc = time.perf_counter() - t0
                scores[label] = {k: per_seq(covs[k][tau].diagonal(dim1=1, dim2=2).mean(-1), P)
                                 for k in sets}
                # features for the eval sets (val only counts for the grid search) + MC + tau
                cost[label] = (t_feat * (n_feat_sets - 1) / n_feat_sets + t_mc + extra
                               + (t_feat / n_feat_sets if "val" in label else 0.0))

        kron_note = None
        if not a.no_kron:
            layer_names = snaps["empirical"].layer_names
            la, wrapped, t_fit, t_ml = fit_kron(model, layer_names, train_examples, a.kron_fit)
            tau_k = float(la.prior_precision.reshape(-1)[0])
            t0 = time.perf_counter()
            kc = {k: kron_covs(la, wrapped, v, pos, top[k]) for k, v in sets.items() if k != "val"}
            t_pred = time.perf_counter() - t0
            label = "laplace-torch KronLaplace (EF), tau=marglik"
            taus[label] = tau_k
            t0 = time.perf_counter()
            res[label] = {k: nll_ece(mc_probs(mp[k][0], top[k], kc[k], a.mc_samples), mp[k][1])
                          for k in kc}
            cost[label] = t_fit + t_ml + t_pred + time.perf_counter() - t0
            scores[label] = {k: per_seq(c.diagonal(dim1=1, dim2=2).mean(-1), P)
                             for k, c in kc.items()}
            kron_note = {"fit_s": t_fit, "marglik_s": t_ml, "predictive_s": t_pred,
                         "fit_sequences": a.kron_fit, "tau": tau_k}
            print(f"[laplace-torch] fit {t_fit:.1f} s on {a.kron_fit} windows, marglik "
                  f"{t_ml:.1f} s (tau {tau_k:.4g}), predictive {t_pred:.1f} s", flush=True)

    ood = [k for k in EVAL_SETS[1:] if k in sets]
    detect = {m: {k: auroc(s["id"], s[k]) for k in ood} for m, s in scores.items()}
    detect["MC dropout (8 samples)"] = dict.fromkeys(ood)
    return {"train_seconds": train_s, "identical_weights": same,
            "train_loss_first_last": [losses[0], losses[-1]],
            "counts": counts, "positions": pos, "calibration": res, "auroc": detect,
            "taus": taus, "cost_seconds": cost, "kron": kron_note,
            "sets": {k: list(v.shape) for k, v in sets.items()}}


def tables(r: dict) -> str:
    sets = [k for k in EVAL_SETS if k in r["sets"]]
    ood = sets[1:]
    head = ("| method | tau | " + " | ".join(f"{k} NLL | {k} ECE %" for k in sets)
            + " | s beyond training |")
    lines = ["Next-token NLL (nats) and ECE (15 bins, top-1), full 256-byte vocabulary:", "",
             head, "|" + "---|" * (2 * len(sets) + 3)]
    for m, v in r["calibration"].items():
        tau = r["taus"].get(m)
        cells = " | ".join(f"{v[k][0]:.4f} | {100 * v[k][1]:.2f}" for k in sets)
        lines.append(f"| {m} | {'–' if tau is None else f'{tau:.3g}'} | {cells} | "
                     f"{r['cost_seconds'].get(m, float('nan')):.1f} |")
    lines += ["", "ID-vs-OOD AUROC of a per-sequence score (mean over positions); 0.5 = chance:",
              "", "| score | " + " | ".join(f"id vs {k}" for k in ood) + " |",
              "|" + "---|" * (len(ood) + 1)]
    for m, v in r["auroc"].items():
        plain = m == "MAP entropy" or m.startswith("MC dropout")
        name = m if plain else f"{m}: top-k logit variance"
        cells = " | ".join("n/a: no dropout" if v[k] is None else f"{v[k]:.3f}" for k in ood)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def verdict(r: dict) -> str:
    base = r["calibration"]["MAP"]
    out = []
    for m, v in r["calibration"].items():
        if m == "MAP":
            continue
        d = "; ".join(f"{k}: NLL {base[k][0]:.4f}→{v[k][0]:.4f}, ECE {100 * base[k][1]:.2f}%"
                      f"→{100 * v[k][1]:.2f}%" for k in v)
        out.append(f"  - {m}: {d}")
    ood = [k for k in EVAL_SETS[1:] if k in r["sets"]]
    ent = r["auroc"]["MAP entropy"]
    best = {k: max(((m, s[k]) for m, s in r["auroc"].items() if s[k] is not None and
                    m != "MAP entropy"), key=lambda t: t[1]) for k in ood}
    out.append("  - detection: " + "; ".join(
        f"id vs {k}: MAP entropy {ent[k]:.3f}, best Laplace variance {best[k][1]:.3f} "
        f"({best[k][0]})" for k in ood))
    return "\n".join(out)


def report(r: dict, a, info: dict) -> str:
    c = r["counts"]
    return "\n".join([
        BEGIN,
        "## Predictive uncertainty on real text (`benchmarks/uncertainty.py`)",
        "",
        f"- date: {info['date']}",
        f"- machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch threads); "
        f"torch {info['torch']}, transformers {info['transformers']}, laplace-torch "
        f"{info['laplace_torch']}, Python {info['python']}",
        f"- command: `{a.command}` (total wall time {r['total_seconds']:.0f} s)",
        f"- model/training: app default tiny GPT-2 (2x128, byte tokens, seq 128, no dropout), "
        f"`transformers.Trainer`, {a.steps} steps, batch 8, lr 1e-3 cosine, on the training "
        f"pydoc topics (loss {r['train_loss_first_last'][0]:.3f} → "
        f"{r['train_loss_first_last'][1]:.3f}); two runs from the same seed, one "
        "`KFACStreamCallback` each (two callbacks on one Trainer: only the last one records, "
        "the first ends with tokens_seen 0), ending with identical weights "
        f"({r['identical_weights']}); training seconds "
        + ", ".join(f"{f} {s:.0f}" for f, s in r["train_seconds"].items())
        + "; token_fraction 0.05, ema_decay 0.95, update_every 10: "
        + "; ".join(f"{f}: {v['updates']} updates, {v['positions_sampled']} positions"
                    for f, v in c.items()),
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
        "- verdict (as measured, one seed, one tiny model):",
        verdict(r),
        END])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="LM training steps")
    p.add_argument("--base-model", default="out/bench/tiny_lm",
                   help="where to save the trained LM for benchmarks/uncertainty_classification.py "
                   "(which trains it there with the same recipe when missing)")
    p.add_argument("--seqs", type=int, default=32, help="windows per evaluation set")
    p.add_argument("--positions", type=int, default=8, help="scored positions per window")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--mc-samples", type=int, default=256)
    p.add_argument("--kron-fit", type=int, default=32, help="training windows for KronLaplace")
    p.add_argument("--no-kron", action="store_true", help="skip laplace-torch")
    p.add_argument("--quick", action="store_true", help="smoke run; writes nothing")
    a = p.parse_args(argv)
    a.command = "python benchmarks/uncertainty.py " + shlex.join(argv if argv is not None
                                                                 else sys.argv[1:])
    if a.quick:
        a.steps, a.seqs, a.positions, a.kron_fit, a.mc_samples = 30, 4, 3, 8, 32
    run_uncertainty_benchmark("uncertainty", a, run, report, BEGIN, END)


if __name__ == "__main__":
    main()
