"""A new Fisher estimator is one class: registered by name, chosen by ``KFACConfig.fisher``,
asked by the tracker for the hooks' mode and for the passes that make the factors.

The toy estimator below keeps only the first micro-batch of each optimizer step (the
empirical Fisher of it): its factors must equal the float64 brute-force factors of those
micro-batches alone, and differ from the empirical Fisher of every micro-batch by far more
than the tolerance (the test can fail)."""

import pytest
import torch

from kfac_stream import KFACConfig, KFACConfigError, Snapshot
from kfac_stream.capture.hooks import CaptureMode
from kfac_stream.fisher import FisherEstimator, register_fisher, unregister_fisher

from harness import factor_errors, run, sum_nll_loss
from models import text_examples, tiny_gpt2
from reference import reference_factors

ORACLE_TOL = 1e-10  # float64 end to end: only summation-order rounding differs
LAYERS = [f"transformer.h.{i}.{m}" for i in range(2)
          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


class FirstMicroBatch(FisherEstimator):
    """The empirical Fisher of each step's first micro-batch only."""

    name = "first_micro_batch"
    sampled_labels = False
    calls = 0

    def capture_mode(self, update_step: bool) -> CaptureMode:
        return CaptureMode(rows=update_step, estimate_scale=True)

    def passes(self, model, passes: list, inputs: list[dict]) -> list:
        type(self).calls += 1
        return passes[:1]


@pytest.fixture
def toy_fisher():
    register_fisher(FirstMicroBatch)
    FirstMicroBatch.calls = 0
    yield FirstMicroBatch
    unregister_fisher(FirstMicroBatch)


def test_unknown_fisher_is_refused_until_registered(toy_fisher):
    assert KFACConfig(fisher="first_micro_batch").fisher == "first_micro_batch"
    unregister_fisher(toy_fisher)
    with pytest.raises(KFACConfigError, match="fisher='first_micro_batch' is not allowed"):
        KFACConfig(fisher="first_micro_batch")
    register_fisher(toy_fisher)


def test_registered_estimator_makes_the_factors_of_its_passes(tmp_path, toy_fisher):
    examples = text_examples(8, 12, lengths=[12, 9, 12, 7, 12, 12, 10, 12])
    model = tiny_gpt2(torch.float64)
    cb, records, _ = run(model, examples, {"fisher": "first_micro_batch"}, batch=1, accum=2,
                         loss=sum_nll_loss, tmp_path=tmp_path / "toy")
    assert len(records) == 8 and toy_fisher.calls == 4  # 4 steps of 2 micro-batches
    assert type(cb.tracker.fisher) is toy_fisher
    assert cb.tracker.curvature.describe() == "first_micro_batch Fisher, expand form"
    ref, _ = reference_factors(model, records[0::2], LAYERS)
    errs = factor_errors(cb, ref)
    assert max(errs.values()) <= ORACLE_TOL, errs
    every, _ = reference_factors(model, records, LAYERS)  # the plain empirical Fisher's
    assert max(factor_errors(cb, every).values()) > 1e-3
    snap = Snapshot.load(cb.snapshots[-1])  # the manifest knows the registered name
    assert snap.manifest.fisher == snap.manifest.run_plan.fisher == "first_micro_batch"
