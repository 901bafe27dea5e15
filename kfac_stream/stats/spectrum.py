r"""Eigendecomposition of PSD factors and the spectrum statistics the snapshots carry.

``safe_psd_eigh`` follows the usual recipe for covariance-like matrices: cast to float64,
symmetrise (:math:`(F + F^\top)/2`), ``torch.linalg.eigh``; if LAPACK fails to converge, retry
with a tiny diagonal shift (removed from the eigenvalues again); clip the slightly negative
eigenvalues rounding produces to zero (the factors are PSD by construction).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

GPU_BATCH_BYTES = 1 << 30  # float32 bytes of one batched GPU eigh call


def default_eigh_threads() -> int:
    """CPU threads for snapshot eigendecompositions when the user sets none: the cores this
    process may run on (its affinity) shared by the processes of the node
    (``LOCAL_WORLD_SIZE``, set by torchrun/accelerate/deepspeed), ignoring the launcher's
    ``OMP_NUM_THREADS=1``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, cores // max(local, 1))


def eigh_factors(factors: dict[str, Tensor], device: torch.device | None = None,
                 threads: int | None = None) -> dict[str, tuple[Tensor, Tensor | None]]:
    """Eigendecompose many PSD factors where it is fast.

    Args:
        factors: ``{key: [d, d] or [d]}`` (float64 on the CPU).
        device: A CUDA device: dense factors are decomposed there in float32, batched by
            size (``[b, d, d]`` up to `GPU_BATCH_BYTES`), on a stream of their own (the
            training stream never waits); a factor whose result is not finite is redone on
            the CPU in float64. None (or a CPU device): `safe_psd_eigh` in float64 on the CPU.
        threads: CPU threads while decomposing on the CPU (default `default_eigh_threads`).
            ``torch.set_num_threads`` is process-wide: it holds for the duration of the call
            and is restored afterwards.

    Returns:
        ``{key: (eigvals [d] float64 ascending ≥ 0, eigvecs [d, d] float64 | None)}``.
    """
    out: dict[str, tuple[Tensor, Tensor | None]] = {}
    dense = {k: f for k, f in factors.items() if f.dim() == 2}
    for k, f in factors.items():
        if f.dim() == 1:
            out[k] = safe_psd_eigh(f)
    if device is not None and device.type == "cuda" and dense:
        dense = _eigh_on_gpu(dense, device, out)  # returns what it could not do
    if dense:
        prev = torch.get_num_threads()
        torch.set_num_threads(threads or default_eigh_threads())
        try:
            for k, f in dense.items():
                out[k] = safe_psd_eigh(f)
        finally:
            torch.set_num_threads(prev)
    return {k: out[k] for k in factors}


def _eigh_on_gpu(dense: dict[str, Tensor], device: torch.device,
                 out: dict[str, tuple[Tensor, Tensor | None]]) -> dict[str, Tensor]:
    """Batched float32 ``eigh`` on ``device`` into ``out``; returns the factors left over
    (non-finite results) for the CPU."""
    by_size: dict[int, list[str]] = {}
    for k, f in dense.items():
        by_size.setdefault(f.shape[0], []).append(k)
    left = {}
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for d, keys in sorted(by_size.items()):
            per_batch = max(1, GPU_BATCH_BYTES // (4 * d * d))
            for i in range(0, len(keys), per_batch):
                chunk = keys[i:i + per_batch]
                mats = torch.stack([dense[k] for k in chunk]).to(device, torch.float32)
                mats = (mats + mats.transpose(1, 2)) * 0.5
                w, q = torch.linalg.eigh(mats)  # [b, d], [b, d, d]
                w, q = w.double().cpu(), q.double().cpu()
                for j, k in enumerate(chunk):
                    if torch.isfinite(w[j]).all() and torch.isfinite(q[j]).all():
                        out[k] = (w[j].clamp(min=0.0), q[j])
                    else:
                        left[k] = dense[k]
    return left


def safe_psd_eigh(factor: Tensor, retries: int = 3) -> tuple[Tensor, Tensor | None]:
    """Eigenvalues (ascending, ≥ 0) and eigenvectors of a PSD factor, in float64.

    Args:
        factor: ``[d, d]`` dense, or ``[d]`` diagonal (then the eigenvectors are the identity
            and None is returned for them).
        retries: Shifted retries after a convergence failure.

    Returns:
        ``(eigvals [d], eigvecs [d, d] | None)`` with ``factor ≈ Q diag(λ) Qᵀ``.
    """
    f = factor.detach().to(device="cpu", dtype=torch.float64)
    if f.dim() == 1:
        return f.clamp(min=0.0), None
    f = (f + f.T) * 0.5
    shift = 0.0
    for attempt in range(retries + 1):
        try:
            w, q = torch.linalg.eigh(f if shift == 0.0 else f + shift * torch.eye(
                f.shape[0], dtype=f.dtype))
            return (w - shift).clamp_(min=0.0), q
        except RuntimeError:  # torch raises _LinAlgError (a RuntimeError) on no convergence
            if attempt == retries:
                raise
            scale = float(f.diagonal().abs().mean()) or 1.0
            shift = scale * 1e-10 * 100**attempt
    raise AssertionError("unreachable")


def spectrum_stats(eigvals: Tensor) -> dict[str, float]:
    """Largest eigenvalue, trace, condition number and effective rank.

    Args:
        eigvals: ``[d]``, ≥ 0.

    Returns:
        ``max``; ``trace``; ``cond`` = max / smallest eigenvalue above ``1e-12·max`` (inf if
        the factor is zero); ``eff_rank`` = exp of the entropy of the eigenvalues normalised
        to sum 1.
    """
    ev = eigvals.detach().double().clamp(min=0.0)
    top, total = float(ev.max()), float(ev.sum())
    if top <= 0.0:
        return {"max": 0.0, "trace": 0.0, "cond": float("inf"), "eff_rank": 0.0}
    significant = ev[ev > top * 1e-12]
    p = ev[ev > 0] / total
    return {"max": top, "trace": total, "cond": top / float(significant.min()),
            "eff_rank": float(torch.exp(-(p * p.log()).sum()))}


def log10_histogram(eigvals: Tensor, bins: int = 32) -> tuple[list[int], list[float]] | None:
    """Histogram ``(counts [bins], edges [bins + 1])`` of log10 of the positive eigenvalues of
    ``eigvals`` (``[d]``); None if none is positive."""
    ev = eigvals.detach().double()
    positive = ev[ev > 0].log10()
    if positive.numel() == 0:
        return None
    lo, hi = float(positive.min()), float(positive.max())
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    counts = torch.histc(positive, bins=bins, min=lo, max=hi)
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    return [int(c) for c in counts.tolist()], edges.tolist()
