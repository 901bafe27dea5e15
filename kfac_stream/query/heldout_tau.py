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
language-model head takes ``labels [B, T]`` (an answer-token fine-tune's: -100 except at the
answer) and ``token_ids`` (the ``K`` answer tokens; default: the snapshot's
``KFACConfig.answer_tokens``). The answer is read where every query reads it
(`inputs.answer_positions`): at each row's first labelled position, whose label must be one of
the answer tokens; the logit position is that position minus one (a causal LM shifts the
labels; an encoder-decoder does not: its decoder position ``t`` predicts ``labels[:, t]``).

Seq2seq (an encoder-decoder LM, T5 or BART, `inputs.seq2seq_lm`): the decoder inputs are made
from the labels as in training (`inputs.query_batch`). Without ``token_ids`` (the Trainer's
``eval_prior_precision=True``: a seq2seq eval set's ``labels [B, T']`` hold a whole target per
row) the NLL is per label token: at every decoder position with a label (``!= -100``), over the
whole vocabulary, of the linearised predictive by Monte Carlo (``n_samples`` draws of the
linearised model, `sampled_predictive`'s ``linearized=True``; the same draws, seeds ``seed …
seed + S − 1``, for every candidate and batch, so the candidates are compared on common random
numbers): ``−log mean_s softmax(f_s)[y]``. The K-logit closed form cannot serve there: it would
need one backward per vocabulary entry and position. Cost per eval batch: ``len(grid) + 1``
times ``S`` linearised forwards (about ``2·S`` forwards each); ``link`` is then ``"mc"`` and
``examples`` counts label tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from ..exceptions import QueryInputError
from ..metrics import nll_per_example
from ..snapshot.heldout_prior import HeldoutPrior
from . import inputs

#: ``τ`` candidates: a log grid over ten decades; the marginal-likelihood ``τ`` is added.
GRID = tuple(10.0 ** e for e in range(-4, 7))

#: Draws of the linearised model per candidate for the per-token NLL of a seq2seq model.
TOKEN_SAMPLES = 16


def _targets(where: str, labels: Tensor, token_ids: Sequence[int] | None) -> Tensor:
    """The right answer's index into ``token_ids`` per example, ``[B]``, from a batch's labels:
    a classifier's ``labels [B]`` themselves; of ``labels [B, T]`` the label at each row's
    first labelled position (the answer position of every query, `inputs.answer_positions`)."""
    if labels.dim() == 1:
        return labels.long()
    if token_ids is None:
        raise QueryInputError(f"{where}: labels of shape {tuple(labels.shape)} need token_ids "
                              "(the answer tokens) for a language-model head: pass token_ids, "
                              "or train with KFACConfig(answer_tokens=...)")
    marked = labels != inputs.IGNORE_INDEX
    if bool((~marked.any(1)).any()):
        b = int((~marked.any(1)).int().argmax())
        raise QueryInputError(f"{where}: row {b} of labels [B, T] holds no label (the answer "
                              "is read at each row's first labelled position)")
    first = marked.int().argmax(1)  # [B]
    tok = labels[torch.arange(len(first)), first]  # [B]
    ids = torch.tensor(list(token_ids))
    match = tok[:, None] == ids[None, :]  # [B, K]
    if bool((~match.any(1)).any()):
        b = int((~match.any(1)).int().argmax())
        raise QueryInputError(f"{where}: the answer label {int(tok[b])} of row {b} (its first "
                              f"labelled position) is not among token_ids={list(token_ids)}")
    return match.long().argmax(1)


def _token_nll(post, batch: Mapping[str, Tensor], labels: Tensor, taus: Sequence[float],
               n_samples: int, seed: int) -> tuple[Tensor, int]:
    """``(summed NLL per candidate [len(taus)], label tokens)`` of a seq2seq batch: at every
    position with a label, ``−log mean_s softmax(f_s)[y]`` over ``n_samples`` draws of the
    linearised model at each candidate ``τ`` (the same seeds for all)."""
    from .sampled import iter_sample_logits

    where = "fit_prior_precision"
    keep = labels != inputs.IGNORE_INDEX  # [B, T']
    y = labels.clamp(min=0)
    total = torch.zeros(len(taus), dtype=torch.float64)
    for i, tau in enumerate(taus):
        post.prior_precision = tau
        lse = None
        for _, logits in iter_sample_logits(post, batch, n_samples, seed, linearized=True,
                                            show_progress=False):
            if tuple(logits.shape[1:-1]) != tuple(labels.shape):
                raise QueryInputError(f"{where}: labels {list(labels.shape)} do not fit the "
                                      f"model's logits {list(logits.shape[1:])}")
            if i == 0 and lse is None:  # once per batch, before any NLL
                bad = labels[keep & ((labels < 0) | (labels >= logits.shape[-1]))]
                if bad.numel():
                    raise QueryInputError(f"{where}: a label ({int(bad[0])}) is outside the "
                                          f"model's {logits.shape[-1]} vocabulary logits "
                                          "(or -100: no label)")
            work = torch.float64 if logits.dtype == torch.float64 else torch.float32
            lp = torch.log_softmax(logits.to(work), -1).gather(
                -1, y.to(logits.device)[None, ..., None].expand(*logits.shape[:-1], 1))
            part = torch.logsumexp(lp.squeeze(-1).double(), 0)  # [B, T']
            lse = part if lse is None else torch.logaddexp(lse, part)
        assert lse is not None
        nll = math.log(n_samples) - lse
        total[i] = nll[keep.to(nll.device)].sum().cpu()
    return total, int(keep.sum())


