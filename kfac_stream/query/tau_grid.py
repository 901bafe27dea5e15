r"""The Jacobian features in their cheapest exact form, and the linearised predictive at many
prior precisions from one Jacobian pass (the held-out fit's ``τ`` grid,
`LaplacePosterior.covariance_grid`).

Per layer and example, with the chosen logits' output gradients ``g_{k,t}`` and the inputs
``ā_t`` at positions ``t``, ``M_k = Q_Gᵀ (Σ_t g_{k,t} ā_tᵀ) Q_A`` (``[d_out, d_A]``) and the
pair eigenvalues ``λ_ij = N γ_i α_j``:

    Cov_τ[k, l] = Σ_layers Σ_ij M_k[i,j] M_l[i,j] / (λ_ij + τ).

Features (`layer_features`): positions where no chosen logit of any example of the batch has
a gradient add nothing and are dropped first (`kept_positions`: a pooled classifier reads one
position of its last layer, so there its query, attention output and MLP keep one of ``T``);
then either the positions' outer products are rotated (``K·T·d_out² + T·d_A²`` to rotate,
``K·T·d_out·d_A`` for the products) or the unrotated sum over positions is (``K·T·d_out·d_A``
then ``K·d_out·d_A·(d_out + d_A)``), whichever costs less, as one batched matrix product.

Many ``τ`` (`grid_covariances`), per layer:

* one position left (rank one: ``M_k = g̃_k ãᵀ``): ``Cov_τ[k, l] = Σ_i g̃_ki g̃_li
  Σ_j ã_j² / (λ_ij + τ)``, exact, ``B·(d_out·d_A + K²·d_out)`` per ``τ``, no ``[K, P]``
  features at all;
* otherwise the variances (all the probit link reads) exactly, every ``τ`` in one
  ``[B·K, P] × [P, n_τ]`` product of the squared features;
* the ``K × K`` covariances (the mean-field and Monte Carlo links) binned: each pair's
  ``M_k M_l`` is summed into the bin of ``log λ`` (width `BIN_WIDTH`, one grid for every
  layer) it falls in, once per batch (``B·K²·P``), and each ``τ`` then costs ``B·K²`` per
  bin. A bin stands for its pairs at its log-centre; pairs below ``(w/2)·min τ`` at
  ``λ = 0``. Every pair's weight ``1/(λ + τ)`` is then within a factor ``e^{±w/2}`` of its
  own (the weight moves by at most the factor ``λ`` does; below the floor by at most
  ``1 + w/2``), and all weights are positive, so every variance, and every variance of a
  difference of two logits (all the mean-field link reads), is within a factor ``e^{±w/2}``
  of the exact one (`VARIANCE_FACTOR`). The mean-field NLL of an example then moves by at
  most ``2 (e^{w/4} − 1) · max_kj |μ_k − μ_j|`` (`meanfield_nll_bound`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from . import kron_eigen as ke

#: Width ``w`` of the eigenvalue-pair bins (natural log of ``λ``) of the binned covariances.
BIN_WIDTH = 1.0 / 16

#: The binned covariances' bound: every variance and every variance of a logit difference is
#: within this factor (either way) of the exact one.
VARIANCE_FACTOR = math.exp(BIN_WIDTH / 2)

#: At most this many feature entries (``B·K·P``) are binned together (layers grouped up to it).
GROUP_ELEMENTS = 1 << 25

#: Feature columns squared at a time for the exact variances.
CHUNK = 2048


def meanfield_nll_bound(mean: Tensor, factor: float = VARIANCE_FACTOR) -> Tensor:
    """``[B]``: how far the mean-field link's NLL of each example can move when every variance
    of a logit difference is off by at most ``factor`` either way:
    ``2 (sqrt(factor) − 1) · max_kj |μ_k − μ_j|`` (each scaled difference
    ``Δ / sqrt(1 + π/8 · s²)`` moves by at most ``sqrt(factor) − 1`` of ``|Δ|``; the NLL is
    2-Lipschitz in them).

    Args:
        mean: ``[B, K]`` MAP logits.
        factor: The variances' bound (≥ 1).
    """
    spread = mean.max(-1).values - mean.min(-1).values  # [B]
    return 2.0 * (math.sqrt(factor) - 1.0) * spread


def kept_positions(a: Tensor, g, has_bias: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(ā [B, T', d_A], g [K, B, T', d_out])`` in ``dtype``: a layer's input ``a``
    (``[B, T, d_in]``) with the bias column appended when ``has_bias``, and its ``K`` output
    gradients ``g`` (a sequence of ``K`` tensors of the output's shape, or one ``[K, ...]``
    tensor), at the ``T'`` positions where some chosen logit of some example has a nonzero
    gradient (the others add nothing to any feature). The returned ``g`` is a view of memory
    laid out ``[B, T', K, d_out]`` (`layer_features` reads it as ``[B, T', K·d_out]``), made by
    the one copy of the kept positions' gradients."""
    B, T = a.shape[0], a.shape[1]
    g = [x.reshape(B, T, x.shape[-1]) for x in g]  # K × [B, T, d_out]
    keep = torch.zeros(T, dtype=torch.bool, device=a.device)  # [T]
    for x in g:
        keep |= (x.amax((0, 2)) != 0) | (x.amin((0, 2)) != 0)
    if not bool(keep.all()):
        idx = keep.nonzero()[:, 0]
        a, g = a[:, idx], [x[:, idx] for x in g]
    a, g = a.to(dtype), torch.stack(g, 2).to(dtype)  # g: [B, T', K, d_out]
    if has_bias:
        a = torch.cat([a, a.new_ones(a.shape[0], a.shape[1], 1)], dim=-1)  # [B, T', d_A]
    return a, g.permute(2, 0, 1, 3)


