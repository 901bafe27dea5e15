"""The figures of the classification benchmark (``uncertainty_classification.py``), from the
predictions it made: one method's test metrics (`evaluate`), selective answering under the
posterior and the comparison of `answer_distribution`'s two sample kinds, their summaries over
seeds, and the acceptance criteria of the default configuration's predictive.
"""

from __future__ import annotations

import math
import time

import torch

from kfac_stream.query import metrics
from kfac_stream.query.calibration import probs_from_gaussian
from kfac_stream.query.prior_choice import NO_HELDOUT_LINK

from _common import batches, mean_std

MAIN = "Laplace stream (default), tau=marglik"
#: the library's default link of the K-way predictive (`LaplacePosterior.predictive_probs`),
#: used for every main figure, the OOD scores and the val-NLL choice of tau
LINK = NO_HELDOUT_LINK  # `predictive_probs`' link without a stored held-out fit
KRON = "laplace-torch KronLaplace (default GGN), tau=marglik"


# -- one method on the test set -------------------------------------------------------------------

def entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * p.clamp_min(1e-300).log()).sum(-1)


def evaluate(mean: torch.Tensor, cov: torch.Tensor | None, y: torch.Tensor,
             map_pred: torch.Tensor, ood: dict, mc_samples: int) -> dict:
    """Metrics of one method on the test set (main figures from the library's default link
    `LINK`; the MAP has ``cov=None``), the probit / mean-field / MC comparison with the
    mean-vs-MAP-argmax one, and OOD AUROCs. ``ood``: ``{name: (mean, cov or None)}`` of the OOD
    inputs (ID = the test set)."""
    links = {} if cov is None else {  # every link once; the main figures use LINK's
        "probit": probs_from_gaussian(mean, cov, "probit"),
        "meanfield": probs_from_gaussian(mean, cov, "meanfield"),
        "mc": probs_from_gaussian(mean, cov, "mc", n_samples=mc_samples, seed=0)}
    p = torch.softmax(mean, -1) if cov is None else links[LINK]
    rep = metrics.classification_report(p, y, bins=15, coverage=0.8)
    out = {k: rep[k] for k in ("accuracy", "nll", "ece", "brier", "aurc",
                               "accuracy_at_coverage")}
    out["mean_confidence"] = float(p.max(-1).values.mean())
    out["auroc"] = {}
    for name, (om, oc) in ood.items():
        po = torch.softmax(om, -1) if oc is None else probs_from_gaussian(om, oc, LINK)
        out["auroc"][f"{name} entropy"] = metrics.auroc(entropy(p), entropy(po))
        if cov is not None:
            var_in = torch.diagonal(cov, dim1=-2, dim2=-1).sum(-1)
            var_out = torch.diagonal(oc, dim1=-2, dim2=-1).sum(-1)
            out["auroc"][f"{name} variance"] = metrics.auroc(var_in, var_out)
    if cov is not None:
        map_correct = map_pred == y
        u_map_dec = 1 - p.gather(1, map_pred[:, None])[:, 0]  # Laplace prob of MAP's class
        out["investigation"] = {
            "acc_map_argmax": float(map_correct.double().mean()),
            "logit_std": float(torch.diagonal(cov, dim1=-2, dim2=-1).clamp_min(0).sqrt().mean()),
            "logit_margin": float((mean.max(-1).values - mean.median(-1).values).mean()),
            "aurc_map_decision": metrics.aurc(map_correct, u_map_dec),
            "acc80_map_decision": metrics.accuracy_at_coverage(map_correct, u_map_dec, 0.8),
        }
        for link, pl in links.items():
            r = metrics.classification_report(pl, y, bins=15)
            out["investigation"].update({
                f"acc_{link}": r["accuracy"], f"nll_{link}": r["nll"], f"ece_{link}": r["ece"],
                f"flips_{link}": float((pl.argmax(-1) != map_pred).double().mean())})
    return out


# -- selective answering and the two sample kinds -------------------------------------------------

AGREEMENT_THRESHOLDS = (0.5, 0.75, 0.9, 1.0)


#: `answer_distribution`'s ``linearized`` -> the name of the sample kind in the tables
SAMPLE_KINDS = {False: "weight", True: "linearised"}


def kind_rule(lin: bool, n_samples: int) -> str:
    """The selective-answering rule of one sample kind of `answer_distribution`."""
    return (f"majority of {n_samples} {SAMPLE_KINDS[lin]} samples (answer_distribution("
            f"linearized={lin})), agreement")


