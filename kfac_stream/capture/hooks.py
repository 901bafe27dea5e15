"""Forward hooks and output-tensor hooks that collect sampled rows of ``ā`` and ``g``.

One ``PassRecord`` per training forward pass of the model (one micro-batch):

* a forward pre-hook on the model draws the token positions once for the pass (same positions
  for every layer; padding never used) and counts the usable tokens;
* a forward hook on each tracked layer gathers the input rows and registers a hook on the
  output *tensor* (not a module backward hook: robust to in-place ops, pytorch#61519). The
  (input rows, output-gradient rows) pair is appended only when that hook fires, so a forward
  that is recomputed by gradient checkpointing (hooks fire twice, only one output receives a
  gradient) counts each position once;
* in empirical mode the logits' gradient gives the loss scale ``c`` of the pass
  (``stats.loss_scale``). Two places are hooked: the logits the model returns (the loss input
  when the user computes the loss, after e.g. soft-capping) and the output of the output
  embedding (``get_output_embeddings()``, the LM head), which is the loss input when the model
  computes the loss itself but the returned logits are a copy (accelerate's mixed-precision
  wrapper converts outputs to float32 after the loss was taken). The first hook that fires in
  the backward (the one nearer the loss) sets ``c``.

The hooks do no math beyond gathering rows; everything else happens in the tracker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..stats.loss_scale import cross_entropy_scale
from ..stats.rows import gather_rows, sample_positions, usable_positions

_HANDLE_ATTR = "_kfac_stream_handles"


@dataclass
class PassRecord:
    """What one forward pass (micro-batch) contributed.

    Attributes:
        index: ``[n]`` flat indices (into ``B*T``) of the sampled positions.
        n_positions: ``B*T`` of the pass.
        scale: Loss scale ``c`` (hook gradients are ``c·g``); None until known.
        residual: Relative residual of the scale fit (see ``stats.loss_scale``).
        rows: ``{layer: [(a_rows [n, d_in], g_rows [n, d_out]), ...]}``, ``g`` still scaled by
            ``c``; one pair per forward call whose output received a gradient.
        outputs: Tracked layer outputs that require grad (used by the MC pass).
    """

    index: Tensor
    n_positions: int
    scale: float | None = None
    residual: float = 0.0
    rows: dict[str, list[tuple[Tensor, Tensor]]] = field(default_factory=dict)
    outputs: list[Tensor] = field(default_factory=list)


def _batch_input(args: tuple, kwargs: dict[str, Any]) -> Tensor | None:
    """The ``[B, T, ...]`` tensor that gives a forward pass its batch shape and device."""
    for key in ("input_ids", "inputs_embeds", "attention_mask"):
        x = kwargs.get(key)
        if isinstance(x, Tensor) and x.dim() >= 2:
            return x
    if args and isinstance(args[0], Tensor) and args[0].dim() >= 2:
        return args[0]
    return None


def _logits_of(output: Any) -> Tensor | None:
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
        capturing: Gather rows in training forward passes (set on update steps).
        record_inputs: Keep each training pass's tensor kwargs (the MC pass replays them).
        estimate_scale: Recover ``c`` from the logits' gradient (empirical Fisher).
        passes: Records of the passes since the last ``take()``.
        inputs: Recorded kwargs since the last ``take()``.
        tokens_seen: Usable positions of every training forward pass, captured or not.
    """

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module], token_fraction: float,
                 seed: int, row_dtype: torch.dtype) -> None:
        self.token_fraction = token_fraction
        self.row_dtype = row_dtype
        self.generator = torch.Generator().manual_seed(seed)
        self.capturing = False
        self.record_inputs = False
        self.estimate_scale = True
        self.counting = True
        self.keep_outputs = False
        self.current: PassRecord | None = None
        self.passes: list[PassRecord] = []
        self.inputs: list[dict[str, Tensor]] = []
        self.tokens_seen = 0
        self.scale_warning: Callable[[float], None] | None = None
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
        self._model = model
        setattr(model, _HANDLE_ATTR, self.handles)

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        for h in self.handles:
            h.remove()
        if getattr(self._model, _HANDLE_ATTR, None) is self.handles:
            delattr(self._model, _HANDLE_ATTR)
        self.handles = []

    def take(self) -> tuple[list[PassRecord], list[dict[str, Tensor]]]:
        """Hand over and forget the records and inputs collected so far."""
        passes, inputs = self.passes, self.inputs
        self.passes, self.inputs, self.current = [], [], None
        return passes, inputs

    # -- hooks -------------------------------------------------------------------------------

    def _on_model_pre(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.current = None
        if not (module.training and torch.is_grad_enabled()):
            return
        x = _batch_input(args, kwargs)
        if x is None:
            return
        shape = (int(x.shape[0]), int(x.shape[1]))
        mask = kwargs.get("attention_mask")
        usable = usable_positions(mask if isinstance(mask, Tensor) else None, shape, x.device)
        if self.counting:
            self.tokens_seen += int(usable.sum())
        if self.record_inputs:
            self.inputs.append({k: v.detach() for k, v in kwargs.items() if isinstance(v, Tensor)})
        if not self.capturing:
            return
        index = sample_positions(usable, self.token_fraction, self.generator)
        self.current = PassRecord(index=index, n_positions=shape[0] * shape[1])
        self.passes.append(self.current)

    def _on_model_post(self, module: nn.Module, args: tuple, kwargs: dict[str, Any],
                       output: Any) -> None:
        self._hook_logits(_logits_of(output))

    def _on_head_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._hook_logits(output if isinstance(output, Tensor) else None)

    def _hook_logits(self, logits: Tensor | None) -> None:
        rec = self.current
        if rec is None or not self.estimate_scale or logits is None or not logits.requires_grad:
            return

        # The closure must not hold `logits` itself: a tensor whose own hook references it is
        # a cycle through autograd's C++ state that Python's GC cannot see (every update
        # step's logits would leak). A detached alias shares the storage, not the cycle.
        detached = logits.detach()

        def on_logits_grad(grad: Tensor, rec: PassRecord = rec, logits: Tensor = detached) -> None:
            if rec.scale is not None or grad is None:  # set by the hook nearer the loss, or
                return  # an undefined gradient (DDP's output wrapper can pass None)
            lg = logits.reshape(-1, logits.shape[-1])  # [rows, V]
            gr = grad.reshape(-1, grad.shape[-1])
            c, resid, used = float("nan"), 0.0, 0
            if lg.shape[0] == rec.n_positions and rec.index.numel() > 0:
                c, resid, used = cross_entropy_scale(lg[rec.index], gr[rec.index])
            if used == 0:  # no loss-bearing row among the sampled ones: use all rows
                c, resid, used = cross_entropy_scale(lg, gr)
            if used == 0:
                return  # no gradient reached these logits; leave c to another hook
            rec.scale, rec.residual = c, resid
            if self.scale_warning is not None and resid > 1e-2:
                self.scale_warning(resid)

        logits.register_hook(on_logits_grad)

    def _layer_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            rec = self.current
            if rec is None or not isinstance(output, Tensor) or not output.requires_grad:
                return
            a = gather_rows(args[0], rec.index, rec.n_positions, self.row_dtype)  # [n, d_in]
            if self.keep_outputs:  # MC pass only: the driver differentiates w.r.t. them
                rec.outputs.append(output)

            def on_grad(grad: Tensor, rec: PassRecord = rec, a: Tensor = a) -> None:
                if grad is None:
                    return
                g = gather_rows(grad, rec.index, rec.n_positions, self.row_dtype)  # [n, d_out]
                rec.rows.setdefault(name, []).append((a, g))

            output.register_hook(on_grad)

        return hook
