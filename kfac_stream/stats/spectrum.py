r"""Eigendecomposition of PSD factors and the spectrum statistics the snapshots carry.

``safe_psd_eigh`` follows the usual recipe for covariance-like matrices: cast to float64,
symmetrise (:math:`(F + F^\top)/2`), ``torch.linalg.eigh``; if LAPACK fails to converge, retry
with a tiny diagonal shift (removed from the eigenvalues again); clip the slightly negative
eigenvalues rounding produces to zero (the factors are PSD by construction).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor

#: Factors with a side below this are decomposed on one thread: LAPACK's threads gain nothing
#: there (a 1024-side float64 eigh takes ~0.1 s on one core), and extra threads on busy
#: cores cost more than they give (24 decompositions of side 257 took 73 s on 2 threads and
#: 0.1 s on 1 while another process used both cores of a 2-core machine).
EIGH_PARALLEL_MIN_DIM = 1024


def _threads_for(f: Tensor, threads: int) -> int:
    """CPU threads for the decomposition of ``f`` (``[d, d]`` or ``[d]``)."""
    return threads if f.dim() == 2 and f.shape[0] >= EIGH_PARALLEL_MIN_DIM else 1


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
    """Eigendecompose many PSD factors where it is fast (float64 in, float64 out; snapshots
    use `eigh_stored`, which takes the stored factors one at a time).

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
        threads: CPU threads while decomposing on the CPU a factor of side at least
            `EIGH_PARALLEL_MIN_DIM` (default `default_eigh_threads`; smaller ones take one).
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
        prev, threads = torch.get_num_threads(), threads or default_eigh_threads()
        try:
            for k, f in dense.items():
                torch.set_num_threads(_threads_for(f, threads))
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


def eigh_stored(stored: Iterable[tuple[str, Tensor, float]], out_dtype: torch.dtype,
                device: torch.device | str | None = None, threads: int | None = None
                ) -> Iterator[tuple[str, Tensor, Tensor | None, dict[str, float]]]:
    """Eigendecompose stored (quantised) factors one at a time, with bounded memory.

    What a snapshot runs (`kfac_stream.snapshot.eigen_stream`): each
    factor is dequantised, decomposed and reduced to its results before the next is touched,
    so at most one factor's working copies are alive at a time (never all factors widened at
    once, nothing held twice); the results are yielded as they come.

    * On the CPU (``device`` None or a CPU device): the factor is dequantised to float64
      (``data.double() * scale``, as it always was) and decomposed by `safe_psd_eigh` with
      ``threads`` threads (default `default_eigh_threads`; one below `EIGH_PARALLEL_MIN_DIM`;
      process-wide, restored when the generator finishes or is closed); the spectrum
      statistics come from the float64 eigenvalues; the float64 copies are dropped before
      the next factor.
    * On a CUDA ``device`` (dense factors; a diagonal one is a ``[d]`` vector and stays on the
      CPU as above): on `eigh_stream`, the stored factor (fp16) is copied to the device,
      dequantised there in float32 (the same value as rounding the float64 dequantisation:
      fp16 x fp32 products are exact in float64), symmetrised and decomposed in float32; the
      eigenvalues are clipped at 0, their finiteness and that of the eigenvectors is checked
      and the spectrum statistics are computed there (`spectrum_stats`' formulas, in float64
      from the float32 eigenvalues); eigenvalues, eigenvectors (float32: never widened unless
      ``out_dtype`` is float64) and the statistics are copied non-blocking into pinned host
      buffers, and the stream is synchronised once per factor. A factor whose decomposition
      raises (``torch.linalg.LinAlgError``, out of memory: any ``RuntimeError``) or is not
      finite is redone on the CPU in float64 as above; the others keep their GPU result.

    Args:
        stored: ``(key, data, scale)`` per factor: ``data`` ``[d, d]`` (dense) or ``[d]``
            (diagonal) in its storage dtype, the factor being ``data * scale``.
        out_dtype: The dtype of the yielded eigenvalues and eigenvectors (the snapshot
            format's: float32, float64 for float64 storage).
        device: Where to decompose the dense factors (see above).
        threads: CPU threads for the CPU decompositions.

    Yields:
        ``(key, eigvals [d] out_dtype ascending ≥ 0, eigvecs [d, d] out_dtype | None,
        spectrum_stats dict)`` in the order of ``stored``.
    """
    dev = torch.device(device) if device is not None else None
    cuda = dev is not None and dev.type == "cuda"
    prev, threads = torch.get_num_threads(), threads or default_eigh_threads()
    try:
        for key, data, scale in stored:
            torch.set_num_threads(_threads_for(data, threads))
            done = _eigh_stored_cuda(data, scale, out_dtype, dev) \
                if cuda and data.dim() == 2 else None
            yield (key, *(done if done is not None else _eigh_stored_cpu(data, scale, out_dtype)))
    finally:
        torch.set_num_threads(prev)


