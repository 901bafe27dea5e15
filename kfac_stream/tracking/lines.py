"""The log lines a tracking run says: at train begin (what is tracked, the plan, the final
window, a raised MC share) and at train end (the callback's cost). Text only: no state."""

from __future__ import annotations

from ..capture.presets import block_stack
from ..snapshot.manifest_types import Manifest
from .plan import RunPlan


def _seconds(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB"


def cost_line(callback_seconds: float, train_seconds: float,
              parts: dict[str, float] | None = None, refreshed=None) -> str:
    """The end-of-train line: the callback's seconds on the training thread and their share
    of the training time (``KFACStreamCallback.callback_seconds``, ``train_end_seconds``),
    split by ``parts`` (``callback_parts``) when given, with the final-weight refresh's
    sequences and seconds (``refreshed``, a `RefreshResult`; part of the end's) when one
    ran."""
    share = 100 * callback_seconds / max(train_seconds, 1e-9)
    split = "".join(f"; {_seconds(v)} s {k}" for k, v in (parts or {}).items())
    if refreshed is not None:
        split += (f", of which {_seconds(refreshed.seconds)} s "
                  f"({100 * refreshed.seconds / max(train_seconds, 1e-9):.1f}%) the "
                  f"final-weight refresh over {refreshed.sequences} sequences")
    return (f"kfac_stream: {_seconds(callback_seconds)} s in the callback ({share:.1f}% of "
            f"{_seconds(train_seconds)} s training, from train begin to this line{split}); "
            "counted: the training thread inside its Trainer events (set-up, factor updates, "
            "snapshots' hold, checkpoint state, the end-of-train snapshot with its wait for the "
            "snapshot thread, the held-out fit), not the forward/backward hooks' row capture "
            "nor the snapshot thread's work while training runs")


def tracking_summary(tracker, output_dir: str, model=None) -> str:
    """The one line logged at train begin: layers, factors (dense, diagonal), the stack of
    blocks they were chosen in (with ``model``, when the blocks chose them: the default
    selection or a block preset), the Fisher and sampling settings, stored factor memory per
    rank, the run plan's resolved settings (`RunPlan.describe`) and the snapshot directory."""
    cfg, own = tracker.config, tracker.ownership
    stack = block_stack(model) if model is not None and cfg.include is None and \
        cfg.preset in (None, "all_linear", "attention", "mlp") else None
    where = f" in stack {stack[0]} ({stack[1]} blocks)" if stack is not None else ""
    diagonal = sum(diag for _, diag in tracker.dims.values())
    per_rank = max(own.bytes_per_rank)
    ranks = tracker.world_size
    memory = (f"{_mib(per_rank)} of {cfg.storage_dtype} factors"
              + (f" on the fullest of {ranks} ranks ({_mib(sum(own.bytes_per_rank))} in all)"
                 if ranks > 1 else " on 1 rank"))
    for ext in getattr(tracker, "extensions", ()):  # what each holds on the model's device
        memory += ext.memory_line()
    return (f"kfac_stream: tracking {len(tracker.specs)} layers, {len(tracker.dims)} factors "
            f"({len(tracker.dims) - diagonal} dense, {diagonal} diagonal){where}, "
            f"{tracker.curvature.describe()}, token_fraction={cfg.token_fraction:g}, "
            f"ema_decay={cfg.ema_decay:g}, update_every={cfg.update_every}; {memory}; "
            f"{tracker.run.describe()}; snapshots every {cfg.snapshot_every} steps and at the "
            f"end into {output_dir}")


def raised_share_line(run: RunPlan) -> str:
    """Says that this run raised the MC share, what the new one replays, and why in words:
    at the configured share the run's factor updates would replay fewer sequences than the
    final window is to hold (``min_window_sequences``), and a posterior from so few is too
    wide (`kfac_stream.tracking.plan.window_mc_share`; the same on every rank: it depends
    only on the run's arguments, and on resume as well)."""
    cfg, shape = run.requested, run.shape
    share, raised = float(cfg.mc_sequences), float(run.config.mc_sequences)
    per_rank = shape.batch * max(shape.accumulation, 1)
    updates = (shape.max_steps - 1) // cfg.update_every + 1 if shape.max_steps > 0 else 0
    if raised >= 1.0:
        replays = "every sequence of each update step"
    else:
        replays = (f"{round(raised * per_rank)} of the {per_rank} sequences of each update "
                   "step" + (" on each rank" if shape.world > 1 else ""))
    at_share = share * updates * per_rank * max(shape.world, 1)  # the draws' expectation
    return (f"kfac_stream: mc_sequences {share:g} -> {raised:g} for this run ({replays}), so "
            f"that the final snapshot's posterior rests on enough samples: its "
            f"{shape.max_steps} steps at update_every={cfg.update_every} make {updates} factor "
            f"update{'s' if updates != 1 else ''}, which at mc_sequences={share:g} would replay "
            f"about {at_share:.3g} sequences in all, fewer than the {cfg.min_window_sequences} "
            "its final window is to hold (min_window_sequences; factors from fewer are noisy "
            "and the posterior comes out "
            "too wide). The replay costs more per update step on this short run (a run long "
            f"enough keeps {share:g}); set min_window_sequences=0 to keep {share:g} here too")


def window_lines(run: RunPlan) -> list[tuple[str, str]]:
    """``[(level, line)]`` about the final window at train begin: ``ema_decay=1`` turning it
    off, the window's restart step and what it holds, and a warning when it holds fewer
    sequences than ``min_window_sequences``."""
    cfg, plan, out = run.config, run.window, []
    if cfg.ema_decay == 1.0 and cfg.final_window > 0:
        out.append(("info", "kfac_stream: ema_decay=1 is the mean over every update of the "
                            f"run: final_window={cfg.final_window:g} is off"))
    if plan is None:
        return out
    out.append(("info", f"kfac_stream: final window (final_window={cfg.final_window:g}, "
                        f"min_window_sequences={cfg.min_window_sequences}): from step "
                        f"{plan.restart_step} of {run.shape.max_steps} the factors are the mean "
                        f"of the updates (the EMA before): {plan.updates} updates, "
                        f"{plan.sequences} sequences"))
    if 0 < plan.sequences < cfg.min_window_sequences:
        out.append(("warning", f"kfac_stream: this run's {plan.updates} factor updates hold "
                               f"{plan.sequences} sequences in all (about "
                               f"{plan.sequences_per_update} each), fewer than "
                               f"min_window_sequences={cfg.min_window_sequences}: the final "
                               "snapshot's factors will rest on few samples, which matters for "
                               "its posterior only (it may be too wide); lower update_every or "
                               "raise mc_sequences for more (said once)"))
    return out


def refresh_start_line(run: RunPlan, budget: int) -> str:
    """Says that the final-weight refresh starts, why, and its bound (``budget`` sequences
    per rank, 0: one epoch alone)."""
    bound = (f"at most one epoch and {budget} sequences per rank "
             f"({100 * run.refresh.budget_share:g}% of the training's FLOPs)" if budget > 0
             else "at most one epoch")
    return (f"kfac_stream: final-weight refresh ({run.refresh.reason}): a pass in eval mode at "
            f"the final weights over {bound}; its mean replaces the factors of the final "
            "snapshot")


def refresh_end_line(result) -> str:
    """Says what the final-weight refresh did (a `RefreshResult`)."""
    if result.batches == 0:
        return ("kfac_stream: final-weight refresh: no batch ran; the final snapshot holds "
                "the run's factors")
    return (f"kfac_stream: final-weight refresh done: {result.sequences} sequences in "
            f"{_seconds(result.seconds)} s ({result.batches} updates); the final snapshot's "
            "factors are their mean at the final weights")


def reloaded_weights_line(path: str, manifest: Manifest) -> str:
    """The end-of-train line of a run whose Trainer reloaded the best checkpoint before train
    end (the manifest's ``weights_from``, `kfac_stream.integrations.best_model`): which step's
    weights the final snapshot at ``path`` describes, and which updates its factors hold (the
    final window's mean from its start to the last step, or the EMA when the window had not
    started or the run has none). The factors are not re-estimated at the reloaded weights."""
    origin, last = manifest.weights_from, int(manifest.step)
    best = f"step {origin.step}" if origin.step is not None else "an unknown step"
    started = int(manifest.counts.window_start_step)
    plan = manifest.run_plan
    window = plan.window if plan is not None else None
    refreshed = manifest.final_refresh
    if refreshed is not None:
        return (f"kfac_stream: load_best_model_at_end: the Trainer reloaded the best model "
                f"({best}, {origin.checkpoint}) before train end, so the final snapshot "
                f"{path} describes the weights of {best} (its weight fingerprint, the held-out "
                f"fit, Snapshot.weights_step; the manifest's weights_from), and its factors "
                f"were refreshed at those weights over {refreshed.sequences} sequences "
                "(final_refresh). Query the reloaded model with it")
    if started >= 0:
        factors = f"the final window's mean of the factor updates from step {started} to {last}"
    elif manifest.ema_decay == 1.0:
        factors = f"the mean of every factor update up to step {last}"
    else:
        factors = f"the EMA of the factor updates up to step {last}"
        if plan is not None and window is not None:
            factors += (f" (the final window, planned from step {window.restart_step}"
                        f" of {plan.max_steps}, had not started when training stopped)")
    return (f"kfac_stream: load_best_model_at_end: the Trainer reloaded the best model ({best}, "
            f"{origin.checkpoint}) before train end, so the final snapshot {path} describes "
            f"the weights of {best} (its weight fingerprint, the held-out fit, "
            f"Snapshot.weights_step; the manifest's weights_from) while its factors are those "
            f"of the run up to step {last}: {factors}, not re-estimated at the {best} weights. "
            f"Query the reloaded model with it; the step-{last} weights would not match it")
