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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn

from ..capture.hooks import logits_of
from ..capture.selection import layer_spec
from ..exceptions import QueryInputError
from ..progress import progress
from . import inputs
from . import kron_eigen as ke
from .laplace import LaplacePosterior

#: Rows x positions (``chunk·B·T``) of one batched forward when ``chunk`` is None, per device
#: type: a GPU wants wide kernels; a CPU's elementwise layers (GELU, softmax) run from its caches
#: only on small tensors (measured on the 2-core CPU, GPT-2 4x256, a 8x256 batch, S = 16: one
#: sample per forward 2.2 s, eight 3.9 s; a plain forward of eight times the rows took 11x one).
CHUNK_TOKENS = {"cpu": 2048, "default": 65536}

#: Posterior samples when neither ``n_samples`` nor ``draws`` is given.
DEFAULT_SAMPLES = 16

#: Label value of a position without a label (as in Hugging Face's losses).
IGNORE_INDEX = -100

LABELS_ALLOWED = ("None, 'next' (causal LM: the next token of input_ids at every position) or "
                  "an integer tensor of the logits' shape without the last axis ([B, T] for a "
                  "language-model head, [B] for a classification head), entries in [0, V) or "
                  f"{IGNORE_INDEX} (no label)")


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
    samples = _Layers(post).draws(range(seed, seed + n_samples))
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
                       linearized: bool = False, return_logits: bool = False,
                       draws: PosteriorDraws | None = None,
                       show_progress: bool | None = None) -> SampledPredictive:
    """The whole-vocabulary predictive of ``S`` posterior samples, in batched forwards.

    Sample ``s`` is exactly the draw of ``post.sampled_weights(seed=seed + s)`` (the same
    random numbers, layer by layer), so a loop over that context manager gives the same
    logits up to round-off — at ``S`` copies of nothing: here the model and its weights stay
    as they are, and each forward evaluates ``chunk`` samples at once (the batch repeated
    ``chunk`` times). Cost: about ``S`` forwards of the batch (with ``linearized`` about
    twice that: every activation carries a tangent), plus the draws — per sample and layer
    the rotation ``Q_G Z Q_Aᵀ``, ``2·d_out·d_A·(d_out + d_A)`` flops on the model's device
    (as in ``sampled_weights``), which dominates when ``B·T`` is small against the layers'
    widths. Memory: ``chunk`` copies of the batch's activations (and logits) and of the
    tracked weights. The statistics are accumulated in float64 over the chunks.

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
        linearized: Evaluate the linearised model ``f* + J(θ_s − θ*)`` (forward-mode
            Jacobian-vector products; attention through PyTorch's math SDPA kernel, the one
            with forward-mode derivatives) instead of the model at ``θ_s``.
        return_logits: Keep every sample's logits (``sample_logits``, ``S`` times the
            logits' memory).
        draws: Samples drawn once by `posterior_draws`, to evaluate the same ``S`` samples on
            many batches without drawing them again (the draws cost ``2·d_out·d_A·(d_out +
            d_A)`` flops per sample and layer, as much as a forward of ``d_out + d_A`` tokens
            through the layer, twice); None: drawn here, for this batch.
        show_progress: A progress bar over the samples: None (when stderr is a terminal,
            `kfac_stream.progress`), True or False.

    Returns:
        A `SampledPredictive` (shapes in its docstring).

    Raises:
        QueryInputError: an argument of the wrong type, shape or range, or a model whose
            output holds no logits.
    """
    where = "sampled_predictive"
    batch, size, length, n_samples, seed, chunk = _check_arguments(
        where, post, batch, n_samples, seed, chunk, linearized, draws, show_progress)
    inputs.check_flag(where, "return_logits", return_logits)
    label_ids = _check_labels(where, labels, batch, size, length)

    acc = _Accumulator(n_samples, return_logits)
    for first, logits in _sample_logits(where, post, batch, size, length, n_samples, seed, chunk,
                                        linearized, draws, show_progress):
        if first == 0 and label_ids is not None:
            label_ids = _labels_for(where, labels, label_ids, logits)
        acc.add(logits, label_ids)
    return acc.result(seed, linearized)


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
    batch, size, length, n_samples, seed, chunk = _check_arguments(
        where, post, batch, n_samples, seed, chunk, linearized, draws, show_progress)
    return _sample_logits(where, post, batch, size, length, n_samples, seed, chunk, linearized,
                          draws, show_progress)


