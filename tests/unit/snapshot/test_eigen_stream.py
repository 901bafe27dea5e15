"""The snapshot's eigendecompositions streamed into the shard as it is written
(`kfac_stream.snapshot.eigen_stream`): the same file as decomposing everything first, the
producer never more than ``ahead`` factors ahead of the writer, errors and early stops."""

import hashlib
import io
import time

import pytest
import torch
from safetensors.torch import load
from test_snapshot_eigh import _shard, add_eigendecompositions

from kfac_stream.snapshot.eigen_stream import EigendecompositionError, EigenStream
from kfac_stream.snapshot.writer import Deferred, write_safetensors
from kfac_stream.stats import spectrum


def _write(tensors) -> bytes:
    buf = io.BytesIO()
    digest, size = write_safetensors(buf, tensors)
    data = buf.getvalue()
    assert size == len(data) and digest == hashlib.sha256(data).hexdigest()
    return data


@pytest.mark.parametrize("storage", ["float16", "float64"])
def test_streamed_shard_is_the_eagerly_decomposed_one(storage):
    eager_t, eager_m = _shard(storage)
    add_eigendecompositions(eager_t, eager_m, threads=1)
    tensors, manifest = _shard(storage)
    stream = EigenStream(tensors, manifest, threads=1)
    assert any(isinstance(v, Deferred) for v in tensors.values())
    try:
        data = _write(tensors)
    finally:
        stream.close()
    assert data == _write(eager_t)  # byte for byte, and the header promised the right shapes
    assert manifest == eager_m  # every spectrum filled in, a shared A's in both layers
    assert manifest["layers"]["l1"]["A"]["spectrum"] == manifest["layers"]["l0"]["A"]["spectrum"]
    assert set(stream.eigvals) == {"l0.A", "l0.G", "l1.G", "l2.A", "l2.G"}
    loaded = load(data)
    for key, w in stream.eigvals.items():
        assert torch.equal(loaded[f"{key}.eigvals"], w)
    assert "l1.G.eigvecs" not in loaded  # diagonal: eigenvalues only


@pytest.mark.parametrize("ahead", [1, 2])
def test_producer_stays_at_most_ahead_factors_ahead_of_the_writer(monkeypatch, ahead):
    """Host memory: decomposed-and-unwritten results never exceed ``ahead + 1`` factors
    (``ahead`` queued, one waiting to be queued), however many factors the shard holds."""
    events = []  # "eigh" (producer, after a decomposition) / "take" (writer, a new factor)
    real = spectrum.safe_psd_eigh

    def counted(f):
        out = real(f)
        events.append("eigh")
        return out

    monkeypatch.setattr(spectrum, "safe_psd_eigh", counted)
    tensors, manifest = _shard()
    stream = EigenStream(tensors, manifest, threads=1, ahead=ahead)
    for name, t in list(tensors.items()):
        if isinstance(t, Deferred) and name.endswith(".eigvals"):
            def get(t=t):
                events.append("take")
                time.sleep(0.05)  # a slow disk: the producer runs as far ahead as it may
                return t.get()
            tensors[name] = Deferred(t.dtype, t.shape, get)
    try:
        _write(tensors)
    finally:
        stream.close()
    assert events.count("eigh") == 5 and events.count("take") == 5
    eighs = takes = 0
    worst = 0
    for e in events:
        eighs, takes = eighs + (e == "eigh"), takes + (e == "take")
        worst = max(worst, eighs - takes)
    assert worst <= ahead + 1, events
    assert worst >= 1  # the producer did run ahead of the writer (the overlap)


def test_writer_blocks_the_producer_beyond_ahead(monkeypatch):
    done = []
    real = spectrum.safe_psd_eigh

    def counted(f):
        done.append(1)
        return real(f)

    monkeypatch.setattr(spectrum, "safe_psd_eigh", counted)
    tensors, manifest = _shard()
    stream = EigenStream(tensors, manifest, threads=1, ahead=1)
    first = next(t for t in tensors.values() if isinstance(t, Deferred))
    try:
        first.get()  # starts the producer; the writer then stalls
        time.sleep(0.5)
        # one taken, one in the queue (ahead=1), one decomposed and waiting to be queued
        assert len(done) == 3, done
    finally:
        stream.close()
    assert not stream._thread.is_alive()


def test_a_failed_decomposition_reaches_the_writer(monkeypatch):
    def broken(f):
        raise torch.linalg.LinAlgError("simulated")

    monkeypatch.setattr(spectrum, "safe_psd_eigh", broken)
    tensors, manifest = _shard()
    stream = EigenStream(tensors, manifest, threads=1)
    try:
        with pytest.raises(EigendecompositionError, match="eigendecomposition failed"):
            _write(tensors)
    finally:
        stream.close()


def test_close_stops_a_producer_the_writer_abandoned():
    threads = torch.get_num_threads()
    tensors, manifest = _shard()
    stream = EigenStream(tensors, manifest, threads=threads + 1, ahead=1)
    next(t for t in tensors.values() if isinstance(t, Deferred)).get()
    stream.close()  # the writer failed after one tensor (e.g. a full disk)
    assert not stream._thread.is_alive()
    assert stream._ready == {}
    assert torch.get_num_threads() == threads  # the decompositions' threads given back
