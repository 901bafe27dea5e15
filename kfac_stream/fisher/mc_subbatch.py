"""The MC Fisher on a share of each update step's sequences (``mc_sequences`` an int or a
fraction below 1): a systematic draw of sequences per micro-batch (`replay_counts`, the same
on every rank), replayed with labels sampled from the model and weighted by ``1/P(drawn)``
(`kfac_stream.fisher.mc_replay.mc_subbatch_pass`)."""

from __future__ import annotations

from ..capture.hooks import CaptureMode
from ..config import KFACConfig
from .base import FisherEstimator, StepContext, register_fisher
from .mc_replay import batch_size, mc_subbatch_pass
from .replay_draws import replay_counts, selection_seed


@register_fisher
class MCSubBatch(FisherEstimator):
    name = "mc"
    sampled_labels = True

    @classmethod
    def applies(cls, config: KFACConfig) -> bool:
        return not config.mc_full_batch

    def capture_mode(self, ctx: StepContext, update_step: bool) -> CaptureMode:
        return CaptureMode(rows=False, record_inputs=update_step, estimate_scale=False)

    def passes(self, ctx: StepContext, model, passes: list, inputs: list[dict]) -> list:
        cfg, step = ctx.config, ctx.step
        ctx.select_generator.manual_seed(selection_seed(cfg.seed, ctx.rank, step))
        counts, share = replay_counts(cfg.mc_sequences, [batch_size(k) for k in inputs],
                                      cfg.seed, step, at_least_one=step == 0)
        for kwargs, count in zip(inputs, counts):
            if count != 0:  # micro-batches the share did not draw are not replayed
                mc_subbatch_pass(model, ctx.capture, kwargs, label_generator=ctx.mc_generator,
                                 select_generator=ctx.select_generator, count=count,
                                 token_fraction=cfg.token_fraction, share=share)
        return ctx.capture.take()[0]
