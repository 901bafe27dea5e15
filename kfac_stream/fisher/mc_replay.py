r"""The Monte-Carlo (type-2) Fisher pass.

Labels :math:`\hat y_t \sim p_\theta(\cdot\mid x_{<t})` sampled at the loss-bearing
positions, :math:`L = \sum_t -\log p_\theta(\hat y_t\mid x_{<t})` (a SUM, so the loss scale
is exactly 1), and ``torch.autograd.grad`` of ``L`` with respect to the tracked layers'
outputs, which fires the capture hooks. Parameters' ``.grad`` are never touched.
:math:`E_{\hat y}[g_s g_s^\top] = \sum_t J_{s,t}^\top(\operatorname{diag} p_t - p_t p_t^\top)
J_{s,t}` (cross terms of different ``t`` vanish in expectation): the GGN's K-FAC G factor.
Three ways:

* **on a sub-batch** (`mc_subbatch_pass`, the default, ``KFACConfig.mc_sequences`` < all):
  after the optimizer step, a fresh forward + backward of ``b`` of the micro-batch's ``B``
  sequences, drawn uniformly without replacement (`select_sequences`, seeded by
  ``(seed, rank, step)``). How many of each micro-batch (`replay_counts`): ``min(k, B)`` for
  an int ``k``; for a share ``f`` of the step's sequences (the default) a systematic draw
  over the step's micro-batches, each sequence with probability ``f``, weight ``1/f`` in
  place of ``B/b`` below and EMA weight ``Σ w`` in place of ``U``; a micro-batch with
  ``b = 0`` is not replayed at all (at micro-batch 1: a share ``f`` of the micro-batches).
  A forward/backward costs what its sequences cost, so the pass
  costs ``b/B`` of the full one, while token subsampling alone shrinks only the factor GEMMs.
  The ``m = ceil(token_fraction·B·T)`` slots the empirical path would take from the whole
  micro-batch are drawn among the sub-batch's ``U_b`` usable positions; a usable slot carries
  the two-stage Horvitz–Thompson weight :math:`w = (B/b)\max(1, U_b/m)`, the inverse of its
  inclusion probability :math:`(b/B)\min(1, m/U_b)`, so
  :math:`E[\sum_s w_s x_s x_s^\top] = \sum_{s\,\mathrm{usable}} x_s x_s^\top` over the whole
  micro-batch (tower rule: positions given the sequences, then the sequences), for
  ``x = ā`` and, over the sampled labels too, ``x = g``. The pass's EMA weight ``n`` is the
  micro-batch's usable count ``U`` (``PassRecord.total``), not :math:`\sum w` (which varies
  with the sequences drawn when their lengths differ): :math:`S = \sum_s w_s x_s x_s^\top/U`
  is then exactly unbiased for the micro-batch's per-token mean, and ``n``, ``N``, the EMA and
  the snapshot mean what they mean on the empirical path. With equal lengths
  :math:`\sum w = U` anyway. ``b = B`` gives the full replay below, draw for draw;
* **in the training forward** (`mc_grad_in_forward`, ``mc_sequences="all"`` where it is
  safe): at the end of each captured forward, on its own graph (``retain_graph=True``; the
  training backward that follows adds no rows). No second forward, and nothing read on the
  host; it costs a backward of the whole micro-batch;
* **after the optimizer step, whole micro-batch** (`mc_fisher_pass`, ``mc_sequences="all"``):
  a fresh forward of the stored inputs. Used under DeepSpeed ZeRO-3 (a second backward inside
  the forward breaks its partitioning), with gradient checkpointing (the extra
  backward would recompute every block) and under fp16 autocast (the in-forward gradient
  would be fp16 without a loss scale); the replay's forward is made free of the model's
  host syncs where that is exact (a Llama-family one: none, `replay_forward`).

Replays run on every rank for the same micro-batch indices of an update step (an int
``mc_sequences``: every one; a share: those `replay_counts` draws, the same on every rank with
equal micro-batch sizes, as the HF Trainer's samplers give), whatever was drawn (a
padding-only sequence gives a zero loss and still runs its backward): under ZeRO-3 the
forward gathers parameters collectively.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..capture.hooks import (
    MC_REPLAY,
    CaptureHooks,
    CaptureMode,
    PassRecord,
    is_encoder_decoder,
    logits_of,
)
from ..stats.rows import sequence_usable, slots_per_pass

_DROP = ("labels", "num_items_in_batch", "return_loss")


def loss_bearing_mask(logits: Tensor, inputs: dict[str, Tensor], shift: bool = True
                      ) -> tuple[Tensor, Tensor]:
    """Logit rows and which of them carry a loss term, without boolean-mask indexing (which
    reads the mask on the host).

    Causal LM (``logits [B, T, V]``, ``shift``): position ``t`` predicts token ``t+1``; it
    bears a loss if ``labels[:, t+1] != -100`` (without labels: if ``attention_mask[:, t+1] ==
    1``). Encoder-decoder (``shift=False``): position ``t`` predicts ``labels[:, t]`` (every
    position without labels). Classification (``logits [B, C]``): every row.

    Returns:
        ``(rows [M, V], keep [M] bool)`` with ``M = B·(T-1)`` (``B·T`` unshifted, ``B`` for
        classification).
    """
    if logits.dim() == 2:
        return logits, torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    if not shift:
        labels = inputs.get("labels")
        keep = (labels != -100) if labels is not None and labels.shape == logits.shape[:2] \
            else torch.ones_like(logits[:, :, 0], dtype=torch.bool)  # [B, T]
        return logits.reshape(-1, logits.shape[-1]), keep.reshape(-1).to(logits.device)
    labels = inputs.get("labels")
    if labels is not None:
        keep = labels[:, 1:] != -100  # [B, T-1]
    else:
        mask = inputs.get("attention_mask")
        keep = (mask[:, 1:] != 0) if mask is not None else torch.ones_like(
            logits[:, 1:, 0], dtype=torch.bool)
    rows = logits[:, :-1].reshape(-1, logits.shape[-1])
    return rows, keep.reshape(-1).to(logits.device)


def sample_labels(logits: Tensor, generator: torch.Generator | None) -> Tensor:
    """One label per row from ``softmax(logits)`` by inverse-CDF sampling.

    One uniform per row from ``generator`` (on the logits' device: no host round trip), ~20x
    faster than ``torch.multinomial`` on CPU for large vocabularies (measured 75 ms for
    2040 x 2048).

    Args:
        logits: ``[m, V]``.
        generator: Generator on ``logits.device`` (None: the default one).

    Returns:
        ``[m]`` int64 labels on ``logits.device``.
    """
    cdf = torch.softmax(logits.float(), dim=-1).cumsum_(-1)  # [m, V]
    u = torch.rand(logits.shape[0], 1, generator=generator, device=logits.device) * cdf[:, -1:]
    return (cdf < u).sum(-1).clamp_(max=logits.shape[1] - 1)


def sampled_label_loss(logits: Tensor, inputs: dict[str, Tensor],
                       generator: torch.Generator, shift: bool = True) -> Tensor:
    """``Σ_t −log p(ŷ_t)`` over the loss-bearing rows, ``ŷ_t`` drawn from the model (0-dim);
    ``shift`` as in `loss_bearing_mask`."""
    rows, keep = loss_bearing_mask(logits, inputs, shift)  # [M, V], [M]
    rows = rows.float()
    gen = generator if generator.device == rows.device else None
    y = sample_labels(rows.detach(), gen)  # [M]
    nll = F.cross_entropy(rows, y, reduction="none")  # [M]
    return torch.where(keep, nll, 0.0).sum()


def mc_grad_in_forward(rec: PassRecord, output: Any, generator: torch.Generator,
                       shift: bool = True) -> bool:
    """Take the MC Fisher gradient of one training pass inside its forward.

    Returns False (nothing done, the record is closed and marked for replay) when it is not
    possible here: fp16 autocast (unscaled fp16 gradients underflow), or no tracked output
    with a graph (reentrant checkpointing). Otherwise fires the capture hooks of ``rec`` with
    the sampled-label gradients and closes the record, so the training backward that follows
    adds nothing to it.
    """
    logits = logits_of(output)
    outputs = [o for o in rec.outputs if o.grad_fn is not None]
    rec.outputs = []  # outputs → their hooks → rec → outputs would be a GC-invisible cycle
    device = logits.device.type if logits is not None else "cpu"
    fp16 = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == \
        torch.float16
    if logits is None or not outputs or fp16 or rec.inputs is None:
        rec.closed = rec.replay = True
        return False
    rec.scale = 1.0
    loss = sampled_label_loss(logits, rec.inputs, generator, shift)
    torch.autograd.grad(loss, outputs, retain_graph=True, allow_unused=True)
    rec.closed = True
    return True


def _cache_keyword(model: nn.Module) -> str | None:
    """The model's own name for its KV-cache argument (``cache`` from transformers 5.2x,
    ``past_key_values`` before), when its ``forward`` names one (None: it does not, e.g. a
    wrapper whose ``forward`` takes only ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def sync_free_kwargs(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The replay's forward kwargs, with an empty ``DynamicCache`` added where that spares
    the model's mask builder its one data-dependent host check (`mc_fisher_pass`);
    ``kwargs`` unchanged otherwise.

    Only for a decoder-only model with ``sdpa`` or ``eager`` attention whose ``forward``
    names its cache argument, and a batch with no ``attention_mask``, no ``position_ids``
    (explicit positions may be packed sequences, which that check must see) and no cache of
    its own. The forward is then the same computation: the mask is still skipped (SDPA's
    ``is_causal``) or built causal, and the layers attend to ``cat([empty, k])``, the same
    values (under gradient checkpointing the layers drop the cache, with transformers'
    one-time "Caching is incompatible with gradient checkpointing" warning).
    """
    config = getattr(model, "config", None)
    if config is None or is_encoder_decoder(model) or \
            getattr(config, "_attn_implementation", None) not in ("sdpa", "eager") or \
            any(kwargs.get(k) is not None for k in ("attention_mask", "position_ids", "cache",
                                                     "past_key_values")):
        return kwargs
    keyword = _cache_keyword(model)
    if keyword is None:
        return kwargs
    try:
        from transformers import DynamicCache
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - an older or unusual transformers: the plain forward
        return kwargs
    return {**kwargs, keyword: cache}


#: transformers families whose causal-LM forward hands its 2-D ``attention_mask`` to the
#: decoder, where only ``create_causal_mask`` reads it (the positions never depend on it), and
#: whose layers are full causal attention unless the config says otherwise
#: (`full_causal_sdpa_decoder`); each one checked bit for bit in
#: tests/unit/tracking/test_host_syncs.py
MASK_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def full_causal_sdpa_decoder(model: nn.Module) -> nn.Module | None:
    """The decoder of ``model`` (its ``base_model``) when a prebuilt 4-D boolean mask gives
    exactly the mask transformers would build from a 2-D ``attention_mask``
    (`padded_causal_mask`), else None.

    That is: a transformers ``*ForCausalLM`` of one of `MASK_FAMILIES` (the library's own
    class, not a subclass defined elsewhere nor a wrapper such as PEFT's), decoder-only,
    ``config.is_causal`` not False, ``sdpa`` attention, every layer full causal attention (no
    ``sliding_window``, every ``layer_types`` entry ``"full_attention"``, no
    ``attention_chunk_size``), and torch ≥ 2.5 (before it, transformers' ``sdpa_mask``
    unmasks fully masked rows).
    """
    config = getattr(model, "config", None)
    try:
        from transformers import PreTrainedModel
    except Exception:  # noqa: BLE001 - no transformers: nothing to hand a mask to
        return None
    family = getattr(config, "model_type", None)
    if not isinstance(model, PreTrainedModel) or family not in MASK_FAMILIES or \
            is_encoder_decoder(model) or \
            getattr(config, "_attn_implementation", None) != "sdpa" or \
            getattr(config, "is_causal", True) is False or \
            not type(model).__name__.endswith("ForCausalLM") or \
            not type(model).__module__.startswith(f"transformers.models.{family}.") or \
            torch.__version__ < "2.5":
        return None
    if getattr(config, "sliding_window", None) is not None or \
            getattr(config, "use_sliding_window", False) or \
            getattr(config, "attention_chunk_size", None) is not None or \
            any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return None
    decoder = model.base_model
    return decoder if decoder is not model else None


def padded_causal_mask(attention_mask: Tensor) -> Tensor:
    """The causal mask of a padded batch, as transformers' ``sdpa_mask`` builds it for a full
    causal layer without cache: ``mask[b, 0, q, k] = (k <= q) & attention_mask[b, k]``,
    ``[B, 1, T, T]`` bool, with device ops only (no host read). A query with no key (a left
    pad) keeps its all-False row, as there: neither transformers 5.17 nor 5.24 alters it
    (``allow_torch_fix`` has no effect), so SDPA gets the same row either way (zeros from
    torch 2.13's CPU kernel).

    Args:
        attention_mask: ``[B, T]`` (nonzero: a real token).
    """
    idx = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    causal = idx[None, :] <= idx[:, None]  # [T(q), T(k)]: k <= q
    return causal[None, None] & attention_mask.to(torch.bool)[:, None, None, :]


def _mask_swap(model: nn.Module, kwargs: dict[str, Any]
               ) -> tuple[nn.Module, Tensor, Tensor] | None:
    """``(decoder, the batch's 2-D mask, its 4-D form)`` when the replay can hand the decoder
    the prebuilt mask (`replay_forward`), else None."""
    mask = kwargs.get("attention_mask")
    ref = kwargs.get("input_ids")
    if ref is None:
        ref = kwargs.get("inputs_embeds")
    if not isinstance(mask, Tensor) or mask.dim() != 2 or not isinstance(ref, Tensor) or \
            ref.dim() < 2 or tuple(ref.shape[:2]) != tuple(mask.shape) or \
            any(kwargs.get(k) is not None for k in ("position_ids", "cache", "past_key_values")):
        return None
    decoder = full_causal_sdpa_decoder(model)
    if decoder is None:
        return None
    return decoder, mask, padded_causal_mask(mask.to(ref.device))


@contextlib.contextmanager
def _decoder_mask(decoder: nn.Module, mask: Tensor, mask4d: Tensor) -> Iterator[None]:
    """While open, a call of ``decoder`` given exactly ``mask`` as its ``attention_mask`` gets
    ``mask4d`` instead (a pre-hook registered after any other: the model's own pre-hooks, the
    capture's among them, still see the 2-D mask)."""
    def swap(module: nn.Module, args: tuple, kw: dict[str, Any]):
        if kw.get("attention_mask") is mask:
            return args, {**kw, "attention_mask": mask4d}
        return None

    handle = decoder.register_forward_pre_hook(swap, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def replay_forward(model: nn.Module, kwargs: dict[str, Any]) -> Any:
    """``model(**kwargs)`` in the form that makes no host sync where an exact one exists
    (`mc_fisher_pass`): `sync_free_kwargs` for a batch without ``attention_mask``; for a
    batch with a 2-D ``attention_mask`` (and no ``position_ids`` or cache of its own) on a
    full causal SDPA model (`full_causal_sdpa_decoder`), its decoder gets the prebuilt
    `padded_causal_mask` in place of the 2-D mask. Otherwise the plain call.

    Host syncs of the model's own forward. The HF Trainer sets ``use_cache=False``, so a
    Llama-family forward builds its causal mask with no cache; it makes ``position_ids``
    itself when they are not given, and transformers' ``create_causal_mask`` then looks for
    packed sequences in them whenever ``attention_mask`` is None:
    ``find_packed_sequence_indices`` ends in ``if ... (packed_sequence_mask[:, -1] ==
    0).all()``, one host read per forward (transformers 5.17 ``masking_utils.py:755``, 5.24
    ``:761``; run only when ``position_ids is not None and attention_mask is None and cache
    is None``, 5.17 ``:855``, 5.24 ``:869``). Dropping ``position_ids`` does not avoid it
    (the model makes its own). For a batch without ``attention_mask`` or ``position_ids``
    the replay hands the model an empty ``DynamicCache`` (`sync_free_kwargs`): the check is
    skipped, and the forward's logits and gradients are bit-identical (the default
    positions are never packed; with SDPA the mask is still skipped for ``is_causal``, with
    eager it is the same causal mask). Zero host syncs in the replay's forward, with and
    without gradient checkpointing, on 5.17 and 5.24 (sdpa and eager).

    With a 2-D ``attention_mask``, SDPA's ``_ignore_causal_mask_sdpa`` reads it on the host
    to choose ``is_causal``: ``fast_all(padding_mask)`` (5.17 ``:269``, 5.24 ``:292``) and,
    when it has padding, ``fast_all(padding_mask[:, :q_length])`` (5.17 ``:275``, 5.24
    ``:298``): 1 sync without padding, 2 with (eager attention: none). Where padding is
    found, ``sdpa_mask`` builds ``causal_mask_function`` (``kv_idx <= q_idx``, 5.24 ``:78``)
    and ``padding_mask_function`` (``padding_mask[batch_idx, kv_idx]``, ``:175``), ANDed
    (``:526``, built at ``:537``; 5.17 ``:81``, ``:178``, ``:506``, ``:517``), nothing else
    for a full causal layer without cache (no fully-masked-row fix: ``allow_torch_fix`` has
    no effect). For a full causal SDPA model (`full_causal_sdpa_decoder`) and a batch with
    no ``position_ids`` or cache of its own, the replay builds that mask on the device
    (`padded_causal_mask`) and hands it to the decoder in place of the 2-D one
    (`replay_forward`); a 4-D mask is returned as is (``_preprocess_mask_arguments``, 5.17
    ``:812``, 5.24 ``:818``), so nothing is read, and the positions (``arange(T)``, never
    from the mask) are the same. A padded batch: the same boolean mask reaches SDPA, the
    logits and gradients are bit-identical. A batch without padding: the plain forward calls
    SDPA with ``is_causal=True`` and no mask, the replay with the explicit causal mask
    (another kernel: on a GPU not the flash one; equal up to rounding), since only the host
    can tell the two batches apart. Still read: a model with a sliding window, chunked or
    other non-full layers (`full_causal_sdpa_decoder` refuses it), or of a family not in
    `MASK_FAMILIES`, or wrapped (a PEFT model): 1–2 per forward with SDPA.
    """
    kwargs = sync_free_kwargs(model, kwargs)
    swap = _mask_swap(model, kwargs)
    if swap is None:
        return model(**kwargs)
    with _decoder_mask(*swap):
        return model(**kwargs)


def replay_kwargs(model: nn.Module, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """The forward kwargs of a replay of a recorded micro-batch: its own without the loss's
    (``labels``, ...); an encoder-decoder gets the decoder inputs the training forward made
    from the labels (without labels it cannot make them)."""
    kwargs = {k: v for k, v in inputs.items() if k not in _DROP}
    labels = inputs.get("labels")
    make = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if is_encoder_decoder(model) and "decoder_input_ids" not in kwargs and \
            "decoder_inputs_embeds" not in kwargs and isinstance(labels, Tensor) and \
            make is not None:
        kwargs["decoder_input_ids"] = make(labels=labels)
    return kwargs


def mc_fisher_pass(model: nn.Module, capture: CaptureHooks, inputs: dict[str, Tensor],
                   generator: torch.Generator, mode: CaptureMode = MC_REPLAY
                   ) -> PassRecord | None:
    """Run one MC Fisher forward/backward for one stored micro-batch (adds one PassRecord).

    Labels are drawn at every position and the loss masked to the loss-bearing ones (a
    masked SUM): the same gradient as a loss over the selected rows, with no host read.

    The forward is `replay_forward`'s: no host sync of the model's own where an exact
    sync-free form exists (its docstring says which, and what is still read).

    Returns:
        The pass's record (None if the forward was not captured).
    """
    kwargs = replay_kwargs(model, inputs)
    seq2seq = is_encoder_decoder(model)
    labels = inputs.get("labels")
    rec = None  # the labels tell the capture which positions carry the loss
    labels = labels if isinstance(labels, Tensor) else None
    with capture.using(dataclasses.replace(mode, labels=labels)), torch.enable_grad():
        try:
            # the ModelOutput goes at once: the cache it carries holds every layer's k/v
            logits = logits_of(replay_forward(model, kwargs))
            rec = capture.current
            if rec is None:
                return None
            rec.scale = 1.0
            if not rec.outputs:
                raise RuntimeError(
                    "kfac_stream fisher='mc': no tracked layer output has a graph in the MC "
                    "forward pass. Reentrant gradient checkpointing runs blocks without "
                    "autograd; use gradient_checkpointing_kwargs={'use_reentrant': False} "
                    "(the transformers default) or fisher='empirical'")
            # an all-padding micro-batch gives a zero loss: the backward still runs, so every
            # rank of a ZeRO-3 run takes part in the same parameter gathers
            loss = sampled_label_loss(logits, inputs, generator, shift=not seq2seq)
            outputs = rec.outputs
            if any(o.grad_fn is None for o in outputs):
                raise RuntimeError("kfac_stream MC Fisher: a tracked output has no graph")
            torch.autograd.grad(loss, outputs, allow_unused=True)
        finally:
            if rec is not None:  # outputs → hooks → rec → outputs: a GC-invisible cycle
                rec.outputs = []
    return rec


def select_sequences(batch: int, count: int, generator: torch.Generator,
                     device: torch.device) -> Tensor:
    """``count`` of ``batch`` sequence indices, uniformly without replacement, on ``device``
    (the ``count`` smallest of ``batch`` uniform keys; nothing read on the host).

    Returns:
        ``[count]`` int64, ascending.
    """
    if count >= batch:
        return torch.arange(batch, device=device)
    keys = torch.rand(batch, generator=generator, device=device)  # [B]
    return torch.topk(keys, count, largest=False, sorted=False).indices.sort().values


def _batch_shape(inputs: dict[str, Tensor]) -> tuple[int, int] | None:
    """``(B, T)`` of a recorded ``[B, T]`` micro-batch (None: not such a batch)."""
    for key in ("input_ids", "inputs_embeds", "attention_mask"):
        x = inputs.get(key)
        if isinstance(x, Tensor) and x.dim() >= 2:
            return int(x.shape[0]), int(x.shape[1])
    return None


def batch_size(inputs: dict[str, Tensor]) -> int | None:
    """Sequences ``B`` of a recorded ``[B, T]`` micro-batch (None: not such a batch)."""
    shape = _batch_shape(inputs)
    return None if shape is None else shape[0]


def mc_subbatch_pass(model: nn.Module, capture: CaptureHooks, inputs: dict[str, Tensor],
                     label_generator: torch.Generator, select_generator: torch.Generator,
                     count: int | None, token_fraction: float,
                     share: float | None = None) -> None:
    """The MC Fisher replay of one stored micro-batch on a random sub-batch of its sequences
    (adds one PassRecord; the estimator and its weights: module docstring).

    Args:
        inputs: The micro-batch's recorded tensor kwargs (``[B, ...]`` batch-first tensors
            are cut to the sub-batch; others pass unchanged).
        label_generator: The MC label sampler.
        select_generator: The sequence sampler (seeded per step by `MCSubBatch`).
        count: Sequences to replay (`replay_counts`, ``≥ 1``; None: the whole micro-batch).
        token_fraction: ``KFACConfig.token_fraction`` (slots of the WHOLE micro-batch).
        share: The probability ``f`` with which `replay_counts` drew every sequence of the
            step (a float ``mc_sequences``): the rows are weighted ``1/f`` (times the token
            stage's weight) and the pass's EMA weight is ``Σ w`` (``U_b/f``, unbiased for
            the step's usable positions). None (an int ``mc_sequences``): the micro-batch is
            always replayed, weights ``B/b`` and EMA weight ``U``.
    """
    shape = _batch_shape(inputs)
    if shape is None or count is None:  # not a [B, T] batch: the whole micro-batch
        mc_fisher_pass(model, capture, inputs, label_generator)
        return
    B, T = shape
    b = min(int(count), B)
    ref = next(v for v in inputs.values() if isinstance(v, Tensor) and v.dim() >= 2)
    labels = inputs.get("labels")
    # the whole micro-batch's (a decoder's positions from its inputs, else from the labels)
    usable, target = capture.streams(inputs, labels if isinstance(labels, Tensor) else None,
                                     shape, ref.device)
    sel = select_sequences(B, b, select_generator, ref.device)  # [b]
    sub = {k: (v.index_select(0, sel.to(v.device))
               if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == B else v)
           for k, v in inputs.items()}
    m = slots_per_pass(token_fraction, B * T)  # the empirical path's slots of this pass
    m_target = slots_per_pass(token_fraction, target.numel()) if target is not None else None
    rec = mc_fisher_pass(model, capture, sub, label_generator,  # m ≥ b·T: every position
                         dataclasses.replace(MC_REPLAY, slots=m, target_slots=m_target))
    if rec is None or (share is None and b == B):  # b = B: the full replay, untouched
        return
    scale = 1.0 / share if share is not None else B / b  # × 1/P(sequence drawn)
    rec.weight = rec.weight * scale
    if rec.target is not None:
        rec.target.weight = rec.target.weight * scale
    rec.seq_scale = scale  # the EK-FAC correction's sequences (`Tracker._collect`)
    if rec.seq_layers:  # a head's sequence rows: the same first stage, no second
        rec.seq_weight = rec.sequence_weight() * scale
    for sums in (rec.a_sums, rec.g_sums):  # diagonal factors: Σ w x⊙x, taken in the pass
        for name, parts in sums.items():
            sums[name] = [x * scale for x in parts]
    if share is None:  # n = U (and the usable sequences) of the whole micro-batch
        rec.total = usable.sum().to(rec.weight)
        if rec.target is not None and target is not None:
            rec.target.total = target.sum().to(rec.weight)
        if rec.seq_layers:
            rec.seq_total = sequence_usable(usable, B).sum().to(rec.seq_weight)