def layer_features(a: Tensor, g: Tensor, qa: Tensor | None, qg: Tensor | None) -> Tensor:
    """``M [B, K, d_out, d_A]``, ``M[b, k] = Q_Gᵀ (Σ_t g[k, b, t] a[b, t]ᵀ) Q_A``, from
    ``a [B, T, d_A]`` and ``g [K, B, T, d_out]`` (`kept_positions`) and the eigenbases
    (``Q_A [d_A, d_A]``, ``Q_G [d_out, d_out]``; None: a diagonal factor's identity).

    Each factor is rotated before or after the sum over positions, whichever costs it less:
    ``Q_G`` before costs ``K·T·d_out²``, after ``K·d_out²·d_A`` (before iff ``T ≤ d_A``);
    ``Q_A`` before ``T·d_A²``, after ``K·d_out·d_A²`` (before iff ``T ≤ K·d_out``); the sum
    over positions is ``K·T·d_out·d_A`` either way, one batched product reading ``g`` as
    ``[B, T, K·d_out]`` (no copy when it is laid out so, as `kept_positions` returns it)."""
    K, B, T, d_out = g.shape
    d_a = a.shape[-1]
    g_first, a_first = qg is not None and T <= d_a, qa is not None and T <= K * d_out
    g = g.permute(1, 2, 0, 3)  # [B, T, K, d_out]
    if g_first:
        g = ke.rotate(g, qg)
    if a_first:
        a = ke.rotate(a, qa)
    m = torch.bmm(g.reshape(B, T, K * d_out).transpose(1, 2), a).view(B, K, d_out, d_a)
    if qg is not None and not g_first:
        m = torch.matmul(qg.T, m)
    return m if qa is None or a_first else torch.matmul(m, qa)


