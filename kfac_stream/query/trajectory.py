r"""Influence along the training run: the mean of the scores over several of the run's
snapshots, each with the model's weights at the snapshot's step (a Trainer checkpoint saved at
that step).

    I_traj(z_q, z) = (1/K) Σ_k Σ_l ∇_l L(z_q; θ_k)ᵀ (F_{l,k} + λ_{l,k} I)⁻¹ ∇_l L(z; θ_k)

one term per step ``k`` that has both a snapshot (its factors ``F_{l,k}``, streamed up to ``k``)
and the weights ``θ_k``; each term is `influence_scores` at that step (damping and eigenvalues as
there, each step's damping from its own factors). A single checkpoint scores with one linear
model around the final weights; the mean over the run counts how each example pulled the
model along the way. What it is: TracIn over checkpoints (Pruthi et al. 2020, "TracIn-CP": a
sum of gradient dot products at saved checkpoints) with each checkpoint's K-FAC
preconditioner in the dot product, and uniform weights over the checkpoints where TracIn
weights them by the learning rate. It is not SOURCE (Bae et al. 2024), which unrolls the
training between checkpoints segment by segment. Measured against the other settings on held-out
queries: benchmarks/influence_lds.py and the results it writes.

Cost: ``K`` times `influence_scores` (each step reads the training set once), one step's model
and factors in memory at a time when ``posteriors`` is a generator.

`checkpoint_snapshots(output_dir)` pairs a Trainer's ``checkpoint-<step>`` folders with the
snapshots ``step-<step>`` of the same steps: set ``save_steps`` to ``snapshot_every`` (or a
multiple of it) to get one pair per snapshot.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

from torch import Tensor

from ..exceptions import QueryInputError
from ..snapshot.adequacy import width_unused
from ..snapshot.layout import STEP_DIR_RE
from ..snapshot.snapshot import Snapshot
from .influence import influence_scores
from .laplace import LaplacePosterior

CHECKPOINT_DIR_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_snapshots(output_dir: str | os.PathLike,
                         kfac_dir: str | os.PathLike | None = None) -> list[tuple[int, str, str]]:
    """``[(step, checkpoint_dir, snapshot_dir)]`` in step order: every step at which the Trainer
    saved ``<output_dir>/checkpoint-<step>`` and the run wrote a snapshot ``step-<step>`` under
    ``kfac_dir`` (default ``<output_dir>/kfac``, the callback's). Steps with only one of them
    are left out; none in common is a `QueryInputError` naming both lists."""
    out = os.fspath(output_dir)
    root = os.fspath(kfac_dir) if kfac_dir is not None else os.path.join(out, "kfac")
    ckpts = {int(m.group(1)): os.path.join(out, e) for e in _entries(out)
             if (m := CHECKPOINT_DIR_RE.match(e)) and os.path.isdir(os.path.join(out, e))}
    snaps = {int(m.group(1)): os.path.join(root, e) for e in _entries(root)
             if (m := STEP_DIR_RE.match(e)) and os.path.isdir(os.path.join(root, e))}
    both = sorted(set(ckpts) & set(snaps))
    if not both:
        raise QueryInputError(
            f"checkpoint_snapshots: no step has both a Trainer checkpoint in {out} (steps "
            f"{sorted(ckpts) or 'none'}) and a snapshot in {root} (steps {sorted(snaps) or 'none'})"
            "; train with save_steps equal to snapshot_every (or a multiple of it)")
    return [(s, ckpts[s], snaps[s]) for s in both]


def _entries(path: str) -> list[str]:
    return os.listdir(path) if os.path.isdir(path) else []


def trajectory_influence(posteriors: Iterable[LaplacePosterior],
                         queries: Mapping[str, Tensor] | Iterable[Mapping[str, Tensor]],
                         train: Iterable[Mapping[str, Tensor]], *,
                         damping: float | str = "heuristic", eigenvalues: str = "auto",
                         show_progress: bool | None = None) -> Tensor:
    """``[Q, N]`` float64: the mean over ``posteriors`` (each a model at a snapshot's step with
    that snapshot, e.g. from `checkpoint_snapshots`) of `influence_scores` ``(post, queries,
    train, damping=, eigenvalues=)`` (module docstring). ``queries`` and ``train`` are read once
    per posterior, so they must be re-iterable (a batch, a list of batches, a DataLoader), not
    an iterator. The posteriors must be of one run (the snapshots' run id) and distinct steps;
    a model whose weights are not its snapshot's warns as `LaplacePosterior` does."""
    for name, value in (("queries", queries), ("train", train)):
        if not isinstance(value, Mapping) and iter(value) is value:
            raise QueryInputError(f"trajectory_influence: {name} is an iterator, which is read "
                                  "once per step: pass a list of batches or a DataLoader")
    total, steps, run = None, [], None
    for post in posteriors:
        step, run_id = post.snapshot.step, post.snapshot.manifest.run_id
        if step in steps:
            raise QueryInputError(f"trajectory_influence: step {step} is given twice; each "
                                  "posterior must be a distinct step of the run")
        if steps and run_id != run:
            raise QueryInputError(f"trajectory_influence: the snapshot of step {step} is of run "
                                  f"{run_id}, the earlier ones of run {run}: one run's "
                                  "snapshots only")
        scores = influence_scores(post, queries, train, damping=damping,
                                  eigenvalues=eigenvalues, show_progress=show_progress).scores
        total = scores.clone() if total is None else total + scores
        steps.append(step)
        run = run_id
    if total is None:
        raise QueryInputError("trajectory_influence: no posterior given (one per step: a "
                              "model at the step's weights with that step's snapshot)")
    return total / len(steps)


def trajectory_posteriors(pairs: Iterable[tuple[int, str, str]], load_model,
                          **posterior_kwargs) -> Iterable[LaplacePosterior]:
    """One `LaplacePosterior` per ``(step, checkpoint_dir, snapshot_dir)`` of
    `checkpoint_snapshots`, made when asked (one step's model in memory at a time):
    ``load_model(checkpoint_dir)`` returns the model (e.g. ``AutoModelForCausalLM.
    from_pretrained``), put in eval mode here; ``posterior_kwargs`` go to `LaplacePosterior`.
    Built for influence, they do not warn of snapshots resting on few samples (`width_unused`:
    that makes a posterior's width too wide, which influence does not use)."""
    for _, ckpt, snap in pairs:
        model = load_model(ckpt)
        model.eval()
        with width_unused():
            post = LaplacePosterior(model, Snapshot.load(snap), **posterior_kwargs)
        yield post
