"""The rest of issue 12's hot path: a worker that falls behind is counted and logged once;
snapshot eigendecompositions use the threads the user asks for (CPU) or the GPU (CUDA-only
tests, skipped with the reason on machines without one)."""

import logging
import time

import pytest
import torch

from kfac_stream.stats.spectrum import default_eigh_threads, eigh_factors, safe_psd_eigh

from harness import run
from models import text_examples, tiny_gpt2

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_worker_that_falls_behind_is_counted_and_logged_once(tmp_path, caplog, monkeypatch):
    from kfac_stream.store.factor_store import FactorStore

    slow = FactorStore.push_rows

    def slow_push(self, *args, **kwargs):  # a fold that takes far longer than a step
        time.sleep(0.05)
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(FactorStore, "push_rows", slow_push)
    with caplog.at_level(logging.WARNING, logger="kfac_stream"):
        cb, _, _ = run(tiny_gpt2(), text_examples(16, 12), {"async_updates": True}, batch=2,
                       tmp_path=tmp_path, record=False)
    c = cb.tracker.counters
    assert c.updates == 8 and c.waits >= 3 and c.wait_seconds > 0.1, (c.waits, c.wait_seconds)
    warnings = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, with the figures and what to change
    assert "update_every" in warnings[0] and "token_fraction" in warnings[0]
    assert "max_dense_dim" in warnings[0]


def test_eigh_factors_on_cpu_with_threads_equals_safe_eigh(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 24, generator=gen, dtype=torch.float64)
    factors = {"a": x.T @ x, "d": x.square().sum(0), "b": (x.T @ x)[:10, :10]}
    prev = torch.get_num_threads()
    out = eigh_factors(factors, threads=1)
    assert torch.get_num_threads() == prev  # restored
    for k, f in factors.items():
        w, q = safe_psd_eigh(f)
        assert torch.equal(out[k][0], w)
        assert (q is None) == (out[k][1] is None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    many = default_eigh_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_eigh_threads() >= many >= 1


@CUDA
def test_gpu_eigh_matches_float64_cpu():
    gen = torch.Generator().manual_seed(0)
    factors = {}
    for i, d in enumerate([64, 64, 300, 1024]):
        x = torch.randn(4 * d, d, generator=gen, dtype=torch.float64)
        factors[f"f{i}"] = x.T @ x / (4 * d)
    out = eigh_factors(factors, device=torch.device("cuda"))
    for k, f in factors.items():
        w, q = out[k]
        rebuilt = q @ torch.diag(w) @ q.T
        # float32 eigh: reconstruction to ~1e-6 of the largest eigenvalue
        assert float((rebuilt - f).abs().max()) <= 1e-5 * float(w.max()), k


@CUDA
def test_bf16_tensor_core_fold_matches_float64():
    from kfac_stream.factor_updates import gram_fp32

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(819, 512, generator=gen, dtype=torch.float64)
    ref = x.T @ x
    got = gram_fp32(x.to("cuda", torch.bfloat16), False).double().cpu()
    # bf16 rows (2^-9 relative rounding per entry), exact fp32 accumulation: the Gram matrix
    # is off by ~2^-8/sqrt(rows) relative in Frobenius norm; 1e-3 is the storage budget
    assert float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref)) <= 1e-3


@CUDA
def test_trainer_on_cuda_has_no_sync_in_tracked_steps(tmp_path):
    """Written without a GPU at hand (issue 12's session had none): the batches live on the
    GPU already and the Trainer's own per-step syncs are switched off (NaN filter, gradient
    clipping), so any synchronising call inside a step is the tracker's."""
    from transformers import TrainerCallback

    class SyncDebug(TrainerCallback):  # errors on any synchronising CUDA call inside steps
        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.set_sync_debug_mode("error")

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.set_sync_debug_mode("default")

    model = tiny_gpt2(torch.float32)
    examples = [{k: v.cuda() for k, v in e.items()} for e in text_examples(16, 12)]
    cb, _, _ = run(model, examples, {"update_every": 1}, batch=2, tmp_path=tmp_path,
                   record=False, use_cpu=False, callbacks=[SyncDebug()],
                   dataloader_pin_memory=False, logging_nan_inf_filter=False, max_grad_norm=0.0)
    assert cb.tracker.device.type == "cuda" and cb.tracker.fold_on == "device"
    assert cb.tracker.counters.updates == 8
