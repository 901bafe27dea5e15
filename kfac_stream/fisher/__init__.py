"""Fisher estimators (`base.FisherEstimator`), one file each; importing the package registers
the built-in ones."""

from . import empirical, mc_full_batch, mc_subbatch  # noqa: F401 (registers them)
from .base import FisherEstimator, estimator_for, register_fisher, unregister_fisher

__all__ = ["FisherEstimator", "estimator_for", "register_fisher", "unregister_fisher"]
