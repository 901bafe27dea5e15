"""`HeldoutConfig`: what the held-out fit at train end and the queries read from a run, apart
from the tracker's own settings (`KFACConfig`).

``KFACStreamCallback(config, heldout=HeldoutConfig(...))`` hands it to the session: the plan
decides the fit from ``prior_precision`` (`kfac_stream.tracking.plan.plan_heldout`), the
callback resolves ``answer_tokens`` at train begin (`kfac_stream.query.answer_tokens`) and
every snapshot's manifest records them, where the queries read them (`Snapshot.answer_tokens`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from ..config import MOVED_OPTIONS, KFACConfig, check_answer_tokens, check_prior_precision
from ..exceptions import KFACConfigError


@dataclass(frozen=True, kw_only=True)
class HeldoutConfig:
    """The held-out fit's and the queries' options of a run (docs/configuration.md).

    Both were ``KFACConfig`` fields (``eval_prior_precision``, ``answer_tokens``); that
    spelling is still accepted, with a ``FutureWarning`` (`of_run`).
    """

    prior_precision: bool | str = "auto"
    """Fit the prior precision ``τ`` and the link on the Trainer's ``eval_dataset`` at the end
    of training, stored beside the final snapshot: ``"auto"`` / ``True`` whenever there is an
    eval set, ``False`` never."""
    answer_tokens: list[int | str] | None = None
    """A language model's answer options (token ids, or strings of one token each such as
    ``[" A", " B"]``), recorded in every snapshot for the queries and the held-out fit."""

    def __post_init__(self) -> None:
        check_prior_precision(self.prior_precision, "HeldoutConfig.prior_precision")
        check_answer_tokens(self.answer_tokens, "HeldoutConfig.answer_tokens")

    @classmethod
    def of_run(cls, config: KFACConfig, heldout: HeldoutConfig | None = None
               ) -> HeldoutConfig:
        """A run's options: ``heldout``, else those ``config`` was given in their old place
        (``KFACConfig(eval_prior_precision=..., answer_tokens=...)``,
        `KFACConfig.moved_options`), else the defaults.

        Raises:
            KFACConfigError: Both carry them (one place only).
        """
        moved = config.moved_options
        if heldout is not None and moved:
            given = ", ".join(f"{name}={value!r}" for name, value in moved.items())
            raise KFACConfigError(
                f"the held-out options are given twice: KFACConfig({given}) and "
                f"KFACStreamCallback(heldout={heldout!r}); set them only in HeldoutConfig "
                "(KFACStreamCallback(heldout=HeldoutConfig(prior_precision=..., "
                "answer_tokens=...)))")
        if heldout is not None:
            if not isinstance(heldout, HeldoutConfig):
                raise KFACConfigError(f"KFACStreamCallback(heldout={heldout!r}) is not "
                                      "allowed: must be None or a HeldoutConfig")
            return heldout
        return cls(**{MOVED_OPTIONS[name]: value for name, value in moved.items()})

    def manifest_entries(self) -> dict[str, Any]:
        """``{"eval_prior_precision": ..., "answer_tokens": ...}``: the options as a snapshot
        manifest's ``config`` records them, under their old names
        (`kfac_stream.tracking.plan.RunPlan.manifest_config`)."""
        values = {"prior_precision": self.prior_precision, "answer_tokens": self.answer_tokens}
        return {old: copy.deepcopy(values[new]) for old, new in MOVED_OPTIONS.items()}
