"""The held-out fit of a language model's whole-text eval set (`heldout_tau.fit_prior_precision`
without answer tokens): the NLL per label token of the linearised next-token predictive, the
predictive `sampled_predictive` gives with ``linearized=True`` and ``kfac-stream query`` runs.

Which tokens: a causal LM's position ``t`` predicts the label of position ``t + 1`` (a Hugging
Face collator's ``labels``, equal to ``input_ids`` with ``-100`` where no loss is taken; without
``labels``, ``input_ids`` where ``attention_mask`` is 1), as its training loss does; an
encoder-decoder's decoder position ``t`` predicts ``labels[:, t]`` (its decoder inputs are made
from the labels as in training). At most `ROW_POSITIONS` labelled positions of each row are
scored, evenly spaced over that row's labelled positions (the first and the last kept), from the
first `MAX_SEQUENCES` rows of the eval set: the model passes are over whole rows anyway, and
neighbouring tokens of one text say much the same about ``τ``.

The NLL of a candidate ``τ``: ``−log mean_s softmax(f_s)[y]`` over ``n_samples`` draws ``f_s``
of the linearised model (the same seeds ``seed … seed + S − 1`` for every candidate: common
random numbers), and MAP's ``−log softmax(f*)[y]`` from one forward of the trained model. The
candidates are `token_grid`: `DECADES` around the marginal-likelihood ``τ`` (fixed before any
suite judged them), not the closed form's ten-decade grid: each candidate costs ``S``
linearised forwards (about ``2·S`` forwards) of every scored row.

Cost, stated: ``len(DECADES) · 2 · n_samples + 1`` forward-equivalents of at most
`MAX_SEQUENCES` rows (``5 · 2 · 16 + 1 = 161`` at the defaults), the vocabulary's softmax taken
only at the scored positions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from ..exceptions import QueryInputError
from . import inputs

#: Draws of the linearised model per candidate ``τ``.
TOKEN_SAMPLES = 16

#: The candidates: ``τ_ml · 10^d`` for these ``d`` (module docstring).
DECADES = (-2, -1, 0, 1, 2)

#: Eval rows (sequences) the fit reads at most: the first ones of the eval set.
MAX_SEQUENCES = 64

#: Labelled positions scored per row at most.
ROW_POSITIONS = 32

#: Forward-equivalents of the fit per row read: ``S`` linearised forwards (about 2 each) per
#: candidate, and MAP's.
FORWARDS = 2 * TOKEN_SAMPLES * len(DECADES) + 1

#: What the fit reads and its cost, in words (the train-end line before it runs).
FIT_METHOD = (f"a language model's whole texts, the NLL per label token of the linearised "
              f"next-token predictive (at most {ROW_POSITIONS} positions of each of the first "
              f"{MAX_SEQUENCES} eval rows), by Monte Carlo over {TOKEN_SAMPLES} draws for each of "
              f"{len(DECADES)} candidate taus around the marginal likelihood's (about {FORWARDS} "
              "forwards of those rows)")


def token_grid(tau_ml: float) -> list[float]:
    """The per-token fit's candidate ``τ``: ``tau_ml · 10^d`` for ``d`` in `DECADES`, sorted."""
    return sorted(float(tau_ml) * 10.0 ** d for d in DECADES)


def first_rows(batches: Iterable[Mapping[str, Tensor]], most: int | None = MAX_SEQUENCES
               ) -> Iterator[Mapping[str, Tensor]]:
    """The batches of the first ``most`` rows (None: all): the batch that crosses the count is
    cut (every ``[B, ...]`` tensor to its first rows), the rest are not read."""
    left = math.inf if most is None else int(most)
    for batch in batches:
        if left <= 0:
            return
        size = _rows(batch)
        if size > left:
            batch = {k: v[:int(left)] if isinstance(v, Tensor) and v.dim() and v.shape[0] == size
                     else v for k, v in batch.items()}
        left -= min(size, left)
        yield batch


def _rows(batch: Mapping[str, Tensor]) -> int:
    first = batch.get("input_ids", batch.get("inputs_embeds"))
    return int(first.shape[0]) if isinstance(first, Tensor) else int(batch["labels"].shape[0])


