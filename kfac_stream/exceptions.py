"""Every error kfac_stream raises on purpose, all under `KFACStreamError`.

Each message names the offending field, value, key or file. The tree::

    KFACStreamError
    ├── KFACConfigError (also ValueError)       a KFACConfig value, or one that misfits the model
    │   └── UnsupportedModuleError              an included module kfac_stream cannot track
    ├── AppConfigError (also ValueError)        a composed Hydra config the app cannot use
    ├── SnapshotError                           a snapshot directory incomplete, altered, unknown
    ├── SnapshotMismatchError (also ValueError) a model whose layers differ from the snapshot's
    ├── TrackerStateError                       a checkpoint's tracker state that cannot restore
    └── QueryInputError (also ValueError)       an argument of a query (LaplacePosterior, the CLI)
        └── PartitionedModelError               a model whose weights DeepSpeed ZeRO-3 partitions
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable


class KFACStreamError(Exception):
    """Base class of every error raised by kfac_stream."""


class KFACConfigError(KFACStreamError, ValueError):
    """A configuration value is out of range or does not fit the model."""


class UnsupportedModuleError(KFACConfigError):
    """An explicitly included module is of a type kfac_stream cannot track."""


class AppConfigError(KFACStreamError, ValueError):
    """A composed app config that Hydra's types accept but the app cannot use (names the key)."""


class SnapshotError(KFACStreamError):
    """A snapshot directory is incomplete, altered, or of an unknown format."""


class EigendecompositionError(SnapshotError):
    """A factor's eigendecomposition failed while its snapshot was written (the snapshot is
    abandoned on every rank; earlier ones stay)."""


class SnapshotMismatchError(KFACStreamError, ValueError):
    """The model's tracked layers do not match the snapshot's (names or shapes)."""


class UnsupportedLayoutError(KFACStreamError, ValueError):
    """A tracked layer receives its input in a layout a query cannot split into the batch's
    examples (neither ``[B, ..., d]`` nor batch-major rows ``[B*T, d]``)."""


class TrackerStateError(KFACStreamError):
    """A checkpoint's kfac_stream state cannot be restored into this tracker."""


class QueryInputError(KFACStreamError, ValueError):
    """An argument of the query API or the ``kfac-stream`` command line is of the wrong type or
    out of range (one line naming the call, the argument, its value and what is allowed)."""


class PartitionedModelError(QueryInputError):
    """The model given to a query has its weights partitioned across ranks by DeepSpeed ZeRO-3
    (the engine gathers them only inside its own forward); query a whole copy instead
    (`kfac_stream.gather_model`, or the saved model loaded in one process)."""


def did_you_mean(word: str, choices: Iterable[str],
                 shown: Callable[[str], str] = str) -> str | None:
    """``"did you mean X or Y?"`` naming the (at most 3) ``choices`` closest to a misspelt
    ``word`` (`difflib.get_close_matches`, cutoff 0.6), each as ``shown`` writes it; None when
    none is close. Every "did you mean" of kfac_stream's messages comes from here."""
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f"did you mean {' or '.join(shown(c) for c in close)}?" if close else None
