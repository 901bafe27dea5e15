"""kfac_stream: training-time, streaming K-FAC curvature tracking for Hugging Face Trainer."""

from .config import KFACConfig
from .enums import FisherType, StorageDtype
from .exceptions import (
    AppConfigError,
    KFACConfigError,
    KFACStreamError,
    QueryInputError,
    SnapshotError,
    SnapshotMismatchError,
    TrackerStateError,
    UnsupportedModuleError,
)
from .integrations.hf_callback import KFACStreamCallback
from .integrations.spectrum_monitor import snapshot_metrics, step_metrics
from .query.laplace import LaplacePosterior
from .snapshot.snapshot import LayerFactors, Snapshot

__version__ = "0.1.0"

__all__ = [
    # training-time tracking
    "KFACConfig",
    "KFACStreamCallback",
    # monitoring: the metrics the callback reports (names: integrations.spectrum_monitor)
    "snapshot_metrics",
    "step_metrics",
    # snapshots
    "Snapshot",
    "LayerFactors",
    # queries
    "LaplacePosterior",
    # enums
    "FisherType",
    "StorageDtype",
    # errors
    "KFACStreamError",
    "KFACConfigError",
    "UnsupportedModuleError",
    "SnapshotError",
    "SnapshotMismatchError",
    "TrackerStateError",
    "QueryInputError",
    "AppConfigError",
    "__version__",
]
