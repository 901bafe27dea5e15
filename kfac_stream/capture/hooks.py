"""Forward hooks and output-tensor hooks that collect sampled rows of ``ā`` and ``g``.

One ``PassRecord`` per training forward pass of the model (one micro-batch):

* a forward pre-hook on the model draws a fixed number of token positions once for the pass
  (same positions for every layer; padding slots weighted 0, `stats.rows.sample_positions`)
  and adds the usable tokens to a counter kept on the device;
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
thread never waits for the device (tests/test_host_syncs.py counts them). The hooks do no math
beyond gathering rows; everything else happens in the tracker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..stats.covariance import weighted_squares
from ..stats.loss_scale import cross_entropy_scale
from ..stats.rows import (
    ROW_SPACES,
    gather_rows,
    reduce_rows,
    row_space_of,
    sample_positions,
    sequence_usable,
    usable_positions,
)
from . import graphs
from .sharing import FactorPlan, same_data

_HANDLE_ATTR = "_kfac_stream_handles"


@dataclass(frozen=True)
class CaptureMode:
    """What the hooks do in the forward passes that follow (`CaptureHooks.set_mode`).

    Attributes:
        rows: Sample positions and gather rows in training passes (update steps).
        record_inputs: Keep each training pass's tensor kwargs (the MC replay needs them).
        estimate_scale: Recover the loss scale ``c`` from the logits' gradient (empirical
            Fisher).
        count_tokens: Add the pass's usable positions to ``tokens_seen`` (not for MC replays,
            which see the same tokens again).
        keep_outputs: Keep the tracked layers' outputs in the record (the MC gradient is taken
            with respect to them).
        on_forward_end: Called with ``(record, model output)`` at the end of a captured
            forward (the tracker's in-forward MC Fisher); None: nothing.
        slots: Positions sampled per pass in the passes that follow, instead of the
            tracker's ``token_fraction`` of them (the MC sub-batch replay, which takes the
            slots of a whole micro-batch from a few of its sequences); None: the fraction's.
        replay: The tracker's own forwards (the MC replays), captured in whatever mode the
            model is (they run in eval mode, `posterior_mode`); other forwards are captured
            only in training mode (an evaluation's are not training's).
    """

    rows: bool = False
    record_inputs: bool = False
    estimate_scale: bool = True
    count_tokens: bool = True
    keep_outputs: bool = False
    on_forward_end: Callable[[PassRecord, Any], None] | None = None
    slots: int | None = None
    replay: bool = False


IDLE = CaptureMode()  # between update steps: count tokens, gather nothing
MC_REPLAY = CaptureMode(rows=True, estimate_scale=False, count_tokens=False, keep_outputs=True,
                        replay=True)


@dataclass(frozen=True)
class CaptureState:
    """What a checkpoint keeps of the hooks.

    Attributes:
        sampler: The token sampler's generator state (uint8 tensor; its format depends on the
            generator's device type).
        tokens_seen: Usable positions of every training forward pass so far.
        sequences_seen: Sequences with a usable position, of the same passes (0 in states
            written before it was counted).
    """

    sampler: Tensor
    tokens_seen: int
    sequences_seen: int = 0


@dataclass
class PassRecord:
    """What one forward pass (micro-batch) contributed.

    Attributes:
        index: ``[m]`` flat indices (into ``B*T``) of the sampled slots (device).
        weight: ``[m]`` float32 Horvitz–Thompson weights (0 on padding slots; device).
        n_positions: ``B*T`` of the pass.
        scale: Loss scale ``c`` when known exactly (1.0 for the MC pass); else None and
            ``fits`` decide.
        fits: ``[(c, residual, rows_used)]`` 0-dim device tensors, one per logits hook that
            fired in the backward, in firing order (see ``stats.loss_scale``).
        a_rows: ``{layer: [a_rows [m, d_in], ...]}``, one per forward call of the layer
            whose output received a gradient; the members of a shared-input group hold the
            same row tensors (gathered once per call), which the tracker takes once per
            shared A key (`Tracker._collect`).
        g_rows: ``{layer: [g_rows [m, d_out], ...]}``, still scaled by ``c``.
        a_sums, g_sums: The same (keyed by layer) for diagonal factors (side >
            ``max_dense_dim``), reduced at once to ``Σ_s w_s x_s⊙x_s`` (``[d]``; no bias
            entry; ``g`` still scaled by ``c``): a diagonal factor never needs its rows, and
            they are the widest.
        outputs: Tracked layer outputs that require grad (used by the MC pass).
        inputs: The pass's tensor kwargs (``record_inputs``: the MC Fisher needs them).
        closed: No more rows are taken (set once the in-forward MC gradient has been taken,
            so the training backward that follows adds nothing).
        replay: The in-forward MC gradient was not possible for this pass: replay it after
            the step (`mc.mc_fisher_pass`).
        total: 0-dim device tensor, the EMA weight ``n`` of the pass when it is not
            ``weight.sum()``: the MC sub-batch replay weights its slots by the inverse of
            their inclusion probability in two stages (sequences, then positions), whose sum
            varies with the sequences drawn, while ``n`` is the micro-batch's usable positions
            (`mc_fisher.mc_subbatch_pass`). None: ``weight.sum()``.
        batch: ``B`` of the pass (the rows of a sequence-space layer).
        usable: ``[B*T]`` bool, the pass's usable positions (device).
        seq_weight: ``[B]`` float32 weights of the sequence rows: 1 for a sequence with a usable
            position, 0 for an all-padding one (times ``1/P(drawn)`` in an MC sub-batch
            replay); made at the first sequence-space call (`sequence_weight`).
        seq_total: Like ``total``, for the sequence rows (None: ``seq_weight.sum()``).
        seq_layers: Layers whose rows in this pass are sequences (`CaptureHooks.row_space`).
        ekfac: The pass's `kfac_stream.ekfac.PassCorrections`: per layer
            ``Σ_n (Q_Gᵀ ∇_W L_n Q_A)² [d_out, d_A]`` over the pass's whole sequences, the
            gradient summed over the layer's calls (``g`` still scaled by ``c``); None unless
            the tracker streams the EK-FAC correction and has a basis.
        seq_scale: The weight of each of the pass's sequences (``1/P(drawn)`` in an MC
            sub-batch replay, `mc_fisher.mc_subbatch_pass`; 1 otherwise).
    """

    index: Tensor
    weight: Tensor
    n_positions: int
    scale: float | None = None
    fits: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)
    a_rows: dict[str, list[Tensor]] = field(default_factory=dict)
    g_rows: dict[str, list[Tensor]] = field(default_factory=dict)
    a_sums: dict[str, list[Tensor]] = field(default_factory=dict)
    g_sums: dict[str, list[Tensor]] = field(default_factory=dict)
    outputs: list[Tensor] = field(default_factory=list)
    inputs: dict[str, Tensor] | None = None
    closed: bool = False
    replay: bool = False
    total: Tensor | None = None
    batch: int = 0
    usable: Tensor | None = None
    seq_weight: Tensor | None = None
    seq_total: Tensor | None = None
    seq_layers: set[str] = field(default_factory=set)
    ekfac: Any = None
    seq_scale: float = 1.0

    def sequence_weight(self) -> Tensor:
        """``[B]`` float32 weights of the pass's sequence rows (made once, on the device)."""
        if self.seq_weight is None:
            self.seq_weight = sequence_usable(self.usable, self.batch).to(torch.float32)
        return self.seq_weight

    def resolve_scale(self) -> Tensor | float | None:
        """``c`` of the pass: ``scale`` if set, else the first fit with live rows (a device
        tensor, NaN if no fit had any), else None (no logits hook fired)."""
        if self.scale is not None:
            return self.scale
        return self._first_live_fit(0)

    def residual(self) -> Tensor | None:
        """Relative residual of the fit that gave ``c`` (device tensor), None without fits."""
        return None if self.scale is not None else self._first_live_fit(1)

    def _first_live_fit(self, field: int) -> Tensor | None:
        """Entry ``field`` of the first fit with live rows (the last fit if none has any)."""
        if not self.fits:
            return None
        out = self.fits[-1][field]
        for fit in reversed(self.fits[:-1]):
            out = torch.where(fit[2] > 0, fit[field], out)
        return out