def scored_labels(where: str, batch: Mapping[str, Tensor], model, per_row: int = ROW_POSITIONS
                  ) -> Tensor:
    """The label each logit position is scored on, ``[B, T]`` (``[B, T']`` for an
    encoder-decoder), ``-100`` at positions not scored (module docstring: next-token labels
    of a causal LM, the labels themselves for an encoder-decoder; at most ``per_row`` per
    row, evenly spaced)."""
    labels = batch.get("labels")
    if inputs.seq2seq_lm(model):
        if not isinstance(labels, Tensor) or labels.dim() != 2:
            raise QueryInputError(f"{where}: a held-out batch has no labels [B, T'] (an "
                                  "encoder-decoder's eval set holds its targets as labels)")
        aligned = labels.clone()
    else:
        ids = batch.get("input_ids")
        if labels is None and ids is None:
            raise QueryInputError(f"{where}: a held-out batch of a causal language model needs "
                                  "'labels' or 'input_ids' (the next tokens it is scored on)")
        if labels is None:
            mask = batch.get("attention_mask")
            labels = ids if mask is None else ids.masked_fill(mask == 0, inputs.IGNORE_INDEX)
        if labels.dim() != 2:
            raise QueryInputError(f"{where}: a causal language model's held-out labels must be "
                                  f"[B, T] (the collator's), got {list(labels.shape)}")
        aligned = torch.full_like(labels, inputs.IGNORE_INDEX)
        aligned[:, :-1] = labels[:, 1:]
    return thin(aligned, per_row)


def thin(labels: Tensor, per_row: int) -> Tensor:
    """``labels`` (``[B, T]``) with at most ``per_row`` labelled entries left per row, at evenly
    spaced ranks among that row's labelled positions (the first and the last kept); the rest
    set to ``-100``."""
    keep = labels != inputs.IGNORE_INDEX  # [B, T]
    rank = keep.long().cumsum(1) - 1  # [B, T]: rank among the row's labelled positions
    count = keep.sum(1, keepdim=True)  # [B, 1]
    if per_row <= 1:
        chosen = rank == 0
    else:
        # ranks round(j * (count - 1) / (per_row - 1)), j = 0 .. per_row - 1
        j = torch.arange(per_row, device=labels.device)  # [per_row]
        want = torch.round(j[None, :] * (count - 1).clamp(min=0) / (per_row - 1)).long()
        chosen = (rank[:, :, None] == want[:, None, :]).any(-1)  # [B, T]
    return labels.masked_fill(~(keep & chosen), inputs.IGNORE_INDEX)


def token_nll(post, batch: Mapping[str, Tensor], labels: Tensor, taus: Sequence[float],
              n_samples: int, seed: int) -> tuple[Tensor, Tensor]:
    """``(NLL [len(taus), n], MAP's NLL [n])`` of a batch's ``n`` scored label tokens (row by
    row, left to right; ``labels`` from `scored_labels`, aligned with the logits): at each
    candidate ``τ`` ``−log mean_s softmax(f_s)[y]`` over ``n_samples`` linearised draws (the
    same seeds for all), and MAP's ``−log softmax(f*)[y]`` from one forward."""
    from .sampled import iter_sample_logits

    where = "fit_prior_precision"
    keep = labels != inputs.IGNORE_INDEX  # [B, T]
    rows, cols = keep.nonzero(as_tuple=True)  # [n] each
    y = labels[rows, cols]  # [n]
    total = torch.zeros(len(taus), len(y), dtype=torch.float64)
    for i, tau in enumerate(taus):
        post.prior_precision = tau
        lse = None
        for _, logits in iter_sample_logits(post, batch, n_samples, seed, linearized=True,
                                            show_progress=False):
            if tuple(logits.shape[1:-1]) != tuple(labels.shape):
                raise QueryInputError(f"{where}: labels {list(labels.shape)} do not fit the "
                                      f"model's logits {list(logits.shape[1:])}")
            picked = _label_logprob(where, logits[:, rows.to(logits.device),
                                                  cols.to(logits.device)], y)  # [S_c, n]
            part = torch.logsumexp(picked, 0)  # [n]
            lse = part if lse is None else torch.logaddexp(lse, part)
        assert lse is not None
        total[i] = (math.log(n_samples) - lse).cpu()
    run = inputs.query_batch(where, "batch", batch, post.model)
    with torch.no_grad():
        logits = post.model(**inputs.forward_inputs(run, post.model)).logits  # [B, T, V]
    map_nll = -_label_logprob(where, logits[rows.to(logits.device),
                                            cols.to(logits.device)][None], y)[0]
    return total, map_nll.cpu()


def _label_logprob(where: str, logits: Tensor, y: Tensor) -> Tensor:
    """``log softmax(logits)[y]`` in float64, ``[S, n]``, of ``logits [S, n, V]`` and labels
    ``y [n]`` (each in ``[0, V)``, checked)."""
    vocab = logits.shape[-1]
    bad = y[(y < 0) | (y >= vocab)]
    if bad.numel():
        raise QueryInputError(f"{where}: a label ({int(bad[0])}) is outside the model's "
                              f"{vocab} vocabulary logits (or -100: no label)")
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lp = torch.log_softmax(logits.to(work), -1)  # [S, n, V]
    index = y.to(logits.device)[None, :, None].expand(lp.shape[0], -1, 1)
    return lp.gather(-1, index).squeeze(-1).double()