class PairGrid:
    """What every batch of one fit shares: the candidate ``τ`` and the binning of every
    layer's eigenvalue pairs (built from eigenvalues only, at the first batch that bins).

    Args:
        eig: ``{layer: (Q_A, α [d_A], Q_G, γ [d_out])}`` (`LaplacePosterior.eig`).
        layer_num_data: ``{layer: N}``.
        taus: The candidate ``τ`` (positive floats).
        device: Where the batches' features live.
    """

    def __init__(self, eig: Mapping, layer_num_data: Mapping[str, float],
                 taus: Sequence[float], device: torch.device) -> None:
        self.eig, self.layer_num_data = eig, layer_num_data
        self.taus = tuple(float(t) for t in taus)
        self.device = device
        self.tau = torch.tensor(self.taus, dtype=torch.float64, device=device)  # [n_τ]
        self.floor = BIN_WIDTH / 2 * min(self.taus)  # pairs below it stand at λ = 0
        self._pos: dict[str, Tensor] | None = None  # {layer: bin of each pair [P]}
        self._groups: dict[tuple, tuple[list[Tensor], list[tuple[int, int, int]]]] = {}
        self._scratch: Tensor | None = None  # `sorted_buffer`'s memory, kept between batches

    def sorted_buffer(self, rows: int, cols: int, like: Tensor) -> Tensor:
        """``[rows, cols]`` uninitialised, in ``like``'s dtype and device, in memory kept for
        the next batch (at most `GROUP_ELEMENTS` entries plus one layer's features; a fresh
        buffer per batch pays the operating system's page faults every time); `release`
        frees it."""
        n = rows * cols
        if (self._scratch is None or self._scratch.numel() < n
                or self._scratch.dtype != like.dtype or self._scratch.device != like.device):
            self._scratch = None
            self._scratch = like.new_empty(n)
        return self._scratch[:n].view(rows, cols)

    def release(self) -> None:
        """Frees `sorted_buffer`'s memory (the next batch allocates it again)."""
        self._scratch = None

    def lam(self, name: str) -> Tensor:
        """``λ = N γ αᵀ`` of a layer, ``[d_out, d_A]`` float64 on the device."""
        _, aval, _, gval = self.eig[name]
        return ke.precision_eigenvalues(gval, aval, self.layer_num_data[name], 0.0).to(
            self.device)

    def weights(self, name: str, dtype: torch.dtype) -> Tensor:
        """``1 / (λ_p + τ)`` of every pair and candidate, ``[P, n_τ]`` in ``dtype``."""
        return (1.0 / (self.lam(name).reshape(-1, 1) + self.tau)).to(dtype)

    def _bins(self) -> dict[str, Tensor]:
        """``{layer: [P]}`` the global bin of each pair (0: below the floor)."""
        if self._pos is None:
            lams = {n: self.lam(n).reshape(-1) for n in self.eig}
            top = max(float(v.max()) for v in lams.values())
            self.first = math.floor(math.log(self.floor) / BIN_WIDTH)  # bin 1
            self.bins = max(math.floor(math.log(max(top, self.floor)) / BIN_WIDTH),
                            self.first) - self.first + 2
            self._pos = {n: torch.where(v < self.floor, 0, (v.clamp(min=self.floor).log()
                                                            / BIN_WIDTH).floor().long()
                                        - self.first + 1) for n, v in lams.items()}
        return self._pos

    def bin_weights(self) -> Tensor:
        """``[n_τ, bins]``: ``1 / (λ̂ + τ)`` at each bin's log-centre (bin 0: ``λ̂ = 0``)."""
        n = torch.arange(self.bins, dtype=torch.float64, device=self.device)
        rep = torch.exp((n - 1 + self.first + 0.5) * BIN_WIDTH)
        rep[0] = 0.0
        return 1.0 / (rep[None, :] + self.tau[:, None])

    def group(self, names: tuple[str, ...]) -> tuple[list[Tensor], list[tuple[int, int, int]]]:
        """Where each pair of ``names``'s layers goes in one buffer sorted by bin, and the
        non-empty bins: ``([dest [P_l] per layer], [(bin, start, end)])``."""
        if names not in self._groups:
            pos = [self._bins()[n] for n in names]
            counts = torch.stack([torch.bincount(p, minlength=self.bins) for p in pos])
            total = counts.sum(0)  # [bins]
            start = total.cumsum(0) - total
            within = counts.cumsum(0) - counts  # [L, bins]: earlier layers' pairs in the bin
            dests = []
            for layer, p in enumerate(pos):
                order = torch.sort(p, stable=True).indices
                sp = p[order]
                rank = torch.arange(len(p), device=p.device) - (
                    counts[layer].cumsum(0) - counts[layer])[sp]
                dest = torch.empty_like(p)
                dest[order] = start[sp] + within[layer, sp] + rank
                dests.append(dest)
            ends = (start + total).tolist()
            bins = [(b, s, e) for b, (s, e) in enumerate(zip(start.tolist(), ends)) if e > s]
            self._groups[names] = (dests, bins)
        return self._groups[names]


def _rank_one(grid: PairGrid, name: str, a: Tensor, g: Tensor, want_full: bool
              ) -> tuple[Tensor, Tensor | None]:
    """``(variances [n_τ, B, K], covariances [n_τ, B, K, K] or None)`` of a layer whose features
    are rank one (``a [B, d_A]``, ``g [K, B, d_out]`` rotated), exactly, in float64."""
    lam = grid.lam(name)  # [d_out, d_A]
    w = 1.0 / (lam[..., None] + grid.tau)  # [d_out, d_A, n_τ]
    h = torch.einsum("bj,ijt->tbi", a.double() ** 2, w)  # [n_τ, B, d_out]
    gd = g.double().transpose(0, 1)  # [B, K, d_out]
    var = torch.einsum("bki,tbi->tbk", gd * gd, h)
    full = torch.matmul(gd[None] * h[:, :, None, :], gd.transpose(1, 2)[None]) \
        if want_full else None
    return var, full


