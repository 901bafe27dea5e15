r"""Eigendecomposition of PSD factors and the spectrum statistics the snapshots carry.

``safe_psd_eigh`` follows the usual recipe for covariance-like matrices: cast to float64,
symmetrise (:math:`(F + F^\top)/2`), ``torch.linalg.eigh``; if LAPACK fails to converge, retry
with a tiny diagonal shift (removed from the eigenvalues again); clip the slightly negative
eigenvalues rounding produces to zero (the factors are PSD by construction).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import Tensor


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
        device: A CUDA device: dense factors are decomposed there in float32, one at a time
            (torch runs a batch of more than 32 matrices one by one anyway), on one stream per
            device made once and reused by every snapshot (the training stream never waits;
            a new stream per snapshot would strand cached blocks and wrap the 32-stream pool
            into other components' streams); the results are copied to the host in float32
            and widened there. A factor whose decomposition fails (``LinAlgError``, out of
            memory) or is not finite is redone on the CPU in float64; the others keep their
            GPU result. None (or a CPU device): `safe_psd_eigh` in float64 on the CPU.
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


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # one eigh stream per device


def eigh_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream snapshot eigendecompositions run on for ``device``, made on first use and
    reused for the life of the process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = torch.device("cuda", index)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(key)
    return stream


def _eigh_on_gpu(dense: dict[str, Tensor], device: torch.device,
                 out: dict[str, tuple[Tensor, Tensor | None]]) -> dict[str, Tensor]:
    """float32 ``eigh`` of each factor on ``device`` into ``out``, on `eigh_stream`; returns the
    factors left over for the CPU."""
    def on_gpu(f: Tensor) -> tuple[Tensor, Tensor]:
        m = f.to(device, torch.float32)  # [d, d]
        w, q = torch.linalg.eigh((m + m.T) * 0.5)  # [d], [d, d]
        return w.cpu(), q.cpu()  # float32 copies (the stream's sync); widened on the host

    stream = eigh_stream(device)
    with torch.cuda.stream(stream):
        return eigh_each(dense, out, on_gpu)


def eigh_each(dense: dict[str, Tensor], out: dict[str, tuple[Tensor, Tensor | None]],
              run: Callable[[Tensor], tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """``run`` (``[d, d] -> (eigvals [d], eigvecs [d, d])``, on the host) on each factor of
    ``dense``; finite results go into ``out`` in float64 with the eigenvalues clipped at 0. A
    factor whose ``run`` raises (``torch.linalg.LinAlgError``, out of memory: any
    ``RuntimeError``) or returns a non-finite value is returned for the CPU fallback; the
    others keep their result."""
    left = {}
    for k, f in dense.items():
        try:
            w, q = run(f)
        except RuntimeError:
            left[k] = f
            continue
        w, q = w.double(), q.double()
        if bool(torch.isfinite(w).all()) and bool(torch.isfinite(q).all()):
            out[k] = (w.clamp(min=0.0), q)
        else:
            left[k] = f
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
