r"""The LDS protocol's metrics and its one rule for tunable settings (`influence_lds.py`).

* `lds_per_query`: a query's linear datamodeling score: Spearman over the random halves between
  the scores summed over a half's members and minus the half's retrained output (positive
  scores help, i.e. lower the loss).
* `QueryTruth`: the retrained outputs of ONE query set (validation or test) of one task and
  seed, cut from a `lds_truth.Truth` by `split_truth`; the two halves of a split are separate
  objects, and the selection below is handed the validation one only.
* `choose`: per method family, the setting with the best mean LDS on the validation queries
  (ties: the first in the family's order). `choose_recommended`: one setting for every task,
  the one whose worst task (mean over seeds of the validation LDS) is best — the rule was fixed
  before any LDS was computed.
* `paired`: per-query paired differences between two methods on the same test queries, pooled
  over seeds (different splits: independent queries), mean with a 95% interval
  (± 1.96 s.e.); `verdict` reads it as win / tie / loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy.stats import rankdata


def lds_per_query(scores: torch.Tensor, members: list[list[int]],
                  outputs: torch.Tensor) -> list[float]:
    """``scores`` ``[Q, N]`` (NaN rows: a method that did not score that query), ``members``
    ``K`` lists of training indices, ``outputs`` ``[K, Q]`` → ``Q`` Spearman correlations
    (NaN where the scores row is NaN; 0 where a side is constant): the Pearson correlation of
    the average ranks (ties shared), every query at once — `scipy.stats.spearmanr`'s value."""
    scores = scores.double()
    finite = torch.isfinite(scores).all(1)
    member = torch.zeros(len(members), scores.shape[1], dtype=torch.float64)  # [K, N] 0/1
    for k, m in enumerate(members):
        member[k, m] = 1.0
    pred = member @ scores.nan_to_num().T  # [K, Q]: each half's summed scores
    rp = torch.from_numpy(rankdata(pred.numpy(), axis=0))
    ro = torch.from_numpy(rankdata((-outputs.double()).numpy(), axis=0))
    rp, ro = rp - rp.mean(0), ro - ro.mean(0)
    den = (rp.square().sum(0) * ro.square().sum(0)).sqrt()
    rho = torch.where(den > 0, (rp * ro).sum(0) / den.clamp(min=1e-300), 0.0)
    return [float(r) if ok else float("nan") for r, ok in zip(rho.tolist(), finite.tolist())]


@dataclass(frozen=True)
class QueryTruth:
    """One query set's ground truth: ``part`` ("val" or "test"), ``rows`` the query rows of
    the split (into the ``[Q, N]`` score matrices), ``members`` the ``K`` halves, ``mean``
    ``[K, Qp]`` the outputs averaged over the fresh retrainings, ``fixed`` ``[K, Qp]`` the
    fixed-seed retraining's."""

    part: str
    rows: range
    members: list[list[int]]
    mean: torch.Tensor
    fixed: torch.Tensor

    def lds(self, scores: torch.Tensor, fixed: bool = False) -> list[float]:
        """``scores`` ``[Q, N]`` over every query of the split → this part's per-query LDS."""
        rows = scores[self.rows.start:self.rows.stop]
        return lds_per_query(rows, self.members, self.fixed if fixed else self.mean)


def split_truth(truth) -> tuple[QueryTruth, QueryTruth]:
    """``(validation, test)`` `QueryTruth` of a complete `lds_truth.Truth`."""
    if not truth.complete():
        raise SystemExit(f"{truth.path}: {len(truth.missing())} retrainings missing; run "
                         "benchmarks/lds_truth.py first")
    members, nv = truth.members(), truth.n_val
    mean = truth.fresh.mean(1)
    q = mean.shape[1]
    return (QueryTruth("val", range(0, nv), members, mean[:, :nv], truth.fixed[:, :nv]),
            QueryTruth("test", range(nv, q), members, mean[:, nv:], truth.fixed[:, nv:]))


def nanmean(xs: list[float]) -> float:
    vals = [x for x in xs if math.isfinite(x)]
    return sum(vals) / len(vals) if vals else float("nan")


def family(variant: str) -> str:
    """``"family:setting"`` → ``"family"``."""
    return variant.split(":", 1)[0]


def choose(scores: dict[str, torch.Tensor], val: QueryTruth) -> dict[str, str]:
    """``{family: variant}``: per family (the part of a variant's name before ``:``), the
    variant with the highest mean LDS over the validation queries it scored (first on ties).
    Reads ``val`` only, which must be a validation part."""
    if val.part != "val":
        raise ValueError(f"settings are chosen on validation queries, not {val.part!r}")
    best: dict[str, tuple[float, str]] = {}
    for variant, s in scores.items():
        m = nanmean(val.lds(s))
        fam = family(variant)
        if fam not in best or (math.isfinite(m) and not m <= best[fam][0]):
            best[fam] = (m, variant)
    return {fam: v for fam, (_, v) in best.items()}


def choose_recommended(val_means: dict[str, dict[str, float]]) -> str:
    """One setting for every task: ``val_means`` ``{task: {variant: mean over seeds of the
    validation LDS}}`` (variants present in every task) → the variant whose worst task is
    best (first on ties)."""
    tasks = list(val_means)
    common = [v for v in val_means[tasks[0]] if all(v in val_means[t] for t in tasks)]
    return max(common, key=lambda v: (min(val_means[t][v] for t in tasks), -common.index(v)))


def paired(a: list[list[float]], b: list[list[float]]) -> dict[str, float]:
    """Per-query differences ``a − b`` over the queries both scored, pooled over seeds
    (``a[s][q]``: seed ``s``'s query ``q``) → ``{"mean", "lo", "hi", "n", "wins"}`` (95%:
    ± 1.96 standard errors; ``wins``: the share of queries where ``a > b``)."""
    d = [x - y for xs, ys in zip(a, b) for x, y in zip(xs, ys)
         if math.isfinite(x) and math.isfinite(y)]
    n = len(d)
    if n == 0:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0,
                "wins": float("nan")}
    m = sum(d) / n
    se = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
    return {"mean": m, "lo": m - 1.96 * se, "hi": m + 1.96 * se, "n": n,
            "wins": sum(x > 0 for x in d) / n}


def verdict(p: dict[str, float]) -> str:
    """``"ahead"`` when the interval is above 0, ``"behind"`` below, else ``"tie"``."""
    if p["lo"] > 0:
        return "ahead"
    return "behind" if p["hi"] < 0 else "tie"
