r"""`sampled_predictive`: the whole-vocabulary predictive from posterior weight samples.

``S`` draws ``W̄_s = W̄* + ΔW̄_s`` of the tracked layers (``ΔW̄_s = Q_G (Z_s ⊘ sqrt(N γ αᵀ +
τ)) Q_Aᵀ``, the draws of ``LaplacePosterior.sampled_weights(seed + s)``) are evaluated in
batched forward passes: the batch is repeated ``S_c`` times (sample-major, ``S_c`` samples of
one chunk), and every tracked layer computes its rows of sample ``s`` with its own weights,
``x_s W_sᵀ + b_s`` (one batched matmul, instead of its trained weights; the model is never
copied and its weights are never changed). One forward of ``S_c·B`` rows thus costs what
``S_c`` forwards of the batch cost. From the logits of every sample, for every position:
the predictive distribution ``p̄ = mean_s softmax(f_s)`` over the whole vocabulary, its entropy
``H[p̄]`` (total uncertainty), the expected entropy ``mean_s H[p_s]`` (aleatoric) and their
difference, the mutual information between the prediction and the weights (epistemic), and,
given labels, the mean and variance over samples of the label's log-probability.

``linearized=True`` evaluates the linearised model instead (the GLM predictive):
``f_s = f(x; θ*) + J (θ_s − θ*)``, the Jacobian-vector product computed in forward mode
(`torch.autograd.forward_ad` dual tensors) in one batched forward per chunk, each sample's
rows carrying its own tangent. Its logits are exactly Gaussian, ``N(f*, J Σ Jᵀ)``: the
distribution `LaplacePosterior.predictive` gives in closed form for ``K`` chosen logits.

Here: the arguments, the draws and the chunked loop over the samples; the tracked layers'
draws and per-sample forwards are in `kfac_stream.query.sample_layers`, the statistics in
`kfac_stream.query.sample_stats`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..exceptions import QueryInputError
from ..utils.progress import progress
from . import inputs
from .laplace import LaplacePosterior
from .sample_layers import SampledLayers, Samples, forwards_replaced
from .sample_stats import PredictiveAccumulator, SampledPredictive

#: Rows x positions (``chunk·B·T``) of one batched forward when ``chunk`` is None, per device
#: type: a GPU wants wide kernels; a CPU's elementwise layers (GELU, softmax) run from its caches
#: only on small tensors (measured on the 2-core CPU, GPT-2 4x256, a 8x256 batch, S = 16: one
#: sample per forward 2.2 s, eight 3.9 s; a plain forward of eight times the rows took 11x one).
CHUNK_TOKENS = {"cpu": 2048, "default": 65536}

#: Posterior samples when neither ``n_samples`` nor ``draws`` is given.
DEFAULT_SAMPLES = 16

#: Label value of a position without a label (as in Hugging Face's losses).
IGNORE_INDEX = inputs.IGNORE_INDEX

LABELS_ALLOWED = ("None, 'next' (causal LM: the next token of input_ids at every position) or "
                  "an integer tensor of the logits' shape without the last axis ([B, T] for a "
                  "language-model head, [B] for a classification head), entries in [0, V) or "
                  f"{IGNORE_INDEX} (no label)")


@dataclass(frozen=True, repr=False)
class PosteriorDraws:
    """``S`` posterior weight samples of a posterior's tracked layers, drawn once.

    Sample ``s`` is ``post.sampled_weights(seed + s)``'s draw. Pass it as ``draws=`` to
    `sampled_predictive`, `iter_sample_logits` or `sample_rows` to evaluate the same samples on
    many batches: the draws (``2·d_out·d_A·(d_out + d_A)`` flops per sample and layer) are then
    paid once, and each batch costs its ``S`` forwards.

    The sampled weights are kept, not the perturbations: each batch then computes with them as
    they are (adding ``W̄*`` to every sample's ``ΔW̄`` cost a pass over the tracked weights per
    sample and call). The linearised variant takes the perturbation back as ``W̄_s − W̄*``:
    the exact difference between the weight ``sampled_weights`` writes and the trained one
    (Sterbenz: exact wherever ``W̄_s`` is within a factor 2 of ``W̄*``; elsewhere one rounding).

    Attributes:
        weights: ``{layer: W_s [S, d_out, d_in]}``, the sampled weights ``W* + ΔW_s`` in the
            layer's weight dtype on its device, contiguous (a ``Conv1D``'s too in
            ``[d_out, d_in]``). Memory: ``S`` copies of the tracked weights.
        biases: ``{layer: b_s [S, d_out]}``, the sampled biases of the layers with a bias.
        n_samples: ``S``.
        seed: The seed of sample 0.
        prior_precision: The posterior's ``τ`` when drawn (a float or ``{layer: float}``).
        num_data: The posterior's ``N`` when drawn.
    """

    weights: Mapping[str, Tensor]
    biases: Mapping[str, Tensor]
    n_samples: int
    seed: int
    prior_precision: float | Mapping[str, float]
    num_data: float

    def __repr__(self) -> str:
        return (f"PosteriorDraws(n_samples={self.n_samples}, seed={self.seed}, "
                f"{len(self.weights)} layers)")


def posterior_draws(post: LaplacePosterior, n_samples: int = DEFAULT_SAMPLES,
                    seed: int = 0) -> PosteriorDraws:
    """Draw ``S`` posterior weight samples of ``post``'s tracked layers once (see
    `PosteriorDraws`; sample ``s`` = ``post.sampled_weights(seed + s)``'s draw).

    Args:
        post: The posterior (a `LaplacePosterior`), at the prior precision and ``N`` to use.
        n_samples: ``S``, an int ≥ 1.
        seed: Seed of sample 0, an int.

    Raises:
        QueryInputError: an argument of the wrong type or range.
    """
    where = "posterior_draws"
    if not isinstance(post, LaplacePosterior):
        raise inputs.error(where, "post", post, "a kfac_stream.LaplacePosterior", typed=True)
    n_samples = inputs.check_int(where, "n_samples", n_samples, 1)
    seed = inputs.check_seed(where, "seed", seed)
    samples = SampledLayers(post).draws(range(seed, seed + n_samples))
    prior = post.prior_precision
    return PosteriorDraws(weights={n: w for n, (w, _) in samples.items()},
                          biases={n: b for n, (_, b) in samples.items() if b is not None},
                          n_samples=n_samples, seed=seed,
                          prior_precision=dict(prior) if isinstance(prior, dict) else prior,
                          num_data=post.num_data)


def _check_samples(where: str, post: LaplacePosterior, n_samples: object, seed: object,
                   draws: object, lowest: int) -> tuple[int, int]:
    """``(S, seed)`` from the arguments, or from ``draws`` (which must be this posterior's,
    at its current prior precision and ``N``; ``n_samples``/``seed`` None or equal)."""
    if draws is None:
        n = DEFAULT_SAMPLES if n_samples is None else inputs.check_int(where, "n_samples",
                                                                       n_samples, lowest)
        return n, 0 if seed is None else inputs.check_seed(where, "seed", seed)
    allowed = "None or a PosteriorDraws of this posterior (kfac_stream.posterior_draws(post))"
    if not isinstance(draws, PosteriorDraws):
        raise inputs.error(where, "draws", draws, allowed, typed=True)
    if set(draws.weights) != set(post.modules):
        raise inputs.error(where, "draws", draws, allowed,
                           problem="holds other layers than this posterior's")
    prior = post.prior_precision
    if (dict(prior) if isinstance(prior, dict) else prior) != draws.prior_precision or \
            post.num_data != draws.num_data:
        raise inputs.error(where, "draws", draws, allowed,
                           problem=f"were drawn at prior precision {draws.prior_precision!r} "
                                   f"and N = {draws.num_data:g}, but the posterior now has "
                                   f"{prior!r} and N = {post.num_data:g}")
    for arg, given, theirs in (("n_samples", n_samples, draws.n_samples),
                               ("seed", seed, draws.seed)):
        if given is not None and given != theirs:
            raise inputs.error(where, arg, given, f"None or the draws' {arg} ({theirs})",
                               problem="differs from the draws'")
    if draws.n_samples < lowest:
        raise inputs.error(where, "draws", draws, f"draws of at least {lowest} samples")
    return draws.n_samples, draws.seed

def sampled_predictive(post: LaplacePosterior, batch: Mapping[str, Tensor],
                       n_samples: int | None = None, seed: int | None = None,
                       chunk: int | None = None, labels: Tensor | str | None = None, *,
                       linearized: bool | None = None, return_logits: bool = False,
                       draws: PosteriorDraws | None = None,
                       show_progress: bool | None = None) -> SampledPredictive:
    """The whole-vocabulary predictive of ``S`` posterior samples, in batched forwards.

    Sample ``s`` is exactly the draw of ``post.sampled_weights(seed=seed + s)`` (the same
    random numbers, layer by layer), so a loop over that context manager gives the same
    logits up to round-off — at ``S`` copies of nothing: here the model and its weights stay
    as they are, and each forward evaluates ``chunk`` samples at once (the batch repeated
    ``chunk`` times). Cost: about ``S`` forwards of the batch (linearised: about twice that),
    plus the draws (per sample and layer ``Q_G Z Q_Aᵀ``, ``2·d_out·d_A·(d_out + d_A)`` flops,
    as in ``sampled_weights``). Memory: ``chunk`` copies of the batch's activations (and
    logits) and of the tracked weights. The statistics are accumulated in float64.

    A tracked layer whose weight is shared with another module (tied embeddings) is
    perturbed in this layer's use only, as in `LaplacePosterior.predictive` (while
    ``sampled_weights`` changes the shared tensor, so also the other use). The model runs in
    the mode it is in (call ``model.eval()`` to turn dropout off).

    Args:
        post: The posterior (a `LaplacePosterior`), with its prior precision and ``N``.
        batch: Model inputs, a dict with ``input_ids`` ``[B, T]`` (an integer tensor; on the
            CPU, ids within the model's input embeddings) or ``inputs_embeds`` ``[B, T, d]``,
            optionally ``attention_mask`` ``[B, T]`` and other inputs whose first axis is the
            batch's (``labels`` ignored: pass them as ``labels``). An encoder-decoder LM (T5,
            BART) also needs ``labels`` ``[B, T']`` (its decoder inputs are made from them as
            in training) or ``decoder_input_ids`` ``[B, T']``; its logits are ``[B, T', V]``.
        n_samples: ``S``, an int ≥ 2 (default: `DEFAULT_SAMPLES`, or the count of ``draws``).
        seed: Seed of sample 0 (sample ``s`` uses ``seed + s``), an int (default 0, or the
            seed of ``draws``).
        chunk: Samples per forward, None (as many as fit `CHUNK_TOKENS` rows × positions for
            the model's device type, at least 1, at most ``S``) or an int ≥ 1.
        labels: None; ``"next"`` (a causal LM's next tokens: ``input_ids[:, t + 1]`` at
            position ``t``, none at the last position and at padding); or the label of each
            position, an integer tensor of shape ``[B, T]`` (language-model head, aligned with
            the logits: position ``t`` holds the token that follows it; a Hugging Face
            collator's ``labels``, equal to ``input_ids``, are not: pass ``"next"``; an
            encoder-decoder's ``[B, T']`` labels are: pass ``batch["labels"]``) or ``[B]``
            (classification head), entries in ``[0, V)`` or ``-100`` (no label).
        linearized: None (default): the linearised model ``f* + J(θ_s − θ*)`` (forward-mode
            Jacobian-vector products, attention through the math SDPA kernel), the predictive
            measured best (next-token NLL at the marginal likelihood's ``τ`` 7-12% above MAP's
            on fine-tuned causal LMs, weight samples 72-81%: ``benchmarks/lm_finetune_fit.py``)
            and the one the held-out fit scores; where the model has an operation without a
            forward-mode derivative (BLOOM's GELU), the weight samples' with a warning. True:
            linearised or a one-line error. False: the model at ``θ_s`` (half the cost).
        return_logits: Keep every sample's logits (``sample_logits``, ``S`` times the
            logits' memory).
        draws: Samples drawn once by `posterior_draws`, to evaluate the same ``S`` samples on
            many batches without drawing them again (the draws cost ``2·d_out·d_A·(d_out +
            d_A)`` flops per sample and layer, as much as a forward of ``d_out + d_A`` tokens
            through the layer, twice); None: drawn here, for this batch.
        show_progress: A progress bar over the samples: None (when stderr is a terminal,
            `kfac_stream.utils.progress`), True or False.

    Returns:
        A `SampledPredictive` (shapes in its docstring).

    Raises:
        QueryInputError: an argument of the wrong type, shape or range, or a model whose
            output holds no logits.
    """
    where = "sampled_predictive"
    run = _check_arguments(where, post, batch, n_samples=n_samples, seed=seed, chunk=chunk,
                           linearized=linearized, draws=draws, show_progress=show_progress)
    inputs.check_flag(where, "return_logits", return_logits)
    label_ids = _check_labels(where, labels, run.batch, run.size, run.length)

    acc = PredictiveAccumulator(run.n_samples, return_logits)
    ran_linearized = False
    for first, logits, linear in _sample_logits(run):
        if first == 0 and label_ids is not None:
            label_ids = _labels_for(where, labels, label_ids, logits)
        acc.add(logits, label_ids)
        ran_linearized = linear
    return acc.result(run.seed, ran_linearized)


def iter_sample_logits(post: LaplacePosterior, batch: Mapping[str, Tensor],
                       n_samples: int | None = None, seed: int | None = None,
                       chunk: int | None = None, *, linearized: bool = False,
                       draws: PosteriorDraws | None = None,
                       show_progress: bool | None = None) -> Iterator[tuple[int, Tensor]]:
    """The logits of ``S`` posterior samples, one chunk of samples at a time.

    The samples, the batched forwards and the arguments are those of `sampled_predictive`
    (sample ``s`` is ``post.sampled_weights(seed + s)``'s draw); use this to compute a
    statistic of your own without keeping ``S`` copies of the logits.

    Yields:
        ``(first, logits [S_c, *P, V])``: the logits of samples ``first … first + S_c − 1``
        in the model's dtype, ``*P`` the logits' shape without the class axis (``[B, T]`` for
        a language-model head, ``[B]`` for a classification head).

    Raises:
        QueryInputError: as `sampled_predictive` (checked before the first forward).
    """
    where = "iter_sample_logits"
    run = _check_arguments(where, post, batch, n_samples=n_samples, seed=seed, chunk=chunk,
                           linearized=linearized, draws=draws, show_progress=show_progress)
    return ((first, logits) for first, logits, _ in _sample_logits(run))


@dataclass(frozen=True)
class _SampleRun:
    """The checked arguments every sampled query shares (`_check_arguments`)."""

    where: str
    post: LaplacePosterior
    batch: Mapping[str, Tensor]  # the batch the model runs on (seq2seq: with decoder inputs)
    size: int  # B
    length: int  # T: the logits' positions (an encoder-decoder's: the decoder's T')
    n_samples: int  # S
    seed: int
    chunk: int  # samples per forward
    linearized: bool | None  # None: linearised where the model has forward-mode derivatives
    draws: PosteriorDraws | None
    show_progress: bool | None


def _check_arguments(where: str, post: object, batch: object, *, n_samples: object,
                     seed: object, chunk: object, linearized: object, draws: object,
                     show_progress: object) -> _SampleRun:
    """The arguments every sampled query shares, checked: the batch the model runs on (an
    encoder-decoder's with the ``decoder_input_ids`` made from its labels,
    `inputs.query_batch`) and ``T`` its logits' positions (the decoder's ``T'`` for an
    encoder-decoder)."""
    if not isinstance(post, LaplacePosterior):
        raise inputs.error(where, "post", post, "a kfac_stream.LaplacePosterior", typed=True)
    size, length = inputs.check_model_batch(where, "batch", batch, post.model)
    batch = inputs.query_batch(where, "batch", batch, post.model)
    out_length, _ = inputs.output_positions(batch, length)  # an encoder-decoder's: decoder's
    n_samples, seed = _check_samples(where, post, n_samples, seed, draws, 2)
    chunk = _check_chunk(where, chunk, n_samples, post, size, max(length, out_length))
    length = out_length
    if linearized is not None:  # None: linearised where the model allows (`_sample_logits`)
        inputs.check_flag(where, "linearized", linearized)
    if show_progress is not None:
        inputs.check_flag(where, "show_progress", show_progress)
    return _SampleRun(where=where, post=post, batch=batch, size=size, length=length,
                      n_samples=n_samples, seed=seed, chunk=chunk, linearized=linearized,
                      draws=draws, show_progress=show_progress)


def _check_chunk(where: str, chunk: object, n_samples: int, post: LaplacePosterior,
                 size: int, length: int) -> int:
    if chunk is None:
        tokens = CHUNK_TOKENS.get(post.device.type, CHUNK_TOKENS["default"])
        return max(1, min(n_samples, tokens // max(size * length, 1)))
    return min(inputs.check_int(where, "chunk", chunk, 1), n_samples)


def _sample_logits(run: _SampleRun) -> Iterator[tuple[int, Tensor, bool]]:
    """`iter_sample_logits` of checked arguments: ``(first, logits, linearised)`` per chunk
    (``run.linearized`` None: linearised unless the model has no forward-mode derivatives,
    then the weight samples from the first chunk on, with a warning)."""
    post, size, n_samples = run.post, run.size, run.n_samples
    model_inputs = inputs.forward_inputs(run.batch, post.model)  # no key/value cache of S·B rows
    layers = SampledLayers(post)
    linear = run.linearized is not False
    bar = progress(total=n_samples, desc=f"sampled predictive ({n_samples} samples of "
                   f"{size}x{run.length}{', linearised' if linear else ''})",
                   unit="sample", show=run.show_progress)
    try:
        for first in range(0, n_samples, run.chunk):
            count = min(run.chunk, n_samples - first)
            samples = (layers.draws(range(run.seed + first, run.seed + first + count))
                       if run.draws is None else _drawn(run.draws, first, count))
            rows = _repeat(model_inputs, size, count)
            logits = None
            if linear:
                try:
                    logits = _linearized_logits(run.where, layers, rows, samples, count)
                except QueryInputError:
                    if run.linearized:  # asked for by name: the error stands
                        raise
                    warnings.warn(f"{run.where}: the model's forward has an operation without "
                                  "a forward-mode derivative, so the predictive is the "
                                  "posterior weight samples' (linearized=False), not the "
                                  "linearised one", UserWarning, stacklevel=4)
                    linear = False
            if not linear:
                logits = layers.sampled_forward(rows, samples, count)
            yield first, _check_logits(run.where, logits, size, count), linear
            bar.update(count)
    finally:
        bar.close()


def _linearized_logits(where: str, layers: SampledLayers, rows: dict[str, Tensor],
                       samples: Samples, count: int) -> Tensor | None:
    """`SampledLayers.linearized_forward`, with a model operation that has no forward-mode
    derivative (a custom ``autograd.Function`` without ``jvp``, e.g. BLOOM's GELU in either
    mode) turned into a one-line error that says what to do."""
    try:
        return layers.linearized_forward(rows, samples, count)
    except NotImplementedError as e:
        raise QueryInputError(
            f"{where}: the linearised predictive (linearized=True) needs forward-mode "
            "derivatives of the model's forward, and one of its operations has none "
            f"({str(e).splitlines()[0]}); pass linearized=False for the predictive of "
            "posterior weight samples (the default, None, falls back to it with a "
            "warning)") from e


@contextlib.contextmanager
def sample_rows(post: LaplacePosterior, n_samples: int | None = None, seed: int | None = None,
                *, draws: PosteriorDraws | None = None) -> Iterator[None]:
    """Context manager: the model evaluates ``S`` posterior samples at once, one per group of
    rows.

    Inside, every tracked layer of ``post.model`` splits its input's rows into ``S`` equal
    groups (sample-major) and computes group ``s`` with the weights of sample ``s``
    (``post.sampled_weights(seed + s)``'s draw); nothing else changes and the model's weights
    are never written. Call the model with the batch repeated ``S`` times along the batch axis
    (``x.repeat(S, ...)``): each group of ``B`` rows then sees its own posterior sample. Any
    number of calls fit inside, with any sequence length (e.g. ``model.generate`` with its
    key/value cache: decode ``S`` posterior samples in one generation). Gradients are off
    inside. Memory: ``S`` copies of the tracked weights (the draws), in their dtype.

    Args:
        post: The posterior (a `LaplacePosterior`).
        n_samples: ``S``, an int ≥ 1 (default: `DEFAULT_SAMPLES`, or the count of ``draws``).
        seed: Seed of sample 0 (sample ``s`` uses ``seed + s``), an int (default 0, or the
            seed of ``draws``).
        draws: Samples drawn once by `posterior_draws` (then ``n_samples`` and ``seed`` are
            theirs), or None: drawn here.

    Raises:
        QueryInputError: an argument of the wrong type or range.
    """
    where = "sample_rows"
    if not isinstance(post, LaplacePosterior):
        raise inputs.error(where, "post", post, "a kfac_stream.LaplacePosterior", typed=True)
    n_samples, seed = _check_samples(where, post, n_samples, seed, draws, 1)
    layers = SampledLayers(post)
    samples = (layers.draws(range(seed, seed + n_samples)) if draws is None
               else _drawn(draws, 0, n_samples))
    forwards = layers.sampled_forwards(samples, n_samples)
    with torch.no_grad(), forwards_replaced(post.modules, forwards):
        yield


def _drawn(draws: PosteriorDraws, first: int, count: int) -> Samples:
    """Samples ``first … first + count − 1`` of ``draws`` (views)."""
    stop = first + count
    return {n: (w[first:stop], None if n not in draws.biases else draws.biases[n][first:stop])
            for n, w in draws.weights.items()}


# -- arguments ----------------------------------------------------------------------------------


def _check_labels(where: str, labels: object, batch: Mapping[str, Tensor], size: int,
                  length: int) -> Tensor | None:
    """Labels as an int64 tensor (``-100``: none) before any model call: ``"next"`` from
    ``input_ids`` and ``attention_mask`` (``[B, T]``), a given tensor checked for type and
    batch size (its shape against the logits', and its range, after the first forward)."""
    if labels is None:
        return None
    if isinstance(labels, str):
        if labels != "next":
            raise inputs.error(where, "labels", labels, LABELS_ALLOWED)
        ids = batch.get("input_ids")
        if ids is None:
            raise inputs.error(where, "labels", labels, LABELS_ALLOWED,
                               problem="needs the batch's input_ids (it has inputs_embeds)")
        nxt = torch.full_like(ids, IGNORE_INDEX, dtype=torch.long)
        nxt[:, :-1] = ids[:, 1:]
        mask = batch.get("attention_mask")
        if mask is not None:
            keep = mask.bool().clone()  # never write into the caller's mask
            keep[:, :-1] &= mask[:, 1:].bool()
            nxt = nxt.masked_fill(~keep, IGNORE_INDEX)
        return nxt
    labels = inputs.from_numpy(labels)
    if not inputs.is_int_tensor(labels) or labels.dim() not in (1, 2):
        raise inputs.error(where, "labels", labels, LABELS_ALLOWED,
                           typed=not isinstance(labels, Tensor))
    if labels.shape[0] != size or (labels.dim() == 2 and labels.shape[1] != length):
        raise inputs.error(where, "labels", labels, LABELS_ALLOWED,
                           problem=f"does not fit the batch [B, T] = {[size, length]}")
    return labels.long()


def _labels_for(where: str, given: object, labels: Tensor, logits: Tensor) -> Tensor:
    """``labels`` on the logits' device, checked against the logits ``[S_c, *P, V]``."""
    shape, vocab = tuple(logits.shape[1:-1]), logits.shape[-1]
    if tuple(labels.shape) != shape:
        head = "a classification head" if len(shape) == 1 else "a language-model head"
        raise inputs.error(where, "labels", given, LABELS_ALLOWED,
                           problem=f"is {list(labels.shape)}, but the logits of {head} are "
                                   f"{list(logits.shape[1:])}")
    if labels.device.type == "cpu" and labels.numel():
        bad = labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))]
        if bad.numel():
            raise inputs.error(where, "labels", given, LABELS_ALLOWED,
                               problem=f"holds {int(bad[0])}, outside the logits' {vocab} "
                                       f"classes")
    return labels.to(logits.device)


def _check_logits(where: str, logits: Tensor | None, size: int, count: int) -> Tensor:
    """``[S_c, *P, V]`` from the model's ``[S_c·B, *P, V]`` logits."""
    if logits is None or logits.dim() not in (2, 3) or logits.shape[0] != count * size:
        raise QueryInputError(f"{where}: the model's output holds no logits [B, C] or "
                              f"[B, T, V] (got {inputs.show(logits)} for {count}x{size} rows): "
                              "the model must return logits (a tensor, or an output with "
                              ".logits) with the batch's rows first")
    return logits.reshape(count, size, *logits.shape[1:])


def _repeat(model_inputs: Mapping[str, object], size: int, count: int) -> dict[str, object]:
    """The inputs repeated ``count`` times along the batch axis (sample-major); values
    without the batch axis first are passed as they are."""
    out: dict[str, object] = {}
    for k, v in model_inputs.items():
        if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == size:
            out[k] = v.repeat(count, *([1] * (v.dim() - 1)))
        else:
            out[k] = v
    return out
