"""A new Fisher estimator is one class: registered by name, chosen by ``KFACConfig.fisher``,
asked by the tracker (through a `StepContext`) for the hooks' mode and for the passes that make
the factors. The registry is the one table of Fisher names: the run plan refuses a name no
estimator is registered under, and a snapshot made with a registered estimator reads, and
answers ``kfac-stream inspect``, in a process where it is not registered.

The toy estimator below keeps only the first micro-batch of each optimizer step (the
empirical Fisher of it): its factors must equal the float64 brute-force factors of those
micro-batches alone, and differ from the empirical Fisher of every micro-batch by far more
than the tolerance (the test can fail)."""

import os
import subprocess
import sys

import pytest
import torch

from kfac_stream import KFACConfig, KFACConfigError, Snapshot
from kfac_stream.capture.hooks import CaptureMode
from kfac_stream.fisher import (
    FisherEstimator,
    StepContext,
    fisher_names,
    register_fisher,
    unregister_fisher,
)
from kfac_stream.tracking.plan import RunPlan

from harness import factor_errors, run, sum_nll_loss
from models import text_examples, tiny_gpt2
from reference import reference_factors
from repo_paths import ROOT

ORACLE_TOL = 1e-10  # float64 end to end: only summation-order rounding differs
LAYERS = [f"transformer.h.{i}.{m}" for i in range(2)
          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


class FirstMicroBatch(FisherEstimator):
    """The empirical Fisher of each step's first micro-batch only."""

    name = "first_micro_batch"
    sampled_labels = False
    steps: list[int] = []  # the optimizer step of each `passes` call, read from its context

    def capture_mode(self, ctx: StepContext, update_step: bool) -> CaptureMode:
        return CaptureMode(rows=update_step, estimate_scale=True)

    def passes(self, ctx: StepContext, model, passes: list, inputs: list[dict]) -> list:
        type(self).steps.append(ctx.step)
        return passes[:1]


@pytest.fixture
def toy_fisher():
    register_fisher(FirstMicroBatch)
    FirstMicroBatch.steps = []
    yield FirstMicroBatch
    unregister_fisher(FirstMicroBatch)


def test_the_run_plan_refuses_a_fisher_no_estimator_is_registered_under(toy_fisher):
    config = KFACConfig(fisher="first_micro_batch")
    assert RunPlan.resolve(config).curvature.fisher == "first_micro_batch"
    unregister_fisher(toy_fisher)
    assert "first_micro_batch" not in fisher_names()
    assert KFACConfig(fisher="first_micro_batch") == config  # a config carries any name
    with pytest.raises(KFACConfigError, match=r"KFACConfig.fisher='first_micro_batch' is not "
                       r"allowed: must be one of the registered Fisher estimators "
                       r"\('empirical', 'mc'\)"):
        RunPlan.resolve(config)
    register_fisher(toy_fisher)
    assert RunPlan.resolve(config).curvature.describe() == "first_micro_batch Fisher, expand form"


def test_registered_estimator_makes_the_factors_of_its_passes(tmp_path, toy_fisher):
    examples = text_examples(8, 12, lengths=[12, 9, 12, 7, 12, 12, 10, 12])
    model = tiny_gpt2(torch.float64)
    cb, records, _ = run(model, examples, {"fisher": "first_micro_batch"}, batch=1, accum=2,
                         loss=sum_nll_loss, tmp_path=tmp_path / "toy")
    assert len(records) == 8 and toy_fisher.steps == [0, 1, 2, 3]  # 4 steps of 2 micro-batches
    assert type(cb.tracker.fisher) is toy_fisher
    assert cb.tracker.curvature.describe() == "first_micro_batch Fisher, expand form"
    ref, _ = reference_factors(model, records[0::2], LAYERS)
    errs = factor_errors(cb, ref)
    assert max(errs.values()) <= ORACLE_TOL, errs
    every, _ = reference_factors(model, records, LAYERS)  # the plain empirical Fisher's
    assert max(factor_errors(cb, every).values()) > 1e-3
    snap = Snapshot.load(cb.snapshots[-1])  # the manifest knows the registered name
    assert snap.manifest.fisher == snap.manifest.run_plan.fisher == "first_micro_batch"


def test_a_snapshot_of_a_registered_estimator_reads_where_it_is_not_registered(tmp_path,
                                                                               toy_fisher):
    """Written in this process with the toy estimator registered; `kfac-stream inspect` in a
    fresh interpreter (which never imports this file, so has only the built-in estimators)
    opens it and prints its layer table under the estimator's name."""
    examples = text_examples(4, 12, lengths=[12, 9, 12, 7])
    cb, _, _ = run(tiny_gpt2(torch.float64), examples, {"fisher": "first_micro_batch"}, batch=1,
                   accum=2, tmp_path=tmp_path / "toy", record=False)
    path = cb.snapshots[-1]
    unregister_fisher(toy_fisher)  # and in this process: the reader checks no Fisher name
    snap = Snapshot.load(path)
    assert snap.manifest.fisher == "first_micro_batch" and len(snap.layer_names) == len(LAYERS)
    root = str(ROOT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "kfac_stream.cli", "inspect", str(path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"snapshot {path} (step {snap.step}, first_micro_batch Fisher, ")
    assert all(name in proc.stdout for name in LAYERS), proc.stdout
