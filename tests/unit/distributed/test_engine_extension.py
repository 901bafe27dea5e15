"""A distributed engine is one `EngineAdapter` subclass: registered, it is picked by
`engine_for` for the models it matches, and the library reads their weights through its hooks
(the snapshot's weight fingerprint through its gather, a layer's shape through its
``full_shape``); a plain model gets the fallback adapter.

The toy engine below shards like DeepSpeed ZeRO-3: each parameter keeps an empty placeholder
and its whole values live elsewhere (here in a ``toy_full`` attribute) until gathered.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from kfac_stream.capture.selection import layer_spec
from kfac_stream.distributed.engines import (
    EngineAdapter,
    PlainEngine,
    engine_for,
    register_engine,
    registered_engines,
    unregister_engine,
)
from kfac_stream.snapshot.weights import compare_weights, weights_fingerprint


class ToyShardEngine(EngineAdapter):
    """Parameters with a ``toy_full`` attribute hold an empty placeholder; `gathered` puts the
    whole values in for the block and records which parameters it gathered."""

    name = "toy"

    def __init__(self) -> None:
        self.gathers: list[list[tuple[int, ...]]] = []

    def matches(self, model: nn.Module) -> bool:
        return any(hasattr(p, "toy_full") for p in model.parameters())

    def is_sharded_parameter(self, param) -> bool:
        return hasattr(param, "toy_full")

    def full_shape(self, param) -> tuple[int, ...]:
        return tuple(param.toy_full.shape) if hasattr(param, "toy_full") else tuple(param.shape)

    def full_numel(self, param) -> int:
        return param.toy_full.numel() if hasattr(param, "toy_full") else param.numel()

    @contextlib.contextmanager
    def gathered(self, params):
        parts = [p for p in params if hasattr(p, "toy_full")]
        self.gathers.append([tuple(p.toy_full.shape) for p in parts])
        for p in parts:
            p.data = p.toy_full
        try:
            yield
        finally:
            for p in parts:
                p.data = torch.empty(0, dtype=p.dtype)


def _shard(model: nn.Module) -> nn.Module:
    """``model`` as the toy engine holds it: every parameter an empty placeholder."""
    for p in model.parameters():
        p.toy_full = p.data.clone()
        p.data = torch.empty(0, dtype=p.dtype)
    return model


@pytest.fixture
def toy_engine():
    register_engine(ToyShardEngine)
    try:
        yield
    finally:
        unregister_engine(ToyShardEngine)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 4))


def test_registered_engine_is_picked_and_plain_model_falls_back(toy_engine):
    sharded, plain = _shard(_mlp()), _mlp()
    engine = engine_for(sharded)
    assert isinstance(engine, ToyShardEngine)
    assert isinstance(registered_engines()[0], ToyShardEngine)  # the newest is asked first
    assert engine.is_sharded(sharded) and not engine.is_sharded(plain)
    assert isinstance(engine_for(sharded[0]), ToyShardEngine)  # one layer of it, too
    assert isinstance(engine_for(plain), PlainEngine)
    assert not engine_for(plain).is_sharded(plain)


def test_unregistered_engine_is_no_longer_asked():
    register_engine(ToyShardEngine)
    unregister_engine(ToyShardEngine)
    assert not any(isinstance(e, ToyShardEngine) for e in registered_engines())
    assert isinstance(engine_for(_shard(_mlp())), PlainEngine)


def test_weight_fingerprint_reads_sharded_weights_through_the_engine_gather(toy_engine):
    whole = _mlp()
    layers = {"0": whole[0], "2": whole[2]}
    want = weights_fingerprint(layers)
    sharded = _shard(_mlp())
    parts = {"0": sharded[0], "2": sharded[2]}
    engine = engine_for(sharded)
    got = weights_fingerprint(parts)
    # one gather per layer, of its weight alone, released after the read
    assert engine.gathers == [[(300, 8)], [(4, 300)]]
    assert all(m.weight.numel() == 0 for m in parts.values())
    assert got["0"]["numel"] == 2400 and got["2"]["numel"] == 1200  # whole, not the placeholder
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-12)
    assert compare_weights(want, parts) == []
    with torch.no_grad():
        sharded[2].weight.toy_full[0, 0] += 1.0  # a moved weight is told apart
    assert [d.split()[0] for d in compare_weights(want, parts)] == ["2"]


def test_layer_shape_of_a_sharded_conv1d_comes_from_the_engine(toy_engine):
    conv = Conv1D(6, 5)  # weight [d_in=5, d_out=6]
    _shard(conv)
    assert conv.weight.shape == (0,)
    spec = layer_spec("c", conv)
    assert (spec.d_in, spec.d_out, spec.has_bias) == (5, 6, True)
