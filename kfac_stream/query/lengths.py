"""An input longer than the model's positions: the limit (`input_positions`), the message
(`too_long`, the same in the query API and the ``kfac-stream`` CLI) and the check
(`check_length`, raising `QueryInputError` before the model's forward would fail on it with
"The size of tensor a (122) must match the size of tensor b (64)")."""

from __future__ import annotations

import numbers
from typing import Any

from ..exceptions import QueryInputError


def input_positions(model: Any) -> int | None:
    """The most positions the model's inputs may have (its config's ``n_positions`` or
    ``max_position_embeddings``, as the CLI reads them), or None when its config says none
    (T5's relative positions)."""
    cfg = getattr(model, "config", None)
    limit = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)
    ok = isinstance(limit, numbers.Integral) and not isinstance(limit, bool) and limit > 0
    return int(limit) if ok else None


def too_long(what: str, length: int, limit: int, fix: str) -> str:
    """``"{what} is {length} tokens long: must be at most {limit} tokens (the model's
    positions); {fix}"``: the message of an input longer than the model's positions."""
    return (f"{what} is {length} tokens long: must be at most {limit} tokens (the model's "
            f"positions); {fix}")


def check_length(where: str, arg: str, length: int, positions: int | None) -> None:
    """An input ``arg`` of ``length`` tokens fits the model's ``positions`` (`input_positions`;
    None: no limit), else the one-line `QueryInputError` ``"{where}: {arg} is ... tokens long:
    ..."`` (`too_long`) that says how to cut it as training did."""
    if positions is not None and length > positions:
        raise QueryInputError(f"{where}: " + too_long(
            arg, length, positions, "cut it as training did, e.g. tokenizer(texts, "
            f"truncation=True, max_length={positions})"))
