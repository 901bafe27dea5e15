"""The sampling-error figures come from quantities kept as the updates arrive:
the sketch ``F Z`` rides along with the EMA (``(1-η)·FZ + η·S Z``, the update's own sketch)
and ``‖F‖²_F`` is computed by the fold that writes the factor. A snapshot's export then makes
no pass over the factors' entries for them. Checked against the definitions computed from the
exact (float64) factor and its probes, on the host and the device path (CPU standing in).
"""

import dataclasses
import math

import pytest
import torch

import kfac_stream.store.factor_store as fs
from kfac_stream.store.factor_store import FactorStore, probes

CPU = torch.device("cpu")


def _store(path: str, storage: str, decay: float) -> FactorStore:
    if path == "device":
        return FactorStore(storage, decay, device=CPU, device_budget=1 << 30)
    return FactorStore(storage, decay, flush_every=3)


def _feed(store, path, d, count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    stats = []
    for i in range(count):
        m = 3 + i % 4
        x = torch.randn(m, d, generator=gen, dtype=torch.float64) * (1 + i % 3)
        x = x.to(torch.float64 if store.storage_dtype == torch.float64 else torch.float32)
        if path == "device":
            store.push_device("f", x, "rows", m, m)
            store.end_update()
        else:
            store.push_rows("f", x, m)
        stats.append((x.double().T @ x.double() / m, m))
    return stats


@pytest.mark.parametrize("path", ["host", "device"])
def test_kept_sketch_gives_the_defined_spread_and_norm(path):
    """float64 storage: ``spread = Q/w − ‖F Z‖²/p`` and ``‖F‖²_F`` from the kept quantities
    equal their definitions on the exact factor to float64 rounding."""
    d, decay = 40, 0.9  # d > 4·PROBES: Gaussian probes, not the identity
    store = _store(path, "float64", decay)
    store.add("f", d, False)
    _feed(store, path, d, 11)
    st = store.state_dict()["f"]
    F = st.value()
    z = probes("f", d)
    want_spread = st.sq_norm_sum / st.weight - float((F @ z).square().sum()) / z.shape[1]
    assert st.spread == pytest.approx(want_spread, rel=1e-10)
    assert st.sq_frob == pytest.approx(float(F.square().sum()), rel=1e-12)
    assert torch.allclose(st.sketch, F @ z, rtol=1e-12, atol=0)


@pytest.mark.parametrize("path", ["host", "device"])
def test_fp16_norm_is_that_of_the_stored_factor(path, monkeypatch):
    """FP16 storage: ``‖F‖²`` is the stored (rounded) factor's, from the values the fold
    wrote (several chunks on the device path); the spread's sketch is the exact EMA's, so the
    spread is never negative by rounding."""
    from kfac_stream.store import fold_cost

    monkeypatch.setattr(fold_cost, "CHUNK_ENTRIES", 40 * 9)  # 5 chunks per flush
    d = 40
    store = _store(path, "float16", 0.95)
    store.add("f", d, False)
    _feed(store, path, d, 13, seed=1)
    st = store.state_dict()["f"]
    assert st.sq_frob == pytest.approx(float(st.value().double().square().sum()), rel=1e-12)
    assert st.spread > 0
    rel_se, k_eff = st.sampling_error()
    assert math.isfinite(rel_se) and k_eff > 1


def test_export_makes_no_pass_over_the_entries(monkeypatch):
    """With the kept quantities, `state_dict` and `sampling_error` never call the chunked
    entry pass (`_sq_norm`)."""
    store = _store("device", "float16", 0.9)
    store.add("f", 40, False)
    store.add("g", 50, True)
    _feed(store, "device", 40, 5)
    store.push_device("g", torch.rand(50) * 4, "stats", 4, 4)
    store.flush()

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass over the factor's entries at export")

    monkeypatch.setattr(fs, "_sq_norm", no_pass)
    states = store.state_dict()
    for st in states.values():
        st.sampling_error()


def test_checkpoint_round_trip_keeps_the_figures():
    """A state with the sketch restores the same spread, ‖F‖² and sampling error; a dense
    factor's state with updates but no sketch is refused."""
    d = 36
    a = _store("host", "float64", 0.8)
    a.add("f", d, False)
    _feed(a, "host", d, 7, seed=2)
    st = a.state_dict()["f"]
    b = _store("device", "float64", 0.8)
    b.add("f", d, False)
    b.load_state_dict({"f": st})
    back = b.state_dict()["f"]
    assert back.spread == pytest.approx(st.spread, rel=1e-9)
    assert back.sq_frob == pytest.approx(st.sq_frob, rel=1e-12)
    assert back.sampling_error()[0] == pytest.approx(st.sampling_error()[0], rel=1e-9)
    with pytest.raises(ValueError, match="no sketch"):
        b.load_state_dict({"f": dataclasses.replace(st, sketch=None)})