def grid_covariances(grid: PairGrid, f: Tensor, layers, bases: Mapping, *,
                     dtype: torch.dtype, links: Sequence[str]) -> tuple[Tensor, dict]:
    """``(mean [B, K], {link: covs [n_τ, B, K, K]})`` of one batch at every ``grid.taus``
    (module docstring): ``"probit"``'s exact variances on the diagonal (zeros off it), any
    other link's binned ``K × K`` covariances.

    Args:
        grid: The fit's `PairGrid`.
        f: ``[B, K]`` chosen logits.
        layers: ``(layer, has_bias, [(input [B, T, d_in], the K output gradients) per
            call])`` of every tracked layer (`per_example.layer_gradients`).
        bases: ``{layer: (Q_A, Q_G)}`` in ``dtype``.
        dtype: The features' dtype.
        links: The links wanted.
    """
    B, K = f.shape
    want_full = any(k != "probit" for k in links)
    var = torch.zeros(len(grid.taus), B, K, dtype=torch.float64, device=f.device)
    full = torch.zeros(len(grid.taus), B, K, K, dtype=torch.float64, device=f.device) \
        if want_full else None
    binned: list[tuple[str, Tensor]] = []
    for name, has_bias, calls in layers:
        parts = [kept_positions(a, g, has_bias, dtype) for a, g in calls]
        qa, qg = bases[name]
        if len(parts) == 1 and parts[0][0].shape[1] == 1:  # rank one: exact, no features
            a, g = parts[0]
            v, c = _rank_one(grid, name, ke.rotate(a[:, 0], qa), ke.rotate(g[:, :, 0], qg),
                             want_full)
            var += v
            if c is not None:
                full += c
            continue
        m = layer_features(*parts[0], qa, qg)
        for p in parts[1:]:  # a layer called several times: the sum over its calls
            m = m + layer_features(*p, qa, qg)
        m = m.reshape(B * K, -1)  # [B·K, P]
        var += _variances(m, grid.weights(name, m.dtype)).double().T.reshape(-1, B, K)
        if want_full:
            binned.append((name, m))
        if sum(x.numel() for _, x in binned) >= GROUP_ELEMENTS:
            full += _binned(grid, binned, B, K)
            binned = []
    if binned:
        full += _binned(grid, binned, B, K)
    out = {k: full for k in links if k != "probit"}
    if "probit" in links:
        out["probit"] = torch.diag_embed(var)
    return f.detach().double(), out


def _variances(m: Tensor, weights: Tensor) -> Tensor:
    """``[B·K, n_τ]``: ``Σ_p m[:, p]² weights[p]`` of ``m [B·K, P]`` and ``weights [P, n_τ]``,
    a column block at a time (its square stays in cache)."""
    out = m.new_zeros(m.shape[0], weights.shape[1])
    for s in range(0, m.shape[1], CHUNK):
        x = m[:, s:s + CHUNK]
        out.addmm_(x * x, weights[s:s + CHUNK])
    return out


def _binned(grid: PairGrid, layers: list[tuple[str, Tensor]], B: int, K: int) -> Tensor:
    """``[n_τ, B, K, K]``: the binned covariances of ``layers`` (``(layer, M [B·K, P])``)."""
    dests, bins = grid.group(tuple(n for n, _ in layers))
    m0 = layers[0][1]
    buf = grid.sorted_buffer(B * K, sum(m.shape[1] for _, m in layers), m0)
    for (_, m), dest in zip(layers, dests):
        buf.index_copy_(1, dest, m)
    buf = buf.view(B, K, -1)
    sums = m0.new_zeros(grid.bins, B, K, K)  # [bins, B, K, K]
    for b, s, e in bins:
        x = buf[:, :, s:e]
        sums[b].baddbmm_(x, x.transpose(1, 2))
    w = grid.bin_weights()  # [n_τ, bins]
    return (w @ sums.double().reshape(grid.bins, -1)).view(-1, B, K, K)