def _check_arguments(where: str, post: object, batch: object, n_samples: object, seed: object,
                     chunk: object, linearized: object, draws: object,
                     show_progress: object
                     ) -> tuple[Mapping[str, Tensor], int, int, int, int, int]:
    """``(batch, B, T, S, seed, chunk)`` from the arguments every sampled query shares,
    checked: the batch the model runs on (an encoder-decoder's with the ``decoder_input_ids``
    made from its labels, `inputs.query_batch`) and ``T`` its logits' positions (the
    decoder's ``T'`` for an encoder-decoder)."""
    if not isinstance(post, LaplacePosterior):
        raise inputs.error(where, "post", post, "a kfac_stream.LaplacePosterior", typed=True)
    size, length = inputs.check_batch(where, "batch", batch, inputs.input_vocab(post.model))
    batch = inputs.query_batch(where, "batch", batch, post.model)
    out_length, _ = inputs.output_positions(batch, length)  # an encoder-decoder's: decoder's
    n_samples, seed = _check_samples(where, post, n_samples, seed, draws, 2)
    chunk = _check_chunk(where, chunk, n_samples, post, size, max(length, out_length))
    length = out_length
    inputs.check_flag(where, "linearized", linearized)
    if show_progress is not None:
        inputs.check_flag(where, "show_progress", show_progress)
    return batch, size, length, n_samples, seed, chunk


