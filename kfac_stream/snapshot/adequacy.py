"""Does a snapshot's posterior rest on enough samples? Read from its manifest.

Three signs, all recorded by the tracker (`kfac_stream.store.factor_store.FactorState`):

* the final window held fewer sequences than ``KFACConfig.min_window_sequences`` asks for
  (``counts.window_sequences``: the run had too few updates, or too few MC sequences per
  update, to reach it even over its whole length);
* a factor that holds no rows at all (EMA weight 0, `empty_factors`: a layer no captured
  pass reached), whose block of the posterior is then the prior alone;
* in a final-window snapshot, a factor's relative sampling error ``‖SE(F)‖_F / ‖F‖_F``
  (``sampling.rel_se``, from the spread of the updates around their mean) above
  `REL_SE_WARN`. Before the window (the EMA) the spread measures the drift of the curvature
  along training as much as sampling noise, so it is recorded but not judged.

A factor estimated from few samples is noisy and rank-poor: the posterior precision
``N·(A ⊗ G) + τI`` then falls back to the prior ``τ`` in most directions, and the predictive
comes out too wide. The snapshot report (`kfac-stream inspect`) says so; the callback warns once
per run in its log (a short window at train begin, a sampling error at the final snapshot) and
`LaplacePosterior` once more (a short window once per run, a sampling error once per snapshot,
in each process: `sampling_warning`; a snapshot without a run id once per snapshot path),
except where it is built for influence (`width_unused`: the damped curvature, not the
posterior's width); the manifest keeps the figures.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from collections.abc import Iterator
from typing import Any

from ..utils.factor_keys import FACTOR_KINDS
from .manifest_types import Manifest

#: Relative sampling error of a factor above which a final-window snapshot is reported as
#: resting on too few samples. Set from `benchmarks/suite.py`, which prints each rule's largest
#: value beside its predictive NLL: windows of 4-120 updates (16-240 sequences) gave 0.7-1.5
#: on six tasks (0.3-1.6 on the first suite run's seven), with predictives better than the trained
#: model's and laplace-torch's, so the figure alone does not mark a bad posterior; a factor
#: whose error is several times its size (one or two updates) is flagged.
REL_SE_WARN = 3.0


def sampling_summary(m: Manifest) -> dict[str, Any]:
    """``{"max_rel_se", "max_rel_se_factor", "min_effective_updates", "window_sequences",
    "min_window_sequences", "in_window"}`` of manifest ``m`` (NaN / 0 / None where the
    snapshot did not record them: no update, or no final window)."""
    worst, worst_key, k_min = math.nan, None, math.nan
    for entry in m.layers.values():
        for factor in FACTOR_KINDS:
            f = getattr(entry, factor)
            s = f.sampling
            if s is None:
                continue
            if math.isnan(worst) or s.rel_se > worst:
                worst, worst_key = float(s.rel_se), f.key
            k_min = min(k_min, s.effective_updates) if not math.isnan(k_min) \
                else float(s.effective_updates)
    cfg, counts = m.config, m.counts
    window = int(counts.window_sequences) if cfg.get("final_window", 0) else 0
    return {"max_rel_se": worst, "max_rel_se_factor": worst_key, "min_effective_updates": k_min,
            "window_sequences": window,
            "min_window_sequences": int(cfg.get("min_window_sequences", 0) or 0),
            "in_window": int(counts.window_start_step) >= 0}


def empty_factors(m: Manifest) -> list[str]:
    """The keys of manifest ``m``'s factors whose EMA weight is 0: no row was ever folded into
    them (a layer no captured pass reached), so the posterior's block there is the prior's.
    A rank's part leaves another rank's factor's weight None: not counted."""
    return [getattr(entry, f).key for entry in m.layers.values()
            for f in FACTOR_KINDS if getattr(entry, f).weight == 0]


def rel_se_verdict(summary: dict[str, Any]) -> str:
    """The largest relative standard error of a `sampling_summary` with its threshold
    (`REL_SE_WARN`) and verdict, as `kfac-stream inspect` prints it: ``"0.82 (≤ 3: enough
    samples)"``, ``"4.1 (> 3: too few samples, ...)"``, or, before the final window (the
    EMA, where the spread is not judged), the figure and why it is not judged."""
    se = summary["max_rel_se"]
    if math.isnan(se):
        return "not recorded"
    if not summary["in_window"]:
        return (f"{se:.3g} (not judged: the threshold {REL_SE_WARN:g} applies in the final "
                "window; before it the spread of the updates measures the curvature's drift "
                "along training as much as sampling noise)")
    if se <= REL_SE_WARN:
        return f"{se:.3g} (≤ {REL_SE_WARN:g}: enough samples)"
    return (f"{se:.3g} (> {REL_SE_WARN:g}: too few samples, the posterior falls back to the "
            "prior in most directions; lower update_every or raise mc_sequences or "
            "final_window)")


def sampling_problems(m: Manifest) -> list[str]:
    """One sentence per sign that the snapshot (manifest ``m``) rests on too few samples
    (empty: none seen)."""
    return [text for _, text in _problems(m)]


