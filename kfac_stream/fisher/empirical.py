"""The empirical Fisher: G from the training backward's own gradients (the observed labels).
Free: the training passes' rows are the factors' rows; the loss scale is estimated from the
logits' gradient (`kfac_stream.stats.loss_scale`)."""

from __future__ import annotations

from ..capture.hooks import CaptureMode
from .base import FisherEstimator, StepContext, register_fisher


@register_fisher
class EmpiricalFisher(FisherEstimator):
    name = "empirical"
    sampled_labels = False

    def capture_mode(self, ctx: StepContext, update_step: bool) -> CaptureMode:
        return CaptureMode(rows=update_step, record_inputs=False, estimate_scale=True)

    def passes(self, ctx: StepContext, model, passes: list, inputs: list[dict]) -> list:
        return passes