def _eigh_stored_cpu(data: Tensor, scale: float, out_dtype: torch.dtype
                     ) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """float64 `safe_psd_eigh` of ``data * scale`` on the CPU; only the results survive."""
    f = data.detach().to("cpu").double() * scale  # [d, d] or [d] float64
    w, q = safe_psd_eigh(f)  # looked up at call time (tests patch it)
    del f
    stats = spectrum_stats(w)
    if q is not None:  # row-major, as the shard stores it (LAPACK returns column-major)
        q = q.to(out_dtype, memory_format=torch.contiguous_format)
    return w.to(out_dtype), q, stats


def _eigh_stored_cuda(data: Tensor, scale: float, out_dtype: torch.dtype, device: torch.device
                      ) -> tuple[Tensor, Tensor, dict[str, float]] | None:
    """float32 eigh of ``data * scale`` on ``device`` into pinned host buffers; None if it
    failed or is not finite (then the caller decomposes it on the CPU)."""
    stream = eigh_stream(device)
    if data.is_cuda:  # made on the caller's stream
        stream.wait_stream(torch.cuda.current_stream(data.device))
    try:
        with torch.cuda.stream(stream):
            x = data.detach().to(device, non_blocking=True)  # [d, d] as stored (fp16)
            m = (x.double() * scale).float() if x.dtype == torch.float64 else x.float() * scale
            del x
            m = (m + m.T) * 0.5
            w, q = torch.linalg.eigh(m)  # [d], [d, d] float32
            del m
            finite = torch.isfinite(w).all() & torch.isfinite(q).all()
            w = w.clamp(min=0.0)
            head = torch.cat([finite.double().reshape(1), _stats_vector(w.double())])  # [5]
            # row-major on the device (cuSOLVER returns column-major): the shard's layout,
            # so the copy is one contiguous transfer and the writer copies nothing
            results = (w.to(out_dtype), q.to(out_dtype, memory_format=torch.contiguous_format),
                       head)
            del w, q
            host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in results)
            for h, t in zip(host, results):
                h.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # once per factor
    except RuntimeError:  # LinAlgError, out of memory
        return None
    flags = host[2].tolist()
    if flags[0] != 1.0:
        return None
    return host[0], host[1], _stats_dict(flags[1:])


def _stats_vector(ev: Tensor) -> Tensor:
    """`spectrum_stats` as a tensor ``[max, trace, cond, eff_rank]`` where ``ev`` (``[d]``,
    float64, ≥ 0) lives: no host sync."""
    top, total = ev.max(), ev.sum()
    smallest = torch.where(ev > top * 1e-12, ev, torch.full_like(ev, float("inf"))).min()
    p = torch.where(ev > 0, ev / total, torch.ones_like(ev))  # p log p = 0 where ev = 0
    return torch.stack([top, total, top / smallest, torch.exp(-(p * p.log()).sum())])


def _stats_dict(values: list[float]) -> dict[str, float]:
    top, total, cond, eff_rank = values
    if top <= 0.0:
        return {"max": 0.0, "trace": 0.0, "cond": float("inf"), "eff_rank": 0.0}
    return {"max": top, "trace": total, "cond": cond, "eff_rank": eff_rank}


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
    return _stats_dict([float(v) for v in _stats_vector(ev)])  # the device path's formulas


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
