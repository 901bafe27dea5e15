"""Fisher estimators (`base.FisherEstimator`), one file each, and what they share: the
curvature a run estimates (`curvature.Curvature`), the MC replay (`mc_replay`) and its draws
(`replay_draws`). Importing the package registers the built-in estimators."""

from . import empirical, mc_full_batch, mc_subbatch  # noqa: F401 (registers them)
from .base import (
    FisherEstimator,
    StepContext,
    estimator_for,
    fisher_names,
    register_fisher,
    registered_fisher,
    unregister_fisher,
)

__all__ = ["FisherEstimator", "StepContext", "estimator_for", "fisher_names", "register_fisher",
           "registered_fisher", "unregister_fisher"]
