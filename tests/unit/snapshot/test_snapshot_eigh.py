"""Snapshot eigendecompositions one factor at a time: the results equal a float64
reference of the same dequantised factors, in the snapshot format as before (names, dtypes,
spectrum fields); at most one factor's float64 working copies are alive at a time; on a GPU
the factors are dequantised and decomposed there and the results land in pinned buffers.
CUDA-only tests skip with the reason on machines without one."""

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
from test_worker_eigh_and_cuda import EIGH_BACKWARD_C, FP32_UNIT_ROUNDOFF, _eigh_excess

from kfac_stream.snapshot.eigen_stream import EigendecompositionError, EigenStream
from kfac_stream.snapshot.writer import Deferred, resolved, write_order
from kfac_stream.stats import spectrum
from kfac_stream.stats.spectrum import safe_psd_eigh, spectrum_stats

import repo_paths

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = str(repo_paths.ROOT)


def _shard(storage: str = "float16", seed: int = 0):
    """Shard tensors and a manifest as `snapshot_contents` makes them: two layers sharing an
    A (decomposed once), dense factors of several sides, one diagonal G."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, storage)

    def stored(d: int, dense: bool = True):
        x = torch.randn(3 * d, d, generator=gen, dtype=torch.float64)
        f = x.T @ x / (3 * d) if dense else x.square().mean(0)
        scale = float(f.abs().max()) if storage == "float16" else 1.0
        return (f / scale).to(dtype), torch.tensor([scale], dtype=torch.float32)

    sides = {"l0.A": (24, True), "l0.G": (40, True), "l1.G": (17, False), "l2.A": (33, True),
             "l2.G": (8, True)}
    tensors = {}
    for key, (d, dense) in sides.items():
        tensors[key], tensors[f"{key}.scale"] = stored(d, dense)
    layers = {"l0": {"A": {"key": "l0.A"}, "G": {"key": "l0.G"}},
              "l1": {"A": {"key": "l0.A"}, "G": {"key": "l1.G"}},  # shares l0's A
              "l2": {"A": {"key": "l2.A"}, "G": {"key": "l2.G"}}}
    return tensors, {"storage_dtype": storage, "layers": layers}


def _dequantised(tensors, key) -> torch.Tensor:
    return tensors[key].double() * float(tensors[f"{key}.scale"])


def add_eigendecompositions(tensors, manifest, device=None, threads=None) -> None:
    """Every factor's ``<key>.eigvals`` / ``<key>.eigvecs`` and spectrum statistics, in place
    and at once: `EigenStream`'s deferred results resolved in the writer's order (what a
    snapshot streams into its shard, every result held here)."""
    stream = EigenStream(tensors, manifest, device, threads)
    try:
        for name in write_order(tensors):
            if isinstance(tensors[name], Deferred):
                tensors[name] = resolved(tensors[name])
    finally:
        stream.close()


def _old_add_eigendecompositions(tensors, manifest) -> None:
    """The former implementation (all factors widened to float64 at once), as the reference
    for names, dtypes and spectrum fields."""
    eig_dtype = torch.float64 if manifest["storage_dtype"] == "float64" else torch.float32
    keys = dict.fromkeys(e[f]["key"] for e in manifest["layers"].values() for f in "AG")
    values = {k: _dequantised(tensors, k) for k in keys}
    decomposed = spectrum.eigh_factors(values)
    for key, (w, q) in decomposed.items():
        tensors[f"{key}.eigvals"] = w.to(eig_dtype)
        if q is not None:
            tensors[f"{key}.eigvecs"] = q.to(eig_dtype)
    for entry in manifest["layers"].values():
        for f in "AG":
            entry[f]["spectrum"] = spectrum_stats(decomposed[entry[f]["key"]][0])


@pytest.mark.parametrize("storage", ["float16", "float64"])
def test_per_factor_cpu_path_equals_float64_reference_and_the_old_format(storage):
    tensors, manifest = _shard(storage)
    old_t, old_m = _shard(storage)
    add_eigendecompositions(tensors, manifest, threads=1)
    _old_add_eigendecompositions(old_t, old_m)
    assert sorted(tensors) == sorted(old_t)  # the same tensor names
    for k, v in old_t.items():
        assert tensors[k].dtype == v.dtype and tensors[k].shape == v.shape, k
    assert manifest == old_m  # spectrum fields: the float64 eigenvalues' statistics, exactly
    for key in ("l0.A", "l0.G", "l1.G", "l2.A", "l2.G"):
        f = _dequantised(tensors, key)
        w_ref, q_ref = safe_psd_eigh(f)  # float64 reference of the same dequantised factor
        w = tensors[f"{key}.eigvals"].double()
        top = float(w_ref.max())
        if storage == "float64":
            assert torch.equal(w, w_ref), key
            q = tensors.get(f"{key}.eigvecs")
            assert (q is None and q_ref is None) or torch.equal(q, q_ref), key
            continue
        # float32 storage of the float64 eigenvalues: within their rounding (half an ulp)
        assert float((w - w_ref).abs().max()) <= FP32_UNIT_ROUNDOFF * top, key
        if f.dim() == 1:
            assert f"{key}.eigvecs" not in tensors
            continue
        assert tensors[f"{key}.eigvecs"].is_contiguous()  # as stored: the writer copies none
        q = tensors[f"{key}.eigvecs"].double()
        recon = (q * w) @ q.T
        sym = (f + f.T) * 0.5
        # float32 eigenvectors: reconstruction and orthogonality to ~n·u (n ≤ 40 here)
        n = f.shape[0]
        assert float((recon - sym).abs().max()) <= 4 * n * FP32_UNIT_ROUNDOFF * top, key
        assert float((q.T @ q - torch.eye(n, dtype=q.dtype)).abs().max()) \
            <= 4 * n * FP32_UNIT_ROUNDOFF, key


def _watch_float64_copies(monkeypatch):
    """Record, at each `safe_psd_eigh` call, how many float64 inputs and eigenvector outputs of
    earlier calls are still alive (weak references; the caller's copies must be gone)."""
    real, seen, alive_at_call = spectrum.safe_psd_eigh, [], []

    def watched(f):
        gc.collect()
        alive_at_call.append(sum(r() is not None for r in seen))
        w, q = real(f)
        seen.append(weakref.ref(f))
        if q is not None:
            seen.append(weakref.ref(q))
        return w, q

    monkeypatch.setattr(spectrum, "safe_psd_eigh", watched)
    return alive_at_call


def test_at_most_one_factor_in_float64_at_a_time(monkeypatch):
    alive = _watch_float64_copies(monkeypatch)
    tensors, manifest = _shard()
    add_eigendecompositions(tensors, manifest, threads=1)
    assert len(alive) == 5 and alive == [0] * 5, alive  # each decomposed alone, then freed
    # the check is able to fail: the former code held every factor in float64 at once
    alive.clear()
    _old_add_eigendecompositions(*_shard())
    assert alive[-1] >= 3, alive


def test_a_failed_decomposition_still_raises(monkeypatch):
    def broken(f):
        raise torch.linalg.LinAlgError("simulated: eigh failed even with a shift")

    monkeypatch.setattr(spectrum, "safe_psd_eigh", broken)
    tensors, manifest = _shard()
    with pytest.raises(EigendecompositionError, match="eigendecomposition failed") as info:
        add_eigendecompositions(tensors, manifest)
    assert isinstance(info.value.__cause__, torch.linalg.LinAlgError)


def test_device_spectrum_statistics_match_spectrum_stats():
    """The statistics the device path computes without host syncs (run here on the CPU)."""
    gen = torch.Generator().manual_seed(1)
    cases = [torch.rand(50, generator=gen, dtype=torch.float64),
             torch.cat([torch.zeros(5, dtype=torch.float64), torch.rand(20, generator=gen,
                                                                        dtype=torch.float64)]),
             torch.tensor([1e-20, 1.0, 2.0], dtype=torch.float64),
             torch.zeros(7, dtype=torch.float64)]
    for ev in cases:
        got = spectrum._stats_dict(spectrum._stats_vector(ev).tolist())
        want = spectrum_stats(ev)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-12), (k, got, want)


