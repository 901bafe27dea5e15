"""Uncertainty contrast for the end-of-run report: held-out in-domain vs out-of-domain text.

For ``windows`` windows of each kind and ``positions`` evenly spaced positions per window, the
linearised Laplace predictive (`LaplacePosterior.predictive`) of the ``top_k`` MAP next-token
logits: the score is the mean of the diagonal of their covariance (predictive variance of the
logits). Beside it, the baseline every LM already has: the softmax entropy of the MAP
next-token distribution at the same positions. For each score, the mean per kind and the
AUROC of telling out-of-domain from in-domain by that score (0.5 = no better than chance),
reported whatever they show.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..query.laplace import LaplacePosterior
from ..utils.progress import progress


@dataclass
class Contrast:
    """Scores per position: ``variance``/``entropy`` ``{"in": [n], "out": [n]}`` (float64)."""

    variance: dict[str, Tensor]
    entropy: dict[str, Tensor]

    def auroc(self, which: str) -> float:
        """P(score of a random out-of-domain position > a random in-domain one), ties ½."""
        s = getattr(self, which)
        a, b = s["out"][:, None], s["in"][None, :]
        return float((a > b).double().mean() + 0.5 * (a == b).double().mean())

    def lines(self) -> list[str]:
        """Human-readable summary."""
        v, e = self.variance, self.entropy
        n_in, n_out = v["in"].numel(), v["out"].numel()
        return [
            f"uncertainty contrast ({n_in} in-domain / {n_out} out-of-domain positions):",
            f"  predictive variance of top-k logits: in {v['in'].mean():.4g}, "
            f"out {v['out'].mean():.4g} (x{float(v['out'].mean() / v['in'].mean()):.2f}), "
            f"AUROC out-vs-in {self.auroc('variance'):.3f}",
            f"  softmax entropy (baseline, nats):    in {e['in'].mean():.4g}, "
            f"out {e['out'].mean():.4g} (x{float(e['out'].mean() / e['in'].mean()):.2f}), "
            f"AUROC out-vs-in {self.auroc('entropy'):.3f}",
        ]


def window_scores(post: LaplacePosterior, windows: list[Tensor], positions: int, top_k: int,
                  bar=None) -> tuple[Tensor, Tensor]:
    """``(variance [n], entropy [n])`` over windows x positions; ``bar`` (a tqdm bar, or None)
    advances by one per window."""
    variances, entropies = [], []
    for ids in windows:  # ids: [T]
        batch = {"input_ids": ids[None], "attention_mask": torch.ones_like(ids)[None]}
        with torch.no_grad():
            logits = post.model(**batch).logits[0].double()  # [T, V]
        t_max = ids.shape[0] - 1
        ts = torch.linspace(t_max / positions, t_max, positions).round().long().tolist()
        logp = torch.log_softmax(logits[ts], -1)  # [P, V]
        entropies += (-(logp.exp() * logp).sum(-1)).tolist()
        top = torch.topk(logits[ts], top_k).indices  # [P, k]
        # all P positions in one Jacobian pass: the window repeated P times, one position and
        # one row of top-k ids per copy (the same figures as P passes of one position each)
        rows = {k: v.expand(len(ts), -1) for k, v in batch.items()}
        _, cov = post.predictive(rows, positions=ts, token_ids=top)  # [P, k, k]
        variances += cov.diagonal(dim1=-2, dim2=-1).mean(-1).tolist()
        if bar is not None:
            bar.update()
    return torch.tensor(variances, dtype=torch.float64), torch.tensor(entropies,
                                                                      dtype=torch.float64)


def uncertainty_contrasts(post: LaplacePosterior, in_domain: list[Tensor],
                          out_of_domain: dict[str, list[Tensor]], positions: int = 4,
                          top_k: int = 4, show_progress: bool | None = None
                          ) -> dict[str, Contrast]:
    """`uncertainty_contrast` of the in-domain windows against each set of ``out_of_domain``
    (``{name: windows}``); the in-domain windows are scored once. One progress bar over all
    windows (`kfac_stream.query.progress`: ``show_progress`` None = on a terminal)."""
    total = len(in_domain) + sum(len(w) for w in out_of_domain.values())
    bar = progress(total=total, desc="uncertainty contrast", unit="window", show=show_progress)
    try:
        vi, ei = window_scores(post, in_domain, positions, top_k, bar)
        out = {}
        for name, windows in out_of_domain.items():
            vo, eo = window_scores(post, windows, positions, top_k, bar)
            out[name] = Contrast({"in": vi, "out": vo}, {"in": ei, "out": eo})
    finally:
        bar.close()
    return out


def uncertainty_contrast(post: LaplacePosterior, in_domain: list[Tensor],
                         out_of_domain: list[Tensor], positions: int = 4, top_k: int = 4,
                         show_progress: bool | None = None) -> Contrast:
    """Score in-domain and out-of-domain windows (each ``[T]`` token ids) with ``post``."""
    return uncertainty_contrasts(post, in_domain, {"out": out_of_domain}, positions, top_k,
                                 show_progress)["out"]
