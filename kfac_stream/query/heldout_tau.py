"""The prior precision fitted on held-out data (`fit_prior_precision`): the ``τ`` whose
linearised predictive has the lowest NLL on labelled examples the model was not trained on.

The marginal likelihood picks ``τ`` from the training data alone, through the Laplace
approximation's own assumptions; on a small or shifted task it can leave the posterior too wide
or too narrow. A held-out set measures the predictive directly. With ``KFACConfig(
eval_prior_precision=True)`` the callback fits it on the Trainer's ``eval_dataset`` at the
final snapshot and stores it beside that snapshot
(`kfac_stream.snapshot.heldout_prior`); `Snapshot.load` reads it back as
``snap.heldout_prior`` (None when absent). `benchmarks/suite.py` reports this rule beside the
marginal likelihood.

Labels: a classification head (logits ``[B, C]``) takes ``labels [B]`` (class ids); a
language-model head takes ``labels [B, T]`` with exactly one label per row (the rest -100, as in
an answer-token fine-tune) and ``token_ids`` (the ``K`` answer tokens; the label must be one of
them): the logit position is the label's position minus one (the model shifts the labels).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from ..exceptions import QueryInputError
from ..metrics import nll_per_example
from ..snapshot.heldout_prior import HeldoutPrior

#: ``τ`` candidates: a log grid over ten decades; the marginal-likelihood ``τ`` is added.
GRID = tuple(10.0 ** e for e in range(-4, 7))
def _targets(where: str, labels: Tensor, token_ids: Sequence[int] | None
             ) -> tuple[int | list[int], Tensor]:
    """``(positions, class index per example [B])`` from a batch's labels."""
    if labels.dim() == 1:
        return -1, labels.long()
    if token_ids is None:
        raise QueryInputError(f"{where}: labels of shape {tuple(labels.shape)} need token_ids "
                              "(the answer tokens) for a language-model head")
    mask = labels != -100
    if bool((mask.sum(1) != 1).any()):
        raise QueryInputError(f"{where}: every row of labels [B, T] must hold exactly one "
                              "label (the answer token; the rest -100)")
    pos = mask.long().argmax(1)  # [B]
    tok = labels[torch.arange(len(pos)), pos]  # [B]
    ids = torch.tensor(list(token_ids))
    match = tok[:, None] == ids[None, :]  # [B, K]
    if bool((~match.any(1)).any()):
        raise QueryInputError(f"{where}: a label is not among token_ids={list(token_ids)}")
    return (pos - 1).tolist(), match.long().argmax(1)


def fit_prior_precision(post, batches: Iterable[Mapping[str, Tensor]], *,
                        token_ids: Sequence[int] | None = None, link: str = "meanfield",
                        grid: Sequence[float] = GRID) -> HeldoutPrior:
    """The ``τ`` of ``grid`` ∪ {marginal-likelihood ``τ``} with the lowest held-out NLL.

    Args:
        post: A `LaplacePosterior`.
        batches: Model inputs with ``labels`` (see the module docstring), on the model's
            device; one Jacobian pass per batch serves every candidate.
        token_ids: The answer tokens, for a language-model head.
        link: ``"meanfield"``, ``"probit"`` or ``"mc"`` (`probs_from_gaussian`).
        grid: Candidate ``τ`` values (positive).

    Returns:
        A `HeldoutPrior`; ``post.prior_precision`` is left as it was.
    """
    from .laplace import probs_from_gaussian

    where = "fit_prior_precision"
    before = post.prior_precision
    tau_ml = post.optimize_prior_precision(show_progress=False)
    post.prior_precision = before
    taus = sorted({float(t) for t in grid} | {tau_ml})
    total = torch.zeros(len(taus), dtype=torch.float64)
    n = 0
    for batch in batches:
        if "labels" not in batch:
            raise QueryInputError(f"{where}: a held-out batch has no labels")
        positions, y = _targets(where, batch["labels"].cpu(), token_ids)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        mean, covs = post.predictive_covariances(inputs, positions, token_ids,
                                                 prior_precisions=taus)
        y = y.to(mean.device)
        for i in range(len(taus)):
            total[i] += nll_per_example(probs_from_gaussian(mean, covs[i], link), y).sum().cpu()
        n += len(y)
    if n == 0:
        raise QueryInputError(f"{where}: no held-out examples")
    mean_nll = (total / n).tolist()
    best = min(range(len(taus)), key=lambda i: (mean_nll[i], taus[i]))
    ml = taus.index(tau_ml)
    return HeldoutPrior(taus[best], mean_nll[best], tau_ml, mean_nll[ml], n, link, tuple(taus),
                        tuple(mean_nll))
