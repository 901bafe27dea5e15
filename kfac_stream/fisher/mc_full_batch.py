"""The MC Fisher on whole micro-batches (``mc_sequences="all"`` or ``1.0``): one label per
position sampled from the model, its gradient taken inside the training forward where the
engine and the model allow a second backward there, else in a replay of each micro-batch
(`kfac_stream.capture.mc_fisher`)."""

from __future__ import annotations

from ..capture.hooks import CaptureMode
from ..capture.mc_fisher import is_encoder_decoder, mc_fisher_pass, mc_grad_in_forward
from ..config import KFACConfig
from .base import FisherEstimator, register_fisher


@register_fisher
class MCFullBatch(FisherEstimator):
    name = "mc"
    sampled_labels = True

    @classmethod
    def applies(cls, config: KFACConfig) -> bool:
        return config.mc_full_batch

    def capture_mode(self, update_step: bool) -> CaptureMode:
        in_forward = update_step and self.tracker.backward_in_forward_ok()
        return CaptureMode(rows=in_forward, record_inputs=update_step, estimate_scale=False,
                           keep_outputs=in_forward,
                           on_forward_end=self._in_forward if in_forward else None)

    def _in_forward(self, rec, output) -> None:
        t = self.tracker
        mc_grad_in_forward(rec, output, t.mc_generator, shift=not is_encoder_decoder(t.model))

    def passes(self, model, passes: list, inputs: list[dict]) -> list:
        capture = self.tracker.capture
        inputs = inputs + [rec.inputs for rec in passes if rec.replay]  # what the forward
        passes = [rec for rec in passes if not rec.replay]  # could not take is replayed
        for kwargs in inputs:
            mc_fisher_pass(model, capture, kwargs, self.tracker.mc_generator)
        return passes + capture.take()[0]
