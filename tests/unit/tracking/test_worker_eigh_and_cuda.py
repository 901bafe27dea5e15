"""The training thread's hot path beyond host syncs: a worker that falls behind is counted and
logged once; snapshot eigendecompositions use the threads the user asks for (CPU) or the GPU
(one reused stream, a failed matrix redone on the CPU alone); CUDA graphs are refused with a
clear error.
CUDA-only tests skip with the reason on machines without one (``make gpu-check`` runs them)."""

import logging
import time

import pytest
import torch

from kfac_stream.stats.spectrum import (
    default_eigh_threads,
    eigh_each,
    eigh_factors,
    safe_psd_eigh,
)

from harness import run
from models import text_examples, tiny_gpt2

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# fp32 accumulation of 819 bf16 products per entry (each exact in fp32): relative Frobenius
# error of order 2^-24·sqrt(819) ≈ 2e-6, 1e-5 with room for the GEMM's summation order
FP32_ACCUMULATION_TOL = 1e-5
# The GPU eigh (test_gpu_eigh_matches_float64_cpu). A float32 symmetric eigensolver is backward
# stable: Q̂ diag(λ̂) Q̂ᵀ = A + E with ‖E‖₂ ≤ c·n·u·‖A‖₂ and ‖Q̂ᵀQ̂ − I‖₂ ≤ c·n·u (n the side,
# u = 2^-24), the usual worst-case-linear estimate: each pass over the matrix takes every entry
# of A and Q̂ through about n plane rotations or reflections, each of relative error ≲ u.
# torch's float32 CUDA eigh is cuSOLVER's Jacobi (syevj) for 32 ≤ n ≤ 512: one pass per sweep,
# to the default tolerance (machine accuracy), which cuSOLVER says 15 sweeps reach; above 512,
# syevd (Householder tridiagonalisation, divide and conquer: a few passes). c = 16: 15 sweeps,
# and rounding A to float32 (‖ΔA‖₂ ≤ u·‖A‖_F ≤ √n·u·‖A‖₂). Checked, relative to ‖A‖₂:
#   max |A − Q̂Λ̂Q̂ᵀ|ᵢⱼ ≤ ‖E‖₂ ≤ c·n·u;  max |Q̂ᵀQ̂ − I|ᵢⱼ ≤ c·n·u;  max |λ̂ᵢ − λᵢ(float64)| ≤ ‖E‖₂
#   (Weyl) ≤ c·n·u;  ‖A q̂ᵢ − λ̂ᵢ q̂ᵢ‖₂ = ‖(Q̂Λ̂(Q̂ᵀQ̂ − I) − EQ̂)eᵢ‖₂ ≲ 2·c·n·u.
# On an H200 (torch 2.11, cu130) the n = 64 matrix (‖A‖₂ = 2.13) rebuilt to 2.73e-5 at worst:
# 1.28e-5·‖A‖₂ = 215u = 3.4·n·u, 4.8x inside 16·n·u = 6.1e-5 (the former bound, 1e-5 = 2.6·n·u
# at n = 64, had no derivation and failed); a float32 Jacobi run on the CPU gives 2.7·n·u
# (n = 64) and 3.0·n·u (n = 300) on these matrices, 5x inside. Swapping the top two
# eigenvectors makes their residual their gap (≥ 2x the bound here, n = 1024 the closest). A
# float16 rounding (unit roundoff 2^-11) fails where c·n·u ≤ 2^-11 / 8, n = 64 here; for the
# larger matrices the worst-case bound is as wide as float16 rounding itself.
FP32_UNIT_ROUNDOFF = 2.0**-24
FP16_UNIT_ROUNDOFF = 2.0**-11
EIGH_BACKWARD_C = 16
EIGH_RESIDUAL_C = 2 * EIGH_BACKWARD_C


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


def test_small_factors_take_one_thread_large_ones_the_threads_asked(monkeypatch):
    """Below `EIGH_PARALLEL_MIN_DIM` a decomposition runs on one thread (threads gain nothing
    there and cost a great deal on busy cores); at or above it on the threads asked for."""
    from kfac_stream.stats import spectrum

    seen = []
    monkeypatch.setattr(spectrum, "safe_psd_eigh",
                        lambda f: (seen.append((f.shape[0], torch.get_num_threads())),
                                   safe_psd_eigh(f))[1])
    big = spectrum.EIGH_PARALLEL_MIN_DIM
    gen = torch.Generator().manual_seed(0)
    factors = {k: (lambda x: x @ x.T)(torch.randn(d, d, dtype=torch.float64, generator=gen))
               for k, d in (("small", 33), ("big", big))}
    prev = torch.get_num_threads()
    eigh_factors(factors, threads=2)
    assert seen == [(33, 1), (big, 2)] and torch.get_num_threads() == prev
    seen.clear()
    stored = [(k, f.float(), 1.0) for k, f in factors.items()]
    list(spectrum.eigh_stored(stored, torch.float32, threads=2))
    assert seen == [(33, 1), (big, 2)] and torch.get_num_threads() == prev


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


