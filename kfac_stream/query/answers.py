r"""Answers under the posterior: which answer ``S`` posterior samples of the model give.

For a prompt and ``K`` answer options (e.g. the tokens " A" … " D" of a multiple-choice
question, or the classes of a classification head), `answer_distribution` evaluates ``S``
posterior weight samples ``θ_s`` (the draws of ``LaplacePosterior.sampled_weights(seed + s)``,
in batched forwards: `kfac_stream.iter_sample_logits`) and lets each one answer: sample ``s``
answers ``argmax_k f_s[k]`` over the ``K`` option logits at the answer position. The
distribution of these answers over the samples (the "Bayesian introspection" of the seeds: the
answers of a model whose weights are drawn from the Laplace posterior, aggregated by majority
vote), its majority answer and the agreement rate (the majority's share of the samples) say
how much the answer depends on the weights the data left uncertain: agreement 1 means every
plausible model answers alike, an agreement near ``1/K`` that the data decide nothing.

`generated_answers` does the same for free generation: each posterior sample decodes a
continuation greedily (a fixed decoding, so that the posterior sample is the only source of
randomness), all ``S`` samples in one ``model.generate`` call (`kfac_stream.sample_rows`), and
the distinct continuations are counted.

Selective answering. The agreement is a confidence: answer where the samples agree, abstain
where they do not. With `kfac_stream.query.metrics` (where higher uncertainty = less certain), use
``1 − agreement`` as the uncertainty::

    from . import metrics
    d = answer_distribution(post, batch, options)
    correct = d.majority == labels                      # [B] bool, labels: index into options
    coverage, risk = metrics.risk_coverage(correct, 1 - d.agreement)
    metrics.accuracy_at_coverage(correct, 1 - d.agreement, coverage=0.8)
    metrics.aurc(correct, 1 - d.agreement)
    answered = ~abstain(d.agreement, 0.75)              # answer only where >= 75% agree

Agreement takes only the values ``c/S``, so many examples tie; the metrics average over ties
(`kfac_stream.query.metrics`' module docstring), and a larger ``S`` resolves more of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..capture.hooks import logits_of
from ..exceptions import QueryInputError
from . import inputs
from .laplace import LaplacePosterior
from .sampled import iter_sample_logits, sample_rows

#: Keyword arguments of ``model.generate`` that would change the fixed greedy decoding, and the
#: only value each may have.
GREEDY = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1}


@dataclass(frozen=True)
class AnswerDistribution:
    """The answers of ``S`` posterior samples to ``B`` prompts with ``K`` options each.

    An answer is an index into the example's options (``0 … K − 1``). Every tensor lies on the
    device of the model's logits.

    Attributes:
        options: ``[B, K]`` int64: the option ids of each example (vocabulary ids for a
            language-model head, class indices for a classification head).
        sample_answers: ``[S, B]`` int64: the answer of sample ``s`` (``argmax_k`` of its
            option logits; of equal logits the lowest index).
        counts: ``[B, K]`` int64: how many samples gave each answer (rows sum to ``S``).
        frequencies: ``[B, K]`` float64: ``counts / S``.
        probs: ``[B, K]`` float64: ``(1/S) Σ_s softmax(f_s)`` with the softmax renormalised over
            the ``K`` option logits (the predictive restricted to the options).
        map_answer: ``[B]`` int64: the answer of the trained weights ``θ*`` (one plain forward).
        majority: ``[B]`` int64: the most frequent answer; of answers tied at the top count, the
            MAP answer if it is one of them, else the lowest index.
        agreement: ``[B]`` float64: ``counts[majority] / S``, in ``[1/K, 1]`` (the majority's
            share; ``1 − agreement`` is an uncertainty for `kfac_stream.query.metrics`).
        map_agrees: ``[B]`` bool: ``majority == map_answer``.
        n_samples: ``S``.
        seed: The seed of sample 0 (sample ``s`` is ``post.sampled_weights(seed + s)``'s draw).
        linearized: Whether the samples' logits are those of the linearised model.
    """

    options: Tensor
    sample_answers: Tensor
    counts: Tensor
    frequencies: Tensor
    probs: Tensor
    map_answer: Tensor
    majority: Tensor
    agreement: Tensor
    map_agrees: Tensor
    n_samples: int
    seed: int
    linearized: bool


@dataclass(frozen=True)
class GeneratedAnswers:
    """The greedy continuations of ``S`` posterior samples for ``B`` prompts.

    An answer is a continuation: a tuple of generated token ids, cut before the first
    end-of-sequence token (when the generation config has one; the end token itself and the
    padding after it are not part of the answer). Per-example fields are tuples indexed by the
    example ``b``.

    Attributes:
        samples: ``[B][S]``: the continuation of sample ``s`` for example ``b``.
        answers: ``[B]``: the distinct continuations of example ``b`` with their counts,
            ``((answer, count), …)``, most frequent first; of equal counts the MAP answer
            first, then in the order of the sample that first gave it.
        sample_answers: ``[S, B]`` int64 tensor (CPU): index of sample ``s``'s answer in
            ``answers[b]``.
        majority: ``[B]``: the most frequent answer, ``answers[b][0][0]`` (ties as above:
            toward the MAP answer, then the earliest sample).
        agreement: ``[B]`` float64 tensor (CPU): the majority's count over ``S``.
        map_answer: ``[B]``: the continuation of the trained weights ``θ*``.
        map_agrees: ``[B]`` bool tensor (CPU): ``majority[b] == map_answer[b]``.
        n_samples: ``S``.
        seed: The seed of sample 0 (sample ``s`` is ``post.sampled_weights(seed + s)``'s draw).
        max_new_tokens: The most tokens generated per continuation.
    """

    samples: tuple[tuple[tuple[int, ...], ...], ...]
    answers: tuple[tuple[tuple[tuple[int, ...], int], ...], ...]
    sample_answers: Tensor
    majority: tuple[tuple[int, ...], ...]
    agreement: Tensor
    map_answer: tuple[tuple[int, ...], ...]
    map_agrees: Tensor
    n_samples: int
    seed: int
    max_new_tokens: int


def answer_distribution(post: LaplacePosterior, batch: Mapping[str, Tensor],
                        options: Sequence[int] | Sequence[Sequence[int]] | Tensor | None = None,
                        n_samples: int = 32, seed: int = 0, chunk: int | None = None,
                        positions: int | Sequence[int] | None = None, *,
                        linearized: bool = True,
                        show_progress: bool | None = None) -> AnswerDistribution:
    """The distribution of the answers of ``S`` posterior samples over ``K`` options.

    Sample ``s`` (the weights of ``post.sampled_weights(seed + s)``, evaluated in batched
    forwards as in `kfac_stream.sampled_predictive`) answers ``argmax_k f_s[b, k]``, ``f_s[b,
    k]`` the logit of option ``k`` of example ``b`` at the answer position; the trained weights
    answer likewise (``map_answer``, one plain forward). Cost: one forward of the batch plus
    that of `kfac_stream.iter_sample_logits` (about ``S`` forwards of the batch); memory: the
    logits of ``chunk`` samples at a time.

    Args:
        post: The posterior (a `LaplacePosterior`), with its prior precision and ``N``.
        batch: Model inputs, as in `kfac_stream.sampled_predictive` (``input_ids`` ``[B, T]``
            or ``inputs_embeds`` ``[B, T, d]``, optionally ``attention_mask`` ``[B, T]`` and
            ``labels [B, T]``: the answer is then read at each row's first labelled position,
            as in `LaplacePosterior.jacobian_features`).
        options: The ``K ≥ 2`` answer ids, distinct within an example, each in ``[0, V)``:
            one sequence of ``K`` ints for every example, or per example a row of ``K`` (a
            ``[B, K]`` integer tensor or ``B`` sequences of ``K`` ints), as ``token_ids`` of
            `LaplacePosterior.jacobian_features` (``B`` one-int lists are refused as
            ambiguous). None (default): all classes of a classification head; for a
            language-model head the snapshot's answer tokens (``HeldoutConfig.answer_tokens``),
            else required. (A ``[B, K]`` tensor on an accelerator is not checked for range or
            repeats: that would need a host sync.)
        n_samples: ``S``, an int ≥ 2.
        seed: Seed of sample 0 (sample ``s`` uses ``seed + s``), an int.
        chunk: Samples per forward, None (as `sampled_predictive` chooses: by
            `kfac_stream.query.sampled.CHUNK_TOKENS`) or an int ≥ 1.
        positions: Language-model head, a batch without labels: the position whose
            next-token logits answer, one int for all examples or ``B`` ints, each in ``[-T,
            T)``; negative counts back from the example's last non-padding token (None or
            ``-1``: the last one, with the padding on the right or on the left; it must land on
            a token of the example); a non-negative position is a column of the batch. None
            with labels (`kfac_stream.query.inputs.answer_positions`). Ignored for a
            classification head (logits ``[B, C]``).
        linearized: Which samples answer. True (default): the linearised model ``f* +
            J(θ_s − θ*)`` (as in `kfac_stream.sampled_predictive`), whose option logits are
            draws of the linearised predictive's Gaussian, the posterior every other query
            answers with. False: the network itself at the weight samples ``θ_s``. On the
            multiple-choice LoRA task of ``benchmarks/uncertainty_classification.py`` the
            weight samples' majority votes at chance (a LoRA update ``B·A`` is bilinear in
            its factors, and the posterior is wide): majority accuracy 25.7 / 25.0 / 24.7%
            against the linearised samples' 45.1 / 37.5 / 46.5% over three seeds (MAP's 51.7
            / 41.3 / 50.7%), so the default answers by the votes. The mean of the samples'
            probabilities (``probs``) is no calibrated predictive of either kind (NLL 1.39 -
            1.66 where a uniform guess has 1.386 and `LaplacePosterior.predictive_probs`
            1.17 - 1.28): use ``predictive_probs`` for probabilities.
        show_progress: A progress bar over the samples: None (when stderr is a terminal), True
            or False.

    Returns:
        An `AnswerDistribution` (shapes in its docstring).

    Raises:
        QueryInputError: an argument of the wrong type, shape or range (checked before the
            sampled forwards; ``options`` and ``positions`` against the logits of the plain
            forward), or a model whose output holds no logits.
    """
    where = "answer_distribution"
    q = _check_options_query(where, post, batch, options, positions, n_samples=n_samples,
                             seed=seed, chunk=chunk, linearized=linearized,
                             show_progress=show_progress)
    with torch.no_grad():
        map_logits = logits_of(post.model(**inputs.forward_inputs(q.batch, post.model)))
    select = _Selector(where, map_logits, q.batch, size=q.size, pos=q.pos,
                       positions_given=positions, ids=q.ids, options_given=q.options)
    map_answer = select(map_logits[None])[0].argmax(-1)  # [B]
    sample_answers, prob_sum = _sample_answers(select, iter_sample_logits(
        post, q.batch, q.n_samples, q.seed, q.chunk, linearized=linearized,
        show_progress=show_progress))
    return _distribution(select.options, sample_answers, prob_sum, map_answer,
                         n_samples=q.n_samples, seed=q.seed, linearized=linearized)


def generated_answers(post: LaplacePosterior, input_ids: Tensor, n_samples: int = 16,
                      seed: int = 0, max_new_tokens: int = 16,
                      attention_mask: Tensor | None = None,
                      **generate_kwargs: Any) -> GeneratedAnswers:
    """The greedy continuations of ``S`` posterior samples, counted: free-form answers.

    The decoding is fixed — greedy (``do_sample=False``, one beam), so that for a given weight
    sample the continuation is determined and the only randomness is the posterior sample.
    All ``S`` samples decode in one ``model.generate`` call of the prompts repeated ``S``
    times inside `kfac_stream.sample_rows` (rows ``[s·B, (s+1)·B)`` decode with sample ``s``,
    ``post.sampled_weights(seed + s)``'s draw; with the key/value cache), and the trained
    weights in one more call (``map_answer``). The model's weights are never changed. Cost:
    about ``S + 1`` generations of the batch; memory: ``S`` copies of the tracked weights and
    ``S·B`` rows of key/value cache. The model runs in the mode it is in (``model.eval()``
    turns dropout off).

    Args:
        post: The posterior (a `LaplacePosterior` of a model with ``generate``).
        input_ids: ``[B, T]`` prompt token ids (an integer tensor; on the CPU, ids within the
            model's input embeddings). Prompts of unequal length must be padded on the LEFT
            (``tokenizer.padding_side = "left"``), as ``generate`` continues every row after
            its last column.
        n_samples: ``S``, an int ≥ 2.
        seed: Seed of sample 0 (sample ``s`` uses ``seed + s``), an int.
        max_new_tokens: The most tokens generated per continuation, an int ≥ 1.
        attention_mask: ``[B, T]`` of 0 (padding) and 1 (token), each row zeros then ones (left
            padding) with at least one token; None: every token is attended (a mask of ones).
        **generate_kwargs: Further arguments of ``model.generate`` (e.g. ``pad_token_id``,
            ``eos_token_id``, ``stopping_criteria``). ``do_sample``, ``num_beams`` and
            ``num_return_sequences`` may only hold their greedy values (False, 1, 1). Without
            ``pad_token_id`` and a generation config without one, the end-of-sequence id pads
            (as ``generate`` does, without its warning).

    Returns:
        A `GeneratedAnswers` (fields in its docstring).

    Raises:
        QueryInputError: an argument of the wrong type, shape or range (a right-padded
            ``attention_mask`` included), checked before any generation.
    """
    where = "generated_answers"
    mask, n_samples, seed, max_new_tokens = _check_generation(
        where, post, input_ids, attention_mask, n_samples=n_samples, seed=seed,
        max_new_tokens=max_new_tokens, generate_kwargs=generate_kwargs)
    model, length = post.model, input_ids.shape[1]
    kwargs, eos_ids = _greedy_kwargs(model, generate_kwargs, max_new_tokens)
    with torch.no_grad():
        map_rows = _continuations(model.generate(input_ids, attention_mask=mask, **kwargs),
                                  length, eos_ids)
    with sample_rows(post, n_samples, seed):
        rows = _continuations(model.generate(input_ids.repeat(n_samples, 1),
                                             attention_mask=mask.repeat(n_samples, 1),
                                             **kwargs), length, eos_ids)
    return _counted_answers(rows, map_rows, n_samples=n_samples, seed=seed,
                            max_new_tokens=max_new_tokens)


def abstain(agreement: Tensor, threshold: float) -> Tensor:
    """``[B]`` bool: where to abstain, ``agreement < threshold`` (answer where at least the
    fraction ``threshold`` of the samples agree; ``threshold`` a float in ``[0, 1]``)."""
    where = "abstain"
    if not isinstance(agreement, Tensor) or not agreement.is_floating_point():
        raise inputs.error(where, "agreement", agreement, "a floating tensor (e.g. "
                           "AnswerDistribution.agreement)", typed=not isinstance(agreement,
                                                                                 Tensor))
    allowed = "a float in [0, 1] (the least share of samples that must agree)"
    threshold = inputs.check_finite(where, "threshold", threshold, allowed)
    if not 0 <= threshold <= 1:
        raise inputs.error(where, "threshold", threshold, allowed)
    return agreement < threshold


# -- answer_distribution ------------------------------------------------------------------------


@dataclass(frozen=True)
class _OptionsQuery:
    """The checked arguments of `answer_distribution`."""

    batch: Mapping[str, Tensor]  # the batch the model runs on (seq2seq: with decoder inputs)
    size: int  # B
    options: object  # as given, or the snapshot's answer tokens for None
    ids: Tensor | None  # [K] or [B, K] int64; None: all classes of a classification head
    pos: int | list[int]  # the answer positions
    n_samples: int
    seed: int
    chunk: int | None


def _check_options_query(where: str, post: object, batch: object, options: object,
                         positions: object, *, n_samples: object, seed: object,
                         chunk: object, linearized: object,
                         show_progress: object) -> _OptionsQuery:
    """`answer_distribution`'s arguments, checked before any model call."""
    if not isinstance(post, LaplacePosterior):
        raise inputs.error(where, "post", post, "a kfac_stream.LaplacePosterior", typed=True)
    size, length = inputs.check_model_batch(where, "batch", batch, post.model)
    batch = inputs.query_batch(where, "batch", batch, post.model)  # seq2seq: decoder inputs
    if options is None:
        options = post.answer_tokens  # the run's HeldoutConfig.answer_tokens, or None
    ids = inputs.check_token_ids(where, "options", options, size, options=True)
    length, _ = inputs.output_positions(batch, length)  # an encoder-decoder's: decoder's
    pos = inputs.answer_positions(where, "positions", positions, batch, size, length,
                                  shift=not inputs.seq2seq_lm(post.model))
    n_samples = inputs.check_int(where, "n_samples", n_samples, 2)
    seed = inputs.check_seed(where, "seed", seed)
    if chunk is not None:
        chunk = inputs.check_int(where, "chunk", chunk, 1)
    inputs.check_flag(where, "linearized", linearized)
    if show_progress is not None:
        inputs.check_flag(where, "show_progress", show_progress)
    return _OptionsQuery(batch=batch, size=size, options=options, ids=ids, pos=pos,
                         n_samples=n_samples, seed=seed, chunk=chunk)


def _sample_answers(select: _Selector, chunks: Iterable[tuple[int, Tensor]]
                    ) -> tuple[Tensor, Tensor | None]:
    """``(answers [S, B], Σ_s softmax(f_s) [B, K] float64)`` of the samples' logits, chunk by
    chunk (``(first, logits [S_c, *P, V])``, `iter_sample_logits`)."""
    answers, prob_sum = [], None
    for _, logits in chunks:
        f = select(logits)  # [S_c, B, K]
        answers.append(f.argmax(-1))
        p = torch.softmax(f.double(), dim=-1).sum(0)
        prob_sum = p if prob_sum is None else prob_sum + p
    return torch.cat(answers), prob_sum  # [S, B]


def _distribution(options: Tensor, sample_answers: Tensor, prob_sum: Tensor,
                  map_answer: Tensor, *, n_samples: int, seed: int,
                  linearized: bool) -> AnswerDistribution:
    """The `AnswerDistribution` of the samples' answers ``[S, B]`` (indices into ``options
    [B, K]``), their summed option probabilities ``[B, K]`` and the MAP answer ``[B]``."""
    k = options.shape[1]
    counts = F.one_hot(sample_answers, k).sum(0)  # [B, K] int64
    majority, top = _majority(counts, map_answer)
    return AnswerDistribution(
        options=options, sample_answers=sample_answers, counts=counts,
        frequencies=counts.double() / n_samples, probs=prob_sum / n_samples,
        map_answer=map_answer, majority=majority, agreement=top.double() / n_samples,
        map_agrees=majority == map_answer, n_samples=n_samples, seed=seed,
        linearized=linearized)


# -- generated_answers --------------------------------------------------------------------------


def _check_generation(where: str, post: object, input_ids: object, attention_mask: object, *,
                      n_samples: object, seed: object, max_new_tokens: object,
                      generate_kwargs: Mapping[str, Any]) -> tuple[Tensor, int, int, int]:
    """``(attention mask, S, seed, max_new_tokens)``: `generated_answers`' arguments, checked
    before any generation."""
    if not isinstance(post, LaplacePosterior):
        raise inputs.error(where, "post", post, "a kfac_stream.LaplacePosterior", typed=True)
    model = post.model
    if not callable(getattr(model, "generate", None)):
        raise inputs.error(where, "post", post, "the posterior of a model with generate() "
                           "(a transformers generation model)", problem="has a model without "
                           f"generate() ({type(model).__name__})")
    if not inputs.is_int_tensor(input_ids) or input_ids.dim() != 2 or input_ids.numel() == 0:
        raise inputs.error(where, "input_ids", input_ids,
                           "a [B, T] integer tensor of token ids with B, T >= 1 (one prompt: "
                           "ids[None])", typed=not isinstance(input_ids, Tensor))
    vocab = inputs.input_vocab(model)
    if vocab is not None:
        inputs.check_id_range(where, "input_ids", input_ids, input_ids, vocab,
                              f"the model's {vocab} input embeddings")
    mask = _check_left_padding(where, attention_mask, input_ids)
    n_samples = inputs.check_int(where, "n_samples", n_samples, 2)
    seed = inputs.check_seed(where, "seed", seed)
    max_new_tokens = inputs.check_int(where, "max_new_tokens", max_new_tokens, 1)
    inputs.check_length(where, "input_ids", int(input_ids.shape[1]),
                        inputs.input_positions(model))
    for key, value in GREEDY.items():
        given = generate_kwargs.get(key, value)
        if not (given is False if value is False else inputs.is_int(given) and given == value):
            raise inputs.error(where, key, given, f"{value} (the decoding is greedy and fixed: "
                               "the posterior sample is the only randomness)")
    return mask, n_samples, seed, max_new_tokens


def _greedy_kwargs(model: Any, generate_kwargs: Mapping[str, Any],
                   max_new_tokens: int) -> tuple[dict[str, Any], list[int]]:
    """``(keyword arguments of model.generate, end-of-sequence ids)``: the caller's with the
    greedy decoding (`GREEDY`), ``max_new_tokens`` and, when neither they nor the generation
    config give one, the first end-of-sequence id as ``pad_token_id``."""
    gen_config = getattr(model, "generation_config", None)
    eos = generate_kwargs.get("eos_token_id", getattr(gen_config, "eos_token_id", None))
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    eos_ids = [] if eos is None else torch.as_tensor(eos).reshape(-1).tolist()
    kwargs = {**generate_kwargs, **GREEDY, "max_new_tokens": max_new_tokens}
    if kwargs.get("pad_token_id") is None and eos_ids and (
            getattr(gen_config, "pad_token_id", None) is None):
        kwargs["pad_token_id"] = eos_ids[0]
    return kwargs, eos_ids


def _continuations(out: Any, length: int, eos_ids: list[int]) -> list[tuple[int, ...]]:
    """The generated tokens of each row of ``generate``'s output (its sequences past the
    ``length`` prompt columns), cut before the first end-of-sequence id."""
    seqs = out if isinstance(out, Tensor) else out.sequences
    rows = []
    for row in seqs[:, length:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
        rows.append(tuple(row[:cut]))
    return rows


def _counted_answers(rows: list[tuple[int, ...]], map_rows: list[tuple[int, ...]], *,
                     n_samples: int, seed: int, max_new_tokens: int) -> GeneratedAnswers:
    """The `GeneratedAnswers` of the samples' continuations ``rows`` (``S·B``, sample-major)
    and the MAP's ``map_rows`` (``B``)."""
    size = len(map_rows)
    samples, answers, index = [], [], torch.empty(n_samples, size, dtype=torch.long)
    for b in range(size):
        mine = [rows[s * size + b] for s in range(n_samples)]
        counts: dict[tuple[int, ...], int] = {}
        for a in mine:  # dicts keep the order of first appearance
            counts[a] = counts.get(a, 0) + 1
        order = sorted(counts, key=lambda a: (-counts[a], a != map_rows[b]))  # stable
        rank = {a: i for i, a in enumerate(order)}
        index[:, b] = torch.tensor([rank[a] for a in mine])
        samples.append(tuple(mine))
        answers.append(tuple((a, counts[a]) for a in order))
    majority = tuple(ans[0][0] for ans in answers)
    return GeneratedAnswers(
        samples=tuple(samples), answers=tuple(answers), sample_answers=index,
        majority=majority,
        agreement=torch.tensor([ans[0][1] / n_samples for ans in answers], dtype=torch.float64),
        map_answer=tuple(map_rows),
        map_agrees=torch.tensor([m == a for m, a in zip(majority, map_rows)], dtype=torch.bool),
        n_samples=n_samples, seed=seed, max_new_tokens=max_new_tokens)


# -- helpers ------------------------------------------------------------------------------------


class _Selector:
    """Picks the ``K`` option logits ``[S_c, B, K]`` out of logits ``[S_c, *P, V]`` (the rows
    at each example's answer position for a language-model head); checks ``options`` and
    ``positions`` against the first logits it is built from (``[B, C]`` or ``[B, T, V]``)."""

    def __init__(self, where: str, logits: Tensor | None, batch: Mapping[str, Tensor],
                 size: int, pos: int | list[int], positions_given: object, ids: Tensor | None,
                 options_given: object) -> None:
        if logits is None or logits.dim() not in (2, 3) or logits.shape[0] != size:
            raise QueryInputError(f"{where}: the model's output holds no logits [B, C] or "
                                  f"[B, T, V] (got {inputs.show(logits)} for {size} rows): the "
                                  "model must return logits (a tensor, or an output with "
                                  ".logits) with the batch's rows first")
        dev, vocab = logits.device, logits.shape[-1]
        self.index: Tensor | None = None
        if logits.dim() == 2:  # classification head [B, C]
            what = f"the head's {vocab} classes"
            if ids is None:
                ids = torch.arange(vocab)
        else:
            what = f"the model's {vocab} vocabulary logits"
            if ids is None:
                raise inputs.error(where, "options", None, "the K >= 2 answer token ids (only "
                                   "a classification head defaults to all its classes)",
                                   problem="is not allowed for a language-model head (logits "
                                           "[B, T, V])")
            self.index = torch.tensor(inputs.position_index(
                where, "positions", positions_given,
                inputs.output_positions(batch, logits.shape[1])[1], size=size,
                length=logits.shape[1], positions=pos), dtype=torch.long, device=dev)
        inputs.check_id_range(where, "options", options_given, ids, vocab, what)
        if ids.dim() == 1:
            ids = ids[None].expand(size, -1)
        if ids.device.type == "cpu" and ids.numel():
            same = (ids.sort(-1).values.diff(dim=-1) == 0).any(-1)
            if bool(same.any()):
                b = int(same.int().argmax())
                raise inputs.error(where, "options", options_given, "K distinct answer ids "
                                   "per example", problem=f"repeats an id in example {b}")
        self.options = ids.to(dev, torch.long).clone()  # [B, K], never the caller's
        self.rows = torch.arange(size, device=dev)

    def __call__(self, logits: Tensor) -> Tensor:
        """``[S_c, B, K]`` option logits of ``logits [S_c, B, C]`` or ``[S_c, B, T, V]``."""
        if self.index is not None:
            logits = logits[:, self.rows, self.index]  # [S_c, B, V]
        return logits.gather(-1, self.options[None].expand(logits.shape[0], -1, -1))


def _majority(counts: Tensor, map_answer: Tensor) -> tuple[Tensor, Tensor]:
    """``(majority [B], its count [B])`` of ``counts [B, K]``: of the answers tied at the top
    count, the MAP answer if it is one, else the lowest index."""
    top = counts.max(-1).values
    tied = counts == top[:, None]
    first = tied.int().argmax(-1)  # argmax returns the first of equal maxima
    return torch.where(tied.gather(1, map_answer[:, None])[:, 0], map_answer, first), top


def _check_left_padding(where: str, mask: object, input_ids: Tensor) -> Tensor:
    """The attention mask of the prompts (ones when None), checked: ``[B, T]`` of 0/1, every row
    zeros then ones (left padding) ending in a token."""
    if mask is None:
        return torch.ones_like(input_ids)
    shape = list(input_ids.shape)
    allowed = (f"None or a [B, T] = {shape} tensor of 0 (padding) and 1 (token), padded on the "
               "left (each row zeros, then ones: generate continues after the last column; "
               "tokenizer.padding_side = 'left')")
    if not isinstance(mask, Tensor) or list(mask.shape) != shape or mask.is_complex():
        raise inputs.error(where, "attention_mask", mask, allowed,
                           typed=not isinstance(mask, Tensor))
    m = mask.detach().cpu()
    if not bool(((m == 0) | (m == 1)).all()):
        raise inputs.error(where, "attention_mask", mask, allowed,
                           problem="holds values other than 0 and 1")
    m = m.long()
    bad = (m[:, 1:] < m[:, :-1]).any(1) | (m[:, -1] == 0)
    if bool(bad.any()):
        b = int(bad.int().argmax())
        raise inputs.error(where, "attention_mask", mask, allowed,
                           problem=f"is not left-padded (row {b} has padding after a token or "
                                   "ends in padding)")
    return mask
