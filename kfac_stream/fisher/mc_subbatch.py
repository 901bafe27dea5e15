"""The MC Fisher on a share of each update step's sequences (``mc_sequences`` an int or a
fraction below 1): a systematic draw of sequences per micro-batch (`replay_counts`, the same
on every rank), replayed with labels sampled from the model and weighted by ``1/P(drawn)``
(`kfac_stream.capture.mc_fisher.mc_subbatch_pass`)."""

from __future__ import annotations

from ..capture.hooks import CaptureMode
from ..capture.mc_fisher import batch_size, mc_subbatch_pass
from ..config import KFACConfig
from ..replay_draws import replay_counts, selection_seed
from .base import FisherEstimator, register_fisher


@register_fisher
class MCSubBatch(FisherEstimator):
    name = "mc"
    sampled_labels = True

    @classmethod
    def applies(cls, config: KFACConfig) -> bool:
        return not config.mc_full_batch

    def capture_mode(self, update_step: bool) -> CaptureMode:
        return CaptureMode(rows=False, record_inputs=update_step, estimate_scale=False)

    def passes(self, model, passes: list, inputs: list[dict]) -> list:
        t, cfg = self.tracker, self.tracker.config
        step = int(t.step or 0)
        t.select_generator.manual_seed(selection_seed(cfg.seed, t.rank, step))
        counts, share = replay_counts(cfg.mc_sequences, [batch_size(k) for k in inputs],
                                      cfg.seed, step, at_least_one=step == 0)
        for kwargs, count in zip(inputs, counts):
            if count != 0:  # micro-batches the share did not draw are not replayed
                mc_subbatch_pass(model, t.capture, kwargs, label_generator=t.mc_generator,
                                 select_generator=t.select_generator, count=count,
                                 token_fraction=cfg.token_fraction, share=share)
        return t.capture.take()[0]
