"""`KFACConfig`: every knob of the tracker, validated when it is built.

Validation that needs the model (do the include/exclude regexes match a supported layer?) runs
in `KFACStreamCallback.on_train_begin`, before the first training step.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any

from .exceptions import KFACConfigError, did_you_mean
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
    option_value,
    option_values,
)


@dataclass(frozen=True, kw_only=True)
class KFACConfig:
    """Configuration of the streaming K-FAC tracker.

    Each field's help sits below it; docs/configuration.md explains every field in full, with
    the measurements behind the defaults. An option field takes its enum's member or its string
    (``fisher=FisherType.MC`` or ``fisher="mc"``) and holds the plain string once built, so
    ``asdict`` and the snapshot manifests hold strings.

    The held-out fit's and the queries' options (the prior precision fitted on the eval set,
    the answer tokens) are `kfac_stream.tracking.heldout_config.HeldoutConfig`'s, handed over
    as ``KFACStreamCallback(heldout=HeldoutConfig(...))``. Their old spelling here,
    ``KFACConfig(eval_prior_precision=..., answer_tokens=...)``, is still accepted (validated
    as before, with a ``FutureWarning``) and carried to the run (`moved_options`).
    """

    token_fraction: float = 0.05
    """Share of each forward pass's ``B·T`` token positions sampled for the factors (among the
    usable ones, weighted to be unbiased); ``1.0`` gives the exact full-batch factors."""
    ema_decay: float = 0.95
    """Per-update decay ``λ`` of the token-weighted, bias-free EMA of the factors; ``1.0`` is
    the exact running mean over the whole run (``final_window`` is then off)."""
    final_window: float = 0.1
    """Share of the training steps at the end whose updates are averaged exactly instead of by
    the EMA, so the last snapshot holds the end of training's curvature; ``0``: the EMA
    throughout."""
    final_refresh: FinalRefresh | str = "auto"
    """At train end, replace the factors by their mean over a pass at the final weights (at most
    one epoch and 10% of the training's FLOPs): ``"auto"`` (when the planned final window starts
    in the first half of the run), ``"on"`` or ``"off"``."""
    min_window_sequences: int = 256
    """The fewest sequences the final window's mean may rest on: the window starts earlier (and
    a short run's MC share is raised) until it holds this many; ``0``: ``final_window`` alone."""
    update_every: int = 10
    """Update the factors on every ``update_every``-th optimizer step (steps 0, k, 2k, ...);
    the other steps cost one Python branch per hook."""
    snapshot_every: int = 500
    """Write a snapshot every ``snapshot_every`` optimizer steps, and one at the end of
    training."""
    fisher: FisherType | str = "mc"
    """Which Fisher the G factor estimates: ``"mc"`` (labels sampled from the model, replayed on
    update steps), ``"empirical"`` (the observed labels, no extra pass) or a registered
    estimator's name."""
    factor_form: FactorForm | str = "expand"
    """How a layer applied at every token position makes its rows: ``"expand"`` (one per
    sampled position), ``"reduce"`` (one per sequence) or ``"auto"`` (``"reduce"`` for a
    sequence-level loss)."""
    mc_sequences: int | float | str = 0.05
    """What the MC replay runs on: a share in ``(0, 1)`` of each update step's sequences, an int
    ``k`` (``min(k, B)`` of every micro-batch) or ``"all"`` / ``1.0`` (whole micro-batches)."""
    include: list[str] | None = None
    """Regexes (``re.search``) over ``model.named_modules()`` names choosing the tracked
    layers; ``None``: every trainable Linear/Conv1D inside the transformer blocks."""
    exclude: list[str] | None = None
    """Regexes of layers never tracked, also with a ``preset``."""
    preset: LayerPreset | str | None = None
    """A named layer selection instead of ``include`` (``"last_layer"``, ``"lora"``,
    ``"attention"``, ``"mlp"``, ``"all_linear"``); ``exclude`` applies on top."""
    output_dir: str | None = None
    """Where snapshots go; ``None``: ``<TrainingArguments.output_dir>/kfac``."""
    storage_dtype: StorageDtype | str = "float16"
    """CPU dtype of the stored factors: ``"float16"`` (with a float32 scale per factor),
    ``"float32"`` or ``"float64"``."""
    max_dense_dim: int = 8192
    """A factor whose side is longer than this is kept diagonal (``O(d)`` memory instead of
    ``O(d²)``)."""
    seed: int = 0
    """Seed of the token sampler's generator."""
    async_updates: bool | None = None
    """Run the factor arithmetic on a background thread; ``None``: on when the model is on a
    CUDA device."""
    share_inputs: bool = True
    """Layers that read the same input tensor (q/k/v, gate/up) share one A factor; ``False``:
    one A per layer."""
    fold_on: FoldOn | str = "auto"
    """Where the second moments ``XᵀX`` are formed and the EMA runs: ``"device"``, ``"host"``
    or ``"auto"`` (``"device"`` on CUDA, ``"host"`` on CPU)."""
    device_memory_budget: int | str = "auto"
    """Bytes of accelerator memory for the resident pending statistics and their work space;
    ``"auto"``: decided at the first update from what training left free."""
    exchange: ExchangeMode | str = "auto"
    """How each update's contributions reach a factor's owner with several ranks: ``"rows"``,
    ``"stats"`` or ``"auto"`` (per factor, whichever moves fewer bytes)."""
    eigh_device: EighDevice | str = "auto"
    """Where snapshots eigendecompose the factors: ``"auto"`` (the owner's GPU when training on
    one, else the CPU) or ``"cpu"``."""
    eigh_threads: int | None = None
    """CPU threads for snapshot eigendecompositions; ``None``: this process's cores divided by
    the processes on the node."""
    eigendecompose: Eigendecompose | str = "auto"
    """When snapshots eigendecompose their factors: ``"auto"`` (in the run when cheap, else at
    first use), ``"always"`` or ``"final"``; the final snapshot always is."""
    fail_on_snapshot_error: bool = False
    """Make a failed snapshot stop training; by default it is logged and counted, and training
    goes on."""
    ekfac: bool = False
    """Also stream the EK-FAC eigenvalue correction in the previous snapshot's eigenbasis,
    stored with each later snapshot (``snap[name].ekfac_eigvals``)."""

    def __post_init__(self) -> None:
        for name, options in _OPTION_FIELDS:  # a member or its string: the string
            object.__setattr__(self, name, option_value(options, getattr(self, name)))
        self._check_rates()
        self._check_switches()
        self._check_sizes()
        self._check_kinds()
        self._check_layers()

    def _check_rates(self) -> None:
        """Validate the rates and step counts."""
        _check_range("token_fraction", self.token_fraction, "in (0, 1]",
                     lambda v: 0.0 < v <= 1.0)
        _check_range("ema_decay", self.ema_decay, "in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        _check_range("final_window", self.final_window, "in [0, 1)",
                     lambda v: 0.0 <= v < 1.0)
        for name in ("update_every", "snapshot_every", "max_dense_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KFACConfigError(
                    f"KFACConfig.{name}={value!r} is not allowed: must be a positive integer"
                )

    def _check_switches(self) -> None:
        """Validate the switches and the device choices."""
        for name in ("share_inputs", "fail_on_snapshot_error", "ekfac"):
            if not isinstance(getattr(self, name), bool):
                raise KFACConfigError(f"KFACConfig.{name}={getattr(self, name)!r} is not "
                                      "allowed: must be a bool")
        for name, options in (("fold_on", FoldOn), ("exchange", ExchangeMode),
                              ("eigh_device", EighDevice), ("eigendecompose", Eigendecompose),
                              ("final_refresh", FinalRefresh)):
            if getattr(self, name) not in options:
                raise KFACConfigError(f"KFACConfig.{name}={getattr(self, name)!r} is not "
                                      f"allowed: must be one of {option_values(options)}")
        if self.ekfac and self.eigendecompose == "final":
            raise KFACConfigError("KFACConfig.eigendecompose='final' is not allowed with "
                                  "ekfac=True: each snapshot's eigenbasis is the next EK-FAC "
                                  "correction's, so every snapshot is decomposed in the run "
                                  "(use 'auto' or 'always')")

        if self.ekfac and self.final_refresh == "on":
            raise KFACConfigError("KFACConfig.final_refresh='on' is not allowed with ekfac=True: "
                                  "the EK-FAC correction is streamed on the previous snapshot's "
                                  "basis over the training steps, which a refresh at the final "
                                  "weights would not match (use 'auto' or 'off')")

    def _check_sizes(self) -> None:
        """Validate the sizes and counts."""
        mws = self.min_window_sequences
        if isinstance(mws, bool) or not isinstance(mws, int) or mws < 0:
            raise KFACConfigError(f"KFACConfig.min_window_sequences={mws!r} is not allowed: "
                                  "must be a non-negative integer (sequences)")
        budget = self.device_memory_budget
        if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int)
                                 or budget < 0):
            raise KFACConfigError(f"KFACConfig.device_memory_budget={budget!r} is not allowed: "
                                  "must be 'auto' or a non-negative integer (bytes)")
        threads = self.eigh_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 1):
            raise KFACConfigError(f"KFACConfig.eigh_threads={threads!r} is not allowed: must "
                                  "be None or a positive integer")

    def _check_kinds(self) -> None:
        """Validate the types and the named kinds (Fisher, form, MC share, storage)."""
        if not isinstance(self.fail_on_snapshot_error, bool):
            raise KFACConfigError(f"KFACConfig.fail_on_snapshot_error="
                                  f"{self.fail_on_snapshot_error!r} is not allowed: must be a bool")
        if self.output_dir is not None and not isinstance(self.output_dir, str):
            raise KFACConfigError(f"KFACConfig.output_dir={self.output_dir!r} is not allowed: "
                                  "must be None or a path string")
        if self.async_updates is not None and not isinstance(self.async_updates, bool):
            raise KFACConfigError(f"KFACConfig.async_updates={self.async_updates!r} is not "
                                  "allowed: must be None or a bool")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise KFACConfigError(f"KFACConfig.seed={self.seed!r} is not allowed: must be an int")
        if not isinstance(self.fisher, str) or not self.fisher:
            raise KFACConfigError(  # the name: checked against the registry by the run plan
                f"KFACConfig.fisher={self.fisher!r} is not allowed: must be one of the Fisher "
                "estimators' names (a non-empty string)")
        if self.factor_form not in FactorForm:
            raise KFACConfigError(
                f"KFACConfig.factor_form={self.factor_form!r} is not allowed: "
                f"must be one of {option_values(FactorForm)}")
        _check_mc_sequences(self.mc_sequences)
        if self.storage_dtype not in StorageDtype:
            raise KFACConfigError(
                f"KFACConfig.storage_dtype={self.storage_dtype!r} is not allowed: "
                f"must be one of {option_values(StorageDtype)}"
            )

    def _check_layers(self) -> None:
        """Validate the layer selection (regexes, preset)."""
        for name in ("include", "exclude"):
            patterns = getattr(self, name)
            if patterns is None:
                continue
            if not isinstance(patterns, (list, tuple)) or not all(
                    isinstance(p, str) for p in patterns):
                raise KFACConfigError(
                    f"KFACConfig.{name}={patterns!r} is not allowed: must be a list of regex "
                    "strings"
                )
            for p in patterns:
                try:
                    re.compile(p)
                except re.error as e:
                    raise KFACConfigError(
                        f"KFACConfig.{name} has an invalid regex {p!r}: {e}"
                    ) from None
        if self.preset is not None:
            if self.preset not in LayerPreset:
                raise unknown_preset_error(self.preset)
            if self.include is not None:
                raise KFACConfigError(
                    f"KFACConfig.preset={self.preset!r} and include={self.include!r} are both "
                    "set: a preset chooses the layers itself; set one of them (exclude still "
                    "applies on top of a preset)"
                )

    @property
    def mc_full_batch(self) -> bool:
        """The MC pass runs on whole micro-batches (``mc_sequences`` ``"all"`` or ``1.0``)."""
        return mc_full_batch(self.mc_sequences)

    @property
    def moved_options(self) -> dict[str, Any]:
        """The held-out options given here in their old place, by their old names
        (``{"eval_prior_precision": ..., "answer_tokens": ...}``, only those given; empty for
        the new spelling), which the run takes as its `HeldoutConfig`
        (`kfac_stream.tracking.heldout_config.HeldoutConfig.of_run`)."""
        return dict(getattr(self, "_moved", {}))

    @property
    def eval_prior_precision(self) -> bool | str:
        """Moved: ``HeldoutConfig.prior_precision`` (given here, or its default)."""
        _warn_moved(["eval_prior_precision"], stacklevel=3)
        return self.moved_options.get("eval_prior_precision", "auto")

    @property
    def answer_tokens(self) -> list[int | str] | None:
        """Moved: ``HeldoutConfig.answer_tokens`` (given here, or its default)."""
        _warn_moved(["answer_tokens"], stacklevel=3)
        return self.moved_options.get("answer_tokens")

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view (lists, not tuples), as written into snapshot manifests (with the
        held-out options beside it: `kfac_stream.tracking.plan.RunPlan.manifest_config`).
        ``ekfac`` only when on: a run without it writes the manifests it wrote before the
        option existed."""
        out = asdict(self)
        if not out["ekfac"]:
            del out["ekfac"]
        return out


#: The option fields and their enums: each takes a member or its string and holds the string
#: (a ``fisher`` outside `FisherType`, a registered estimator's name, is kept as given).
_OPTION_FIELDS = (("final_refresh", FinalRefresh), ("fisher", FisherType),
                  ("factor_form", FactorForm), ("preset", LayerPreset),
                  ("storage_dtype", StorageDtype), ("fold_on", FoldOn),
                  ("exchange", ExchangeMode), ("eigh_device", EighDevice),
                  ("eigendecompose", Eigendecompose))


#: The held-out options that moved to `HeldoutConfig`: ``{old KFACConfig name: new name}``.
MOVED_OPTIONS = {"eval_prior_precision": "prior_precision", "answer_tokens": "answer_tokens"}


def _warn_moved(names: list[str], stacklevel: int) -> None:
    """The one ``FutureWarning`` for ``KFACConfig.<name>`` of each of ``names``, naming their
    new place."""
    old = ", ".join(f"KFACConfig.{name}" for name in names)
    new = ", ".join(f"{MOVED_OPTIONS[name]}=..." for name in names)
    warnings.warn(f"{old} moved to HeldoutConfig: pass KFACStreamCallback(heldout="
                  f"HeldoutConfig({new})) (kfac_stream.HeldoutConfig); the old spelling still "
                  "works for now", FutureWarning, stacklevel=stacklevel)


def _named_arguments_only(init):
    """``KFACConfig.__init__`` that names a misspelt argument and the closest ones, in one line
    (a ``TypeError``, as Python's own for an unknown keyword), before the dataclass's; the
    moved held-out options (`MOVED_OPTIONS`) are validated, warned about and kept aside
    (`KFACConfig.moved_options`)."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        known = [f.name for f in fields(KFACConfig)] + list(MOVED_OPTIONS)
        for key in kwargs:
            if key not in known:
                hint = (did_you_mean(key, known)
                        or "the arguments are listed in docs/configuration.md")
                raise TypeError(f"KFACConfig: {key!r} is not an argument: {hint}")
        moved = {name: kwargs.pop(name) for name in MOVED_OPTIONS if name in kwargs}
        init(self, *args, **kwargs)
        for name, value in moved.items():
            check_moved_option(name, value)
        if moved:
            _warn_moved(list(moved), stacklevel=3)
        object.__setattr__(self, "_moved", moved)
    return __init__


KFACConfig.__init__ = _named_arguments_only(KFACConfig.__init__)


def unknown_preset_error(preset: Any) -> KFACConfigError:
    """The error for a ``preset`` that is no `LayerPreset`: the presets, and the closest ones
    to a misspelt name (``'last-layer'``: did you mean ``'last_layer'``?)."""
    presets = option_values(LayerPreset)
    hint = did_you_mean(preset, presets, repr) if isinstance(preset, str) else None
    return KFACConfigError(f"KFACConfig.preset={preset!r} is not allowed: must be None or one "
                           f"of {presets}" + (f"; {hint}" if hint else ""))


def _check_range(name: str, value: Any, allowed: str, ok) -> None:
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    if bad or not math.isfinite(value) or not ok(value):
        raise KFACConfigError(f"KFACConfig.{name}={value!r} is out of range: must be {allowed}")


def mc_full_batch(spec: int | float | str) -> bool:
    """``mc_sequences`` asks for the whole micro-batch (``"all"`` or the fraction ``1.0``)."""
    return spec == "all" or (isinstance(spec, float) and spec >= 1.0)


def check_moved_option(name: str, value: Any) -> None:
    """Validate a moved held-out option under its old name ``KFACConfig.<name>`` (the old
    spelling, and a manifest's ``config`` entry): `check_prior_precision` or
    `check_answer_tokens`."""
    check = check_prior_precision if name == "eval_prior_precision" else check_answer_tokens
    check(value, f"KFACConfig.{name}")


def check_prior_precision(value: Any, where: str) -> None:
    """The held-out fit's switch (``HeldoutConfig.prior_precision``): ``"auto"``, True or False
    (``"auto"`` resolved in the RunPlan); ``where`` names the setting in the error."""
    if not (isinstance(value, bool) or value in ("auto",)):
        raise KFACConfigError(f"{where}={value!r} is not allowed: must be 'auto', True or False")


def check_answer_tokens(value: Any, where: str) -> None:
    """The answer options (``HeldoutConfig.answer_tokens``): None, or two or more distinct
    token ids or one-token strings; ``where`` names the setting in the error."""
    if value is None:
        return
    allowed = ("must be None or a list of two or more distinct answer options, each a token id "
               "(an int >= 0) or a non-empty string of one token (e.g. [' A', ' B', ' C', ' D'])")
    ok = isinstance(value, (list, tuple)) and len(value) >= 2 and all(
        (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
        or (isinstance(v, str) and v != "") for v in value)
    if ok and len(set(value)) != len(value):
        ok, allowed = False, "repeats an option: " + allowed
    if not ok:
        raise KFACConfigError(f"{where}={value!r} is not allowed: {allowed}")


def _check_mc_sequences(value: Any) -> None:
    ok = (value == "all" if isinstance(value, str) else
          not isinstance(value, bool) and (
              (isinstance(value, int) and value >= 1)
              or (isinstance(value, float) and math.isfinite(value) and 0.0 < value <= 1.0)))
    if not ok:
        raise KFACConfigError(
            f"KFACConfig.mc_sequences={value!r} is not allowed: must be a positive int "
            "(sequences per micro-batch), a fraction in (0, 1], or 'all'")
