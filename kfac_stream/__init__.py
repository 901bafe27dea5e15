"""kfac_stream: training-time, streaming K-FAC curvature tracking for Hugging Face Trainer."""

import importlib

from . import ekfac as _ekfac  # noqa: F401 (registers the EK-FAC tracker extension)
from .config import KFACConfig
from .exceptions import (
    AppConfigError,
    EigendecompositionError,
    KFACConfigError,
    KFACStreamError,
    PartitionedModelError,
    QueryInputError,
    SnapshotError,
    SnapshotMismatchError,
    TrackerStateError,
    UnsupportedLayoutError,
    UnsupportedModuleError,
)
from .tracking.heldout_config import HeldoutConfig
from .utils.enums import (
    Eigendecompose,
    EighDevice,
    ExchangeMode,
    FactorForm,
    FinalRefresh,
    FisherType,
    FoldOn,
    LayerPreset,
    StorageDtype,
)

__version__ = "0.1.0"

# Imported on first use (PEP 562): the callback pulls in transformers' Trainer machinery
# (~4 s, peft included), which `kfac-stream query` and `inspect` never need.
_LAZY = {
    "KFACStreamCallback": "integrations.hf_callback",
    "snapshot_metrics": "integrations.spectrum_monitor",
    "step_metrics": "integrations.spectrum_monitor",
    "LaplacePosterior": "query.laplace",
    "LayerFactors": "snapshot.snapshot",
    "Snapshot": "snapshot.snapshot",
    "sampled_predictive": "query.sampled",
    "iter_sample_logits": "query.sampled",
    "sample_rows": "query.sampled",
    "posterior_draws": "query.sampled",
    "PosteriorDraws": "query.sampled",
    "answer_distribution": "query.answers", "generated_answers": "query.answers",
    "AnswerDistribution": "query.answers", "GeneratedAnswers": "query.answers",
    "abstain": "query.answers",
    "gather_model": "integrations.unshard",
    "fit_prior_precision": "query.heldout_tau", "HeldoutPrior": "snapshot.heldout_prior",
    "influence_scores": "query.influence", "Influence": "query.influence",
    "InfluenceScores": "query.influence", "self_influence": "query.influence",
    "influence_memory": "query.influence",
    "trajectory_influence": "query.trajectory", "checkpoint_snapshots": "query.trajectory",
    "trajectory_posteriors": "query.trajectory",
}


#: Old public names, still answered with a FutureWarning that names the new one.
_RENAMED = {"whole_model": "gather_model"}


def __getattr__(name: str):
    if name in _RENAMED:
        import warnings

        warnings.warn(f"kfac_stream.{name} is now kfac_stream.{_RENAMED[name]}", FutureWarning,
                      stacklevel=2)
        return __getattr__(_RENAMED[name])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kfac_stream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    # training-time tracking
    "KFACConfig",
    "HeldoutConfig",
    "KFACStreamCallback",
    # monitoring: the metrics the callback reports (names: integrations.spectrum_monitor)
    "snapshot_metrics",
    "step_metrics",
    # snapshots
    "Snapshot",
    "LayerFactors",
    # queries
    "LaplacePosterior",
    "sampled_predictive",
    "iter_sample_logits",
    "sample_rows",
    "posterior_draws",
    "PosteriorDraws",
    "answer_distribution", "generated_answers", "AnswerDistribution", "GeneratedAnswers",
    "abstain",
    "fit_prior_precision", "HeldoutPrior",
    "influence_scores", "Influence", "InfluenceScores", "self_influence", "influence_memory",
    "trajectory_influence", "checkpoint_snapshots", "trajectory_posteriors",
    "gather_model",
    # enums: KFACConfig's options
    "FisherType",
    "StorageDtype",
    "FactorForm",
    "LayerPreset",
    "FinalRefresh",
    "FoldOn",
    "ExchangeMode",
    "EighDevice",
    "Eigendecompose",
    # errors
    "KFACStreamError",
    "KFACConfigError",
    "UnsupportedLayoutError",
    "UnsupportedModuleError",
    "SnapshotError",
    "EigendecompositionError",
    "SnapshotMismatchError",
    "TrackerStateError",
    "QueryInputError",
    "PartitionedModelError",
    "AppConfigError",
    "__version__",
]
