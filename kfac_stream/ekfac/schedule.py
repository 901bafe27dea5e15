"""Which snapshots of a run can carry the EK-FAC correction (`kfac_stream.ekfac`): the
correction of a snapshot is accumulated at the update steps that ran on the eigenbasis of the
snapshot before it, so a run's final snapshot carries one only when an earlier snapshot was
taken and an update step followed it. Pure arithmetic on the schedule (``max_steps``,
``snapshot_every``, ``update_every``), read at train begin (`final_correction_gap`, the
tracker's warning) and by the influence scores on a snapshot that has none
(`missing_correction_reason`).

Steps as the tracker counts them: snapshots at the global steps ``k·S`` (``S =
snapshot_every``) and the final one at ``M = max_steps``; the optimizer step that begins at
global step ``b`` (0-based) is an update step iff ``b % U == 0`` (``U = update_every``), and a
snapshot taken at the end of step ``P`` is in use from the step that begins at ``P`` on (on the
training thread; with background snapshots from when its eigendecompositions are done, which
the schedule cannot know, so it says only what is certain).

A run no longer than ``snapshot_every`` would write only its final snapshot, which has no
eigenbasis before it: such a run takes one extra snapshot midway (`basis_snapshot_step`, the
tracking session waits for its eigendecompositions so that its basis is in use from the next
step), and its final snapshot stores the correction measured in that basis over the rest of
the run. What is left without one (`final_correction_gap`) is said at train begin."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def basis_snapshot_step(max_steps: int, snapshot_every: int, update_every: int) -> int | None:
    """The step of the extra snapshot a run no longer than ``snapshot_every`` takes so that its
    final snapshot carries a correction: its eigenbasis is in use from that step on, and the
    update steps from it to the end measure the correction the final snapshot stores. The
    latest update step's index ``L = U·⌊(M − 1)/U⌋`` must be at or after it; within that, half
    the run (``min(⌊M/2⌋, L)``, at least 1). None: a run longer than ``snapshot_every`` (its
    own snapshots give one), of unknown length, or with no update step after its first."""
    M, S, U = int(max_steps), int(snapshot_every), int(update_every)
    if M <= 0 or S <= 0 or U <= 0 or M > S:
        return None
    step = min(max(M // 2, 1), U * ((M - 1) // U))
    return step if step >= 1 else None


def final_correction_gap(max_steps: int, snapshot_every: int, update_every: int) -> str | None:
    """Why a run of ``max_steps`` steps ends with no EK-FAC correction in its final snapshot,
    whatever the snapshots' timing (module docstring; with the extra snapshot of
    `basis_snapshot_step` where there is one), or None when the schedule leaves room for one
    (``max_steps`` unknown, ``<= 0``: None)."""
    M, S, U = int(max_steps), int(snapshot_every), int(update_every)
    if M <= 0 or S <= 0 or U <= 0:
        return None
    if M <= S:
        if basis_snapshot_step(M, S, U) is not None:
            return None
        return (f"the run's {M} steps end at or before its first snapshot (snapshot_every={S}) "
                f"and hold one factor update step (update_every={U}), at the start, before any "
                "eigenbasis exists")
    before = S * ((M - 1) // S)  # the last snapshot before the final one
    if U * ((M - 1) // U) < before:
        return (f"no factor update step runs between snapshot {before} and the final step {M} "
                f"(update_every={U})")
    return None


def schedule_advice(max_steps: int, update_every: int) -> str:
    """What to change so that a run of ``max_steps`` steps ends with a correction: the largest
    ``snapshot_every`` at most half the run that leaves one (`final_correction_gap`), else a
    lower ``update_every``."""
    M, U = int(max_steps), int(update_every)
    for every in range(max(M // 2, 1), 0, -1):
        if final_correction_gap(M, every, U) is None:
            return (f"set snapshot_every={every} (or lower) so that an earlier snapshot's "
                    "eigenbasis is in use at update steps before the end")
    return f"lower update_every (now {U}) below half the run's {M} steps and snapshot_every too"


def missing_correction_reason(step: int, config: Mapping[str, Any]) -> str:
    """Why snapshot ``step`` of a run with ``config`` (its manifest's ``KFACConfig.to_dict()``,
    ``ekfac`` on) carries no correction, and what to change: a sentence for a warning."""
    every, update = int(config.get("snapshot_every", 0)), int(config.get("update_every", 1))
    if 0 < step <= every:
        gap = (f"it is the run's first snapshot (step {step}, snapshot_every={every}): no "
               "eigenbasis precedes it")
    else:
        gap = final_correction_gap(step, every, update) or (
            "no update step ran on the eigenbasis of the snapshot before it (that basis "
            "arrived after the last update step, its snapshot failed, or the run resumed "
            "from a checkpoint without the EK-FAC state)")
    return (f"{gap}, and the correction accumulates in the eigenbasis of a previous snapshot; "
            f"for a run whose last snapshot at step {step} has one, "
            f"{schedule_advice(step, update)}")


def train_begin_line(cfg: Any, steps: int) -> tuple[str, str] | None:
    """``(level, line)`` at train begin of a ``KFACConfig(ekfac=True)`` run of ``steps``
    optimizer steps (``cfg`` its `KFACConfig`) whose final
    snapshot would have no eigenbasis before it: the extra snapshot it takes for one
    (`basis_snapshot_step`, info), or a warning of a schedule that leaves
    its final snapshot without the correction (`final_correction_gap`): why,
    what the influence scores do then, and what to change; None otherwise."""
    if not cfg.ekfac:
        return None
    extra = basis_snapshot_step(steps, cfg.snapshot_every, cfg.update_every)
    if extra is not None:
        return ("info", f"kfac_stream: EK-FAC on a run of {steps} steps, no longer than "
                        f"snapshot_every={cfg.snapshot_every}: an extra snapshot at step {extra} "
                        "gives the eigenbasis in which the update steps after it measure the "
                        "correction the final snapshot stores")
    gap = final_correction_gap(steps, cfg.snapshot_every, cfg.update_every)
    if gap is None:
        return None
    return ("warning", f"kfac_stream: KFACConfig(ekfac=True), but this run will end without an "
                       f"EK-FAC correction: {gap}, and the correction accumulates at update "
                       "steps in the eigenbasis of a previous snapshot. Its final snapshot "
                       "holds K-FAC's eigenvalues only: influence scores with "
                       "eigenvalues='auto' fall back to them, 'ekfac' refuses it; "
                       f"{schedule_advice(steps, cfg.update_every)}")