def _problems(m: Manifest) -> list[tuple[str, str]]:
    """`sampling_problems` with each sentence's kind: ``"window"`` or ``"rel_se"``."""
    s = sampling_summary(m)
    out = []
    if 0 < s["window_sequences"] < s["min_window_sequences"]:
        out.append(("window",
                    f"its final window holds {s['window_sequences']:,} sequences, fewer than "
                    f"min_window_sequences={s['min_window_sequences']:,} (the run has too few "
                    "factor updates to reach it; lower update_every or raise mc_sequences)"))
    empty = empty_factors(m)
    if empty:
        out.append(("empty",
                    f"{len(empty)} of its factors hold no rows at all ("
                    + ", ".join(empty[:3]) + (", ..." if len(empty) > 3 else "")
                    + ": no captured pass of the run reached those layers), so their blocks "
                    "are the prior alone"))
    if s["in_window"] and not math.isnan(s["max_rel_se"]) and s["max_rel_se"] > REL_SE_WARN:
        out.append(("rel_se",
                    f"factor {s['max_rel_se_factor']} has a relative sampling error of "
                    f"{s['max_rel_se']:.2g} (> {REL_SE_WARN:g}; over "
                    f"{s['min_effective_updates']:.3g} effective updates)"))
    return out


#: The few-samples problems this process has warned about, each said once per scope:
#: ``(scope, run id, "window")`` (the final window's sequences: the run's plan, the same in every
#: snapshot of the run, so once per run) and ``(scope, run id, step, "rel_se")`` (a snapshot's
#: own sampling error, once per snapshot). Scopes: ``"train"`` (the callback's log: the short
#: window at train begin, the final snapshot's sampling error; its own held-out tau fit) and
#: ``"query"`` (`LaplacePosterior`): a run told at train begin is told once more when a posterior
#: is first built on one of its snapshots, in the same process or a later one.
_SAID: set[tuple] = set()
_SCOPE: contextvars.ContextVar[str] = contextvars.ContextVar("kfac_stream_said_scope",
                                                            default="query")
#: Inside `width_unused`: the posteriors built there are for influence, which does not read
#: the posterior's width, so `sampling_warning` with ``once`` says nothing there.
_WIDTH_UNUSED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kfac_stream_width_unused", default=False)


def _key(scope: str, run_id: str, step: Any, kind: str) -> tuple:
    return (scope, run_id, kind) if kind == "window" else (scope, run_id, step, kind)


def mark_said(run_id: str, step: Any = None, kind: str = "window", scope: str = "train") -> None:
    """Record that the few-samples warning of ``kind`` for ``run_id`` (its snapshot ``step``
    for ``"rel_se"``) was given in ``scope`` (the callback's train-begin warning of a short
    final window: ``"train"``, ``"window"``)."""
    _SAID.add(_key(scope, run_id, step, kind))


@contextlib.contextmanager
def said_scope(scope: str) -> Iterator[None]:
    """Within the block, warnings with no scope of their own (a `LaplacePosterior`'s) count
    as said in ``scope``: the callback's held-out tau fit at train end runs in ``"train"``,
    so the run's warnings are not repeated there and the user's first posterior still says
    them."""
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def width_unused() -> Iterator[None]:
    """Within the block, `sampling_warning` with ``once`` gives nothing and marks nothing said:
    the `LaplacePosterior` built there serves influence (``kfac-stream influence``,
    `kfac_stream.query.trajectory`), whose damped curvature ``(F + λI)⁻¹`` does not use the
    posterior's width, which is what few samples make too wide. A posterior built later for a
    predictive still says it."""
    token = _WIDTH_UNUSED.set(True)
    try:
        yield
    finally:
        _WIDTH_UNUSED.reset(token)


def sampling_warning(where: str, m: Manifest, once: bool = False,
                     scope: str | None = None, source: str | None = None) -> str | None:
    """The warning text for `sampling_problems` of manifest ``m`` (None: nothing to warn
    about; with ``once`` the problems this process warned about already in ``scope`` (None:
    the `said_scope`, ``"query"`` by default) are left out: a short window once per run, a
    sampling error once per snapshot; a manifest without a run id is keyed by ``source``, the
    snapshot's path, so once per snapshot; and nothing inside `width_unused`)."""
    if once and _WIDTH_UNUSED.get():
        return None
    run_id = m.run_id or (f"path:{os.path.realpath(source)}" if source else "")
    step = m.step
    scope = _SCOPE.get() if scope is None else scope
    problems = [(k, t) for k, t in _problems(m)
                if not (once and run_id and _key(scope, run_id, step, k) in _SAID)]
    if not problems:
        return None
    if once:
        _SAID.update(_key(scope, run_id, step, k) for k, _ in problems)
    return (f"{where}: the snapshot of step {step} rests on few samples: "
            + "; ".join(t for _, t in problems) + ". It matters for its posterior only (the "
            "factors and training are fine): a posterior from noisy, rank-poor factors falls "
            "back to the prior in most directions and its predictive tends to be too wide.")
