"""Progress bars of the long steps after training (tqdm on stderr, like the HF Trainer's).

Who sees a bar (``show`` argument of `progress`):

* ``None`` (the default of every public function that takes it): shown when stderr is a
  terminal (tqdm's ``disable=None``), so logs, CI and captured output stay clean; hidden
  everywhere when transformers' progress bars are turned off
  (``transformers.utils.logging.disable_progress_bar()``, or ``HF_HUB_DISABLE_PROGRESS_BARS``
  honoured by it) and a ``transformers`` module is already loaded.
* ``True``: always shown (also to a file or a pipe), e.g. the app when ``trainer.disable_tqdm``
  is false, like the Trainer's own bar.
* ``False``: never shown.

The environment variable ``KFAC_STREAM_PROGRESS`` overrides all of these: ``1`` always,
``0`` never.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")

ENV = "KFAC_STREAM_PROGRESS"


def enabled(show: bool | None = None) -> bool | None:
    """The bar's switch: True (shown), False (hidden) or None (shown on a terminal)."""
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    if show is not None:
        return bool(show)
    hf = sys.modules.get("transformers.utils.logging")  # only if already imported: no cost
    if hf is not None and not hf.is_progress_bar_enabled():
        return False
    return None


def progress(iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", show: bool | None = None, **kwargs: Any) -> Any:
    """A tqdm bar over ``iterable`` (or a manual one with ``total`` to ``update()``), on
    stderr, gone when done (``leave=False``); ``show`` as in the module's docstring."""
    from tqdm.auto import tqdm

    on = enabled(show)
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=kwargs.pop("leave", False),
                disable=None if on is None else not on, dynamic_ncols=True, **kwargs)

