"""From an update step's pass records to the `UpdateJob` the factor updater folds: each
captured row weighted by the square root of its sampling weight and divided by the pass's loss
scale ``c``, per factor key; diagonal factors as sums; the step's finiteness; each tracker
extension's share of every pass (`kfac_stream.extensions`). Device ops only (no host read).
Each part is scaled in the wide dtype and cast to the fold dtype (`Folding.row_dtype`) at
once, so at most one part is held wide at a time (a 16-bit fold never holds every key's rows
in fp32)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..stats.covariance import all_finite
from .factor_updates import RowGroup, UpdateJob


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
class _Group:
    """Rows of factors of one side stacked over the passes: ``rows`` ``[[G, m_i, d]]``, with
    each pass's weight and rows kept (``n``, ``n_rows``: 0-dim each)."""

    rows: list[Tensor] = field(default_factory=list)
    n: list[Tensor] = field(default_factory=list)
    n_rows: list[Tensor] = field(default_factory=list)


@dataclass
class _Parts:
    """What one update collects: stacks of rows by factor group, per factor key what does not
    stack, and per tracker extension what its `collect_pass` returned."""

    groups: dict[tuple[str, ...], _Group] = field(default_factory=dict)
    rows: dict[str, list[Tensor]] = field(default_factory=dict)
    sums: dict[str, Tensor] = field(default_factory=dict)
    weights: dict[str, Tensor] = field(default_factory=dict)
    positions: dict[str, Tensor] = field(default_factory=dict)
    bad: list[Tensor] = field(default_factory=list)
    residuals: list[Tensor] = field(default_factory=list)
    extensions: dict[str, Any] = field(default_factory=dict)  # by extension name

    def count(self, key: str, w_sum: Tensor, n: Tensor) -> None:
        self.weights[key] = self.weights[key] + w_sum if key in self.weights else w_sum
        self.positions[key] = self.positions[key] + n if key in self.positions else n

    def add_sum(self, key: str, x: Tensor) -> None:
        self.sums[key] = self.sums[key] + x if key in self.sums else x

    def add_rows(self, st: _Stack, rows: Tensor, w: RowWeights) -> None:
        """One pass's weighted rows of the stack ``st``: ``[G, m, d]`` of its keys (one call
        of one key's layer, ``[m, d]``, when its layer was called several times), of weight
        ``w.n``."""
        if st.rows is None:
            self.rows.setdefault(st.keys[0], []).append(rows)
            self.count(st.keys[0], w.n, w.n_rows)
            return
        group = self.groups.setdefault(st.keys, _Group())
        group.rows.append(rows)
        group.n.append(w.n)
        group.n_rows.append(w.n_rows)

    def settle(self) -> None:
        """Groups whose keys another group or a key's own rows also hold are taken apart into
        those keys' own rows (a layer called in several row spaces or shapes), so every key
        has one place."""
        seen: dict[str, int] = {}
        for keys in self.groups:
            for k in keys:
                seen[k] = seen.get(k, 0) + 1
        for keys in [ks for ks in self.groups
                     if any(seen[k] > 1 or k in self.rows for k in ks)]:
            group = self.groups.pop(keys)
            for rows, n, n_rows in zip(group.rows, group.n, group.n_rows):
                for key, r in zip(keys, rows.unbind(0)):
                    self.rows.setdefault(key, []).append(r)
                    self.count(key, n, n_rows)

    def stacked(self) -> list[RowGroup]:
        """The groups as `RowGroup` s (passes concatenated), their keys' weights and
        positions recorded."""
        out = []
        for keys, group in self.groups.items():
            n, n_rows = group.n[0], group.n_rows[0]
            for more, more_rows in zip(group.n[1:], group.n_rows[1:]):
                n, n_rows = n + more, n_rows + more_rows
            for key in keys:
                self.weights[key], self.positions[key] = n, n_rows
            out.append(RowGroup(keys, _cat(group.rows, dim=1)))
        return out


def collect_update(tracker, passes) -> UpdateJob | None:
    """The `UpdateJob` of ``passes`` (the records the tracker's Fisher estimator yielded) for
    ``tracker``'s current step; None when no pass holds rows on a single process."""
    fold = tracker.folding.row_dtype(_captured_dtype(passes))
    parts = _Parts()
    extensions = getattr(tracker, "extensions", ())
    for rec in passes:
        if not (rec.g_rows or rec.g_sums):
            continue
        spaces = {"position": RowWeights.of(rec.weight, rec.total)}
        if rec.target_layers:  # an encoder-decoder's decoder positions
            spaces["target"] = RowWeights.of(rec.target.weight, rec.target.total)
        if rec.seq_layers:  # a pooler / head: one row per sequence (`capture.hooks`)
            spaces["sequence"] = RowWeights.of(rec.sequence_weight(), rec.seq_total)
        g_layer = {tracker.plan.g_key(name): name for name in rec.g_rows}
        g_stacks = _stacks({key: rec.g_rows[name] for key, name in g_layer.items()},
                           {key: rec.space_of(name) for key, name in g_layer.items()})
        c = _loss_scale(rec, parts, g_stacks)
        _add_a(tracker, rec, spaces, fold, parts)
        _add_g(tracker, rec, spaces, g_stacks, c=c, fold=fold, parts=parts)
        for ext in extensions:
            parts.extensions[ext.name] = ext.collect_pass(rec, c, parts.extensions.get(ext.name))
    if not parts.rows and not parts.sums and not parts.groups and tracker.world_size == 1:
        return None
    parts.settle()
    groups = parts.stacked()
    cat = {k: _cat(v) for k, v in parts.rows.items()}
    ok = all_finite([g.rows for g in groups] + list(cat.values()) + list(parts.sums.values()))
    if parts.bad:
        ok = ok & ~torch.stack(parts.bad).any().to(ok.device)
    residual = torch.stack(parts.residuals).max() if parts.residuals else None
    step = int(tracker.step or 0)
    for ext in extensions:
        if ext.name in parts.extensions:
            ext.add_update(step, parts.extensions[ext.name], ok)
    return UpdateJob(step, cat, parts.weights, parts.positions, ok, residual, sums=parts.sums,
                     groups=groups)


