"""The MC Fisher on whole micro-batches (``mc_sequences="all"`` or ``1.0``): one label per
position sampled from the model, its gradient taken inside the training forward where the
engine and the model allow a second backward there, else in a replay of each micro-batch
(`kfac_stream.fisher.mc_replay`)."""

from __future__ import annotations

import functools

from ..capture.hooks import CaptureMode
from ..config import KFACConfig
from .base import FisherEstimator, StepContext, register_fisher
from .mc_replay import is_encoder_decoder, mc_fisher_pass, mc_grad_in_forward


@register_fisher
class MCFullBatch(FisherEstimator):
    name = "mc"
    sampled_labels = True

    @classmethod
    def applies(cls, config: KFACConfig) -> bool:
        return config.mc_full_batch

    def capture_mode(self, ctx: StepContext, update_step: bool) -> CaptureMode:
        in_forward = update_step and ctx.backward_in_forward_ok()
        return CaptureMode(rows=in_forward, record_inputs=update_step, estimate_scale=False,
                           keep_outputs=in_forward,
                           on_forward_end=functools.partial(self._in_forward, ctx)
                           if in_forward else None)

    @staticmethod
    def _in_forward(ctx: StepContext, rec, output) -> None:
        mc_grad_in_forward(rec, output, ctx.mc_generator,
                           shift=not is_encoder_decoder(ctx.model))

    def passes(self, ctx: StepContext, model, passes: list, inputs: list[dict]) -> list:
        capture = ctx.capture
        inputs = inputs + [rec.inputs for rec in passes if rec.replay]  # what the forward
        passes = [rec for rec in passes if not rec.replay]  # could not take is replayed
        for kwargs in inputs:
            mc_fisher_pass(model, capture, kwargs, ctx.mc_generator)
        return passes + capture.take()[0]