def _batch_input(args: tuple, kwargs: dict[str, Any]) -> Tensor | None:
    """The ``[B, T, ...]`` tensor that gives a forward pass its batch shape and device."""
    for key in ("input_ids", "inputs_embeds", "attention_mask"):
        x = kwargs.get(key)
        if isinstance(x, Tensor) and x.dim() >= 2:
            return x
    if args and isinstance(args[0], Tensor) and args[0].dim() >= 2:
        return args[0]
    return None


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
        self.reduce = reduce  # the reduce form (`kfac_stream.curvature`): per-sequence rows
        self.row_dtype = row_dtype
        self.sum_dtype = sum_dtype
        self._diagonal = {key for key, (_, diag) in plan.dims.items() if diag}
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.mode = IDLE
        self.current: PassRecord | None = None
        self.passes: list[PassRecord] = []
        self.inputs: list[dict[str, Tensor]] = []
        self._counts_host = [0, 0]  # [usable positions, usable sequences]
        self._counts_device: Tensor | None = None  # [2] int64, since the last read
        self.row_space: dict[str, str] = {}  # layer -> its factors' rows: "position" | "sequence"
        self._input_space: dict[str, str] = {}  # layer -> its input's rows (first call)
        self._layers = layers
        self._a_diagonal = {n: plan.dims[k][1] for n, k in plan.a_key.items()}
        self._group = {n: g for g in plan.groups for n in g}  # layer -> its shared-input group
        # group -> [its input of this call, its rows, members still to be called]; dropped when
        # the last member has been called, so no activation outlives its block
        self._shared_input: dict[tuple[str, ...], list] = {}
        self.dissolved: list[tuple[str, ...]] = []  # groups dissolved, not yet taken
        self._warned_dissolve = False
        # the tracker's `kfac_stream.ekfac.EkfacState` with KFACConfig(ekfac=True), else None
        self.ekfac = None
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
        for name, module in layers.items():
            self.handles.append(module.register_forward_hook(self._layer_hook(name)))
        self.model = model
        setattr(model, _HANDLE_ATTR, self.handles)

    def _read_counts(self) -> list[int]:
        """``[tokens, sequences]`` so far (reads the device counter once)."""
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

    def set_counts(self, tokens: int, sequences: int) -> None:
        """Set `tokens_seen` and `sequences_seen` (a restored state); the counts of passes
        not yet read are dropped, nothing is read from the device."""
        self._counts_host, self._counts_device = [int(tokens), int(sequences)], None

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
        """The sampler's state, ``tokens_seen`` and ``sequences_seen`` (reads the device
        counter)."""
        return CaptureState(self.generator.get_state(), self.tokens_seen, self.sequences_seen)

    def load_state_dict(self, state: CaptureState) -> None:
        """Restore the sampler, ``tokens_seen`` and ``sequences_seen``.

        Raises:
            RuntimeError: the sampler state is from a generator of another device type (their
                formats differ); ``tokens_seen`` is restored first.
        """
        self.set_counts(state.tokens_seen, state.sequences_seen)
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
        mask = kwargs.get("attention_mask")
        usable = usable_positions(mask if isinstance(mask, Tensor) else None, shape, x.device)
        mode = self.mode
        if mode.count_tokens:
            count = torch.stack([usable.sum(), sequence_usable(usable, shape[0]).sum()])
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
        self.passes.append(self.current)

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
            space = self._space(name, x, rec)
            if space == "position":
                index, weight, n = rec.index, rec.weight, rec.n_positions
            else:  # one row per sequence: a [B, d] input, or the reduce form
                rec.seq_layers.add(name)
                index, weight, n = None, rec.sequence_weight(), rec.batch

            def rows(t: Tensor, mean: bool) -> Tensor:  # [m, d] of an input or a gradient
                if space == "reduced":
                    return reduce_rows(t, rec.usable, rec.batch, mean, self.row_dtype)
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
            # EK-FAC (`kfac_stream.ekfac`): the whole input, for the per-sequence gradients
            basis = self.ekfac.basis_of(name) if self.ekfac is not None else None
            full = x if basis is not None else None

            def on_grad(grad: Tensor, rec: PassRecord = rec, a: Tensor = a,
                        full: Tensor | None = full) -> None:
                if grad is None or rec.closed:
                    return
                if full is not None:  # squared once over the layer's calls of the pass
                    usable = rec.usable if space != "sequence" else rec.sequence_weight() > 0
                    if rec.ekfac is None:
                        rec.ekfac = self.ekfac.new_pass(rec.batch)
                    rec.ekfac.add_call(name, full, grad, usable, basis)
                g = rows(grad, False)  # [m, d_out]
                if g_diag:
                    rec.g_sums.setdefault(name, []).append(
                        weighted_squares(g, weight, self.sum_dtype))  # [d_out]
                else:
                    rec.g_rows.setdefault(name, []).append(g)
                (rec.a_sums if a_diag else rec.a_rows).setdefault(name, []).append(a)

            output.register_hook(on_grad)

        return hook

    def _space(self, name: str, x: Tensor, rec: PassRecord) -> str:
        """How ``name``'s rows are made in this call: ``"position"`` (sampled positions),
        ``"sequence"`` (a ``[B, d]`` input: every row) or ``"reduced"`` (the reduce form: one
        row per sequence from its positions). The input's row space (`ROW_SPACES`) is fixed
        at the first captured call; a later call in another, or rows that fit neither, raise
        (`stats.rows.row_space_of`)."""
        space = row_space_of(name, x, rec.batch, rec.n_positions, self.model)
        known = self._input_space.setdefault(name, space)
        if known != space:
            raise RuntimeError(
                f"kfac_stream: tracked layer {name!r} saw one row per {space} in this forward "
                f"pass but one per {known} before ({tuple(x.shape)} input here); a layer's "
                "factors need one row space. Exclude it (KFACConfig(exclude=[...])).")
        assert space in ROW_SPACES
        made = "reduced" if space == "position" and self.reduce else space
        self.row_space[name] = "position" if made == "position" else "sequence"
        return made