def selective_answers(task, post, map_logits: torch.Tensor, cov: torch.Tensor, y: torch.Tensor,
                      a) -> dict:
    """Selective answering on the test set (answers under the posterior, both sample
    kinds): each rule answers, or abstains when its
    uncertainty is high.

    * MAP's answer, ranked by MAP's confidence (1 − max softmax of the answer logits);
    * MAP's answer, ranked by the linearised variance of its logit (``Σ[k*, k*]`` at the
      marglik tau, the default posterior);
    * the majority answer of ``S`` posterior samples, ranked by 1 − agreement (the majority's
      share of the votes), for both sample kinds of `kfac_stream.answer_distribution`, each
      with ``linearized`` passed explicitly: the network at posterior weight samples
      (``linearized=False``) and the linearised model ``f* + J(θ_s − θ*)`` at the same draws
      (``linearized=True``); each sample answers with its argmax over the four answer tokens;
    * the same vote from ``S`` draws of the answer logits' Gaussian N(MAP's logits, Σ) (the
      linearised model's answer logits in distribution, in closed form: no forward pass, not
      the library call; other random draws than ``linearized=True``'s).

    Per rule: accuracy of its answers at full coverage, AURC and accuracy at 80% / 50% coverage
    (`kfac_stream.query.metrics`; ties in the uncertainty, frequent for the agreement with ``S``
    votes, averaged over every order), how often its answer is MAP's, NLL and ECE (15 bins) of
    its probabilities where it has some (MAP's softmax; for the votes the mean of the samples'
    softmax over the four answers, `AnswerDistribution.probs`), and for the votes the coverage
    and accuracy of the threshold rule "answer when agreement ≥ t" for t in
    `AGREEMENT_THRESHOLDS`."""
    from kfac_stream import answer_distribution

    batch = task.evals["test"][0]
    map_pred = map_logits.argmax(-1)
    # rule -> (answer, uncertainty, probabilities or None)
    rules = {"MAP answer, MAP confidence": (
                 map_pred, 1 - torch.softmax(map_logits, -1).max(-1).values,
                 torch.softmax(map_logits, -1)),
             "MAP answer, linearised variance of its logit": (
                 map_pred, cov[torch.arange(len(map_pred)), map_pred, map_pred], None)}
    agreements, seconds = {}, {}
    for lin in SAMPLE_KINDS:  # the library call, the sample kind always named
        name = kind_rule(lin, a.answer_samples)
        t0 = time.perf_counter()
        dists = [answer_distribution(post, b, options=task.answer_options,
                                     n_samples=a.answer_samples, seed=task.seed,
                                     linearized=lin, show_progress=False)
                 for b in batches(batch, 32)]
        seconds[name] = time.perf_counter() - t0
        agreement = torch.cat([d.agreement for d in dists])
        agreements[name] = agreement
        rules[name] = (torch.cat([d.majority for d in dists]), 1 - agreement,
                       torch.cat([d.probs for d in dists]))
        print(f"  [selective] {SAMPLE_KINDS[lin]} samples: {seconds[name]:.1f} s", flush=True)
    # the linearised model's answer logits are exactly N(MAP logits, Σ) (Σ: the closed-form
    # covariance of the four answer logits), so its answers under S posterior samples are the
    # argmaxes of S draws from that Gaussian: exact in distribution, at no forward pass
    name = (f"majority of {a.answer_samples} draws of the answer-logit Gaussian N(MAP, Σ) "
            "(closed form, not answer_distribution), agreement")
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(task.seed)
    jitter = 1e-9 * torch.diagonal(cov, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    chol = torch.linalg.cholesky(cov + jitter[:, None, None] * torch.eye(cov.shape[-1],
                                                                         dtype=cov.dtype))
    z = torch.randn(a.answer_samples, *map_logits.shape, generator=gen, dtype=cov.dtype)
    draws = map_logits[None] + torch.einsum("bij,sbj->sbi", chol, z)  # [S, B, K]
    votes = draws.argmax(-1)  # [S, B]
    counts = torch.nn.functional.one_hot(votes, map_logits.shape[-1]).sum(0)  # [B, K]
    # ties toward MAP's answer, then the lowest option (as answer_distribution)
    majority = (counts.double() + 0.5 * torch.nn.functional.one_hot(
        map_pred, map_logits.shape[-1])).argmax(-1)
    agreement = counts.gather(1, majority[:, None])[:, 0].double() / a.answer_samples
    seconds[name] = time.perf_counter() - t0
    agreements[name] = agreement
    rules[name] = (majority, 1 - agreement, torch.softmax(draws, -1).mean(0))
    out = {}
    for name, (pred, unc, probs) in rules.items():
        correct = pred.cpu() == y
        unc = unc.double().cpu()
        out[name] = {"accuracy": float(correct.double().mean()),
                     "aurc": metrics.aurc(correct, unc),
                     "acc80": metrics.accuracy_at_coverage(correct, unc, 0.8),
                     "acc50": metrics.accuracy_at_coverage(correct, unc, 0.5),
                     "agrees_with_map": float((pred.cpu() == map_pred.cpu()).double().mean())}
        if probs is not None:
            probs = probs.double().cpu()
            out[name]["nll"] = metrics.nll(probs, y)
            out[name]["ece"] = metrics.ece(probs, y, bins=15)
        if name in agreements:
            ag = agreements[name].cpu()
            out[name]["seconds"] = seconds[name]
            out[name]["mean_agreement"] = float(ag.mean())
            for t in AGREEMENT_THRESHOLDS:
                keep = ag >= t - 1e-12
                out[name][f"coverage@{t:g}"] = float(keep.double().mean())
                out[name][f"accuracy@{t:g}"] = (float(correct[keep].double().mean())
                                                if bool(keep.any()) else float("nan"))
    for name, v in out.items():
        extra = (f", NLL {v['nll']:.4f}, ECE {100 * v['ece']:.2f}%" if "nll" in v else "")
        print(f"  [selective] {name}: accuracy {100 * v['accuracy']:.1f}%, answer = MAP's "
              f"{100 * v['agrees_with_map']:.1f}%, AURC {v['aurc']:.4f}, acc@80% "
              f"{100 * v['acc80']:.1f}%, acc@50% {100 * v['acc50']:.1f}%{extra}", flush=True)
    return out


#: the figures of the sample-kind comparison (`sample_kinds`), each with ``+1`` where higher is
#: better and ``-1`` where lower is
KIND_FIGURES = {"accuracy": 1, "agrees_with_map": 1, "nll": -1, "ece": -1, "aurc": -1}


def sample_kinds(per_seed: list[dict], n_samples: int) -> dict | None:
    """Weight samples vs linearised samples of `answer_distribution` (which should be the default),
    from the per-seed selective-answering figures: ``{"per_seed": [{"seed", "weight": {figure:
    value}, "linearised": {...}}], "verdict": {figure: {"every_seed": kind or None, "worst_seed":
    kind or None, "worst": {kind: value}}}}`` for the figures of `KIND_FIGURES`. A kind is
    better on every seed when its figure is strictly better on each seed (None: neither);
    better by the worst seed when its worst value over the seeds is strictly better (the lowest
    accuracy / agreement, the highest NLL / ECE / AURC; None: equal). None when a seed lacks
    either kind (results of a run from before both kinds ran)."""
    names = {k: kind_rule(lin, n_samples) for lin, k in SAMPLE_KINDS.items()}
    if not per_seed or any(n not in r.get("selective", {}) for r in per_seed
                           for n in names.values()):
        return None
    rows = [{"seed": r["seed"], **{k: {f: r["selective"][n][f] for f in KIND_FIGURES}
                                   for k, n in names.items()}} for r in per_seed]
    verdict = {}
    for f, sign in KIND_FIGURES.items():
        def better(x: float, y: float, sign: int = sign) -> bool:
            return sign * (x - y) > 0

        every = [k for k, o in (("weight", "linearised"), ("linearised", "weight"))
                 if all(better(r[k][f], r[o][f]) for r in rows)]
        worst = {k: (min if sign > 0 else max)(r[k][f] for r in rows) for k in names}
        by_worst = [k for k, o in (("weight", "linearised"), ("linearised", "weight"))
                    if better(worst[k], worst[o])]
        verdict[f] = {"every_seed": every[0] if every else None,
                      "worst_seed": by_worst[0] if by_worst else None, "worst": worst}
    return {"n_samples": n_samples, "per_seed": rows, "verdict": verdict}


def kinds_verdict(c: dict) -> str:
    """`sample_kinds`' verdict in one line."""
    v = c["verdict"]

    def every(f: str) -> str:
        return v[f]["every_seed"] or "neither"

    def worst(f: str, scale: float, fmt: str) -> str:
        w = v[f]["worst"]
        return (f"{v[f]['worst_seed'] or 'neither'} ({scale * w['linearised']:{fmt}} "
                f"linearised vs {scale * w['weight']:{fmt}} weight)")

    return (f"better on every seed: by majority accuracy **{every('accuracy')}**, by NLL of the "
            f"mean probabilities **{every('nll')}** (ECE {every('ece')}, AURC {every('aurc')}, "
            f"answer = MAP's {every('agrees_with_map')}); by the worst seed: accuracy "
            f"**{worst('accuracy', 100, '.1f')}**, NLL **{worst('nll', 1, '.4f')}**")


# -- over seeds -----------------------------------------------------------------------------------

def summarise(per_seed: list[dict]) -> dict:
    """``{method: {metric: (mean, std)}}`` over seeds, nested dicts flattened with ``/``."""
    out: dict[str, dict] = {}
    for m in per_seed[0]["results"]:
        flat: dict[str, list[float]] = {}
        for r in per_seed:
            for key, v in _flatten(r["results"][m]).items():
                flat.setdefault(key, []).append(v)
        flat["cost_seconds"] = [r["cost_seconds"][m] for r in per_seed]
        if m in per_seed[0]["taus"]:
            flat["tau"] = [r["taus"][m] for r in per_seed]
        out[m] = {k: mean_std(v) for k, v in flat.items()}
    return out


def summarise_selective(per_seed: list[dict]) -> dict:
    """``{rule: {figure: (mean, std)}}`` of `selective_answers` over seeds (NaN figures, a
    threshold no answer reached, left out of their mean)."""
    out: dict[str, dict] = {}
    for rule in per_seed[0]["selective"]:
        keys = per_seed[0]["selective"][rule]
        out[rule] = {}
        for key in keys:
            xs = [r["selective"][rule][key] for r in per_seed]
            xs = [x for x in xs if not math.isnan(x)]
            if xs:
                out[rule][key] = mean_std(xs)
    return out


def _flatten(d: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)):
            out[f"{prefix}{k}"] = float(v)
    return out


