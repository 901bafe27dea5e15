r"""Estimated spectra of stored K-FAC factors by block Lanczos, without eigendecomposing them.

A periodic snapshot records, per factor :math:`F = \text{data} \cdot \text{scale}` (side
:math:`d`), an *estimated* spectrum: :math:`\lambda_{\max}`, the effective rank, the condition
number and a density of eigenvalues (atoms ``nodes`` with eigenvalue counts ``weights``).
Exact by construction: the trace (the diagonal sum), :math:`\|F\|_F` and the largest diagonal
entry. The only eigenproblem solved is the small projected one (side :math:`m =`
``steps · probes`` at most), in float64 on the CPU; the factor itself is only multiplied.

Method (`estimate_spectrum`):

1. **Block Lanczos with full reorthogonalisation.** ``probes`` random Gaussian vectors (drawn on
   the CPU from a ``torch.Generator`` seeded with ``seed``, so the result is deterministic),
   orthonormalised, span the first block; each block step multiplies the newest block by
   :math:`F` and orthogonalises the product twice against the whole basis ("twice is
   enough"), then orthonormalises it through its :math:`p \times p` Gram matrix, dropping the
   directions below the rounding level (a *breakdown*: the Krylov space is invariant, as for a
   rank-deficient factor or :math:`d \le m`).
2. **Rayleigh–Ritz on the whole basis** :math:`Q` (``[d, m]``): :math:`T = Q^\top (F Q)`
   (symmetrised; float64 on the CPU), :math:`T = S \Theta S^\top`. Ritz value
   :math:`\theta_i`, residual :math:`r_i = \|F Q s_i - \theta_i Q s_i\|` (an eigenvalue of
   :math:`F` lies within :math:`r_i` of :math:`\theta_i`).
3. **Deflated stochastic Lanczos quadrature.** A Ritz pair with :math:`r_i \le 10^{-3}
   |\theta_i|` (plus the rounding level) is an eigenpair: weight 1, unless it belongs to a
   cluster of at least ``probes`` such pairs (a random ``probes``-block meets an eigenspace of
   higher multiplicity in exactly ``probes`` directions, so a cluster that full may stand for
   more eigenvalues: the zero eigenvalue of a rank-deficient factor). Every other Ritz value
   carries its Gauss-quadrature weight :math:`\|S_{:p, i}\|^2` (its share of the starting
   block), scaled so that all weights sum to :math:`d`.
4. **Calibration.** The weights of step 3's non-deflated atoms are tilted,
   :math:`w_i \to w_i e^{a + b\theta_i + c\theta_i^2}` (the smallest change in the
   Kullback–Leibler sense), so that the atoms reproduce what is known exactly of the part of
   the spectrum they stand for: its count, its sum (trace less the deflated eigenvalues) and
   its sum of squares (:math:`\|F\|_F^2` less theirs). The probes' variance mostly moves mass
   along :math:`\lambda`, which these moments pin down (the entropy of the eigenvalues, hence
   ``eff_rank``, is close to linear in them over the tail); without a solution the weights of
   step 3 are kept.

Limit: the density is resolved on a log axis only down to ~``λ_top · (π / 2 steps)²`` of the
part of the spectrum not deflated; below that, eigenvalues spread evenly over many decades are
lumped into the lowest atoms (log-uniform eigenvalues over 6 decades: W1 ~0.3 decades, see
tests/unit/stats/test_lanczos.py), while ``max`` and ``eff_rank`` (dominated by the upper decades)
stay accurate.

Precision: float32 on a CUDA device (the product reads the factor in float32), float64 on the
CPU. The Ritz values are clipped at 0 into ``nodes`` (K-FAC factors are PSD; the fp16 storage's
rounding makes small negative eigenvalues, as `spectrum_stats` clips them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

#: Block size: random starting vectors. 4 Gauss-quadrature samples of the density (the
#: calibration, module docstring, keeps the effective rank's probe noise below 0.5% on real
#: factors) and a block product that reads the factor once per step for 4 vectors.
LANCZOS_PROBES = 4
#: Block steps: polynomials of degree 64 in the factor, the basis ``m = 64 · 4 = 256`` columns. The
#: steps, not the probes, set how far down the density is resolved (a polynomial of degree s
#: resolves eigenvalues down to ~``λ_top · (π / 2s)²`` of the part not yet deflated): on the
#: mid-size Llama's factors (benchmarks/lanczos_accuracy.py: sides 1024, 2816) 24 steps x 8 probes
#: left the steepest factors (o_proj's A, effective rank ~45 of 1024) at W1 0.14 decades, 48 x 4 at
#: 0.09, 64 x 4 at 0.04 (48 x 8: 0.03, but a side-384 eigenproblem). Cost for a factor of side d:
#: the products ``steps · 2 d² · probes`` FLOPs (d = 5632: 1.6e10), the full reorthogonalisation and
#: the Ritz residuals ``~8 d m²`` (3e9), a float64 CPU ``eigh`` of side 256 (5-7 ms on one core) and
#: one host round trip per step (the block's 4 x 4 Gram matrix, ~20 us each). On an H100/H200 (not
#: measured here: estimates) the products are memory-bound: 64 reads of d² float32 (127 MB at d =
#: 5632) at ~4.8 TB/s, ~1.7 ms (the FLOPs alone ~0.3 ms at ~50 TFLOP/s); with the round trips (~1.3
#: ms) and the CPU ``eigh``, ~9 ms per factor of side 5632, ~7 ms at 2048, ~6 ms at 256. A 1.1B
#: Llama (22 blocks of 11 factors, 242 in all: per block the A's of q/k/v, o, gate/up (2048) and
#: down (5632), the G's of q, o, down (2048), k, v (256), gate, up (5632): 66 of side 5632, 132 of
#: 2048, 44 of 256) takes ~1.7 s, dominated by the CPU ``eigh`` of the projected matrices.
LANCZOS_STEPS = 64
#: Floor of `log10_wasserstein`, relative to the largest exact eigenvalue (docstring there).
FLOOR_REL = 1e-6
#: A Ritz pair is an eigenpair (weight 1) when its residual is at most this times |Ritz value|
#: (an eigenvalue lies within 0.0004 decades of it), plus the rounding level.
CONVERGED_REL = 1e-3


@dataclass(frozen=True)
class SpectrumEstimate:
    """The estimated spectrum of one factor (side ``d``); `estimate_spectrum` makes it.

    Attributes:
        max: λ_max estimate: the largest Ritz value (a lower bound: Rayleigh–Ritz).
        max_bound: A posteriori bound on ``|λ_max − max|``: the top Ritz pair's residual norm
            (an eigenvalue lies within it; 0 where ``exact``).
        trace: Exact: the diagonal sum.
        frobenius: Exact ``‖F‖_F``.
        diag_max: Exact largest diagonal entry.
        eff_rank: Estimated exp of the entropy of the eigenvalues / their sum (the density's).
        cond: Estimated max / smallest density atom above ``1e-12 · max`` (inf if zero).
        nodes: ``[k]`` float64 CPU: density atoms (Ritz values clipped at 0), ascending.
        weights: ``[k]`` float64 CPU: estimated eigenvalue counts at the atoms (sum d).
        steps: Block steps run (fewer than asked after a breakdown; 0 for a diagonal factor).
        probes: Block size (starting vectors).
        exact: The atoms are the eigenvalues with their multiplicities (the Krylov space
            covered the whole space, or broke down with at most one eigenvalue of
            multiplicity ≥ ``probes``, which takes the rest; a diagonal factor).
    """

    max: float
    max_bound: float
    trace: float
    frobenius: float
    diag_max: float
    eff_rank: float
    cond: float
    nodes: Tensor
    weights: Tensor
    steps: int
    probes: int
    exact: bool

    def stats(self) -> dict[str, float]:
        """``{max, trace, cond, eff_rank}``: the keys of `spectrum_stats` (estimated)."""
        if self.max <= 0.0:
            return {"max": 0.0, "trace": 0.0, "cond": float("inf"), "eff_rank": 0.0}
        return {"max": self.max, "trace": self.trace, "cond": self.cond,
                "eff_rank": self.eff_rank}

    def to_json(self) -> dict[str, float | int | bool]:
        """The fields beyond `stats` as plain Python values: ``estimate`` (not ``exact``),
        ``exact``, ``max_bound``, ``steps``, ``probes``, ``frobenius``, ``diag_max``,
        ``atoms`` (the density's atom count)."""
        return {"estimate": not self.exact, "exact": bool(self.exact),
                "max_bound": float(self.max_bound), "steps": int(self.steps),
                "probes": int(self.probes), "frobenius": float(self.frobenius),
                "diag_max": float(self.diag_max), "atoms": int(self.nodes.numel())}


def estimate_spectrum(data: Tensor, scale: float, steps: int = LANCZOS_STEPS,
                      probes: int = LANCZOS_PROBES, seed: int = 0,
                      device: torch.device | str | None = None) -> SpectrumEstimate:
    """Estimate the spectrum of the stored factor ``F = data * scale`` (module docstring).

    Args:
        data: ``[d, d]`` (dense, symmetric as stored) or ``[d]`` (diagonal: then exact, no
            Lanczos), in its storage dtype (fp16, bf16, float32, float64), on any device.
        scale: The stored scale.
        steps: Block Lanczos steps (the basis has at most ``steps · probes`` columns).
        probes: Random starting vectors (the block size).
        seed: Seed of the starting vectors (the result is deterministic for a seed).
        device: Where the factor is multiplied: a CUDA device (float32) or None / a CPU device
            (float64 on the CPU). The small eigenproblem is solved in float64 on the CPU.

    Returns:
        The `SpectrumEstimate`.

    Raises:
        ValueError: ``data`` is not ``[d, d]`` or ``[d]``, or ``data * scale`` is not finite;
            ``steps`` or ``probes`` below 1.
    """
    if data.dim() not in (1, 2) or (data.dim() == 2 and data.shape[0] != data.shape[1]):
        raise ValueError(f"estimate_spectrum: a [d, d] or [d] factor, got {tuple(data.shape)}")
    if steps < 1 or probes < 1:
        raise ValueError(f"estimate_spectrum: steps={steps}, probes={probes} (both >= 1)")
    f = _dequantise(data, scale, device)  # [d, d] or [d]
    if not bool(torch.isfinite(f).all()):
        raise ValueError("estimate_spectrum: the factor has non-finite entries")
    diag = f if f.dim() == 1 else f.diagonal()  # [d]
    exact = {"trace": float(diag.sum()), "diag_max": float(diag.max()) if diag.numel() else 0.0,
             "frobenius": float(torch.linalg.vector_norm(f))}
    d = f.shape[0]
    if f.dim() == 1 or exact["frobenius"] == 0.0 or d == 1:
        vals = diag.detach().to("cpu", torch.float64)  # [d]
        del f
        return _from_eigenvalues(vals, exact, probes)
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(d, min(probes, d), generator=gen, dtype=torch.float64)  # [d, p]
    q, fq, invariant = _block_krylov(f, start.to(f.device, f.dtype), steps, exact["frobenius"])
    eps = float(torch.finfo(f.dtype).eps)
    del f
    theta, s, resid = _ritz(q, fq)
    del q, fq
    rz = _RitzPairs(theta=theta, s=s, resid=resid, d=d, p=start.shape[1], invariant=invariant,
                    eps=eps)
    nodes, weights, is_exact = _density(rz, exact)
    eff_rank, cond = _density_stats(nodes, weights)
    return SpectrumEstimate(
        max=float(nodes[-1]), max_bound=0.0 if is_exact else float(resid[-1]),
        eff_rank=eff_rank, cond=cond, nodes=nodes, weights=weights,
        steps=-(-theta.numel() // start.shape[1]), probes=probes, exact=is_exact, **exact)


def _dequantise(data: Tensor, scale: float, device: torch.device | str | None) -> Tensor:
    """``data * scale`` symmetrised (``(F + Fᵀ)/2``), float32 on a CUDA ``device``, float64 on the
    CPU otherwise; ``[d, d]`` or ``[d]`` as ``data``."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        x = data.detach().to(dev, non_blocking=True)
        f = (x.double() * scale).float() if x.dtype == torch.float64 else x.float() * scale
    else:
        f = data.detach().to("cpu", torch.float64) * scale
    if f.dim() == 2:
        f = torch.add(f, f.T).mul_(0.5)  # one temporary, then in place
    return f


def _from_eigenvalues(vals: Tensor, exact: dict[str, float], probes: int) -> SpectrumEstimate:
    """The exact estimate of a factor whose eigenvalues are known: ``vals`` ``[d]`` float64
    (a diagonal factor, a zero factor, side 1)."""
    nodes, counts = torch.unique(vals.clamp(min=0.0), sorted=True, return_counts=True)  # [k]
    weights = counts.to(torch.float64)  # [k]
    ev, cond = _density_stats(nodes, weights)
    return SpectrumEstimate(max=float(nodes[-1]), max_bound=0.0, eff_rank=ev, cond=cond,
                            nodes=nodes, weights=weights, steps=0, probes=probes, exact=True,
                            **exact)


def _block_krylov(f: Tensor, start: Tensor, steps: int, fro: float
                  ) -> tuple[Tensor, Tensor, bool]:
    """Block Lanczos basis with full reorthogonalisation.

    Args:
        f: ``[d, d]`` the factor (float32 or float64).
        start: ``[d, p]`` starting block (same dtype and device).
        steps: Block steps (products).
        fro: ``‖F‖_F``, the scale of the breakdown test.

    Returns:
        ``(Q [d, k] orthonormal, FQ [d, k] = F @ Q, broke_down)``; ``k ≤ steps · p``, ``k ≤ d``;
        ``broke_down``: the Krylov space is invariant under ``F`` (it stopped growing).
    """
    d, p = start.shape
    m = min(steps * p, d)
    q = torch.empty(d, m, dtype=f.dtype, device=f.device)  # [d, m]
    fq = torch.empty_like(q)  # [d, m]
    block = _orthonormal_block(start, q[:, :0], 1.0)  # [d, b]
    k0, k = 0, block.shape[1]
    q[:, :k] = block
    for step in range(steps):
        fq[:, k0:k] = f @ q[:, k0:k]  # [d, b]: the step's product
        if k == d or k == m or step == steps - 1:
            return q[:, :k], fq[:, :k], k == d
        block = _orthonormal_block(fq[:, k0:k], q[:, :k], fro)  # [d, b']
        if block.shape[1] == 0:
            return q[:, :k], fq[:, :k], True
        block = block[:, :m - k]
        k0, k = k, k + block.shape[1]
        q[:, k0:k] = block
    raise AssertionError("unreachable")


def _orthonormal_block(w: Tensor, basis: Tensor, ref: float) -> Tensor:
    """An orthonormal basis ``[d, b']`` (``b' ≤ b``) of the part of ``w`` (``[d, b]``) orthogonal
    to ``basis`` (``[d, k]`` orthonormal columns): projected out twice, then orthonormalised
    through the ``[b, b]`` Gram matrix (float64 on the CPU), dropping the directions whose norm
    is below the rounding level relative to ``ref`` (``‖F‖_F``; 1 for the start block)."""
    w = w.clone()
    for _ in range(2):  # (wᵀ basis)ᵀ, not basisᵀ w: a column slice's transpose is a slow GEMM
        if basis.shape[1]:
            w -= basis @ (w.T @ basis).T  # [d, b]
    gram = (w.T @ w).to("cpu", torch.float64)  # [b, b]
    sq, u = torch.linalg.eigh((gram + gram.T) * 0.5)  # [b], [b, b]
    eps = torch.finfo(w.dtype).eps
    keep = sq.clamp(min=0.0).sqrt() > 256 * eps * ref * math.sqrt(w.shape[0])
    if not bool(keep.any()):
        return w[:, :0]
    u = (u[:, keep] / sq[keep].sqrt()).to(w.device, w.dtype)  # [b, b']
    x = w @ u  # [d, b'] nearly orthonormal
    if basis.shape[1]:
        x -= basis @ (x.T @ basis).T
    return torch.linalg.qr(x).Q  # [d, b']


@dataclass(frozen=True)
class _RitzPairs:
    """Rayleigh–Ritz on a Krylov basis of side ``d``: ``theta`` ``[k]`` ascending, ``s``
    ``[k, k]`` (``T = S diag(theta) Sᵀ``; rows ``:p`` are the starting block's coordinates),
    ``resid`` ``[k]`` residual norms, all float64 CPU; ``p`` the starting block's width;
    ``invariant``: the basis broke down; ``eps``: the products' unit roundoff."""

    theta: Tensor
    s: Tensor
    resid: Tensor
    d: int
    p: int
    invariant: bool
    eps: float


def _ritz(q: Tensor, fq: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rayleigh–Ritz on the basis ``q`` (``[d, k]``) with ``fq = F @ q`` (``[d, k]``).

    Returns:
        ``(theta [k] ascending, S [k, k], residuals [k])``, float64 on the CPU: ``T = Qᵀ F Q
        = S diag(theta) Sᵀ`` (symmetrised), residual ``i`` = ``‖F Q s_i − theta_i Q s_i‖``.
    """
    t = (q.T @ fq).to("cpu", torch.float64)  # [k, k]
    theta, s = torch.linalg.eigh((t + t.T) * 0.5)  # [k], [k, k]: side k ≤ steps · probes
    sd = s.to(q.device, q.dtype)  # [k, k]
    r = fq @ sd - (q @ sd) * theta.to(q.device, q.dtype)  # [d, k]
    resid = torch.linalg.vector_norm(r, dim=0).to("cpu", torch.float64)  # [k]
    return theta, s, resid


def _density(rz: _RitzPairs, exact: dict[str, float]) -> tuple[Tensor, Tensor, bool]:
    """The density atoms and weights from the Ritz pairs (module docstring, steps 3 and 4);
    ``exact`` holds the factor's ``trace`` and ``frobenius``.

    Returns:
        ``(nodes [k] ascending ≥ 0, weights [k] summing to d, exact)``, float64 CPU.
    """
    theta, noise = rz.theta, 64 * rz.eps * exact["frobenius"]
    conv = rz.resid <= CONVERGED_REL * theta.abs() + noise  # [k]
    full, clusters = _full_clusters(theta, rz.resid + noise, conv, rz.p)
    single = conv & ~full  # [k]: eigenvalues, weight 1
    if int(single.sum()) == rz.d:
        return theta.clamp(min=0.0), single.to(torch.float64), True
    if bool(single.all()):  # all converged yet fewer than d: no deflation (plain quadrature)
        single = torch.zeros_like(single)
    n_single, rest = int(single.sum()), ~single
    weights = single.to(torch.float64)  # [k]
    gauss = (rz.s[: rz.p, rest] ** 2).sum(0)  # [k_rest]: shares of the starting block
    total = float(gauss.sum())
    weights[rest] = (rz.d - n_single) * (gauss / total if total > 0 else
                                          torch.full_like(gauss, 1.0 / gauss.numel()))
    if rz.invariant and clusters <= 1 and bool(conv.all()):
        # the one full cluster is one eigenvalue: one atom with the rest of the count
        nodes = torch.cat([theta[single], theta[rest].mean().reshape(1)])  # [n_single + 1]
        order = torch.argsort(nodes)
        counts = torch.cat([weights[single], torch.tensor([float(rz.d - n_single)],
                                                           dtype=torch.float64)])
        return nodes[order].clamp(min=0.0), counts[order], True
    t_rest = exact["trace"] - float(theta[single].sum())
    f2_rest = exact["frobenius"] ** 2 - float((theta[single] ** 2).sum())
    slack = (float(rz.resid[single].sum()) + rz.d * noise,
             float((2 * theta[single].abs() * rz.resid[single]).sum())
             + rz.d * noise * exact["frobenius"])
    moments = [float(rz.d - n_single)]
    for value, err in zip((t_rest, f2_rest), slack):
        if value <= 20 * err:
            break  # not known well enough to match (nor the next one)
        moments.append(value)
    weights[rest] = _calibrate(theta[rest], weights[rest], moments)
    return theta.clamp(min=0.0), weights, False


def _full_clusters(theta: Tensor, tol: Tensor, conv: Tensor, p: int) -> tuple[Tensor, int]:
    """The converged Ritz values (``conv``, ``[k]``) in clusters of at least ``p`` (values
    ascending ``theta`` ``[k]`` within ``tol`` ``[k]`` of a neighbour): ``(mask [k], number
    of such clusters)``. Such a cluster may stand for an eigenvalue of higher multiplicity."""
    idx = torch.nonzero(conv).flatten().tolist()
    groups: list[list[int]] = []
    for i in idx:
        last = groups[-1][-1] if groups else -1
        if groups and float(theta[i] - theta[last]) <= float(tol[i] + tol[last]):
            groups[-1].append(i)
        else:
            groups.append([i])
    mask = torch.zeros_like(conv)
    full = [g for g in groups if len(g) >= p]
    for g in full:
        mask[g] = True
    return mask, len(full)


def _calibrate(x: Tensor, w: Tensor, moments: list[float]) -> Tensor:
    """Weights ``w`` (``[n]`` > 0 at atoms ``x`` ``[n]``) tilted to ``w_i exp(Σ_j c_j x_i^j)``
    so that ``Σ w_i x_i^j = moments[j]`` for ``j < len(moments)`` (at most 3): the nearest
    weights in the Kullback–Leibler sense, by Newton's method on the convex dual. When that
    fails (the moments outside what the atoms can reach), one moment fewer; ``w`` rescaled to
    the count if none is reachable.

    Returns:
        ``[n]`` float64.
    """
    scale = float(x.abs().max()) or 1.0
    for n in range(len(moments), 1, -1):
        powers = torch.stack([(x / scale) ** j for j in range(n)], 1)  # [n_atoms, n]
        target = torch.tensor([moments[j] / scale ** j for j in range(n)], dtype=torch.float64)
        c = torch.zeros(n, dtype=torch.float64)
        for _ in range(60):
            tilted = w * torch.exp((powers @ c).clamp(max=700.0))  # [n_atoms]
            grad = powers.T @ tilted - target  # [n]
            if float(grad.abs().div(target.abs().clamp(min=1e-300)).max()) < 1e-10:
                return tilted
            hess = powers.T @ (powers * tilted[:, None])  # [n, n]
            try:
                step = torch.linalg.solve(hess, grad)
            except RuntimeError:
                break
            dual = float(tilted.sum() - target @ c)
            t = 1.0
            while t > 1e-8 and float((w * torch.exp((powers @ (c - t * step)).clamp(
                    max=700.0))).sum() - target @ (c - t * step)) > dual:
                t *= 0.5
            c = c - t * step
    return w * (moments[0] / float(w.sum()))


def _density_stats(nodes: Tensor, weights: Tensor) -> tuple[float, float]:
    """``(eff_rank, cond)`` of the density (``nodes`` ``[k]`` ≥ 0 ascending, ``weights``
    ``[k]``), `spectrum_stats`' definitions: exp of the entropy of the eigenvalues normalised
    to sum 1; max / smallest atom above ``1e-12 · max`` (inf if all are 0)."""
    top = float(nodes.max()) if nodes.numel() else 0.0
    total = float((weights * nodes).sum())
    if top <= 0.0 or total <= 0.0:
        return 0.0, float("inf")
    q = nodes / total  # [k]
    pos = (q > 0) & (weights > 0)
    entropy = -float((weights[pos] * q[pos] * q[pos].log()).sum())
    above = nodes[(nodes > top * 1e-12) & (weights > 0)]
    return math.exp(entropy), top / float(above.min())


def estimate_stored(stored: Iterable[tuple[str, Tensor, float]],
                    device: torch.device | str | None = None, steps: int = LANCZOS_STEPS,
                    probes: int = LANCZOS_PROBES, seed: int = 0
                    ) -> Iterator[tuple[str, SpectrumEstimate]]:
    """`estimate_spectrum` of stored factors one at a time, with bounded memory (as
    `eigh_stored`): each factor is dequantised, estimated and dropped before the next is
    touched, so one factor's working copies (the factor and two ``[d, m]`` bases) are alive
    at a time.

    Args:
        stored: ``(key, data, scale)`` per factor: ``data`` ``[d, d]`` or ``[d]`` as stored.
        device: Where to multiply (a CUDA device: float32; None / CPU: float64).
        steps, probes, seed: As `estimate_spectrum` (the same seed for every factor).

    Yields:
        ``(key, SpectrumEstimate)`` in the order of ``stored``.
    """
    for key, data, scale in stored:
        yield key, estimate_spectrum(data, scale, steps=steps, probes=probes, seed=seed,
                                     device=device)


def log10_wasserstein(nodes: Tensor, weights: Tensor, eigvals: Tensor,
                      floor_rel: float = FLOOR_REL) -> float:
    """1-Wasserstein distance, in decades, between an estimated density and exact eigenvalues.

    Both are distributions of ``log10(max(λ, floor))`` with ``floor = floor_rel · λ_max``
    (``λ_max`` the largest exact eigenvalue): the estimate's atoms ``nodes`` (``[k]``) with
    ``weights`` (``[k]``, normalised here), the exact ``eigvals`` (``[d]``) with ``1/d`` each.
    ``W1 = ∫ |C1(x) − C2(x)| dx`` over the two CDFs.

    The floor (default ``1e-6``): rank-deficient factors have exact zeros (log −inf); and
    below ``1e-6 · λ_max`` a stored factor's eigenvalues are its fp16 rounding (entries are
    kept to ``2^-11`` of their size, so eigenvalues below ``~1e-6 · λ_max`` are not resolved),
    float32 arithmetic (``eps ≈ 1.2e-7``) cannot resolve them, and a Laplace posterior with
    any prior precision does not see them. All of them count as the floor.

    Returns:
        W1 in decades (0 when every eigenvalue is 0).
    """
    ev = eigvals.detach().to("cpu", torch.float64).flatten()  # [d]
    top = float(ev.max()) if ev.numel() else 0.0
    if top <= 0.0:
        return 0.0
    floor = floor_rel * top
    x1 = nodes.detach().to("cpu", torch.float64).flatten().clamp(min=floor).log10()  # [k]
    w1 = weights.detach().to("cpu", torch.float64).flatten().clamp(min=0.0)  # [k]
    x2 = ev.clamp(min=floor).log10()  # [d]
    w2 = torch.full_like(x2, 1.0 / x2.numel())  # [d]
    x = torch.cat([x1, x2])  # [k + d]
    signed = torch.cat([w1 / w1.sum(), -w2])  # CDF difference's jumps
    order = torch.argsort(x)
    x, cdf_gap = x[order], torch.cumsum(signed[order], 0)  # [k + d]
    return float((cdf_gap[:-1].abs() * (x[1:] - x[:-1])).sum())