def test_benchmark_quick_runs():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "snapshot_scale.py"),
                          "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| median |" in out.stdout and "ratio" in out.stdout, out.stdout[-2000:]


@CUDA
def test_device_path_pins_its_outputs_and_matches_float64_cpu():
    cpu_t, cpu_m = _shard()
    add_eigendecompositions(cpu_t, cpu_m, threads=1)
    tensors, manifest = _shard()
    add_eigendecompositions(tensors, manifest, torch.device("cuda"))
    assert sorted(tensors) == sorted(cpu_t)
    for k, v in cpu_t.items():
        assert tensors[k].dtype == v.dtype and tensors[k].shape == v.shape, k
    for key in ("l0.A", "l0.G", "l2.A", "l2.G"):  # dense: decomposed on the GPU
        w, q = tensors[f"{key}.eigvals"], tensors[f"{key}.eigvecs"]
        assert w.is_pinned() and q.is_pinned() and q.dtype == torch.float32, key
        f = _dequantised(tensors, key)
        excess = _eigh_excess((f + f.T) * 0.5, w.double(), q.double())
        assert max(excess.values()) <= 1, (key, excess)
        # eigenvalues against the CPU float64 path's (Weyl: within c·n·u·‖A‖₂, plus its
        # float32 rounding)
        n, top = f.shape[0], float(cpu_t[f"{key}.eigvals"].max())
        tol = (EIGH_BACKWARD_C * n + 1) * FP32_UNIT_ROUNDOFF * top
        assert float((w.double() - cpu_t[f"{key}.eigvals"].double()).abs().max()) <= tol, key
    assert not tensors["l1.G.eigvals"].is_pinned()  # diagonal: on the CPU, exactly
    assert torch.equal(tensors["l1.G.eigvals"], cpu_t["l1.G.eigvals"])
    for name, entry in manifest["layers"].items():
        for f in "AG":
            got, want = entry[f]["spectrum"], cpu_m["layers"][name][f]["spectrum"]
            n = tensors[entry[f]["key"]].shape[0]
            rel = (EIGH_BACKWARD_C * n + 1) * FP32_UNIT_ROUNDOFF
            assert got["max"] == pytest.approx(want["max"], rel=rel), (name, f)
            assert got["trace"] == pytest.approx(want["trace"], rel=n * rel), (name, f)