def _eigh_excess(f: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> dict[str, float]:
    """Each error of the eigendecomposition ``(w [n], q [n, n])`` of the PSD float64 ``f``
    over its tolerance (EIGH_BACKWARD_C): ≤ 1 passes. Computed in float64 on the CPU."""
    n = f.shape[0]
    exact = torch.linalg.eigvalsh(f)  # [n] ascending, float64
    norm = float(exact[-1])  # ‖A‖₂ (PSD)
    tol = EIGH_BACKWARD_C * n * FP32_UNIT_ROUNDOFF
    residual = torch.linalg.vector_norm(f @ q - q * w, dim=0)  # [n] per eigenpair
    return {"reconstruction": float((q @ torch.diag(w) @ q.T - f).abs().max()) / (tol * norm),
            "orthogonality": float((q.T @ q - torch.eye(n, dtype=q.dtype)).abs().max()) / tol,
            "eigenvalues": float((w - exact).abs().max()) / (tol * norm),
            "residual": float(residual.max())
            / (EIGH_RESIDUAL_C * n * FP32_UNIT_ROUNDOFF * norm)}


@CUDA
def test_gpu_eigh_matches_float64_cpu():
    gen = torch.Generator().manual_seed(0)
    factors = {}
    for i, d in enumerate([64, 64, 300, 1024]):  # syevj (32 ≤ n ≤ 512) and syevd
        x = torch.randn(4 * d, d, generator=gen, dtype=torch.float64)
        factors[f"f{i}"] = x.T @ x / (4 * d)
    cuda = torch.device("cuda")
    out = eigh_factors(factors, device=cuda)
    rounded_input = eigh_factors({k: f.half().double() for k, f in factors.items()}, cuda)
    for k, f in factors.items():
        n = f.shape[0]
        w, q = out[k]
        excess = _eigh_excess(f, w, q)
        assert max(excess.values()) <= 1, (k, n, excess)
        # a wrong answer fails the same check: the top two eigenvectors swapped
        swapped = q[:, [*range(n - 2), n - 1, n - 2]]
        assert _eigh_excess(f, w, swapped)["residual"] > 1, (k, n)
        if EIGH_BACKWARD_C * n * FP32_UNIT_ROUNDOFF <= FP16_UNIT_ROUNDOFF / 8:
            # float16 rounding of the result, or of the factor before the float32 eigh
            assert max(_eigh_excess(f, w.half().double(), q.half().double()).values()) > 1, k
            assert max(_eigh_excess(f, *rounded_input[k]).values()) > 1, k


@CUDA
def test_bf16_tensor_core_fold_matches_float64():
    from kfac_stream.tracking.factor_updates import gram_fp32

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(819, 512, generator=gen, dtype=torch.float64)
    xb = x.to(torch.bfloat16)
    rounded = xb.double().T @ xb.double()  # the exact Gram of the bf16-rounded rows
    got = gram_fp32(xb.to("cuda"), False).double().cpu()
    # the tensor cores add only the fp32 accumulation to what rounding the rows to bf16 did;
    # that rounding (2^-9 per entry) is the caller's choice: 1.47e-3 relative here, above the
    # 1e-3 storage budget, so the fold is checked against the rounded rows' Gram, and against
    # the float64 Gram of the unrounded rows only as far as the rounding itself moves it
    assert float(torch.linalg.norm(got - rounded) / torch.linalg.norm(rounded)) \
        <= FP32_ACCUMULATION_TOL
    ref = x.T @ x
    moved = float(torch.linalg.norm(rounded - ref) / torch.linalg.norm(ref))
    err = float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))
    assert abs(err - moved) <= FP32_ACCUMULATION_TOL, (err, moved)