def _check_chunk(where: str, chunk: object, n_samples: int, post: LaplacePosterior,
                 size: int, length: int) -> int:
    if chunk is None:
        tokens = CHUNK_TOKENS.get(post.device.type, CHUNK_TOKENS["default"])
        return max(1, min(n_samples, tokens // max(size * length, 1)))
    return min(inputs.check_int(where, "chunk", chunk, 1), n_samples)


def _sample_logits(where: str, post: LaplacePosterior, batch: Mapping[str, Tensor], size: int,
                   length: int, n_samples: int, seed: int, chunk: int, linearized: bool,
                   draws: PosteriorDraws | None,
                   show_progress: bool | None) -> Iterator[tuple[int, Tensor]]:
    """`iter_sample_logits` of checked arguments."""
    model_inputs = inputs.forward_inputs(batch, post.model)  # no key/value cache of S·B rows
    layers = _Layers(post)
    bar = progress(total=n_samples, desc=f"sampled predictive ({n_samples} samples of "
                   f"{size}x{length}{', linearised' if linearized else ''})", unit="sample",
                   show=show_progress)
    try:
        for first in range(0, n_samples, chunk):
            count = min(chunk, n_samples - first)
            samples = (layers.draws(range(seed + first, seed + first + count))
                       if draws is None else _drawn(draws, first, count))
            rows = _repeat(model_inputs, size, count)
            if linearized:
                logits = layers.linearized_forward(rows, samples, count)
            else:
                logits = layers.sampled_forward(rows, samples, count)
            yield first, _check_logits(where, logits, size, count)
            bar.update(count)
    finally:
        bar.close()


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
    layers = _Layers(post)
    samples = (layers.draws(range(seed, seed + n_samples)) if draws is None
               else _drawn(draws, 0, n_samples))
    forwards = layers.sampled_forwards(samples, n_samples)
    with torch.no_grad(), _forwards_replaced(post.modules, forwards):
        yield


# -- the tracked layers under samples -----------------------------------------------------------

#: ``{layer: (W_s [S_c, d_out, d_in], b_s [S_c, d_out] or None)}``: sampled weights of a chunk.
Samples = dict[str, tuple[Tensor, "Tensor | None"]]


def _drawn(draws: PosteriorDraws, first: int, count: int) -> Samples:
    """Samples ``first … first + count − 1`` of ``draws`` (views)."""
    stop = first + count
    return {n: (w[first:stop], None if n not in draws.biases else draws.biases[n][first:stop])
            for n, w in draws.weights.items()}


class _Layers:
    """The tracked layers of a posterior: posterior draws, and forwards of the model with
    per-sample weights (exact) or per-sample tangents (linearised)."""

    def __init__(self, post: LaplacePosterior) -> None:
        self.post = post
        self.specs = {n: layer_spec(n, m) for n, m in post.modules.items()}
        self._bases: dict[str, Tensor] = {}

    def base_weight(self, name: str) -> Tensor:
        """The layer's ``W`` as a contiguous ``[d_out, d_in]`` (a Conv1D's transposed copy, made
        once per query: adding a transposed view to every sample's ``ΔW`` read it strided, 5–9×
        slower than the contiguous add on a CPU)."""
        if name not in self._bases:
            m = self.post.modules[name]
            w = m.weight.detach()
            self._bases[name] = (w.T if self.specs[name].kind == "conv1d" else w).contiguous()
        return self._bases[name]

    def draws(self, seeds: range) -> Samples:
        """The sampled weights ``W̄* + ΔW̄`` of every layer in its weight dtype on its device
        (`Samples`): sample ``i`` is ``sampled_weights(seeds[i])``'s draw (the same generator,
        consumed layer by layer in the same order; the rotation ``Q_G Z Q_Aᵀ`` on the device in
        the posterior's ``feature_dtype`` — float64 for float64 models, else float32, whose
        rounding is far below a draw's own spread — with the eigenbases the posterior converted
        once, `LaplacePosterior.eigenbases`), added to the weights as ``sampled_weights`` adds
        them (``W + ΔW`` in the weight's dtype: the very weights it writes)."""
        post = self.post
        # Z ⊘ sqrt(D) by `kron_eigen.eigenbasis_draw`, one generator per seed consumed layer by
        # layer as in sampled_weights (so the draws are bit-equal to its). sqrt(D), the same for
        # every sample, is computed once per layer (per sample it cost more than the rotations).
        root_d, zs = {}, {}
        for name in post.modules:
            _, aval, _, gval = post.eig[name]
            root_d[name] = ke.precision_eigenvalues(gval, aval, post.layer_num_data[name],
                                                    post.tau(name)).sqrt()
            zs[name] = root_d[name].new_empty((len(seeds), *root_d[name].shape))
        for i, s in enumerate(seeds):
            gen = torch.Generator().manual_seed(s)
            for name in post.modules:
                ke.eigenbasis_draw(root_d[name], gen, out=zs[name][i])
        out: Samples = {}
        for name, m in post.modules.items():
            qa, qg = post.eigenbases(name)  # feature dtype, converted once per posterior
            dev = m.weight.device
            z = zs.pop(name).to(dev, post.feature_dtype)
            if qg is not None:
                z = qg.to(dev) @ z
            if qa is not None:
                z = z @ qa.to(dev).T
            dw = z.to(m.weight.dtype)  # ΔW̄ [S_c, d_out, d_A]
            d_in = self.specs[name].d_in
            # one pass writing the contiguous [S_c, d_out, d_in] that bmm reads as its
            # transposed operand (a view of [S_c, d_out, d_A] would read with an odd stride)
            weight = torch.add(dw[:, :, :d_in], self.base_weight(name)[None])
            bias = (m.bias.detach()[None] + dw[:, :, d_in]) if self.specs[name].has_bias \
                else None
            out[name] = (weight, bias)
        return out

    def sampled_forward(self, rows: dict[str, Tensor], samples: Samples,
                        count: int) -> Tensor | None:
        """Logits of the model at ``W̄_s``, rows of sample ``s`` at ``[s·B, (s+1)·B)``."""
        with torch.no_grad(), _forwards_replaced(self.post.modules,
                                                 self.sampled_forwards(samples, count)):
            return logits_of(self.post.model(**rows))

    def sampled_forwards(self, samples: Samples, count: int) -> dict[str, object]:
        """``{layer: forward}`` computing sample ``s``'s rows with ``W̄_s`` (the weights handed
        to bmm as their transposed view ``[S_c, d_in, d_out]``, for ``x_s @ W_sᵀ``: BLAS reads
        a transposed operand in place)."""
        return {name: _sampled_linear(w.transpose(1, 2), b, count)
                for name, (w, b) in samples.items()}

    def linearized_forward(self, rows: dict[str, Tensor], samples: Samples,
                           count: int) -> Tensor | None:
        """Logits of the linearised model ``f* + J (W̄_s − W̄*)`` (forward mode), rows as
        above."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        handles = []
        try:
            for name, m in self.post.modules.items():
                w, b = samples[name]
                dw = w - self.base_weight(name)  # see PosteriorDraws: θ_s − θ* as written
                db = None if b is None else b - m.bias.detach()
                handles.append(m.register_forward_hook(_tangent_hook(
                    dw.transpose(1, 2), db, count, self.specs[name].d_in)))
            with torch.no_grad(), fwAD.dual_level(), sdpa_kernel(SDPBackend.MATH):
                logits = logits_of(self.post.model(**rows))
                if logits is None:
                    return None
                primal, tangent = fwAD.unpack_dual(logits)
                return primal if tangent is None else primal + tangent
        finally:
            for h in handles:
                h.remove()


def _sampled_linear(weight: Tensor, bias: Tensor | None, count: int):
    """A tracked layer's forward with ``count`` weights ``weight [S_c, d_in, d_out]`` (and
    ``bias [S_c, d_out]``): ``x [count·B, ..., d_in]`` → ``x_s W_sᵀ + b_s`` per sample group."""
    d_in = weight.shape[1]

    def forward(x: Tensor) -> Tensor:
        xs = x.reshape(count, -1, d_in)
        out = (torch.bmm(xs, weight) if bias is None
               else torch.baddbmm(bias[:, None, :], xs, weight))
        return out.reshape(*x.shape[:-1], weight.shape[-1])

    return forward


def _tangent_hook(w_delta_t: Tensor, b_delta: Tensor | None, count: int, d_in: int):
    """A forward hook adding ``x_s ΔW_sᵀ + Δb_s`` to the tangent of a tracked layer's output
    (the product rule's weight term; the module's own forward carries the input's tangent)."""

    def fn(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        x = fwAD.unpack_dual(args[0]).primal
        xs = x.reshape(count, -1, d_in)
        t = torch.bmm(xs, w_delta_t) if b_delta is None else torch.baddbmm(
            b_delta[:, None, :], xs, w_delta_t)
        primal, tangent = fwAD.unpack_dual(out)
        t = t.reshape(primal.shape)
        return fwAD.make_dual(primal, t if tangent is None else tangent + t)

    return fn


class _forwards_replaced:
    """Context manager: ``module.forward = forwards[name]`` (an instance attribute; hooks still
    run), the previous attribute restored on exit, also when the body raises."""

    def __init__(self, modules: Mapping[str, nn.Module], forwards: Mapping[str, object]) -> None:
        self.modules, self.forwards = modules, forwards
        self.saved: list[tuple[nn.Module, object]] = []

    def __enter__(self) -> None:
        for name, fwd in self.forwards.items():
            m = self.modules[name]
            self.saved.append((m, m.__dict__.get("forward")))
            m.forward = fwd  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        for m, prev in reversed(self.saved):
            if prev is None:
                del m.forward
            else:
                m.forward = prev  # type: ignore[method-assign]
        self.saved.clear()


# -- statistics ---------------------------------------------------------------------------------


class _Accumulator:
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
    place), in row slices of `_Accumulator.CACHE_ELEMENTS` on a CPU (one pass each over a
    slice in cache; ``0 · log 0 = 0``); ``[R]`` in ``sums``' dtype."""
    rows = (max(1, _Accumulator.CACHE_ELEMENTS // sums.shape[-1])
            if sums.device.type == "cpu" else sums.shape[0])
    h = sums.new_empty(sums.shape[0])
    for i in range(0, sums.shape[0], rows):
        p = sums[i:i + rows].mul_(scale)
        torch.sum(torch.special.xlogy(p, p), -1, out=h[i:i + rows])
    return h.neg_()


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

