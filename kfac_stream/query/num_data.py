"""``N`` of a posterior: what it counts (token positions or sequences), the snapshot's own
count, each layer's ``N``, and the checks of a ``num_data`` given by hand."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

from ..exceptions import QueryInputError
from ..snapshot.manifest_types import Manifest
from . import inputs

#: `LaplacePosterior` warns when ``num_data`` is more than this factor away (either way) from
#: the snapshot's own count (`default_num_data`).
NUM_DATA_WARN_FACTOR = 4.0


#: The snapshot counter each unit of ``N`` is read from.
UNIT_COUNTERS = {"position": "tokens_seen", "target": "target_tokens_seen",
                 "sequence": "sequences_seen"}


def num_data_unit(m: Manifest, names: Sequence[str]) -> str:
    """What ``num_data`` counts for a posterior over ``names``: the rows every one of them has
    (the manifest's ``layers.<name>.rows``): ``"sequence"`` (a ``[B, d]`` head, or the reduce
    form), ``"target"`` (an encoder-decoder's decoder positions), else ``"position"`` (token
    positions of the input, also for a mix)."""
    rows = {m.layers[n].rows or "position" for n in names}
    return rows.pop() if len(rows) == 1 else "position"


def default_num_data(m: Manifest, unit: str = "position") -> float:
    """``N`` in ``unit``, from the counts of the snapshot's manifest ``m``: the usable
    positions (``tokens_seen``), the usable decoder positions (``target_tokens_seen``) or the
    sequences with a usable position (``sequences_seen``) of every training forward, divided
    by the epochs run (when known and positive): the data set's size, also after a partial
    epoch."""
    seen = float(getattr(m.counts, UNIT_COUNTERS[unit]))
    epoch = m.epoch
    return seen / epoch if epoch and epoch > 0 else seen


def layer_num_data(m: Manifest, names: Sequence[str], num_data: float,
                   unit: str = "position") -> dict[str, float]:
    """``N`` of each layer, for ``num_data`` in ``unit`` (`num_data_unit`): ``num_data`` for a
    layer whose rows are in that unit; for one whose rows are another (token positions,
    decoder positions or sequences, the manifest's ``layers.<name>.rows``) ``num_data`` times
    the snapshot's ratio of the two counts (e.g. ``counts.sequences_seen /
    counts.tokens_seen``), so the
    default ``num_data`` gives each layer its own count per epoch and a ``num_data`` of your
    own rescales every layer alike."""
    counts = {u: float(getattr(m.counts, c)) for u, c in UNIT_COUNTERS.items()}
    out = {}
    for name in names:
        rows = m.layers[name].rows or "position"
        out[name] = num_data if rows == unit else num_data * counts[rows] / counts[unit]
    return out


def check_num_data(where: str, num_data: object, m: Manifest, unit: str = "position"
                    ) -> float:
    """``N`` in ``unit``: ``num_data`` (a positive finite number) or, when None, the
    snapshot's own."""
    what = {"position": "training positions", "target": "training decoder positions",
            "sequence": "training sequences"}[unit]
    allowed = ("None (N from the snapshot's counts) or a positive finite number (N: the "
               f"{what} the factors average over)")
    if num_data is not None:
        return inputs.check_positive(where, "num_data", num_data, allowed)
    counter = UNIT_COUNTERS[unit]
    try:
        n = default_num_data(m, unit)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise QueryInputError(f"{where}: num_data=None takes N from the snapshot's counts, which "
                              f"are unreadable ({type(e).__name__}: {e}): pass num_data, "
                              "a positive finite number") from None
    if not (math.isfinite(n) and n > 0):
        raise QueryInputError(f"{where}: num_data=None takes N from the snapshot's counts, which "
                              f"give N={n!r} (counts.{counter}={getattr(m.counts, counter)!r},"
                              f" epoch={m.epoch!r}): pass num_data, a positive finite "
                              "number")
    return n


def warn_far_num_data(where: str, num_data: float, m: Manifest, unit: str = "position"
                       ) -> None:
    """Warn (``UserWarning``) when ``num_data`` is more than `NUM_DATA_WARN_FACTOR` times away
    from the snapshot's own count; silent when the counts are unreadable (nothing to compare)."""
    try:
        own = default_num_data(m, unit)
    except (KeyError, TypeError, ValueError, AttributeError):
        return
    if not (math.isfinite(own) and own > 0):
        return
    ratio = num_data / own
    if 1 / NUM_DATA_WARN_FACTOR <= ratio <= NUM_DATA_WARN_FACTOR:
        return
    epoch = m.epoch
    per = f" over {epoch:.3g} epochs" if isinstance(epoch, (int, float)) and epoch > 0 else ""
    factor = max(ratio, 1 / ratio)
    times = f"{factor:,.0f}x" if factor >= 10 else f"{factor:.2g}x"
    far = f"{times} below" if ratio < 1 else f"{times} above"
    small, wide = ("small", "wide") if ratio < 1 else ("large", "narrow")
    counter = UNIT_COUNTERS[unit]
    why = ("Here N counts token positions, not examples: the K-FAC Fisher (expand form) is a "
           "sum over every position of the training forwards (e.g. 300 examples of 65 tokens "
           "are N=19,500), unlike laplace-torch's num_data." if unit == "position" else
           "Here N counts the training sequences (every layer of this posterior has one row "
           "per sequence).")
    warnings.warn(
        f"{where}: num_data={num_data:,.6g} is {far} the snapshot's own count N={own:,.0f} "
        f"(counts.{counter}={getattr(m.counts, counter):,}{per}). {why} The data term "
        f"N*(A(x)G) of the posterior precision scales with N, so it is {times} too {small} "
        f"here (the posterior up to {times} too {wide}). Pass num_data=None for the "
        "snapshot's count.", UserWarning, stacklevel=3)
