"""What the capture hooks record: the mode they run in (`CaptureMode`), what a checkpoint keeps
of them (`CaptureState`), one forward pass's rows (`PassRecord`) and the positions drawn for
one of its position streams (`Positions`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..stats.rows import sequence_usable


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
        target_slots: Like ``slots``, for the decoder positions of an encoder-decoder.
        labels: ``[B, T]`` labels of the passes that follow when their forward is called
            without them (the MC replays): they say which positions carry a loss.
    """

    rows: bool = False
    record_inputs: bool = False
    estimate_scale: bool = True
    count_tokens: bool = True
    keep_outputs: bool = False
    on_forward_end: Callable[[PassRecord, Any], None] | None = None
    slots: int | None = None
    replay: bool = False
    target_slots: int | None = None
    labels: Tensor | None = field(default=None, compare=False)


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
        target_tokens_seen: Usable decoder positions of an encoder-decoder's training
            passes (0 for other models).
    """

    sampler: Tensor
    tokens_seen: int
    sequences_seen: int = 0
    target_tokens_seen: int = 0


@dataclass
class Positions:
    """The positions drawn in one position stream of a pass (the decoder's, `PassRecord`).

    Attributes:
        index: ``[m]`` flat indices (into ``B*T``) of the sampled slots (device).
        weight: ``[m]`` float32 Horvitz–Thompson weights (0 on unusable slots; device).
        n_positions: ``B*T`` of the stream.
        usable: ``[B*T]`` bool, the stream's usable positions (device).
        total: Like `PassRecord.total` (None: ``weight.sum()``).
    """

    index: Tensor
    weight: Tensor
    n_positions: int
    usable: Tensor
    total: Tensor | None = None


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
            (`mc_replay.mc_subbatch_pass`). None: ``weight.sum()``.
        batch: ``B`` of the pass (the rows of a sequence-space layer).
        usable: ``[B*T]`` bool, the pass's usable positions (device).
        seq_weight: ``[B]`` float32 weights of the sequence rows: 1 for a sequence with a usable
            position, 0 for an all-padding one (times ``1/P(drawn)`` in an MC sub-batch
            replay); made at the first sequence-space call (`sequence_weight`).
        seq_total: Like ``total``, for the sequence rows (None: ``seq_weight.sum()``).
        seq_layers: Layers whose rows in this pass are sequences (`CaptureHooks.row_space`).
        extensions: ``{name: the pass's state}`` of the tracker's extensions that kept a call
            of it (`kfac_stream.extensions.TrackerExtension.add_call`; EK-FAC's
            `kfac_stream.ekfac.PassCorrections`).
        seq_scale: The weight of each of the pass's sequences (``1/P(drawn)`` in an MC
            sub-batch replay, `mc_replay.mc_subbatch_pass`; 1 otherwise).
        target: The decoder positions of an encoder-decoder's pass (None: other models);
            ``index``, ``weight``, ``n_positions``, ``usable`` and ``total`` above are the
            model input's (its encoder's).
        target_layers: Layers whose rows in this pass are decoder positions.
        encoder_out: The encoder's output of the pass (an encoder-decoder's; the
            cross-attention projections that read it are in the input's positions).
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
    extensions: dict[str, Any] = field(default_factory=dict)
    seq_scale: float = 1.0
    target: Positions | None = None
    target_layers: set[str] = field(default_factory=set)
    encoder_out: Tensor | None = None

    def space_of(self, name: str) -> str:
        """The row space of layer ``name``'s rows in this pass (`stats.rows.ROW_SPACES`)."""
        return "sequence" if name in self.seq_layers else \
            "target" if name in self.target_layers else "position"

    def stream(self, space: str) -> tuple[Tensor, Tensor | None, Tensor]:
        """``(weight, total, usable)`` of a position stream: ``"position"`` or ``"target"``."""
        if space == "target":
            return self.target.weight, self.target.total, self.target.usable
        return self.weight, self.total, self.usable

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
