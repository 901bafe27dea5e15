"""From an update step's pass records to the `UpdateJob` the factor updater folds: each
captured row weighted by the square root of its sampling weight and divided by the pass's loss
scale ``c``, per factor key; diagonal factors as sums; the step's finiteness and the EK-FAC
correction's squares. Device ops only (no host read). Each part is scaled in the wide dtype
and cast to the fold dtype (`Folding.row_dtype`) at once, so at most one part is held wide at
a time (a 16-bit fold never holds every key's rows in fp32)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..stats.covariance import all_finite, with_bias_column
from .factor_updates import UpdateJob


@dataclass(frozen=True)
class RowWeights:
    """How one pass's rows of one row space are weighted.

    Attributes:
        keep: ``[m, 1]`` bool, rows with a positive weight.
        root: ``[m, 1]`` square roots of the weights (a row ``x`` enters as ``√w·x``).
        w_sum: 0-dim ``Σ w`` (a diagonal A's bias entry).
        n_rows: 0-dim count of rows kept.
        n: 0-dim EMA weight of the pass (``Σ w``, or the record's own total).
    """

    keep: Tensor
    root: Tensor
    w_sum: Tensor
    n_rows: Tensor
    n: Tensor

    @classmethod
    def of(cls, weight: Tensor, total: Tensor | None) -> RowWeights:
        """From ``[m]`` row weights and the record's total (None: ``Σ w``)."""
        keep = (weight > 0)[:, None]
        w_sum = weight.sum()
        return cls(keep, weight.sqrt()[:, None], w_sum, keep.sum(),
                   w_sum if total is None else total)


@dataclass
class _Parts:
    """What one update collects, per factor key (layer for EK-FAC)."""

    rows: dict[str, list[Tensor]] = field(default_factory=dict)
    sums: dict[str, Tensor] = field(default_factory=dict)
    weights: dict[str, Tensor] = field(default_factory=dict)
    positions: dict[str, Tensor] = field(default_factory=dict)
    bad: list[Tensor] = field(default_factory=list)
    residuals: list[Tensor] = field(default_factory=list)
    ek_num: dict[str, Tensor] = field(default_factory=dict)  # Σ_n w_n (Q_Gᵀ ∇L_n Q_A)²
    ek_den: dict[str, Tensor] = field(default_factory=dict)  # its N

    def count(self, key: str, w_sum: Tensor, n: Tensor) -> None:
        self.weights[key] = self.weights[key] + w_sum if key in self.weights else w_sum
        self.positions[key] = self.positions[key] + n if key in self.positions else n

    def add_sum(self, key: str, x: Tensor) -> None:
        self.sums[key] = self.sums[key] + x if key in self.sums else x


def collect_update(tracker, passes) -> UpdateJob | None:
    """The `UpdateJob` of ``passes`` (the records the tracker's Fisher estimator yielded) for
    ``tracker``'s current step; None when no pass holds rows on a single process."""
    fold = tracker.folding.row_dtype(_captured_dtype(passes))
    parts = _Parts()
    for rec in passes:
        if not (rec.g_rows or rec.g_sums):
            continue
        c = _loss_scale(rec, parts)
        spaces = {"position": RowWeights.of(rec.weight, rec.total)}
        if rec.seq_layers:  # a pooler / head: one row per sequence (`capture.hooks`)
            spaces["sequence"] = RowWeights.of(rec.sequence_weight(), rec.seq_total)
        _add_a(tracker, rec, spaces, fold, parts)
        _add_g(tracker, rec, spaces, c, fold, parts)
        _add_ekfac(rec, c, parts)
    if not parts.rows and not parts.sums and tracker.world_size == 1:
        return None
    cat = {k: _cat(v) for k, v in parts.rows.items()}
    ok = all_finite(list(cat.values()) + list(parts.sums.values()))
    if parts.bad:
        ok = ok & ~torch.stack(parts.bad).any().to(ok.device)
    residual = torch.stack(parts.residuals).max() if parts.residuals else None
    step = int(tracker.step or 0)
    if parts.ek_num:
        tracker.ekfac.add(step, parts.ek_num, parts.ek_den, ok)
    return UpdateJob(step, cat, parts.weights, parts.positions, ok, residual, sums=parts.sums)


def _loss_scale(rec, parts: _Parts):
    """The pass's loss scale ``c`` (a float, or a 0-dim tensor), noting in ``parts`` whether
    it is unusable (``bad``) and the fit's residual."""
    c = rec.resolve_scale()
    if c is None or isinstance(c, Tensor):
        g_live = torch.stack(
            [g.abs().sum().to(torch.float64) for gs in rec.g_rows.values() for g in gs]
            + [g.sum().to(torch.float64) for gs in rec.g_sums.values() for g in gs]
        ).sum() > 0
        if c is None:  # no logits hook fired: fine only if no gradient arrived
            parts.bad.append(g_live)
            c = 1.0
        else:
            fitted = torch.stack([used > 0 for _, _, used in rec.fits]).any()
            parts.bad.append(fitted & ~((c > 0) & torch.isfinite(c)) | (~fitted & g_live))
            c = torch.where(fitted, c, torch.ones_like(c))
            parts.residuals.append(torch.where(fitted, rec.residual(), 0.0))
    return c


def _add_a(tracker, rec, spaces: dict[str, RowWeights], fold, parts: _Parts) -> None:
    """The pass's A rows (``√w·a``, a bias column appended) and diagonal A sums."""
    a_rows, a_sums = _by_a_key(tracker, rec.a_rows), _by_a_key(tracker, rec.a_sums)
    for key, found in a_rows.items():
        w = spaces[_a_space(tracker, key, rec.seq_layers)]
        for a in found:
            a = a.to(tracker.row_dtype)
            if tracker.a_has_bias[key]:
                a = with_bias_column(a)
            parts.rows.setdefault(key, []).append(
                torch.where(w.keep, a * w.root.to(a.dtype), 0.0).to(fold))
            parts.count(key, w.n, w.n_rows)
    for key, found in a_sums.items():
        w = spaces[_a_space(tracker, key, rec.seq_layers)]
        for a in found:  # Σ w a⊙a [d_in]; the bias entry is Σ w·1²
            if tracker.a_has_bias[key]:
                a = torch.cat([a, w.w_sum.reshape(1).to(a.dtype)])
            parts.add_sum(key, a)
            parts.count(key, w.n, w.n_rows)


def _add_g(tracker, rec, spaces: dict[str, RowWeights], c, fold, parts: _Parts) -> None:
    """The pass's G rows (``√w·g/c``) and diagonal G sums (``Σ w g⊙g / c²``)."""
    for name, found in rec.g_rows.items():
        w = spaces["sequence" if name in rec.seq_layers else "position"]
        g_root = w.root.to(tracker.row_dtype) / c  # [m, 1], in the rows' dtype (a
        # float32 root over a float64 0-dim c would stay float32: float64 rows 1e-7 off)
        for g in found:
            g = g.to(tracker.row_dtype)
            parts.rows.setdefault(tracker.plan.g_key(name), []).append(
                torch.where(w.keep, g * g_root.to(g.dtype), 0.0).to(fold))
            parts.count(tracker.plan.g_key(name), w.n, w.n_rows)
    for name, found in rec.g_sums.items():
        w = spaces["sequence" if name in rec.seq_layers else "position"]
        for g in found:  # Σ w (c·g)⊙(c·g) / c²
            parts.add_sum(tracker.plan.g_key(name), g / (c * c))
            parts.count(tracker.plan.g_key(name), w.n, w.n_rows)


def _add_ekfac(rec, c, parts: _Parts) -> None:
    """The EK-FAC correction's squares ``(c·g)² / c²`` of the pass, each sequence weighted,
    and their count."""
    for name, found in rec.ekfac.items():
        if name in rec.seq_layers:  # N: the sequences (with their weights)
            n = rec.seq_total if rec.seq_total is not None else rec.sequence_weight().sum()
        else:  # the usable positions, as the factors' n
            n = rec.total if rec.total is not None else rec.usable.sum() * rec.seq_scale
        num = torch.stack(found).sum(0) * (rec.seq_scale / (c * c))
        parts.ek_num[name] = parts.ek_num[name] + num if name in parts.ek_num else num
        n = n * len(found)
        parts.ek_den[name] = parts.ek_den[name] + n if name in parts.ek_den else n


def _a_space(tracker, key: str, seq_layers: set[str]) -> str:
    """The row space of A factor ``key`` in a pass whose sequence-space layers are
    ``seq_layers`` (a shared A: its members' one space)."""
    return "sequence" if seq_layers and not seq_layers.isdisjoint(tracker.a_members[key]) \
        else "position"


def _by_a_key(tracker, by_layer: dict[str, list[Tensor]]) -> dict[str, list[Tensor]]:
    """``{A key: rows}`` from a pass's ``{layer: rows}``: a shared A takes its rows once, from
    the member with the most calls that received a gradient (every member of a group holds the
    same row tensors, `capture.hooks`)."""
    out = {}
    for key, members in tracker.a_members.items():
        found = max((by_layer.get(n, []) for n in members), key=len)
        if found:
            out[key] = found
    return out


def _captured_dtype(passes) -> torch.dtype | None:
    """The dtype of the first captured rows of ``passes`` (None: no rows)."""
    for rec in passes:
        for found in list(rec.g_rows.values()) + list(rec.a_rows.values()):
            return found[0].dtype
    return None


def _cat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