@CUDA
def test_cuda_device_store_equals_the_float64_ema_and_the_host_path(monkeypatch):
    """The store's device path on a real GPU: bf16 rows (tensor-core Gram, fp32 pending sum,
    not fused), an exchanged fp32 statistic, a diagonal factor; flushes streamed through the
    pinned FP16 factors in several chunks per factor (two copy streams, two buffer slots
    reused many times). Against the float64 EMA of the bf16-rounded rows: within the
    FP16 budget; against the host path on the same rounded rows: two fp16 roundings."""
    from kfac_stream.stats.ema import ema_closed_form
    from kfac_stream.store import fold_cost
    from kfac_stream.store.factor_store import FactorStore

    monkeypatch.setattr(fold_cost, "CHUNK_ENTRIES", 96 * 11)  # d = 96: 9 chunks per flush
    dev, cuda = torch.device("cuda"), torch.device("cuda")
    d, decay = 96, 0.95
    store = FactorStore("float16", decay, device=dev, device_budget=1 << 30)
    host = FactorStore("float16", decay)
    for s in (store, host):
        s.add("f", d, False)
        s.add("g", 300, True)
    assert store._factors["f"].data.is_pinned()
    gen = torch.Generator().manual_seed(0)
    stats, diag_stats, counts = [], [], []
    for i in range(40):
        m = 5 + i % 7
        x = torch.randn(m, d, generator=gen, dtype=torch.float64)
        x[:, 3] *= 1e4  # an outlier feature, as real LLM activations have
        xb = x.to(torch.bfloat16)
        xr = xb.double()
        gsum = torch.rand(300, generator=gen, dtype=torch.float64) * m
        stats.append(xr.T @ xr / m)
        diag_stats.append(gsum / m)
        counts.append(m)
        if i % 5 == 4:  # an exchanged summed statistic
            store.push_device("f", (xr.T @ xr).float().to(cuda), "stats", m, m)
        else:
            store.push_device("f", xb.to(cuda), "rows", m, m)
        store.push_device("g", gsum.float().to(cuda), "stats", m, m)
        store.end_update()
        host.push_rows("f", xr.float(), m)
        host.update("g", (gsum / m).float(), m)
        if i % 13 == 12:
            store.flush()
    ref = ema_closed_form(stats, counts, decay)
    ref_g = ema_closed_form(diag_stats, counts, decay)
    got, got_host = store.values(), host.values()

    def rel(a, b):
        return float(torch.linalg.norm(a.double() - b.double())
                     / torch.linalg.norm(b.double()))

    assert rel(got["f"], ref) <= 1e-3 and rel(got["g"], ref_g) <= 1e-3
    assert rel(got["f"], got_host["f"]) <= 2 * 2.0**-11
    t = store.traffic
    assert t.host_entries == 0 and t.budget_flushes == 0
    assert t.flushes == 4 and t.flush_syncs == 4  # 3 in the loop, 1 by values()
    assert t.flush_chunks == 4 * (9 + 1) and t.flush_copies == 2 * t.flush_chunks


@CUDA
def test_fused_bf16_accumulate_equals_the_unfused_one():
    """Where torch has the tensor-core ``addmm`` with float32 output into the pending sum
    (`device_fold.fused_16bit`, probed once), it is used, and equals the ``mm`` + add fold to
    float32 accumulation (the two differ only in where the fp32 sum is rounded)."""
    from kfac_stream.store import device_fold
    from kfac_stream.store.device_fold import DevicePending, accumulate
    from kfac_stream.store.traffic import Traffic

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 256, generator=gen).to("cuda", torch.bfloat16)
    print(f"fused bf16 accumulate available: {device_fold.fused_16bit(x.device)}")
    out = []
    for fused in (True, False):
        if not fused:
            device_fold._FUSED_16BIT[str(x.device)] = False
        p = DevicePending(torch.empty(256, 256, device="cuda"))
        t = Traffic()
        for eta in (1.0, 0.5, 0.25):
            accumulate(p, x, "rows", eta, 300.0, False, t)
        out.append((p.data * p.s).double().cpu())
    device_fold._FUSED_16BIT.pop(str(x.device))
    rel = float(torch.linalg.norm(out[0] - out[1]) / torch.linalg.norm(out[1]))
    assert rel <= FP32_ACCUMULATION_TOL, rel