@dataclass
class _Stack:
    """One pass's captured rows of factors of one shape and row space: ``keys`` and their
    rows ``[G, m, d]`` (``rows`` None: one key whose layer was called several times,
    ``calls`` its rows per call)."""

    keys: tuple[str, ...]
    space: str
    rows: Tensor | None
    calls: list[Tensor] = field(default_factory=list)


def _stacks(by_key: dict[str, list[Tensor]], space_of: dict[str, str]) -> list[_Stack]:
    """``by_key``'s rows stacked by row space (``space_of``: per key), shape and dtype (one op
    per stack); a key with several calls keeps its own."""
    buckets: dict[tuple, list[tuple[str, Tensor]]] = {}
    out = []
    for key, found in by_key.items():
        if len(found) == 1:
            t = found[0]
            buckets.setdefault((space_of[key], tuple(t.shape), t.dtype), []).append((key, t))
        else:
            out.append(_Stack((key,), space_of[key], None, list(found)))
    for (space, _, _), members in buckets.items():
        keys = tuple(k for k, _ in members)
        out.append(_Stack(keys, space, torch.stack([t for _, t in members])))
    return out


def _loss_scale(rec, parts: _Parts, g_stacks: list[_Stack]):
    """The pass's loss scale ``c`` (a float, or a 0-dim tensor), noting in ``parts`` whether
    it is unusable (``bad``) and the fit's residual."""
    c = rec.resolve_scale()
    if c is None or isinstance(c, Tensor):
        g_live = torch.stack(
            [t.abs().sum().to(torch.float64) for st in g_stacks
             for t in ([st.rows] if st.rows is not None else st.calls)]
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


def _weighted(rows: Tensor, w: RowWeights, root: Tensor, fold) -> Tensor:
    """``rows`` (``[m, d]`` or ``[G, m, d]``) times ``root`` (``[m, 1]``) where ``w`` keeps
    a row, zero elsewhere, in the fold dtype."""
    return torch.where(w.keep, rows * root.to(rows.dtype), 0.0).to(fold)


def _add_a(tracker, rec, spaces: dict[str, RowWeights], fold, parts: _Parts) -> None:
    """The pass's A rows (``√w·a``, a bias column appended) and diagonal A sums."""
    a_rows, a_sums = _by_a_key(tracker, rec.a_rows), _by_a_key(tracker, rec.a_sums)
    space_of = {key: _a_space(tracker, key, rec) for key in a_rows}
    bias = [k for k in a_rows if tracker.a_has_bias[k]]
    plain = {k: v for k, v in a_rows.items() if not tracker.a_has_bias[k]}
    for stacks in (_stacks(plain, space_of),
                   _stacks({k: a_rows[k] for k in bias}, space_of)):
        for st in stacks:
            w = spaces[st.space]
            for rows in ([st.rows] if st.rows is not None else st.calls):
                rows = rows.to(tracker.row_dtype)
                if tracker.a_has_bias[st.keys[0]]:  # a trailing column of ones
                    rows = torch.nn.functional.pad(rows, (0, 1), value=1.0)
                parts.add_rows(st, _weighted(rows, w, w.root, fold), w)
    for key, found in a_sums.items():
        w = spaces[_a_space(tracker, key, rec)]
        for a in found:  # Σ w a⊙a [d_in]; the bias entry is Σ w·1²
            if tracker.a_has_bias[key]:
                a = torch.cat([a, w.w_sum.reshape(1).to(a.dtype)])
            parts.add_sum(key, a)
            parts.count(key, w.n, w.n_rows)


def _add_g(tracker, rec, spaces: dict[str, RowWeights], g_stacks: list[_Stack], *, c, fold,
           parts: _Parts) -> None:
    """The pass's G rows (``√w·g/c``) and diagonal G sums (``Σ w g⊙g / c²``)."""
    roots: dict[str, Tensor] = {}
    for st in g_stacks:
        w = spaces[st.space]
        if st.space not in roots:  # [m, 1], in the rows' dtype (a float32 root over a
            # float64 0-dim c would stay float32: float64 rows 1e-7 off)
            roots[st.space] = w.root.to(tracker.row_dtype) / c
        for rows in ([st.rows] if st.rows is not None else st.calls):
            parts.add_rows(st, _weighted(rows.to(tracker.row_dtype), w, roots[st.space], fold),
                           w)
    for name, found in rec.g_sums.items():
        w = spaces[rec.space_of(name)]
        for g in found:  # Σ w (c·g)⊙(c·g) / c²
            parts.add_sum(tracker.plan.g_key(name), g / (c * c))
            parts.count(tracker.plan.g_key(name), w.n, w.n_rows)


def _a_space(tracker, key: str, rec) -> str:
    """The row space of A factor ``key`` in pass ``rec`` (a shared A: its members' one space;
    a member not called in the pass says "position")."""
    if not (rec.seq_layers or rec.target_layers):  # the common pass: one stream
        return "position"
    found = {rec.space_of(name) for name in tracker.a_members[key]} - {"position"}
    return found.pop() if found else "position"


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


def _cat(parts: list[Tensor], dim: int = 0) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
