r"""The statistics of ``S`` posterior samples' logits at every position: the predictive
``p̄ = mean_s softmax(f_s)`` over the whole vocabulary, its entropy (total uncertainty), the
expected entropy (aleatoric), their difference (the mutual information, epistemic) and the
label's log-probability over the samples (`SampledPredictive`), accumulated chunk by chunk
(`PredictiveAccumulator`). Used by `kfac_stream.query.sampled`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .inputs import IGNORE_INDEX


@dataclass(frozen=True)
class SampledPredictive:
    """The predictive of ``S`` posterior weight samples at every position of a batch.

    Shapes: ``P`` is the logits' shape without the class axis — ``[B, T]`` for a
    language-model head (logits ``[B, T, V]``; position ``t`` predicts token ``t + 1``) and
    ``[B]`` for a classification head (logits ``[B, C]``); ``V`` is the vocabulary (or the
    ``C`` classes). Every tensor lies on the model's device; the statistics are float64.
    Entropies are in nats. Padding positions hold values of no meaning.

    Attributes:
        probs: ``[*P, V]``: the predictive distribution ``p̄ = (1/S) Σ_s softmax(f_s)``.
        entropy: ``[*P]``: ``H[p̄]``, the total predictive uncertainty.
        expected_entropy: ``[*P]``: ``(1/S) Σ_s H[softmax(f_s)]``, the aleatoric part.
        mutual_information: ``[*P]``: ``entropy − expected_entropy`` (≥ 0 by Jensen; clamped
            at 0 against round-off), the epistemic part: the information between the
            prediction and the weights.
        label_logprob_mean: ``[*P]`` or None (no labels): ``(1/S) Σ_s log softmax(f_s)[y]``
            of the label ``y`` at each position; NaN where there is no label.
        label_logprob_var: ``[*P]`` or None: the variance over samples of the same
            (denominator ``S − 1``); NaN where there is no label.
        sample_logits: ``[S, *P, V]`` (the model's dtype) with ``return_logits=True``, else
            None: the logits of each sample ``s`` (drawn as `LaplacePosterior.sampled_weights`
            with ``seed + s``).
        n_samples: ``S``.
        seed: The seed of sample 0.
        linearized: Whether the logits are those of the linearised model.
    """

    probs: Tensor
    entropy: Tensor
    expected_entropy: Tensor
    mutual_information: Tensor
    label_logprob_mean: Tensor | None
    label_logprob_var: Tensor | None
    sample_logits: Tensor | None
    n_samples: int
    seed: int
    linearized: bool


class PredictiveAccumulator:
    """Running sums over the samples: ``Σ p_s``, ``Σ H[p_s]``, the label's log-probabilities
    ``[S, *P]`` and (optionally) every sample's logits.

    Per sample the log-softmax, its exponential and the entropy run in the work dtype: float64
    for a float64 model, else float32 (good to ~1e-7, far inside the spread over samples).
    ``Σ p_s`` is summed in the work dtype over blocks of `FLUSH` samples and the blocks in
    float64 (a float64 copy of the ``[*P, V]`` probabilities per sample would cost more than
    the sample's forward on a CPU), so its rounding stays at ``FLUSH`` times the work dtype's
    (float32: ≤ 32 · 6e-8 ≈ 2e-6 relative). With ``S ≤ FLUSH`` (one block, no float64 sum)
    the entropy of ``p̄`` is taken from the block in the work dtype too, as the samples'
    entropies are: each float64 pass over the ``[*P, V]`` predictive costs about what a
    sample's statistics cost (on 2 CPU cores at 2048 × 2048: converting and adding a block
    9 ms, a float64 ``xlogy`` 15 ms over the whole tensor, 6 ms in slices; the block's
    float32 ``xlogy`` 5 ms).
    """

    FLUSH = 32
    #: elements per row slice of the statistics on a CPU (2 MiB of float32, half per core on
    #: 2 cores): each slice's log-softmax, exponential, entropy and sum run from the caches;
    #: over whole ``[*P, V]`` logits the same passes cost 3–4× as much (12 ms at 2048 × 2048
    #: on 2 cores). Per sample of 2048 × 2048 logits fresh from the LM head, inside
    #: `sampled_predictive` (2-core EPYC, 1 MiB of L2 per core; medians of 5): 512 KiB slices
    #: 4.3 ms, 1 MiB 3.8, 2 MiB 3.5; 4 MiB slices 4.0 in a micro-benchmark. On an accelerator
    #: each sample is one slice (no per-slice kernel launches).
    CACHE_ELEMENTS = 1 << 19

    def __init__(self, n_samples: int, keep_logits: bool) -> None:
        self.n = n_samples
        self.keep_logits = keep_logits
        self.sum_p: Tensor | None = None
        self.block_p: Tensor | None = None
        self.in_block = 0
        self.sum_h: Tensor | None = None
        self.label_lp: list[Tensor] = []
        self.logits: list[Tensor] = []

    def add(self, logits: Tensor, labels: Tensor | None) -> None:
        """``logits [S_c, *P, V]``; ``labels [*P]`` (``-100``: none) or None."""
        if self.keep_logits:
            self.logits.append(logits)
        work = torch.float64 if logits.dtype == torch.float64 else torch.float32
        vocab = logits.shape[-1]
        if self.block_p is None:
            self.block_p = logits.new_empty(logits.shape[1:], dtype=work)  # 1st sample copies
        block = self.block_p.view(-1, vocab)
        flat_labels = None if labels is None else labels.clamp(min=0).reshape(-1, 1)
        rows = (max(1, self.CACHE_ELEMENTS // vocab) if logits.device.type == "cpu"
                else logits[0].numel() // vocab)  # one slice per sample on an accelerator
        for f in logits:
            flat = f.reshape(-1, vocab)
            h = flat.new_empty(flat.shape[0], dtype=work)
            lp = None if labels is None else flat.new_empty((flat.shape[0], 1), dtype=work)
            for i in range(0, flat.shape[0], rows):
                rs = slice(i, i + rows)
                logp = torch.log_softmax(flat[rs].to(work), dim=-1)
                if self.in_block:
                    p = logp.exp()
                    block[rs].add_(p)
                else:  # the block's first sample: written into it (no zeroing, no copy)
                    p = torch.exp(logp, out=block[rs])
                torch.linalg.vecdot(p, logp, out=h[rs])
                if lp is not None:
                    torch.gather(logp, -1, flat_labels[rs], out=lp[rs])
            # H = −Σ p log p; a −∞ logit (p = 0) gives 0·(−∞) = NaN: those rows again with
            # log p clamped to the lowest finite value (0·log 0 = 0); one host read of a flag
            # per sample, and the extra pass only where such logits occur
            bad = h.isnan()
            if bool(bad.any()):
                logp = torch.log_softmax(flat[bad].to(work), dim=-1)
                h[bad] = torch.linalg.vecdot(logp.exp(), logp.clamp_(min=torch.finfo(work).min))
            h = h.neg_().view(f.shape[:-1]).double()
            self.sum_h = h if self.sum_h is None else self.sum_h.add_(h)
            if lp is not None:
                assert labels is not None
                self.label_lp.append(lp.view(labels.shape).double().masked_fill(
                    labels == IGNORE_INDEX, float("nan")))
            self.in_block += 1
            if self.in_block == self.FLUSH:
                self._flush()

    def _flush(self) -> None:
        if self.in_block:
            assert self.block_p is not None
            if self.sum_p is None:
                self.sum_p = self.block_p.to(torch.float64, copy=True)  # block_p is reused
            else:
                self.sum_p.add_(self.block_p)  # float64 += work dtype, in one pass
        self.in_block = 0

    def result(self, seed: int, linearized: bool) -> SampledPredictive:
        """The statistics; the accumulator is read once (its sums are divided in place)."""
        assert self.block_p is not None and self.sum_h is not None
        if self.sum_p is None:  # one block: p̄ and H[p̄] in the work dtype, p̄ then float64
            probs = self.block_p
            entropy = _entropy_in_slices(probs.view(-1, probs.shape[-1]), 1.0 / self.n)
            probs = probs.to(torch.float64)  # no copy for a float64 model
        else:
            self._flush()
            probs = self.sum_p
            entropy = _entropy_in_slices(probs.view(-1, probs.shape[-1]), 1.0 / self.n)
        entropy = entropy.view(probs.shape[:-1]).double()
        expected = self.sum_h / self.n
        mean = var = None
        if self.label_lp:
            lp = torch.stack(self.label_lp)  # [S, *P]
            mean, var = lp.mean(0), lp.var(0)  # unbiased (S ≥ 2)
        return SampledPredictive(
            probs=probs, entropy=entropy, expected_entropy=expected,
            mutual_information=(entropy - expected).clamp(min=0.0),
            label_logprob_mean=mean, label_logprob_var=var,
            sample_logits=torch.cat(self.logits) if self.keep_logits else None,
            n_samples=self.n, seed=seed, linearized=linearized)


def _entropy_in_slices(sums: Tensor, scale: float) -> Tensor:
    """``H[p] = −Σ_v p_v log p_v`` per row of ``p = scale · sums`` (``sums [R, V]``, scaled in
    place), in row slices of `PredictiveAccumulator.CACHE_ELEMENTS` on a CPU (one pass each over a
    slice in cache; ``0 · log 0 = 0``); ``[R]`` in ``sums``' dtype."""
    rows = (max(1, PredictiveAccumulator.CACHE_ELEMENTS // sums.shape[-1])
            if sums.device.type == "cpu" else sums.shape[0])
    h = sums.new_empty(sums.shape[0])
    for i in range(0, sums.shape[0], rows):
        p = sums[i:i + rows].mul_(scale)
        torch.sum(torch.special.xlogy(p, p), -1, out=h[i:i + rows])
    return h.neg_()
