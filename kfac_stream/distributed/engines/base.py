"""`EngineAdapter`: what kfac_stream needs to know about a distributed training engine, and the
registry that picks the adapter of a model (`engine_for`).

An engine (DeepSpeed ZeRO-3, PyTorch FSDP2, ...) may hold each parameter's values across ranks
and gather them only inside its own forward and backward. Capture never needs to know: the
hooks see whole activations ``[B, T, d_in]`` and output gradients ``[B, T, d_out]`` on every
rank, and a layer's ``in_features`` / ``out_features`` are the global ones. Only code that reads
parameter *values* or *shapes* outside the forward asks the model's adapter:

- the weight fingerprint of a snapshot (`kfac_stream.snapshot.weights`): `gathered`,
  `full_tensor`, `full_numel`;
- layer shapes (`kfac_stream.capture.selection`): `full_shape`;
- queries, which refuse a sharded model (`kfac_stream.query.laplace`):
  `sharded_parameter_problem`;
- the MC gradient taken inside the training forward (`kfac_stream.tracking.tracker`):
  `allows_backward_in_forward`;
- the Trainer callback's warning when the launch asked for an engine that did not take the
  model (`kfac_stream.integrations.hf_callback`): `launch_not_applied`, through
  `engines_not_applied`;
- `kfac_stream.gather_model`, the whole copy of a sharded model after training: `is_sharded`,
  `whole_copy` and the hooks it names.

The default of every hook is what a plain model (one process, or DDP: every rank holds every
parameter whole) needs; `PlainEngine` (`kfac_stream.distributed.engines.ddp`) is that adapter
and the fallback of `engine_for`. A new engine is one subclass, registered with
`register_engine`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from contextlib import AbstractContextManager

from torch import Tensor, nn


class EngineAdapter:
    """The hooks kfac_stream asks of a distributed engine; each default is the plain model's.

    Attributes:
        name: The engine's name in messages (``"FSDP2"``, ``"ZeRO-3"``).
        whole_copy: How `kfac_stream.gather_model` reaches the whole weights of a sharded
            model: ``"state_dict"`` (`gather_full_state_dict` on every rank, then a fresh
            `unsharded_class` instance on the main process loads it) or ``"save"`` (the
            Trainer's own ``save_model`` gathers them into files, checked with
            `saved_weights_problem`, and the main process loads them with ``from_pretrained``).
        manual_copy_hint: How a user makes a whole copy of a sharded model that is no
            transformers ``PreTrainedModel`` (ends `gather_model`'s refusal).
        save_gather_hint: What makes the engine's ``save_model`` write whole weights
            (``whole_copy="save"`` only).
    """

    name = "plain"
    whole_copy = "state_dict"
    manual_copy_hint = ""
    save_gather_hint = ""

    def matches(self, model: nn.Module) -> bool:
        """True if this engine manages ``model`` (a whole model or any of its modules, e.g.
        one tracked layer): decided from its parameters (their type, or attributes the engine
        sets on them) or the engine's own global state. Never collective."""
        raise NotImplementedError

    # -- parameters -----------------------------------------------------------------------------

    def is_sharded_parameter(self, param: Tensor) -> bool:
        """True if this process holds only part of ``param``'s values."""
        return False

    def is_sharded(self, model: nn.Module) -> bool:
        """True if any parameter of ``model`` is sharded (`is_sharded_parameter`)."""
        return any(self.is_sharded_parameter(p) for p in model.parameters())

    def full_shape(self, param: Tensor) -> tuple[int, ...]:
        """The whole (global) shape of ``param``, without reading its values."""
        return tuple(param.shape)

    def full_numel(self, param: Tensor) -> int:
        """The number of values of the whole ``param``."""
        return int(param.numel())

    def gathered(self, params: Iterable[Tensor]) -> AbstractContextManager:
        """A context inside which `full_tensor` reads the whole values of ``params`` (read
        only; collective where the engine's gather is: every rank enters it at the same
        point with the same parameters)."""
        return contextlib.nullcontext()

    def full_tensor(self, param: Tensor) -> Tensor:
        """``param`` as a plain, whole tensor, inside `gathered` (may be collective)."""
        return param

    # -- queries and training -------------------------------------------------------------------

    def sharded_parameter_problem(self, where: str, name: str, param: Tensor) -> str | None:
        """Why a query (``where``, e.g. ``"LaplacePosterior"``) cannot read the parameter
        ``name`` of the model in this process, with what to do instead; None if it can."""
        return None

    def allows_backward_in_forward(self, model: nn.Module) -> bool:
        """True if a second backward may run inside the training forward of ``model`` (the
        MC gradient taken in the forward, `kfac_stream.tracking.tracker.Tracker`)."""
        return True

    def launch_not_applied(self, model: nn.Module) -> str | None:
        """The warning to log when the launch asked for this engine (e.g. accelerate's
        environment) and yet it does not manage ``model``; None otherwise. Asked of every
        registered adapter (`engines_not_applied`), matching or not."""
        return None

    # -- gather_model ------------------------------------------------------------------------------

    def unsharded_class(self, model: nn.Module) -> type:
        """The class of a plain model that can hold ``model``'s whole weights."""
        return type(model)

    def gather_full_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """``model``'s whole state dict on the main process (collective under a sharding
        engine: every rank calls it; the others may receive an empty dict)."""
        return model.state_dict()

    def saved_weights_problem(self, save_dir: str) -> str | None:
        """What is wrong with the weights the engine's ``save_model`` wrote to ``save_dir``
        (``whole_copy="save"``; completes ``"trainer.save_model(dir) ..."``), or None."""
        return None

    def before_local_load(self) -> None:
        """Called on the main process before it builds the whole copy outside the engine:
        undo global engine state that would shard a model built now."""


_ENGINES: list[EngineAdapter] = []  # asked in this order
_FALLBACK: list[EngineAdapter] = []  # the adapter of a model no engine matches


def register_engine(adapter_cls: type[EngineAdapter], *, fallback: bool = False
                    ) -> type[EngineAdapter]:
    """Register an engine adapter class (usable as a decorator); `engine_for` asks the most
    recently registered first, so an adapter can take over models a built-in one matches.
    ``fallback=True``: the adapter of every model no registered engine matches instead (the
    package's is `PlainEngine`: one process or DDP)."""
    if fallback:
        _FALLBACK[:] = [adapter_cls()]
        return adapter_cls
    unregister_engine(adapter_cls)
    _ENGINES.insert(0, adapter_cls())
    return adapter_cls


def unregister_engine(adapter_cls: type[EngineAdapter]) -> None:
    """Remove ``adapter_cls`` from the registry (nothing if it is not registered)."""
    _ENGINES[:] = [e for e in _ENGINES if type(e) is not adapter_cls]


def registered_engines() -> list[EngineAdapter]:
    """The registered adapters, in the order `engine_for` asks them (the fallback not
    included)."""
    return list(_ENGINES)


def engine_for(model: nn.Module) -> EngineAdapter:
    """The adapter of the first registered engine that `matches` ``model`` (a model or one of
    its modules), else the fallback adapter (`PlainEngine`: nothing to gather)."""
    for engine in _ENGINES:
        if engine.matches(model):
            return engine
    return _FALLBACK[0] if _FALLBACK else EngineAdapter()


def engines_not_applied(model: nn.Module) -> list[str]:
    """The warnings of registered engines the launch asked for that do not manage ``model``
    (`EngineAdapter.launch_not_applied`), in registry order."""
    return [m for m in (e.launch_not_applied(model) for e in _ENGINES) if m is not None]
