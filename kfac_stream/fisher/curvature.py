"""What the factors estimate, in one place: the Fisher type and the factor form.

The run plan (`kfac_stream.tracking.plan.RunPlan`) resolves a `Curvature` once; the capture
(`kfac_stream.capture.hooks`), the MC replay and the tracker ask it instead of testing
``config.fisher`` or the form themselves. A new Fisher type is an estimator registered in
`kfac_stream.fisher.base` (the one table of Fisher names); a new form is a change here and
in its tests.

**Fisher type** (``KFACConfig.fisher``: `FisherType` for the built-in ones, else a registered
estimator's name): ``"empirical"`` takes the training backward's gradients (the observed
labels); ``"mc"`` samples labels from the model and takes their gradients in a replay of
``mc_sequences`` sequences per micro-batch (or inside the training forward for the whole
micro-batch), `kfac_stream.fisher.mc_replay`.

**Factor form** (``KFACConfig.factor_form``, `FactorForm`), for a layer applied at every token
position of a sequence (Eschenhagen et al. 2023, "Kronecker-Factored Approximate Curvature for
Modern Neural Network Architectures"): the per-sequence weight gradient is
``Σ_t g_t a_tᵀ``.

* ``"expand"`` treats every position as an example: ``A = E_t[a aᵀ]``, ``G = E_t[g gᵀ]`` over
  token positions (sampled, ``token_fraction``), ``N`` = token positions. Right for a loss
  taken at every position (a causal LM's next-token loss).
* ``"reduce"`` sums over a sequence's positions before the outer product: ``ā = mean_t a_t``
  and ``ĝ = Σ_t g_t`` per sequence, ``A = E_n[ā āᵀ]``, ``G = E_n[ĝ ĝᵀ]`` over sequences, ``N``
  = sequences. Exact for the per-sequence gradient when the inputs are the same at every
  position, and the form for a loss taken once per sequence (classification, regression,
  multiple choice). Every sequence of a captured micro-batch is a row (no token sampling: the
  outer product of a sampled sum would be biased); the MC sub-batch replay weighs its
  sequences by ``1/P(drawn)``, so the estimate stays unbiased.
* ``"auto"``: ``"reduce"`` for a model with a sequence-level loss (`sequence_level_loss`),
  else ``"expand"``.

A layer that sees one row per sequence (a pooler or head on ``[B, d]``) has no positions to
expand or reduce: it is in the sequence row space under either form (`capture.hooks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..utils.enums import FactorForm
from .base import registered_fisher

#: ``config.problem_type`` values of a loss taken once per sequence (transformers)
SEQUENCE_PROBLEMS = ("single_label_classification", "multi_label_classification",
                     "regression")
#: model class name endings of a loss taken once per sequence (transformers, PEFT wrappers)
SEQUENCE_HEADS = ("ForSequenceClassification", "ForMultipleChoice")


def sequence_level_loss(model: nn.Module) -> bool:
    """The model's loss is taken once per sequence: a ``*ForSequenceClassification`` or
    ``*ForMultipleChoice`` class (PEFT's wrappers of them too), or a config whose
    ``problem_type`` is a classification or regression."""
    inner = getattr(model, "module", model)  # DDP / DeepSpeed engine wrappers
    names = [type(inner).__name__]
    base = getattr(inner, "base_model", None)
    if base is not None:
        names.append(type(getattr(base, "model", base)).__name__)
    if any(n.endswith(SEQUENCE_HEADS) for n in names):
        return True
    return getattr(getattr(inner, "config", None), "problem_type", None) in SEQUENCE_PROBLEMS


@dataclass(frozen=True)
class Curvature:
    """The resolved Fisher type and factor form of a tracker.

    Attributes:
        fisher: A registered estimator's name (``"empirical"``, ``"mc"`` or one registered
            with `kfac_stream.fisher.register_fisher`).
        form: ``"expand"`` or ``"reduce"`` (``"auto"`` resolved for the model).
    """

    fisher: str
    form: str

    @classmethod
    def of(cls, config, model: nn.Module | None = None) -> Curvature:
        """From a `KFACConfig`; ``factor_form="auto"`` is resolved on ``model`` (None:
        ``"expand"``)."""
        form = FactorForm(config.factor_form)
        if form is FactorForm.AUTO:
            form = FactorForm.REDUCE if model is not None and sequence_level_loss(model) \
                else FactorForm.EXPAND
        return cls(str(config.fisher), form.value)

    @property
    def sampled_labels(self) -> bool:
        """G comes from labels sampled from the model (the MC Fisher), not the training
        backward (the registered estimator's ``sampled_labels``; a `KFACConfigError` naming
        the registered ones for a name none is registered under)."""
        return registered_fisher(self.fisher).sampled_labels

    @property
    def reduces(self) -> bool:
        """A position-space layer's rows are per-sequence reductions (``ā``, ``ĝ``), not
        sampled positions."""
        return self.form == FactorForm.REDUCE.value

    def describe(self) -> str:
        """For the train-begin line, e.g. ``"mc Fisher, reduce form"``."""
        return f"{self.fisher} Fisher, {self.form} form"
