"""Distributed training engines behind one extension point (`EngineAdapter`, `engine_for`).

Code that reads parameter values or shapes outside the forward asks ``engine_for(model)``
instead of testing for an engine itself. Built in, asked in this order: FSDP2
(`fsdp2.FSDP2Engine`), DeepSpeed ZeRO-3 (`deepspeed.DeepSpeedZero3`); every other model (one
process, DDP, ZeRO-1/2) gets `ddp.PlainEngine`. A new engine is one `EngineAdapter` subclass
in a module of this package, imported here and registered with `register_engine`.
"""

from .base import (
    EngineAdapter,
    engine_for,
    engines_not_applied,
    register_engine,
    registered_engines,
    unregister_engine,
)
from .ddp import PlainEngine
from .deepspeed import DeepSpeedZero3
from .fsdp2 import FSDP2Engine

register_engine(PlainEngine, fallback=True)
register_engine(DeepSpeedZero3)
register_engine(FSDP2Engine)  # the last registered is asked first

__all__ = [
    "DeepSpeedZero3",
    "EngineAdapter",
    "FSDP2Engine",
    "PlainEngine",
    "engine_for",
    "engines_not_applied",
    "register_engine",
    "registered_engines",
    "unregister_engine",
]
