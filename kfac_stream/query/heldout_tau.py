"""The prior precision fitted on held-out data (`fit_prior_precision`): the ``τ`` whose
linearised predictive has the lowest NLL on labelled examples the model was not trained on.

The marginal likelihood picks ``τ`` from the training data alone, through the Laplace
approximation's own assumptions; on a small or shifted task it can leave the posterior too wide
or too narrow. A held-out set measures the predictive directly. With ``HeldoutConfig(
prior_precision=True)`` (the default ``"auto"`` too) the callback fits it on the Trainer's
``eval_dataset`` at the final snapshot and stores it beside that snapshot
(`kfac_stream.snapshot.heldout_prior`); `Snapshot.load` reads it back as
``snap.heldout_prior`` (None when absent). `benchmarks/suite.py` reports this rule beside the
marginal likelihood.

Labels: a classification head (logits ``[B, C]``) takes ``labels [B]`` (class ids); a
language-model head takes ``labels [B, T]`` (an answer-token fine-tune's: -100 except at the
answer) and ``token_ids`` (the ``K`` answer tokens; default: the snapshot's
``HeldoutConfig.answer_tokens``). The answer is read where every query reads it
(`inputs.answer_positions`): at each row's first labelled position, whose label must be one of
the answer tokens; the logit position is that position minus one (a causal LM shifts the
labels; an encoder-decoder does not: its decoder position ``t`` predicts ``labels[:, t]``).

A language model without answer tokens (``token_ids`` None and no
``HeldoutConfig.answer_tokens``: a causal LM's or a seq2seq model's whole-text eval set, its
``labels [B, T]`` as the collator makes them) is fitted per label token on its linearised
next-token predictive, by Monte Carlo on the first rows' subsampled positions, at ``τ``
candidates around the marginal likelihood's (`kfac_stream.query.heldout_tokens`: which
tokens, the candidates and the cost); ``link`` is then ``"mc"`` and ``examples`` counts the
scored label tokens. The K-logit closed form cannot serve there: it would need one backward per
vocabulary entry and position.

The guard (`GUARD_SE`, fixed in code before the suite that judges it): MAP's own
probabilities (``softmax`` of the trained logits over the same ``K`` classes or answer tokens;
per label token over the vocabulary for the per-token fit) are a candidate, and every
candidate's per-example NLLs are kept. Over the ``n`` eval examples (label tokens), the gain
of ``b`` over ``a`` is ``mean_i(NLL_a,i − NLL_b,i)`` and its paired standard error
``sd_i(NLL_a,i − NLL_b,i) / sqrt(n)`` (sample sd, ``n − 1``; `paired_gain`). (a) Link: each
link's best ``τ`` (the lowest mean NLL; ties: the larger ``τ``); probit (`BASE_LINK`) unless
another link's best beats probit's best by more than ``GUARD_SE`` standard errors (then the
one with the largest such gain). (b) The posterior (that link at its best ``τ``) replaces MAP's
probabilities only when it beats MAP by more than ``GUARD_SE`` standard errors; otherwise
the stored fit says MAP was kept (`HeldoutPrior.map_kept`) and ``LaplacePosterior(model,
snap)``'s default probabilities are MAP's (link ``"map"``), while ``τ`` still sets the
variances. With one example no gain is beyond noise (its s.e. is undefined): MAP is kept.
The per-token fit's standard error treats label tokens as independent, although tokens of one
target are not: it is the looser side of the guard there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..exceptions import QueryInputError
from ..snapshot.heldout_prior import GUARD_SE, MAP_LINK, HeldoutPrior
from . import inputs
from .calibration import PROBS_METHODS, probs_from_gaussian
from .heldout_tokens import (
    MAX_SEQUENCES,
    TOKEN_SAMPLES,
    first_rows,
    scored_labels,
    token_grid,
    token_nll,
)
from .metrics import nll_per_example

#: ``τ`` candidates: a log grid over ten decades; the marginal-likelihood ``τ`` is added.
#: Fixed before the suite that judged the held-out default. At the top (``1e6``)
#: the posterior's probabilities equal MAP's (`HeldoutPrior.at_map`).
GRID = tuple(10.0 ** e for e in range(-4, 7))

#: The links the held-out fit chooses among, jointly with ``τ`` (fixed before the
#: suite): the probit (laplace-torch's default) and the pairwise mean-field link. Both are
#: closed forms of the same ``[B, K]`` mean and ``[B, K, K]`` covariance, so each adds no
#: model pass.
LINKS = ("probit", "meanfield")

#: The link the guard starts from: the probit, laplace-torch's default and the field's
#: pre-registered one (not tuned on this library's suite).
BASE_LINK = "probit"

#: The links `fit_prior_precision` may be fixed to (`PROBS_METHODS` less MAP's own ``"map"``,
#: which the guard always compares against).
FIT_LINKS = tuple(k for k in PROBS_METHODS if k != MAP_LINK)


def paired_gain(base: Tensor, other: Tensor) -> tuple[float, float]:
    """``(gain, s.e.)`` of ``other`` over ``base``: the mean of the per-example NLL
    differences ``base − other`` (> 0: ``other`` is better) and its paired standard error,
    their sample standard deviation (``n − 1``) over ``sqrt(n)``; NaN s.e. for ``n < 2``.

    Args:
        base: ``[n]`` per-example NLLs (nats).
        other: ``[n]`` per-example NLLs of the same examples.
    """
    diff = base.double() - other.double()  # [n]
    n = diff.numel()
    se = float(diff.std(correction=1)) / math.sqrt(n) if n > 1 else math.nan
    return float(diff.mean()), se


def beyond_noise(gain: float, se: float) -> bool:
    """A gain larger than `GUARD_SE` paired standard errors (False when the s.e. is NaN)."""
    return gain > GUARD_SE * se


@dataclass(frozen=True)
class GuardedChoice:
    """What the guard chose (`guarded_choice`).

    Attributes:
        link: The chosen link (`BASE_LINK` unless another won beyond noise).
        index: Its best candidate's index into ``taus``.
        map_kept: MAP's own probabilities kept (the posterior did not win beyond noise).
        map_gain: The posterior's gain over MAP (nats, > 0: better) and ``map_gain_se`` its
            paired standard error (`paired_gain`).
        map_gain_se: See ``map_gain``.
        link_gain: ``{link: (gain, s.e.)}`` of each other link's best over the base link's.
    """

    link: str
    index: int
    map_kept: bool
    map_gain: float
    map_gain_se: float
    link_gain: dict[str, tuple[float, float]]


def guarded_choice(per_example: Mapping[str, Tensor], map_nll: Tensor,
                   taus: Sequence[float]) -> GuardedChoice:
    """The guard's rule (module docstring) on per-example held-out NLLs.

    Args:
        per_example: ``{link: [len(taus), n]}`` NLL of each eval example (or label token) at
            every candidate ``τ``, nats; the base link is `BASE_LINK` when present, else the
            first.
        map_nll: ``[n]`` MAP's own NLL of the same examples.
        taus: The candidate ``τ`` values (ties of the mean NLL go to the larger).
    """
    links = list(per_example)
    means = {k: v.double().mean(1).tolist() for k, v in per_example.items()}
    # each link's lowest mean NLL; ties: the larger tau (nearer MAP)
    at = {k: min(range(len(taus)), key=lambda i, k=k: (means[k][i], -taus[i])) for k in links}
    base = BASE_LINK if BASE_LINK in links else links[0]
    link_gain = {k: paired_gain(per_example[base][at[base]], per_example[k][at[k]])
                 for k in links if k != base}
    beyond = [k for k, (g, se) in link_gain.items() if beyond_noise(g, se)]
    chosen = max(beyond, key=lambda k: link_gain[k][0]) if beyond else base
    gain, se = paired_gain(map_nll, per_example[chosen][at[chosen]])
    return GuardedChoice(link=chosen, index=at[chosen], map_kept=not beyond_noise(gain, se),
                         map_gain=gain, map_gain_se=se, link_gain=link_gain)


def _targets(where: str, labels: Tensor, token_ids: Sequence[int] | None) -> Tensor:
    """The right answer's index into ``token_ids`` per example, ``[B]``, from a batch's labels:
    a classifier's ``labels [B]`` themselves; of ``labels [B, T]`` the label at each row's
    first labelled position (the answer position of every query, `inputs.answer_positions`)."""
    if labels.dim() == 1:
        return labels.long()
    if token_ids is None:
        raise QueryInputError(f"{where}: labels of shape {tuple(labels.shape)} need token_ids "
                              "(the answer tokens) for a language-model head: pass token_ids, "
                              "or train with HeldoutConfig(answer_tokens=...)")
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


def fit_prior_precision(post, batches: Iterable[Mapping[str, Tensor]], *,
                        token_ids: Sequence[int] | None = None, link: str | None = None,
                        grid: Sequence[float] | None = None, n_samples: int = TOKEN_SAMPLES,
                        seed: int = 0, max_sequences: int | None = MAX_SEQUENCES
                        ) -> HeldoutPrior:
    """The (``τ``, link) of (``grid`` ∪ {marginal-likelihood ``τ``}) × `LINKS` chosen on
    held-out data by the guard (module docstring: probit unless another link wins beyond 2
    paired standard errors; each link's lowest-NLL ``τ``, ties: the larger, nearer MAP), and
    whether the posterior's probabilities replace MAP's (only beyond 2 paired standard errors).

    Cost: one Jacobian pass over the held-out set (a forward, ``K`` logit backwards and the
    eigenbasis features per batch); every candidate is closed-form algebra on that pass
    (`LaplacePosterior.covariance_grid`: probit's variances exact at every ``τ`` in one
    product, the mean-field link's covariances binned by eigenvalue pair, each within a factor
    `tau_grid.VARIANCE_FACTOR`; measured by ``benchmarks/heldout_cost.py``). MAP's own NLL,
    accuracy and confidence come from the same pass's logits. Per-example NLLs of every
    candidate are held in memory (``(2·len(grid) + 3)`` floats per example) for the guard's
    paired standard errors. A language model without answer tokens: the per-token fit
    (`kfac_stream.query.heldout_tokens`, its cost there).

    Args:
        post: A `LaplacePosterior`.
        batches: Model inputs with ``labels`` (see the module docstring), on the model's
            device; one Jacobian pass per batch serves every candidate. A seq2seq model's
            decoder inputs are made from the labels when the batch has none.
        token_ids: The ``K ≥ 2`` answer tokens of a language-model head (one sequence of ints
            for every example); None: the snapshot's ``HeldoutConfig.answer_tokens`` (none: a
            language model's per-token NLL, module docstring).
        link: None (default: chosen among `LINKS` by the guard, module docstring), or one
            link to fix: ``"meanfield"``, ``"probit"`` or ``"mc"`` (`probs_from_gaussian`);
            the per-token NLL of a language model without ``token_ids`` is always ``"mc"``
            (module docstring). MAP's own probabilities are compared with it either way.
        grid: Candidate ``τ`` values (positive); None: `GRID` ∪ {marginal-likelihood ``τ``},
            and for the per-token fit `heldout_tokens.token_grid` around that ``τ``.
        n_samples: Draws of the linearised model per candidate for that per-token NLL, an
            int ≥ 2.
        seed: Seed of the first of those draws, an int.
        max_sequences: The per-token fit reads the first this many eval rows (None: all).

    Returns:
        A `HeldoutPrior`; ``post.prior_precision`` is left as it was.
    """
    where = "fit_prior_precision"
    t0 = time.perf_counter()
    spec = _check_fit(where, post, token_ids=token_ids, link=link, n_samples=n_samples,
                      seed=seed)
    before = post.prior_precision
    tau_ml = post.optimize_prior_precision(show_progress=False)
    post.prior_precision = before
    if grid is None:
        grid = token_grid(tau_ml) if spec.per_token else GRID
    taus = sorted({float(t) for t in grid} | {tau_ml})
    sums = _HeldoutNLL(spec.links, len(taus))
    if spec.per_token:
        batches = first_rows(batches, max_sequences)
    try:
        for batch in batches:
            sums.add(post, batch, taus, spec)
    finally:
        post.prior_precision = before
        if getattr(post, "_grid", None) is not None:  # the grid's sorted buffer, not kept
            post._grid.release()
    return sums.best(where, taus, tau_ml, t0)


@dataclass(frozen=True)
class _FitSpec:
    """The checked arguments of `fit_prior_precision`."""

    where: str
    links: tuple[str, ...]  # the candidate links
    token_ids: list[int] | None  # the K answer tokens of a language-model head
    per_token: bool  # a language-model head without them: the NLL per label token
    n_samples: int  # draws per candidate of the per-token NLL
    seed: int


def _check_fit(where: str, post, *, token_ids: object, link: object, n_samples: object,
               seed: object) -> _FitSpec:
    """`fit_prior_precision`'s arguments, checked (``token_ids`` None: the snapshot's
    answer tokens)."""
    links = LINKS if link is None else (inputs.check_choice(where, "link", link,
                                                            FIT_LINKS),)
    if token_ids is None:
        token_ids = post.answer_tokens  # the run's HeldoutConfig.answer_tokens, or None
    if token_ids is not None:
        token_ids = inputs.check_token_ids(where, "token_ids", token_ids, 1, options=True)
        if token_ids.dim() != 1:
            raise inputs.error(where, "token_ids", token_ids, "the K >= 2 answer tokens, one "
                               "sequence of ints for every example")
        token_ids = token_ids.tolist()
    n_samples = inputs.check_int(where, "n_samples", n_samples, 2)
    seed = inputs.check_seed(where, "seed", seed)
    per_token = token_ids is None and inputs.output_vocab(post.model) is not None
    return _FitSpec(where=where, links=links, token_ids=token_ids, per_token=per_token,
                    n_samples=n_samples, seed=seed)


class _HeldoutNLL:
    """The held-out NLL per example of every link and candidate ``τ`` and of MAP's own
    probabilities, with MAP's correct answers and confidence (`fit_prior_precision`)."""

    def __init__(self, links: Sequence[str], candidates: int) -> None:
        # {link: [[candidates, n_b] per batch]}; MAP's: [[n_b] per batch]
        self.parts: dict[str, list[Tensor]] = {k: [] for k in links}
        self.map_parts: list[Tensor] = []
        self.map_correct = self.map_conf = 0.0
        self.n = 0
        self.per_token = False

    def add(self, post, batch: Mapping[str, Tensor], taus: Sequence[float],
            spec: _FitSpec) -> None:
        """One held-out batch: a language model's whole texts by the per-token NLL
        (`heldout_tokens.token_nll`), else the closed-form links of one Jacobian pass at every
        candidate."""
        where, token_ids = spec.where, spec.token_ids
        if spec.per_token:  # whole texts: the NLL per scored label token
            inputs.check_model_batch(where, "batch", batch, post.model)
            labels = scored_labels(where, batch, post.model)
            part, map_part = token_nll(post, batch, labels, taus, spec.n_samples, spec.seed)
            self.parts = {"mc": [*self.parts.get("mc", []), part]}
            self.map_parts.append(map_part)
            self.n += map_part.numel()
            self.per_token = True
            return
        if "labels" not in batch:
            raise QueryInputError(f"{where}: a held-out batch has no labels")
        y = _targets(where, batch["labels"].cpu(), token_ids)
        mean, covs = post.covariance_grid(batch, None, token_ids,  # at the labels
                                          prior_precisions=taus, links=spec.links)
        y = y.to(mean.device)
        for k in spec.links:
            self.parts[k].append(torch.stack([
                nll_per_example(probs_from_gaussian(mean, covs[k][i], k), y).double().cpu()
                for i in range(len(taus))]))
        p_map = torch.softmax(mean.double(), -1)
        self.map_parts.append(nll_per_example(p_map, y).double().cpu())
        self.map_correct += float((p_map.argmax(-1) == y).sum())
        self.map_conf += float(p_map.max(-1).values.sum())
        self.n += len(y)

    def best(self, where: str, taus: list[float], tau_ml: float, t0: float) -> HeldoutPrior:
        """The `HeldoutPrior` the guard chooses (module docstring; ``t0``: when the fit
        began)."""
        n = self.n
        if n == 0:
            raise QueryInputError(f"{where}: no held-out examples: the eval set is empty (its "
                                  "batches hold no example)")
        per_example = {k: torch.cat(v, 1) for k, v in self.parts.items()}  # [candidates, n]
        map_nll = torch.cat(self.map_parts)  # [n]
        link_nll = {k: v.mean(1).tolist() for k, v in per_example.items()}
        choice = guarded_choice(per_example, map_nll, taus)
        best, chosen = choice.index, choice.link
        ml = taus.index(tau_ml)
        nll = link_nll[chosen]
        maps = ((None, None) if self.per_token else (self.map_correct / n, self.map_conf / n))
        return HeldoutPrior(tau=taus[best], nll=nll[best], marglik_tau=tau_ml,
                            marglik_nll=nll[ml], examples=n, link=chosen, grid=tuple(taus),
                            grid_nll=tuple(nll), map_nll=float(map_nll.mean()),
                            map_accuracy=maps[0], map_confidence=maps[1],
                            link_nll={k: tuple(v) for k, v in link_nll.items()},
                            seconds=time.perf_counter() - t0,
                            map_kept=choice.map_kept, map_gain=choice.map_gain,
                            map_gain_se=choice.map_gain_se, link_gain=choice.link_gain or None)
