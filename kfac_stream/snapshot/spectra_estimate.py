"""A deferred snapshot's spectra: each owned factor's Lanczos estimate in the manifest part.

A snapshot whose eigendecomposition is deferred (`kfac_stream.snapshot.eigen_rule`) still
records every factor's spectrum statistics, estimated (`kfac_stream.stats.lanczos`): the
largest eigenvalue with its a-posteriori error bound, the exact trace, the effective rank and
condition number, and a 32-bin density of log10 eigenvalues (``spectrum.density``), each
flagged ``estimated``. No eigendecomposition of a factor runs here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..stats.lanczos import FLOOR_REL, SpectrumEstimate, estimate_stored
from ..utils.factor_keys import FACTOR_KINDS

#: The stated relative error of an estimated effective rank (the bound
#: tests/unit/stats/test_lanczos.py checks on real factors from a Trainer run; measured worst 0.5%).
EFF_RANK_ERROR = 0.02
#: Bins of the stored density.
DENSITY_BINS = 32


def owned_entries(tensors: dict[str, Any], manifest: dict[str, Any]) -> dict[str, list[dict]]:
    """``{stored key: its manifest factor entries}`` of the factors this shard holds (a shared A:
    every layer entry naming it)."""
    out: dict[str, list[dict]] = {}
    for entry in manifest["layers"].values():
        for factor in FACTOR_KINDS:
            key = entry[factor]["key"]
            if key in tensors and f"{key}.scale" in tensors:
                out.setdefault(key, []).append(entry[factor])
    return out


def estimate_spectra(tensors: dict[str, Any], manifest: dict[str, Any],
                     device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Fill ``spectrum`` of every owned factor entry of ``manifest`` with its estimate; returns
    ``{key: [d] float64}``, the density's quantiles (d values whose log10 histogram is the
    estimated one: the spectra media of an estimated snapshot).

    Args:
        tensors: The shard's tensors: ``<key>`` ``[d, d]``/``[d]`` stored data, ``<key>.scale``.
        manifest: The shard's manifest part (changed in place).
        device: Where the Lanczos products run (float32 on a GPU, float64 on the CPU).
    """
    entries = owned_entries(tensors, manifest)
    stored = ((k, tensors[k], float(tensors[f"{k}.scale"])) for k in entries)
    quantiles = {}
    for key, est in estimate_stored(stored, device=device):
        spectrum = estimate_json(est)
        for entry in entries[key]:
            entry["spectrum"] = spectrum
        quantiles[key] = density_quantiles(est.nodes, est.weights, int(tensors[key].shape[0]))
    return quantiles


def estimate_json(est: SpectrumEstimate) -> dict[str, Any]:
    """The manifest's ``spectrum`` of an estimate
    (`kfac_stream.snapshot.manifest_types.Spectrum`)."""
    out: dict[str, Any] = dict(est.stats())
    if est.exact:  # the Krylov space was the whole space: these are the eigenvalues
        return out
    out.update(estimated=True, max_error=float(est.max_bound), eff_rank_error=EFF_RANK_ERROR)
    density = log10_density(est.nodes, est.weights, est.max)
    if density is not None:
        out["density"] = density
    return out


def log10_density(nodes: torch.Tensor, weights: torch.Tensor, top: float,
                  bins: int = DENSITY_BINS) -> dict[str, Any] | None:
    """``{"lo", "hi", "counts"}``: the weights of the atoms ``nodes`` (``[m]``, weights ``[m]``)
    in ``bins`` bins of log10, atoms below ``FLOOR_REL · top`` in the first; None if ``top``
    is 0."""
    if not top > 0:
        return None
    x = nodes.double().clamp(min=top * FLOOR_REL).log10()
    lo, hi = float(x.min()), float(x.max())
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    idx = ((x - lo) / (hi - lo) * bins).floor().clamp(0, bins - 1).long()
    counts = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, weights.double())
    return {"lo": lo, "hi": hi, "counts": [float(c) for c in counts]}


def density_quantiles(nodes: torch.Tensor, weights: torch.Tensor, d: int) -> torch.Tensor:
    """``[d]`` float64: the density's values at the quantiles ``(i + ½)/d`` (atoms ``nodes``
    ``[m]`` with ``weights`` ``[m]``), ascending."""
    order = torch.argsort(nodes.double())
    x, w = nodes.double()[order], weights.double()[order].clamp(min=0.0)
    total = float(w.sum())
    if d == 0 or not total > 0 or not math.isfinite(total):
        return torch.zeros(d, dtype=torch.float64)
    cdf = torch.cumsum(w, 0) / total  # [m]
    q = (torch.arange(d, dtype=torch.float64) + 0.5) / d
    at = torch.searchsorted(cdf, q).clamp(max=x.numel() - 1)
    return x[at].clamp(min=0.0)
