r"""The device path of the factor store: pending statistics resident on the accelerator, and
the flush that streams the host's FP16 factors through it.

Accumulation (every update, device kernels only). The EMA is linear, so any number of
updates since the last flush combine into one pending sum ``P`` with ``F_new = α·F + P``:
``P ← (1-η)·P + (η/n)·S`` and ``α ← α(1-η)``. ``P`` is kept as ``s·P'`` with a host scalar
``s`` (``s ← s(1-η)``), so an update only *adds* into ``P'``:
``P' ← P' + η/(n·s)·S`` — one fused ``addmm`` (``XᵀX`` accumulated into ``P'`` by the GEMM
itself; 16-bit rows on CUDA on the tensor cores with float32 output where torch has that
kernel, `fused_16bit`, else a tensor-core ``mm`` with float32 output and one add). Nothing
is read on the host. When ``s`` falls below `RENORM` (after
hundreds of updates at ``λ = 0.95``) ``P'`` is multiplied by ``s`` once and ``s`` reset to 1,
so ``P'`` never leaves the float32 range.

Flush (when a snapshot, checkpoint or export reads the factors, or the budget forces it). For
every chunk of rows: host→device copy of the stored FP16 rows (pinned, non-blocking, on a
copy stream), ``(α·scale_old·F + s·sym(P'))·2^-e`` in float32 on the device, rounded to FP16,
device→host copy into the same pinned rows (a second copy stream); two buffer slots, so chunk
``i+1`` loads while chunk ``i`` computes and chunk ``i-1`` drains. The new power-of-two scale
``2^e`` is computed on the device (from the diagonal of ``P'``, PSD: the largest entry is a
diagonal one) before any chunk is written; the host never reads a value per factor or per
chunk: one read at the end of a flush of any number of factors brings every new scale,
largest diagonal entry and trace. ``sym(P')`` is ``(P' + P'ᵀ)/2`` per chunk, so the stored
factor is exactly symmetric as on the host path. On a CPU standing in for the device the same
code runs with plain copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..stats.fp16 import FP16_TARGET
from .fold_cost import (
    accumulate_bytes,
    accumulate_flops,
    chunk_rows,
    flush_bytes,
    flush_chunks,
)
from .traffic import Traffic

#: ``s`` below this: fold it into ``P'`` (one pass) so ``P'`` stays far from float32's range.
RENORM = 2.0**-40


@dataclass
class DevicePending:
    """One factor's pending statistic on the device.

    Attributes:
        data: ``P'`` (``[d, d]`` or ``[d]``, the compute dtype) with ``P = s·P'``.
        s: Host scalar of ``P = s·P'``.
        alpha: ``Π (1-η)`` over the pending updates: ``F_new = α·F + P``.
        updates: Updates in it.
        empty: No update since the last flush (``data`` holds stale values, overwritten by
            the next accumulation).
    """

    data: Tensor
    s: float = 1.0
    alpha: float = 1.0
    updates: int = 0
    empty: bool = True

    def clone(self) -> DevicePending:
        return DevicePending(self.data.clone(), self.s, self.alpha, self.updates, self.empty)


def is_fused(rows: Tensor, acc: Tensor) -> bool:
    """The Gram of ``rows`` goes straight into ``acc`` (no float32 temporary): float32/float64
    rows by ``addmm_``; 16-bit rows on CUDA by a tensor-core ``addmm`` with float32 output
    into ``acc`` itself where this torch has it and it is right on this device
    (`fused_16bit`); else a tensor-core ``mm`` and an add (`gram_mm`)."""
    if not (rows.is_cuda and rows.element_size() == 2):
        return True
    return acc.dtype == torch.float32 and fused_16bit(rows.device)


#: `fused_16bit` per device, probed once.
_FUSED_16BIT: dict[str, bool] = {}


def fused_16bit(device: torch.device) -> bool:
    """Whether ``torch.addmm(acc, Xᵀ, X, out_dtype=float32, out=acc)`` with 16-bit ``X`` runs
    on ``device`` and equals the unfused fold (probed once per device on small matrices: one
    host read; the CPU build has no such kernel)."""
    key = str(device)
    if key not in _FUSED_16BIT:
        _FUSED_16BIT[key] = probe_fused_16bit(device)
    return _FUSED_16BIT[key]


def probe_fused_16bit(device: torch.device, batch: tuple[int, ...] = ()) -> bool:
    """Probe ``addmm`` (``batch`` ``()``) or ``baddbmm`` (``batch`` ``(b,)``, the groups'
    fold) with 16-bit ``X`` and float32 output into the accumulator on ``device``."""
    gen = torch.Generator().manual_seed(0)
    fold = torch.baddbmm if batch else torch.addmm
    try:
        x = torch.randn(*batch, 64, 48, generator=gen).to(device=device, dtype=torch.bfloat16)
        acc = torch.randn(*batch, 48, 48, generator=gen).to(device)
        xf = x.float()
        want = acc * 0.5 + 2.0 * (xf.mT @ xf)
        fold(acc, x.mT, x, beta=0.5, alpha=2.0, out_dtype=torch.float32, out=acc)
        # beta=0 must ignore what the output held (a pending sum's stale entries), NaN too
        fresh = torch.full_like(acc, math.nan)
        fold(fresh, x.mT, x, beta=0.0, alpha=2.0, out_dtype=torch.float32, out=fresh)
        # fp32 accumulation of 64 exact products: far inside 1e-4 of entries of order 10
        return bool(torch.allclose(acc, want, rtol=1e-5, atol=1e-4)
                    and torch.allclose(fresh, 2.0 * (xf.mT @ xf), rtol=1e-5, atol=1e-4))
    except (RuntimeError, TypeError):  # NotImplementedError is a RuntimeError
        return False


def gram_mm(rows: Tensor) -> Tensor:
    """``XᵀX`` of 16-bit rows on CUDA on the tensor cores, float32 accumulation and output."""
    return torch.mm(rows.T, rows, out_dtype=torch.float32)


def accumulate(p: DevicePending, payload: Tensor, how: str, eta: float, n: float,
               diagonal: bool, traffic: Traffic) -> None:
    """``P ← (1-η)·P + (η/n)·S`` in place, device kernels only (see the module docstring).

    Args:
        p: The pending statistic.
        payload: ``how="rows"``: weighted rows ``[m, d]`` (``S = XᵀX``); ``"stats"``: the
            summed statistic ``[d, d]`` or ``[d]``.
        eta: The update's ``η`` (1: the final window's restart, which drops what is pending).
        n: The update's total weight.
        diagonal: Only the diagonal is kept.
        traffic: Counts the FLOPs and device bytes (`fold_cost`).
    """
    acc = p.data
    beta = 1.0 - eta
    overwrite = p.empty or beta == 0.0
    if overwrite:
        s_new = 1.0
    elif p.s * beta < RENORM:
        acc.mul_(p.s * beta)
        s_new = 1.0
    else:
        s_new = p.s * beta
    coef = eta / (n * s_new)
    m = payload.shape[0] if how == "rows" else 0
    fused = True
    if how == "rows" and diagonal:
        _add(acc, payload.to(acc.dtype).square().sum(0), coef, overwrite)
    elif how == "rows":
        fused = is_fused(payload, acc)
        if fused and payload.dtype != acc.dtype and payload.is_cuda:  # 16-bit, tensor cores
            torch.addmm(acc, payload.T, payload, beta=0.0 if overwrite else 1.0, alpha=coef,
                        out_dtype=torch.float32, out=acc)
        elif fused:
            x = payload.to(acc.dtype)
            acc.addmm_(x.T, x, beta=0.0 if overwrite else 1.0, alpha=coef)
        else:
            _add(acc, gram_mm(payload), coef, overwrite)
    else:
        _add(acc, payload, coef, overwrite)
    d = acc.shape[0]
    p.s = s_new
    p.alpha = beta if p.empty else p.alpha * beta  # F_new = α·F + P
    p.updates = 1 if p.empty else p.updates + 1
    p.empty = False
    traffic.device_folds += 1
    traffic.fold_flops += accumulate_flops(how, d, diagonal, m)
    traffic.fold_device_bytes += accumulate_bytes(how, d, diagonal, m,
                                                  in_bytes=payload.element_size(),
                                                  acc_bytes=acc.element_size(), fused=fused)


def _add(acc: Tensor, term: Tensor, coef: float, overwrite: bool) -> None:
    if overwrite:
        torch.mul(term, coef, out=acc)
    else:
        acc.add_(term, alpha=coef)


class FlushLanes:
    """A flush's streams: host→device copies, the caller's compute stream, device→host copies,
    with two buffer slots and the events that order them; on a CPU stand-in every wait and
    record is a no-op and the copies are plain."""

    def __init__(self, device: torch.device, storage: torch.dtype, entries: int) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.slots_in = [torch.empty(entries, dtype=storage, device=device) for _ in range(2)]
        self.slots_out = [torch.empty(entries, dtype=storage, device=device) for _ in range(2)]
        self.i = 0
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.loaded, self.consumed, self.computed, self.drained = (
                [torch.cuda.Event() for _ in range(2)] for _ in range(4))

    def chunk(self, host_rows: Tensor, compute, out_rows: Tensor | None = None) -> None:
        """Stream ``host_rows`` (a contiguous row block of a pinned stored factor) through
        ``compute(device_rows) -> new rows`` (in the storage dtype) and back into place, or
        into ``out_rows`` instead when given (the same rows of the tensor that replaces a
        factor a snapshot holds)."""
        dst = host_rows if out_rows is None else out_rows
        k, n = self.i % 2, host_rows.numel()
        self.i += 1
        into = self.slots_in[k][:n].view(host_rows.shape)
        out = self.slots_out[k][:n].view(host_rows.shape)
        if not self.cuda:
            into.copy_(host_rows)
            out.copy_(compute(into))
            dst.copy_(out)
            return
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(self.consumed[k])  # chunk i-2 has read this slot
            into.copy_(host_rows, non_blocking=True)
            self.loaded[k].record(self.h2d)
        self.compute.wait_event(self.loaded[k])
        self.compute.wait_event(self.drained[k])  # chunk i-2 has left this slot
        out.copy_(compute(into))
        self.consumed[k].record(self.compute)
        self.computed[k].record(self.compute)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(self.computed[k])
            dst.copy_(out, non_blocking=True)
            self.drained[k].record(self.d2h)

    def finish(self) -> None:
        """The compute stream waits for the last device→host copy (a read on it after this
        sees every chunk in place)."""
        if self.cuda:
            self.compute.wait_stream(self.d2h)


@dataclass
class FoldResult:
    """Device scalars of one factor's flush, read on the host at the end of the flush.

    Attributes:
        exponent: ``e`` of the new scale ``2^e`` (0-dim; 0 for non-float16 storage).
        diag_max: Largest stored diagonal entry (before the scale).
        trace: Sum of the stored diagonal (before the scale), float64.
        sq_frob: Sum of the squares of every stored entry (before the scale), float64.
    """

    exponent: Tensor
    diag_max: Tensor
    trace: Tensor
    sq_frob: Tensor


def stream_fold(data: Tensor, scale: float, amax: float, p: DevicePending, diagonal: bool,
                lanes: FlushLanes, traffic: Traffic, out: Tensor | None = None
                ) -> FoldResult:
    """Queue ``F ← α·F + s·sym(P')`` of one stored factor through the device.

    Args:
        data: The stored factor (host, pinned on CUDA), ``[d, d]`` or ``[d]``, float16 (with
            ``scale``) or float32/float64.
        scale, amax: Its current scale and bound on ``max|F|``.
        p: Its pending statistic (not empty).
        diagonal: Only the diagonal is kept.
        lanes: The flush's streams and buffers.
        traffic: Counts chunks, copies and bytes.
        out: A tensor like ``data`` (pinned on CUDA) that receives the new stored values
            instead of ``data``, which is only read (a snapshot in flight holds it).

    Returns:
        The new scale's exponent, the stored diagonal's maximum and sum and the sum of squares
        of every stored entry, as device scalars.
    """
    acc, d = p.data, data.shape[0]
    cd = acc.dtype
    fp16 = data.dtype == torch.float16
    if fp16:  # the new scale from a bound on max|F_new| (PSD: a diagonal entry), on the device
        top = (acc if diagonal else acc.diagonal()).max().to(torch.float64)
        bound = p.alpha * amax + p.s * top
        e = torch.where(bound > 0, torch.ceil(torch.log2(bound / FP16_TARGET)),
                        torch.zeros_like(bound))
        inv = torch.exp2(-e)
        c_old = (scale * p.alpha * inv).to(cd)
        c_new = (p.s * inv).to(cd)
    else:
        e = torch.zeros((), dtype=torch.float64, device=acc.device)
        c_old, c_new = p.alpha * scale, p.s
    diag_max = torch.zeros((), dtype=cd, device=acc.device)
    trace = torch.zeros((), dtype=torch.float64, device=acc.device)
    frob = torch.zeros((), dtype=torch.float64, device=acc.device)
    step = chunk_rows(d, diagonal)
    for r0 in range(0, d, step):
        r1 = min(r0 + step, d)

        def compute(rows: Tensor, r0=r0, r1=r1) -> Tensor:
            nonlocal diag_max, trace, frob
            new = acc[r0:r1] if diagonal else (acc[r0:r1] + acc[:, r0:r1].T) * 0.5
            if fp16:
                out = rows.to(cd).mul_(c_old).addcmul_(new, c_new).to(data.dtype)
            else:
                out = rows.to(cd).mul_(c_old).add_(new, alpha=c_new).to(data.dtype)
            dg = (out if diagonal else out[:, r0:r1].diagonal()).to(cd)
            diag_max = torch.maximum(diag_max, dg.max())
            trace = trace + dg.to(torch.float64).sum()
            frob = frob + out.to(cd).square().sum(dtype=torch.float64)  # full rows: all of F
            return out

        lanes.chunk(data[r0:r1], compute, None if out is None else out[r0:r1])
    traffic.flush_chunks += flush_chunks(d, diagonal)
    traffic.flush_copies += 2 * flush_chunks(d, diagonal)
    moved = flush_bytes(d, diagonal, data.element_size())
    traffic.bytes_to_device += moved
    traffic.bytes_to_host += moved
    return FoldResult(e, diag_max, trace, frob)


def make_lanes(device: torch.device, storage: torch.dtype, dims: list[tuple[int, bool]]
               ) -> FlushLanes:
    """The streams and two buffer slots of a flush of factors of ``dims`` (``(d, diagonal)``;
    the slots fit the largest chunk)."""
    most = max((chunk_rows(d, g) * (d if not g else 1) for d, g in dims), default=1)
    return FlushLanes(device, storage, most)
