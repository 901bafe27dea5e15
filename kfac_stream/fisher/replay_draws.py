"""The MC replay's draws of an update step's sequences (`replay_counts`) and their seed
(`selection_seed`): pure host arithmetic, shared by the replay (`mc_replay`) and the
planning of the final window (`config.update_sequences`), so both count the same draw."""

from __future__ import annotations

import math
import random

__all__ = ["replay_counts", "replay_seed", "selection_seed"]


def selection_seed(seed: int, rank: int, step: int) -> int:
    """Seed of the sequence selection of optimizer step ``step`` on ``rank``: a fixed
    function of the three (reproducible, resumable without state), different per rank."""
    return (((seed * 1_000_003 + rank) * 1_000_033 + step) * 2_654_435_761 + 97) % 2**63


def replay_seed(seed: int, rank: int, step: int) -> int:
    """Seed of the global generators while the tracker replays optimizer step ``step``'s
    micro-batches on ``rank`` (their dropout masks, `kfac_stream.utils.own_rng.own_draws`): a fixed
    function of the three like `selection_seed`, and another stream than its."""
    return selection_seed(seed ^ 0x5EED_D409, rank, step)


def replay_counts(mc_sequences: int | float | str, batches: list[int | None], seed: int,
                  step: int, at_least_one: bool = False
                  ) -> tuple[list[int | None], float | None]:
    """Sequences of each of an update step's micro-batches (sizes ``batches``; None: not a
    ``[B, T]`` batch, replayed whole) that the MC replay runs on (0: not replayed), and the
    probability with which each of the step's sequences was drawn (None for an int).

    An int ``k``: ``min(k, B)`` of every micro-batch. A share ``f`` in ``(0, 1)`` of the
    step's sequences: systematic sampling over the micro-batches' sequences laid end to end,
    ``b_j = ⌊u + f·C_{j+1}⌋ − ⌊u + f·C_j⌋`` (``C_j``: sequences before micro-batch ``j``,
    ``u ~ U[0, 1)`` from Python's generator seeded by ``(seed, step)``), so every sequence is
    drawn with probability exactly ``f`` and ``⌊f·C⌋`` or ``⌈f·C⌉`` of the step's ``C`` are, in
    whole micro-batches when they hold one sequence each (micro-batch 1). ``at_least_one``
    (the tracker sets it at step 0, so that no run ends with empty factors; a step, not a
    state, so a resumed run draws what the whole run drew): when the
    draw is empty, one sequence, uniform over the ``C`` (a second draw of the same generator);
    with ``f·C < 1`` the combined draw is then exactly one uniform sequence, drawn with
    probability ``1/C``. ``u`` is the same on every rank, so with equal micro-batch sizes every
    rank replays the same micro-batch indices: under ZeRO-3 a replay's forward gathers
    parameters collectively.
    """
    if isinstance(mc_sequences, int) and not isinstance(mc_sequences, bool):
        return [None if b is None else min(mc_sequences, b) for b in batches], None
    f = float(mc_sequences)
    rng = random.Random(selection_seed(seed, 0, step))  # host draws: no tensor read
    u = rng.random()
    out, before = [], 0
    for b in batches:
        if b is None:
            out.append(None)
            continue
        out.append(min(b, math.floor(u + f * (before + b)) - math.floor(u + f * before)))
        before += b
    if at_least_one and before > 0 and not any(out) and f * before < 1.0:
        target, at = math.floor(rng.random() * before), 0  # a uniform sequence, independent of u
        for j, b in enumerate(batches):
            if b is not None and at <= target < at + b:
                out[j] = 1
                return out, 1.0 / before
            at += b or 0
    return out, f
