"""Forward hooks and output-tensor hooks that collect sampled rows of ``ā`` and ``g``.

One ``PassRecord`` per training forward pass of the model (one micro-batch):

* a forward pre-hook on the model draws a fixed number of token positions once for the pass
  (same positions for every layer; padding slots weighted 0, `stats.rows.sample_positions`)
  and adds the usable tokens to a counter kept on the device. A usable position is a real
  token that can carry the loss's gradient: in a causal LM, none after a sequence's last
  loss-bearing position (`stats.rows.gradient_positions`; by its ``[B, T]`` labels, or, when
  the forward gets none, e.g. a Trainer with a ``compute_loss_func``, by the next-token loss
  of its real tokens, as the MC Fisher's; labels ``[B]``, one per sequence, are a
  classifier's: every real position is usable). An
  encoder-decoder's decoder positions are a second stream with a draw of their own (the
  *target* row space: the decoder's blocks and LM head, whatever the decoder's length),
  usable where its labels say so, counted apart (``target_tokens_seen``);
* a layer that sees one row per sequence (``[B, d]``: a pooler or classification head that
  reads the first or last token) has no token positions: its rows are the pass's sequences,
  all of them, weighted 1 (0 for an all-padding sequence), and the pre-hook counts the usable
  sequences beside the tokens (``sequences_seen``). Which *row space* a layer has (positions or
  sequences) is fixed by its input's shape at its first captured call (`CaptureHooks.row_space`)
  and written into the snapshot, where it gives the layer its own ``N``;
* a forward hook on each tracked layer gathers the input rows and registers a hook on the
  output *tensor* (not a module backward hook: robust to in-place ops, pytorch#61519). The
  (input rows, output-gradient rows) pair is appended only when that hook fires, so a forward
  that is recomputed by gradient checkpointing (hooks fire twice, only one output receives a
  gradient) counts each position once;
* layers that share their input (`capture.sharing`) gather the A rows once per call, in
  whichever member of the group is called first (the order of calls is the model's, not the
  order of registration: OPT and BART call ``q_proj`` before ``k_proj``); the others only check
  that they received the same tensor and reference the same rows. A group whose members
  receive different inputs, or not one each per call, is *dissolved* on the spot: its members
  keep their own A from then on (one warning naming them; `dissolved` tells the tracker, which
  splits the shared factor, see `Tracker.dissolve_groups`), so a wrong guess of the probe
  never stops training and never changes a factor;
* in empirical mode the logits' gradient gives the loss scale ``c`` of the pass
  (``stats.loss_scale``), as device tensors. Two places are hooked: the logits the model
  returns (the loss input when the user computes the loss, after e.g. soft-capping) and the
  output of the output embedding (``get_output_embeddings()``, the LM head), which is the
  loss input when the model computes the loss itself but the returned logits are a copy
  (accelerate's mixed-precision wrapper converts outputs to float32 after the loss was taken).
  Each hook that fires in the backward adds a fit; the first one (nearer the loss) with live
  rows gives ``c`` (`resolve_scale`, on the device).

No hook reads a device value on the host (no ``.item()``, ``nonzero`` or boolean-mask
indexing): every shape they use is known from the batch shape, so on a GPU the training
thread never waits for the device (tests/unit/tracking/test_host_syncs.py counts them). The hooks
do no math beyond gathering rows; everything else happens in the tracker.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..stats.covariance import weighted_squares
from ..stats.loss_scale import cross_entropy_scale
from ..stats.rows import (
    ROW_SPACES,
    gather_rows,
    gradient_positions,
    reduce_rows,
    row_space_of,
    sample_positions,
    sequence_usable,
    usable_positions,
)
from . import graphs
from .records import (  # noqa: F401 - the capture's records, imported from here too
    IDLE,
    MC_REPLAY,
    CaptureMode,
    CaptureState,
    PassRecord,
    Positions,
)
from .sharing import FactorPlan, same_data

_HANDLE_ATTR = "_kfac_stream_handles"


def _batch_input(args: tuple, kwargs: dict[str, Any]) -> Tensor | None:
    """The ``[B, T, ...]`` tensor that gives a forward pass its batch shape and device: the
    first of ``input_ids``, ``inputs_embeds``, ``attention_mask``, else the first positional
    argument, else the first keyword argument (a model of one's own: ``model(x=…)``) that is
    not ``labels`` nor a decoder's; at least 2-D."""
    named = (kwargs.get(k) for k in ("input_ids", "inputs_embeds", "attention_mask"))
    other = (v for k, v in kwargs.items() if k != "labels" and not k.startswith("decoder_"))
    return next((x for x in itertools.chain(named, args[:1], other)
                 if isinstance(x, Tensor) and x.dim() >= 2), None)


def logits_of(output: Any) -> Tensor | None:
    """The logits in a model's output (a tensor, ``.logits``, a dict or the first ≥2-D tensor
    of a tuple), or None."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None and isinstance(output, (tuple, list)):
        logits = next((o for o in output if isinstance(o, Tensor) and o.dim() >= 2), None)
    return logits if isinstance(logits, Tensor) else None


def is_encoder_decoder(model: nn.Module) -> bool:
    """The model's config says it is an encoder-decoder (T5, BART, ...): its logits ``[B, T,
    V]`` are aligned with its ``labels`` (the decoder's inputs are the labels shifted right),
    not shifted by one as a causal LM's."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def decoder_side(model: nn.Module, layers: dict[str, nn.Module]) -> set[str]:
    """The layers of ``layers`` that an encoder-decoder applies at its decoder's positions
    (or to the encoder's output, `CaptureHooks._space` tells the two apart): those under a
    module with a ``decoder`` name component, and its LM head. Empty for other models."""
    if not is_encoder_decoder(model):
        return set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {n for n, m in layers.items() if m is head or any(
        c == "decoder" or c.endswith("_decoder") for c in n.split("."))}


def _is_causal_lm(model: nn.Module) -> bool:
    """A token-level model whose position ``t`` sees positions ``≤ t`` only: not an
    encoder-decoder and not a transformers model that cannot generate (an encoder, whose
    every position sees every other). A model of your own counts as causal, as the MC
    Fisher's label shift assumes (`mc_replay.loss_bearing_mask`), except in a pass whose
    labels are one per sequence (``[B]``: a classifier, `CaptureHooks.streams`)."""
    can = getattr(model, "can_generate", None)
    return not is_encoder_decoder(model) and (not callable(can) or bool(can()))


def _labels(kwargs: dict[str, Any], mode: CaptureMode) -> Tensor | None:
    """The pass's ``labels`` (the forward's, else the mode's: an MC replay's)."""
    labels = kwargs.get("labels")
    return labels if isinstance(labels, Tensor) else mode.labels


def _target_usable(kwargs: dict[str, Any], labels: Tensor | None, batch: int,
                   device: torch.device) -> Tensor | None:
    """``[B*T_dec]`` bool: the decoder positions of an encoder-decoder's pass that can carry a
    gradient (``decoder_attention_mask``, and none after a sequence's last labelled one,
    `gradient_positions`); None when the pass shows no decoder (no labels, no decoder
    inputs)."""
    dec = next((kwargs[k] for k in ("decoder_input_ids", "decoder_inputs_embeds")
                if isinstance(kwargs.get(k), Tensor)), labels)
    if not isinstance(dec, Tensor) or dec.dim() < 2 or int(dec.shape[0]) != batch:
        return None
    shape = (batch, int(dec.shape[1]))
    mask = kwargs.get("decoder_attention_mask")
    usable = usable_positions(mask if isinstance(mask, Tensor) else None, shape, device)
    if isinstance(labels, Tensor) and tuple(labels.shape) == shape:
        usable = usable & gradient_positions(labels.to(device), shift=False)
    return usable


class CaptureHooks:
    """Owns every hook kfac_stream puts on a model; ``remove()`` takes them all off.

    Attributes:
        mode: The current `CaptureMode` (`set_mode`, or `using` for a temporary one).
        current: The record of the forward pass in progress (None outside a captured pass).
        passes: Records of the passes since the last ``take()``.
        inputs: Recorded kwargs since the last ``take()``.
        generator: The token sampler's generator, on ``device``.
    """

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module], plan: FactorPlan,
                 token_fraction: float, seed: int, row_dtype: torch.dtype | None,
                 device: torch.device, sum_dtype: torch.dtype = torch.float32,
                 reduce: bool = False) -> None:
        self.token_fraction = token_fraction
        self.reduce = reduce  # the reduce form (`kfac_stream.fisher.curvature`): per-sequence rows
        self.row_dtype = row_dtype
        self.sum_dtype = sum_dtype
        self._diagonal = {key for key, (_, diag) in plan.dims.items() if diag}
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.mode = IDLE
        self.current: PassRecord | None = None
        self.passes: list[PassRecord] = []
        self.inputs: list[dict[str, Tensor]] = []
        self._counts_host = [0, 0, 0]  # usable [positions, sequences, decoder positions]
        self._counts_device: Tensor | None = None  # [3] int64, since the last read
        self.row_space: dict[str, str] = {}  # layer -> its factors' rows (`ROW_SPACES`)
        self._input_space: dict[str, str] = {}  # layer -> its input's rows (first call)
        self._layers = layers
        self._causal = _is_causal_lm(model)
        self._decoder_side = decoder_side(model, layers)
        self._a_diagonal = {n: plan.dims[k][1] for n, k in plan.a_key.items()}
        self._group = {n: g for g in plan.groups for n in g}  # layer -> its shared-input group
        # group -> [its input of this call, its rows, members still to be called]; dropped when
        # the last member has been called, so no activation outlives its block
        self._shared_input: dict[tuple[str, ...], list] = {}
        self.dissolved: list[tuple[str, ...]] = []  # groups dissolved, not yet taken
        self._warned_dissolve = False
        # the tracker's extensions (`kfac_stream.extensions`): each keeps what it asks for of
        # a tracked call (`keep_call`) and gets the call's output gradient (`add_call`)
        self.extensions: list = []
        stale = getattr(model, _HANDLE_ATTR, None)
        if stale:  # a previous tracker that never reached on_train_end (e.g. crashed run)
            logging.getLogger("kfac_stream").warning(
                "kfac_stream: removing the hooks another tracker left on this model (a crashed "
                "run, or a second KFACStreamCallback on the same model: only one tracks a "
                "model at a time, the newest)")
            for h in stale:
                h.remove()
        self.handles = [
            model.register_forward_pre_hook(self._on_model_pre, with_kwargs=True),
            model.register_forward_hook(self._on_model_post, with_kwargs=True),
        ]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if isinstance(head, nn.Module):
            self.handles.append(head.register_forward_hook(self._on_head_post))
        encoder = model.get_encoder() if self._decoder_side else None
        if isinstance(encoder, nn.Module):
            self.handles.append(encoder.register_forward_hook(self._on_encoder_post))
        for name, module in layers.items():
            self.handles.append(module.register_forward_hook(self._layer_hook(name)))
        self.model = model
        setattr(model, _HANDLE_ATTR, self.handles)

    def _read_counts(self) -> list[int]:
        """``[tokens, sequences, decoder tokens]`` so far (reads the device counter once)."""
        if self._counts_device is not None:
            self._counts_host = [a + int(b) for a, b in
                                 zip(self._counts_host, self._counts_device.tolist())]
            self._counts_device = None
        return self._counts_host

    @property
    def tokens_seen(self) -> int:
        """Usable positions of every training forward pass, captured or not (reads the device
        counter: call at snapshot, checkpoint or log time, not per step)."""
        return self._read_counts()[0]

    @property
    def sequences_seen(self) -> int:
        """Sequences with a usable position, of every training forward pass (the ``N`` of a
        sequence-space layer; reads the device counter like `tokens_seen`)."""
        return self._read_counts()[1]

    @property
    def target_tokens_seen(self) -> int:
        """Usable decoder positions of an encoder-decoder's training forward passes (the ``N``
        of a target-space layer; reads the device counter like `tokens_seen`)."""
        return self._read_counts()[2]

    def set_counts(self, tokens: int, sequences: int, target_tokens: int = 0) -> None:
        """Set `tokens_seen`, `sequences_seen` and `target_tokens_seen` (a restored state);
        the counts of passes not yet read are dropped, nothing is read from the device."""
        self._counts_host = [int(tokens), int(sequences), int(target_tokens)]
        self._counts_device = None

    def carry_over(self, old: CaptureHooks) -> None:
        """Take ``old``'s state (sampler, counts) and the row spaces it found (`Tracker.attach`
        puts new hooks on a model after `remove`)."""
        self.load_state_dict(old.state_dict())
        self.row_space, self._input_space = dict(old.row_space), dict(old._input_space)

    def set_mode(self, mode: CaptureMode) -> None:
        """Do what ``mode`` says from the next forward pass on."""
        self.mode = mode

    @contextmanager
    def using(self, mode: CaptureMode) -> Iterator[None]:
        """``mode`` inside the block; the previous mode (and no pass in progress) after it."""
        saved = self.mode
        self.mode = mode
        try:
            yield
        finally:
            self.mode, self.current = saved, None

    def state_dict(self) -> CaptureState:
        """The sampler's state and the counts (reads the device counter)."""
        tokens, sequences, target = self._read_counts()
        return CaptureState(self.generator.get_state(), tokens, sequences, target)

    def load_state_dict(self, state: CaptureState) -> None:
        """Restore the sampler and the counts.

        Raises:
            RuntimeError: the sampler state is from a generator of another device type (their
                formats differ); ``tokens_seen`` is restored first.
        """
        self.set_counts(state.tokens_seen, state.sequences_seen, state.target_tokens_seen)
        self.generator.set_state(state.sampler)

    def reseed(self, seed: int) -> None:
        """Restart the token sampler from ``seed``."""
        self.generator.manual_seed(seed)

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        for h in self.handles:
            h.remove()
        if getattr(self.model, _HANDLE_ATTR, None) is self.handles:
            delattr(self.model, _HANDLE_ATTR)
        self.handles = []

    def take(self) -> tuple[list[PassRecord], list[dict[str, Tensor]]]:
        """Hand over and forget the records and inputs collected so far (a shared-input
        group left with a member that was not called is dissolved first)."""
        self.close_calls()
        passes, inputs = self.passes, self.inputs
        self.passes, self.inputs, self.current = [], [], None
        return passes, inputs

    # -- hooks -------------------------------------------------------------------------------

    def _on_model_pre(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.close_calls()
        self.current = None
        if not ((module.training or self.mode.replay) and torch.is_grad_enabled()):
            return
        x = _batch_input(args, kwargs)
        if x is None:
            return
        graphs.check_not_capturing(x)
        shape = (int(x.shape[0]), int(x.shape[1]))
        mode = self.mode
        usable, target = self.streams(kwargs, _labels(kwargs, mode), shape, x.device)
        if mode.count_tokens:
            count = torch.stack([usable.sum(), sequence_usable(usable, shape[0]).sum(),
                                 target.sum() if target is not None else usable.sum() * 0])
            self._counts_device = count if self._counts_device is None else (
                self._counts_device + count.to(self._counts_device.device))
        inputs = {k: v.detach() for k, v in kwargs.items() if isinstance(v, Tensor)} \
            if mode.record_inputs else None
        if not mode.rows:
            if inputs is not None:
                self.inputs.append(inputs)
            return
        gen = self.generator if self.generator.device == usable.device else None
        index, weight = sample_positions(usable, self.token_fraction, gen, slots=mode.slots)
        self.current = PassRecord(index=index, weight=weight, n_positions=shape[0] * shape[1],
                                  inputs=inputs, batch=shape[0], usable=usable)
        if target is not None:  # the decoder's own draw, after the input's
            self.current.target = Positions(*sample_positions(
                target, self.token_fraction, gen, slots=mode.target_slots),
                n_positions=target.numel(), usable=target)
        self.passes.append(self.current)

    def streams(self, kwargs: dict[str, Any], labels: Tensor | None, shape: tuple[int, int],
                device: torch.device) -> tuple[Tensor, Tensor | None]:
        """The usable positions of a pass with forward kwargs ``kwargs`` (``[B, T]`` = ``shape``):
        ``(usable [B*T] bool, decoder's usable [B*T_dec] bool or None)`` (module docstring)."""
        mask = kwargs.get("attention_mask")
        usable = usable_positions(mask if isinstance(mask, Tensor) else None, shape, device)
        # one label per sequence ([B]): a classifier of the user's own, nothing shifted
        per_sequence = isinstance(labels, Tensor) and tuple(labels.shape) == shape[:1]
        if self._causal and not per_sequence:  # without labels (a loss of the user's): the
            scored = labels if isinstance(labels, Tensor) and tuple(labels.shape) == shape \
                else torch.where(usable.reshape(shape), 0, -100)  # next token's (`mc_replay`)
            usable = usable & gradient_positions(scored.to(device), shift=True)
        target = _target_usable(kwargs, labels, shape[0], device) \
            if self._decoder_side else None
        return usable, target

    def _on_encoder_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Note the encoder's output: a decoder-side layer reading it (a cross-attention key
        or value projection) is in the input's positions, not the decoder's."""
        if self.current is not None:
            out = output if isinstance(output, Tensor) else getattr(
                output, "last_hidden_state", None)
            if out is None and isinstance(output, (tuple, list)) and output:
                out = output[0]
            self.current.encoder_out = out if isinstance(out, Tensor) else None

    def _on_model_post(self, module: nn.Module, args: tuple, kwargs: dict[str, Any],
                       output: Any) -> None:
        self._hook_logits(logits_of(output))
        rec, on_end = self.current, self.mode.on_forward_end
        if rec is not None and on_end is not None:
            on_end(rec, output)

    def _on_head_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._hook_logits(output if isinstance(output, Tensor) else None)

    def _hook_logits(self, logits: Tensor | None) -> None:
        rec = self.current
        if rec is None or not self.mode.estimate_scale or logits is None or \
                not logits.requires_grad:
            return

        # The closure must not hold `logits` itself: a tensor whose own hook references it is
        # a cycle through autograd's C++ state that Python's GC cannot see (every update
        # step's logits would leak). A detached alias shares the storage, not the cycle.
        detached = logits.detach()

        def on_logits_grad(grad: Tensor, rec: PassRecord = rec, logits: Tensor = detached) -> None:
            if grad is None:  # an undefined gradient (DDP's output wrapper can pass None)
                return
            lg = logits.reshape(-1, logits.shape[-1])  # [rows, V]
            gr = grad.reshape(-1, grad.shape[-1])
            rec.fits.append(cross_entropy_scale(lg, gr))

        logits.register_hook(on_logits_grad)

    def close_calls(self) -> None:
        """End the shared-input calls in progress: a group with a member that was not called
        with the others is dissolved (its A rows would otherwise count for that member)."""
        for group, held in list(self._shared_input.items()):
            self._dissolve(group, f"{held[2][0]!r} was not called with the others")
        self._shared_input.clear()

    def _dissolve(self, group: tuple[str, ...], why: str) -> None:
        """Stop sharing ``group``'s A (from this call on every member gathers its own rows)."""
        if self._group.get(group[0]) != group:
            return
        for name in group:
            del self._group[name]
        self._shared_input.pop(group, None)
        self.dissolved.append(group)
        log = logging.getLogger("kfac_stream")
        (log.warning if not self._warned_dissolve else log.info)(
            "kfac_stream: layers %s were planned to share one A factor (same input tensor in "
            "the probe forward) but %s in training; they keep their own A factors from now on "
            "(exact: each starts from the shared one, equal until then)%s", list(group), why,
            "" if self._warned_dissolve else "; further dissolved groups are logged at INFO")
        self._warned_dissolve = True

    def forget_groups(self, groups: list[tuple[str, ...]]) -> None:
        """Treat ``groups`` as dissolved without a warning (a checkpoint's plan had them so)."""
        for group in groups:
            for name in group:
                if self._group.get(name) == group:
                    del self._group[name]
            self._shared_input.pop(group, None)

    def _shared_rows(self, name: str, group: tuple[str, ...], x: Tensor,
                     gather: Callable[[], Tensor]) -> tuple[bool, Tensor | None]:
        """Rows of ``name``'s input in a shared-input group: ``(shared, rows)``. The first
        member called gathers them (``gather``), the others get the same tensor if they
        received the same input (host attributes only); a member called twice before the
        others, or with another input, dissolves the group (``shared`` False: gather your
        own)."""
        held = self._shared_input.get(group)
        if held is None:
            rows = gather()
            self._shared_input[group] = [x, rows, [n for n in group if n != name]]
            return True, rows
        if name not in held[2]:
            self._dissolve(group, f"{name!r} was called twice before {held[2][0]!r}")
            return False, None
        if not same_data(held[0], x):
            self._dissolve(group, f"{name!r} received another input than {group[0]!r}"
                           if name != group[0] else f"{name!r} received another input")
            return False, None
        held[2].remove(name)
        if not held[2]:
            del self._shared_input[group]
        return True, held[1]

    def _layer_hook(self, name: str):
        a_diag = self._a_diagonal[name]  # a shared A has its members' side: the same choice
        g_diag = FactorPlan.g_key(name) in self._diagonal

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            rec = self.current
            if rec is None or not isinstance(output, Tensor) or not output.requires_grad:
                return
            x = args[0]
            made, stream = self._space(name, x, rec)
            usable = rec.target.usable if stream == "target" else rec.usable
            if made == "position":
                draw = rec.target if stream == "target" else rec
                if stream == "target":
                    rec.target_layers.add(name)
                index, weight, n = draw.index, draw.weight, draw.n_positions
            else:  # one row per sequence: a [B, d] input, or the reduce form
                rec.seq_layers.add(name)
                index, weight, n = None, rec.sequence_weight(), rec.batch

            def rows(t: Tensor, mean: bool) -> Tensor:  # [m, d] of an input or a gradient
                if made == "reduced":
                    return reduce_rows(t, usable, rec.batch, mean, self.row_dtype)
                return gather_rows(t, index, n, self.row_dtype)

            def gather() -> Tensor:
                a = rows(x, True)  # [m, d_in]
                if a_diag:
                    a = weighted_squares(a, weight, self.sum_dtype)  # [d_in]
                return a

            group = self._group.get(name)
            shared, a = self._shared_rows(name, group, x, gather) if group else (False, None)
            if not shared:
                a = gather()
            if self.mode.keep_outputs:  # MC pass only: the driver differentiates w.r.t. them
                rec.outputs.append(output)
            # the extensions that keep this call: the whole input, for their gradients
            kept = [(ext, token) for ext in self.extensions
                    if (token := ext.keep_call(name)) is not None]
            full = x if kept else None

            def on_grad(grad: Tensor, rec: PassRecord = rec, a: Tensor = a,
                        full: Tensor | None = full) -> None:
                if grad is None or rec.closed:
                    return
                for ext, token in kept:
                    ext.add_call(rec, name, full, grad, usable if made != "sequence"
                                 else rec.sequence_weight() > 0, token)
                g = rows(grad, False)  # [m, d_out]
                if g_diag:
                    rec.g_sums.setdefault(name, []).append(
                        weighted_squares(g, weight, self.sum_dtype))  # [d_out]
                else:
                    rec.g_rows.setdefault(name, []).append(g)
                (rec.a_sums if a_diag else rec.a_rows).setdefault(name, []).append(a)

            output.register_hook(on_grad)

        return hook

    def _space(self, name: str, x: Tensor, rec: PassRecord) -> tuple[str, str]:
        """How ``name``'s rows are made in this call, and from which stream: ``("position",
        stream)`` (sampled positions of the input's stream, ``"position"``, or the decoder's,
        ``"target"``), ``("sequence", "sequence")`` (a ``[B, d]`` input: every row) or
        ``("reduced", stream)`` (the reduce form: one row per sequence from the stream's
        positions). A decoder-side layer (`decoder_side`) is in the decoder's positions unless
        its input is the encoder's output (a cross-attention key or value). The input's row
        space (`ROW_SPACES`) is fixed at the first captured call; a later call in another, or
        rows that fit none, raise (`stats.rows.row_space_of`)."""
        target = rec.target.n_positions if rec.target is not None and \
            name in self._decoder_side and not (
                rec.encoder_out is not None and same_data(rec.encoder_out, x)) else None
        space = row_space_of(name, x, rec.batch, rec.n_positions, target=target,
                             model=self.model)
        known = self._input_space.setdefault(name, space)
        if known != space:
            raise RuntimeError(
                f"kfac_stream: tracked layer {name!r} saw one row per {space} in this forward "
                f"pass but one per {known} before ({tuple(x.shape)} input here); a layer's "
                "factors need one row space. Exclude it (KFACConfig(exclude=[...])).")
        assert space in ROW_SPACES
        made = "reduced" if space != "sequence" and self.reduce else \
            "sequence" if space == "sequence" else "position"
        self.row_space[name] = "sequence" if made != "position" else space
        return made, space
