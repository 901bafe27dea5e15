"""What a tracker extension is: a class the tracker builds when its configuration asks for it
and calls at declared points of every run, and the registry that names them.

An extension streams something of its own next to the factors (an eigenvalue correction:
`kfac_stream.ekfac`). The tracker (`kfac_stream.tracking.tracker`) knows it only through the
hooks below, each a no-op here:

* building: ``__init__(tracker)`` (before any hook goes on the model: refuse a configuration
  here), `reserved_bytes` (device bytes the fold's budget keeps free), `memory_line` (the
  train-begin line's words on them);
* each optimizer step: `begin_step`; `step_table` and `agree` (host ints every rank adds to the
  update's exchange table, and every rank's back); `plan_changed` (a shared-input group
  dissolved);
* each captured pass (`kfac_stream.capture.hooks`): `keep_call` at a tracked layer's forward
  (what to keep of the call; None: nothing), `add_call` at its output gradient;
* each update step (`kfac_stream.tracking.collect`): `collect_pass` per pass record with the
  pass's loss scale, `add_update` once with the step's finiteness;
* each snapshot (`kfac_stream.snapshot.sequence`, the training thread): `export`: per layer a
  tensor ``<layer>.<name>`` for the shard and an entry ``layers[<layer>][<name>]`` for the
  manifest, and where the snapshot's eigenvectors go (``needs_eigenbasis``: every snapshot is
  eigendecomposed in the run);
* checkpoints (`kfac_stream.tracking.tracker_state`): `state_dict` / `load_state_dict`, meta
  under the key ``<name>`` of the state's JSON, tensors named ``<name>.*``; those starting
  with one of ``summed_state`` are per-rank sums (a resume with another world size adds
  every rank's onto rank 0).

Register a class with `register_extension`; `extensions_for` lists the registered classes a
configuration enables (`TrackerExtension.applies`), in registration order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from ..config import KFACConfig


@dataclass
class ExtensionExport:
    """What an extension hands to snapshot ``step`` (`TrackerExtension.export`).

    Attributes:
        tensors: ``{layer: tensor}`` this rank stores, as ``<layer>.<name>`` in its shard.
        entries: ``{layer: JSON object}``, written as ``layers[<layer>][<name>]`` of the
            manifest (with several ranks the entry of the rank that owns the layer's G factor).
        sink: ``receive(factor key, eigenvectors [d, d] | None)`` for the snapshot's
            eigendecompositions (`kfac_stream.snapshot.eigen_stream.EigenStream`), with an
            optional ``share(comm)`` called on every rank once the shard is written; None:
            nothing.
    """

    tensors: dict[str, Tensor] = field(default_factory=dict)
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    sink: Callable[[str, Tensor | None], None] | None = None


class TrackerExtension:
    """The base of every tracker extension (the module docstring lists the hooks).

    Args:
        tracker: The `kfac_stream.tracking.tracker.Tracker` building it (its ``specs``,
            ``plan``, ``dims``, ``ownership``, ``device``, ``row_dtype``, ``rank``,
            ``world_size``, ``dist``, ``run`` and ``step`` are set).
    """

    #: The registry's key, the manifest's per-layer key and the checkpoint state's prefix.
    name: ClassVar[str] = ""
    #: Every snapshot eigendecomposes in the run (its eigenvectors are what `export`'s sink
    #: takes).
    needs_eigenbasis: ClassVar[bool] = False
    #: Prefixes of state tensor names that are per-rank sums (`load_state_dict`).
    summed_state: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker

    @classmethod
    def applies(cls, config: KFACConfig) -> bool:
        """Whether ``config`` enables this extension."""
        return False

    # -- building --------------------------------------------------------------------------------

    def reserved_bytes(self) -> int:
        """Bytes held on the model's device at most, kept out of the fold's device budget."""
        return 0

    def memory_line(self) -> str:
        """Words on those bytes for the train-begin line (``"; ..."``), or ``""``."""
        return ""

    # -- the run's plan --------------------------------------------------------------------------

    def extra_snapshot_step(self, max_steps: int) -> int | None:
        """A step of a ``max_steps``-step run at which the session takes a snapshot beyond the
        periodic ones and waits for it (its eigenbasis in use from the next step); None: none."""
        return None

    def train_begin_line(self, max_steps: int) -> tuple[str, str] | None:
        """``(log level, line)`` the train-begin summary adds for this extension; None: none."""
        return None

    # -- each optimizer step ---------------------------------------------------------------------

    def begin_step(self) -> None:
        """An optimizer step begins (the training thread)."""

    def step_table(self) -> tuple[int, ...]:
        """This rank's host ints for the update's exchange table (`agree` gets every rank's)."""
        return ()

    def agree(self, rows: list[list[int]]) -> None:
        """Every rank's `step_table` of this update (``[world][len(step_table())]``, the same
        on every rank)."""

    def plan_changed(self, plan: Any) -> None:
        """The factor plan changed (`kfac_stream.capture.sharing.FactorPlan`: a shared-input
        group dissolved)."""

    # -- each captured pass ----------------------------------------------------------------------

    def keep_call(self, layer: str) -> Any | None:
        """At a forward call of tracked ``layer`` in a captured pass: a token (anything but
        None) to keep the call's input for `add_call`, else None."""
        return None

    def add_call(self, rec: Any, layer: str, x: Tensor, grad: Tensor, usable: Tensor,
                 token: Any) -> None:
        """The call's input ``x`` (``[B, T, d_in]``, ``[B·T, d_in]`` or ``[B, d_in]``) and its
        output gradient ``grad`` (same leading shape) in pass ``rec``
        (`kfac_stream.capture.records.PassRecord`; per-pass state goes into
        ``rec.extensions[name]``), with the pass's usable rows ``usable`` (``[B·T]`` or
        ``[B]`` bool) and `keep_call`'s ``token``."""

    # -- each update step ------------------------------------------------------------------------

    def collect_pass(self, rec: Any, c: Any, acc: Any) -> Any:
        """Fold pass ``rec`` (its loss scale ``c``: a float or a 0-dim tensor) into ``acc``
        (None at the step's first pass) and return it. Device ops only."""
        return acc

    def add_update(self, step: int, acc: Any, ok: Tensor) -> None:
        """The update step's `collect_pass` result, with ``ok`` (0-dim device bool: the
        step's statistics are finite and its loss scales known). Device ops only."""

    # -- snapshots and checkpoints ---------------------------------------------------------------

    def export(self, step: int) -> ExtensionExport | None:
        """What snapshot ``step`` stores of this extension (collective with several ranks:
        every rank calls it at the same point), or None."""
        return None

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Tensor]] | None:
        """``(JSON meta, {name: CPU tensor})`` for a checkpoint (names ``<name>.*``), or None."""
        return None

    def load_state_dict(self, meta: Mapping[str, Any],
                        get: Callable[[str], Tensor | None]) -> None:
        """Restore a `state_dict` (``get(name)``: that tensor from whichever state file holds
        it, summed over ranks where ``summed_state`` says so; None: in none)."""


_REGISTRY: dict[str, type[TrackerExtension]] = {}


def register_extension(cls: type[TrackerExtension]) -> type[TrackerExtension]:
    """Register an extension class under its ``name`` (a decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a tracker extension needs a name")
    _REGISTRY[cls.name] = cls
    return cls


def unregister_extension(cls: type[TrackerExtension]) -> None:
    """Forget ``cls`` (tests register toy extensions for one run)."""
    if _REGISTRY.get(cls.name) is cls:
        del _REGISTRY[cls.name]


def extensions_for(config: KFACConfig) -> list[type[TrackerExtension]]:
    """The registered extension classes ``config`` enables, in registration order."""
    return [cls for cls in _REGISTRY.values() if cls.applies(config)]
