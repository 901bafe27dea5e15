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


def _scores(post: LaplacePosterior, windows: list[Tensor], positions: int, top_k: int
            ) -> tuple[Tensor, Tensor]:
    """``(variance [n], entropy [n])`` over windows x positions."""
    variances, entropies = [], []
    for ids in windows:  # ids: [T]
        batch = {"input_ids": ids[None], "attention_mask": torch.ones_like(ids)[None]}
        with torch.no_grad():
            logits = post.model(**batch).logits[0].double()  # [T, V]
        t_max = ids.shape[0] - 1
        for t in torch.linspace(t_max / positions, t_max, positions).round().long().tolist():
            logp = torch.log_softmax(logits[t], -1)
            entropies.append(float(-(logp.exp() * logp).sum()))
            top = torch.topk(logits[t], top_k).indices.tolist()
            _, cov = post.predictive(batch, positions=t, token_ids=top)  # [1, k, k]
            variances.append(float(cov[0].diagonal().mean()))
    return torch.tensor(variances, dtype=torch.float64), torch.tensor(entropies,
                                                                      dtype=torch.float64)


def uncertainty_contrast(post: LaplacePosterior, in_domain: list[Tensor],
                         out_of_domain: list[Tensor], positions: int = 4, top_k: int = 4
                         ) -> Contrast:
    """Score in-domain and out-of-domain windows (each ``[T]`` token ids) with ``post``."""
    vi, ei = _scores(post, in_domain, positions, top_k)
    vo, eo = _scores(post, out_of_domain, positions, top_k)
    return Contrast({"in": vi, "out": vo}, {"in": ei, "out": eo})