def fit_prior_precision(post, batches: Iterable[Mapping[str, Tensor]], *,
                        token_ids: Sequence[int] | None = None, link: str = "meanfield",
                        grid: Sequence[float] = GRID, n_samples: int = TOKEN_SAMPLES,
                        seed: int = 0) -> HeldoutPrior:
    """The ``τ`` of ``grid`` ∪ {marginal-likelihood ``τ``} with the lowest held-out NLL.

    Args:
        post: A `LaplacePosterior`.
        batches: Model inputs with ``labels`` (see the module docstring), on the model's
            device; one Jacobian pass per batch serves every candidate. A seq2seq model's
            decoder inputs are made from the labels when the batch has none.
        token_ids: The ``K ≥ 2`` answer tokens of a language-model head (one sequence of ints
            for every example); None: the snapshot's ``KFACConfig.answer_tokens`` (none: a
            seq2seq model's per-token NLL, module docstring).
        link: ``"meanfield"``, ``"probit"`` or ``"mc"`` (`probs_from_gaussian`); the per-token
            NLL of a seq2seq model without ``token_ids`` is always ``"mc"`` (module docstring).
        grid: Candidate ``τ`` values (positive).
        n_samples: Draws of the linearised model per candidate for that per-token NLL, an
            int ≥ 2.
        seed: Seed of the first of those draws, an int.

    Returns:
        A `HeldoutPrior`; ``post.prior_precision`` is left as it was.
    """
    from .laplace import probs_from_gaussian

    where = "fit_prior_precision"
    if token_ids is None:
        token_ids = post.answer_tokens  # the run's KFACConfig.answer_tokens, or None
    if token_ids is not None:
        token_ids = inputs.check_token_ids(where, "token_ids", token_ids, 1, options=True)
        if token_ids.dim() != 1:
            raise inputs.error(where, "token_ids", token_ids, "the K >= 2 answer tokens, one "
                               "sequence of ints for every example")
        token_ids = token_ids.tolist()
    n_samples = inputs.check_int(where, "n_samples", n_samples, 2)
    seed = inputs.check_seed(where, "seed", seed)
    seq2seq = inputs.seq2seq_lm(post.model)
    before = post.prior_precision
    tau_ml = post.optimize_prior_precision(show_progress=False)
    post.prior_precision = before
    taus = sorted({float(t) for t in grid} | {tau_ml})
    total = torch.zeros(len(taus), dtype=torch.float64)
    n = 0
    per_token = False
    try:
        for batch in batches:
            if "labels" not in batch:
                raise QueryInputError(f"{where}: a held-out batch has no labels")
            labels = batch["labels"]
            if seq2seq and token_ids is None and isinstance(labels, Tensor) and \
                    labels.dim() == 2:  # a whole target per row: the NLL per label token
                inputs.check_batch(where, "batch", batch, inputs.input_vocab(post.model))
                part, count = _token_nll(post, batch, labels, taus, n_samples, seed)
                total += part
                n += count
                per_token = True
                continue
            y = _targets(where, labels.cpu(), token_ids)
            mean, covs = post.predictive_covariances(batch, None, token_ids,  # at the labels
                                                     prior_precisions=taus)
            y = y.to(mean.device)
            for i in range(len(taus)):
                total[i] += nll_per_example(probs_from_gaussian(mean, covs[i], link),
                                            y).sum().cpu()
            n += len(y)
    finally:
        post.prior_precision = before
    if n == 0:
        raise QueryInputError(f"{where}: no held-out examples")
    mean_nll = (total / n).tolist()
    best = min(range(len(taus)), key=lambda i: (mean_nll[i], taus[i]))
    ml = taus.index(tau_ml)
    return HeldoutPrior(taus[best], mean_nll[best], tau_ml, mean_nll[ml], n,
                        "mc" if per_token else link, tuple(taus), tuple(mean_nll))