@CUDA
def test_trainer_on_cuda_has_no_sync_in_tracked_steps(tmp_path):
    """The batches live on the GPU already and the Trainer's own per-step syncs are switched
    off (NaN filter, gradient clipping). A thread-local counter (`syncs.CudaSyncCounter`:
    device reads, blocking copies to the host, synchronize calls) on the training thread,
    from each step's begin to its end, must see none in kfac_stream's code. The worker's own
    reads (another thread) and the model's (its SDPA mask check, in the training forward and
    in the MC replay's: ``replayed``) are not the tracker's; they are reported, not asserted:
    ``torch.cuda.set_sync_debug_mode``, process-wide, would count both."""
    from transformers import TrainerCallback

    from syncs import CudaSyncCounter

    class Count(TrainerCallback):
        def __init__(self) -> None:
            self.mode, self.total, self.replayed = None, 0, 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.mode = CudaSyncCounter()
            self.mode.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            self.mode.__exit__(None, None, None)
            ours.update(self.mode.ours)
            theirs.update(self.mode.model)
            self.total += self.mode.count
            self.replayed += self.mode.replayed

    import collections

    ours: collections.Counter = collections.Counter()  # kfac_stream's code
    theirs: collections.Counter = collections.Counter()  # the model's (and the Trainer's)
    counter = Count()
    model = tiny_gpt2(torch.float32)
    examples = [{k: v.cuda() for k, v in e.items()} for e in text_examples(16, 12)]
    # the empirical Fisher, and the MC replay of one sequence per micro-batch after the step
    for extra in ({"update_every": 1}, {"update_every": 1, "fisher": "mc", "mc_sequences": 1}):
        cb, _, _ = run(model, examples, extra, batch=2, tmp_path=tmp_path / str(len(extra)),
                       record=False, use_cpu=False, callbacks=[counter],
                       dataloader_pin_memory=False, logging_nan_inf_filter=False,
                       max_grad_norm=0.0)
        assert cb.tracker.device.type == "cuda" and cb.tracker.fold_on == "device"
        assert cb.tracker.counters.updates == 8
        c = cb.tracker.read_counters()  # resident on the GPU: only the final snapshot flushed
        assert c.host_entries == 0 and c.budget_flushes == 0 and c.flushes == 1, c
        assert c.device_budget > 0 and c.peak_resident_bytes > 0
    report = (f"host syncs on the training thread in tracked steps: {counter.total}; "
              f"kfac_stream's: {sum(ours.values())} {dict(ours)}; the model's: "
              f"{sum(theirs.values())}, {counter.replayed} of them in the MC replay's forward "
              f"{dict(theirs)}")
    print(report)
    assert not ours, report


def test_eigh_failure_falls_back_per_matrix():
    """A decomposition that raises (``LinAlgError``, out of memory) or returns non-finite
    values sends that factor alone to the CPU; the others keep their result."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    dense = {"ok": x.T @ x, "raises": x.T @ x + 1, "nan": x.T @ x + 2}

    def run_one(f):
        if float(f[0, 0]) == float(dense["raises"][0, 0]):
            raise torch.linalg.LinAlgError("simulated: no convergence")
        w, q = torch.linalg.eigh(f.float())
        return (w * float("nan"), q) if float(f[0, 0]) == float(dense["nan"][0, 0]) else (w, q)

    out = {}
    left = eigh_each(dense, out, run_one)
    assert sorted(left) == ["nan", "raises"] and list(out) == ["ok"]
    w, q = out["ok"]
    assert w.dtype == q.dtype == torch.float64
    assert torch.allclose(q @ torch.diag(w) @ q.T, dense["ok"], atol=1e-4 * float(w.max()))


@CUDA
def test_gpu_eigh_reuses_one_stream_and_falls_back_per_matrix(monkeypatch):
    from kfac_stream.stats import spectrum

    dev = torch.device("cuda")
    assert spectrum.eigh_stream(dev) is spectrum.eigh_stream(torch.device("cuda", 0))
    gen = torch.Generator().manual_seed(0)
    factors = {f"f{i}": (lambda x: x.T @ x / 64)(torch.randn(64, 48, generator=gen,
                                                             dtype=torch.float64))
               for i in range(3)}
    real, calls = torch.linalg.eigh, []

    def flaky(m, *args, **kwargs):
        calls.append(m.device.type)
        if m.is_cuda and len([c for c in calls if c == "cuda"]) == 2:
            raise torch.linalg.LinAlgError("simulated: no convergence")
        return real(m, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    out = eigh_factors(factors, device=dev)
    assert calls.count("cuda") == 3 and calls.count("cpu") >= 1  # one factor redone on CPU
    for k, f in factors.items():
        w, q = out[k]
        assert float((q @ torch.diag(w) @ q.T - f).abs().max()) <= 1e-5 * float(w.max()), k


def test_cuda_graph_capture_is_refused(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from kfac_stream.capture import graphs
    from kfac_stream.exceptions import KFACConfigError

    for mode in graphs.GRAPH_MODES:
        err = graphs.compile_mode_error(SimpleNamespace(torch_compile=True,
                                                        torch_compile_mode=mode))
        assert isinstance(err, KFACConfigError) and mode in str(err)
    assert graphs.compile_mode_error(SimpleNamespace(torch_compile=True,
                                                     torch_compile_mode="default")) is None
    assert graphs.compile_mode_error(SimpleNamespace(torch_compile=False)) is None
    # a forward being captured (simulated on CPU: the check a CUDA batch takes)
    monkeypatch.setattr(graphs, "capturing", lambda x: True)
    with pytest.raises(RuntimeError, match="CUDA graph"):
        run(tiny_gpt2(), text_examples(4, 12), {"update_every": 1}, batch=2,
            tmp_path=tmp_path, record=False)