def acceptance(per_seed: list[dict], summary: dict) -> list[dict]:
    """The four acceptance criteria for the default configuration's Laplace predictive (marglik
    tau, the default link `LINK`) against MAP and laplace-torch, from the measured numbers."""
    main = [r["results"][MAIN] for r in per_seed]
    base = [r["results"]["MAP"] for r in per_seed]
    s_main, s_map = summary[MAIN], summary["MAP"]
    nll_pairs = ", ".join(f"{m['nll']:.4f} vs {b['nll']:.4f}" for m, b in zip(main, base,
                                                                               strict=True))
    out = [
        {"criterion": "test NLL ≤ MAP's in every seed",
         "met": all(m["nll"] <= b["nll"] for m, b in zip(main, base, strict=True)),
         "figures": f"per seed (default Laplace vs MAP): {nll_pairs}"},
        {"criterion": "ECE ≤ ½ MAP's on average",
         "met": s_main["ece"][0] <= 0.5 * s_map["ece"][0],
         "figures": f"mean ECE {100 * s_main['ece'][0]:.2f}% vs ½ × {100 * s_map['ece'][0]:.2f}%"
                    f" = {50 * s_map['ece'][0]:.2f}%"},
        {"criterion": "accuracy within 1 point of MAP's on average",
         "met": s_main["accuracy"][0] >= s_map["accuracy"][0] - 0.01,
         "figures": f"mean accuracy {100 * s_main['accuracy'][0]:.2f}% vs MAP "
                    f"{100 * s_map['accuracy'][0]:.2f}% "
                    f"({100 * (s_main['accuracy'][0] - s_map['accuracy'][0]):+.2f} points)"},
    ]
    if KRON in summary:
        # the peer as a user runs it: la(x) predicts with pred_type="glm", link_approx="probit"
        peer = summary[KRON]["investigation/nll_probit"][0]
        ratio = s_main["nll"][0] / peer
        same = s_main["nll"][0] / summary[KRON]["nll"][0]
        out.append({"criterion": "NLL within 3% of laplace-torch KronLaplace (default GGN, its "
                                 "default predictive: GLM, probit) on average (mean NLL ≤ 1.03 × "
                                 "its mean)",
                    "met": ratio <= 1.03,
                    "figures": f"mean NLL {s_main['nll'][0]:.4f} vs {peer:.4f} (ratio "
                               f"{ratio:.3f}); not a criterion, laplace-torch's covariance under "
                               f"our link {LINK!r}: {summary[KRON]['nll'][0]:.4f} (ratio "
                               f"{same:.3f})"})
    else:
        out.append({"criterion": "NLL within 3% of laplace-torch KronLaplace (default GGN)",
                    "met": None, "figures": "laplace-torch not run (--no-kron)"})
    return out