@CUDA
def test_device_path_redoes_a_failed_or_non_finite_factor_on_the_cpu(monkeypatch):
    cpu_t, _ = _shard()
    add_eigendecompositions(cpu_t, _shard()[1], threads=1)
    real, cuda_calls = torch.linalg.eigh, []

    def flaky(m, *args, **kwargs):
        if m.is_cuda:
            cuda_calls.append(m.shape[0])
            if len(cuda_calls) == 1:
                raise torch.linalg.LinAlgError("simulated: no convergence")
            if len(cuda_calls) == 2:
                w, q = real(m, *args, **kwargs)
                return w * float("nan"), q
        return real(m, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    tensors, manifest = _shard()
    add_eigendecompositions(tensors, manifest, torch.device("cuda"), threads=1)
    assert len(cuda_calls) == 4  # the four dense factors, each tried on the GPU once
    for key in ("l0.A", "l0.G"):  # the failed one and the non-finite one: the CPU's result
        assert torch.equal(tensors[f"{key}.eigvals"], cpu_t[f"{key}.eigvals"]), key
        assert torch.equal(tensors[f"{key}.eigvecs"], cpu_t[f"{key}.eigvecs"]), key
    assert tensors["l2.A.eigvecs"].is_pinned() and tensors["l2.G.eigvecs"].is_pinned()
