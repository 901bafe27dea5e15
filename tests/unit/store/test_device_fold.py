"""The store's device path with CPU tensors standing in for the accelerator.

Pending statistics accumulate on the "device" (`FactorStore.push_device`) and reach the FP16
host store only through the streamed flush (`device_fold.stream_fold`). Checked against the
float64 closed-form EMA, against the host path (`push_rows` / `update`), and by the store's
own counters (`Traffic`): in steady state an update touches no host entry, moves no byte to
the host and reads nothing; a flush issues two copies per chunk and one host read.
"""

import math

import pytest
import torch

from kfac_stream.stats.ema import ema_closed_form
from kfac_stream.store import fold_cost
from kfac_stream.store.device_fold import RENORM
from kfac_stream.store.factor_store import FactorStore

CPU = torch.device("cpu")
# FP16 storage within 1e-3 relative Frobenius error of a float32 EMA
FP16_BUDGET = 1e-3


def rel(x, ref):
    return float(torch.linalg.norm((x - ref).double()) / torch.linalg.norm(ref.double()))


def _updates(count, d, seed=0, dtype=torch.float64, outlier=1.0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        m = int(torch.randint(1, 9, (1,), generator=gen))
        x = torch.randn(m, d, generator=gen, dtype=torch.float64)
        x[:, 0] *= outlier
        w = torch.rand(m, generator=gen, dtype=torch.float64) + 0.5  # sampling weights
        out.append((x * w.sqrt()[:, None], float(w.sum())))
    return [(x.to(dtype), n) for x, n in out]


@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("decay", [0.0, 0.5, 0.95, 1.0])
def test_device_path_equals_float64_closed_form(decay, diagonal):
    """float64 storage: the resident pending sum (lazy scale, fused addmm_) and one flush at
    the end reproduce the closed-form EMA to float64 rounding."""
    d = 7
    store = FactorStore("float64", decay, device=CPU, device_budget=1 << 30)
    store.add("f", d, diagonal)
    stats, counts = [], []
    for i, (x, n) in enumerate(_updates(30, d)):
        s = x.T @ x
        stats.append((s.diagonal() if diagonal else s) / n)
        counts.append(n)
        if diagonal:
            store.push_device("f", s.diagonal().clone(), "stats", n, x.shape[0])
        elif i % 3 == 0:  # both payloads: rows and an exchanged summed statistic
            store.push_device("f", s.clone(), "stats", n, x.shape[0])
        else:
            store.push_device("f", x, "rows", n, x.shape[0])
        store.end_update()
    assert store.pending_updates("f") == 30  # resident: nothing folded before the reader
    ref = ema_closed_form(stats, counts, decay)
    assert rel(store.values()["f"], ref) <= 1e-13
    assert store.pending_updates("f") == 0
    st = store.state_dict()["f"]
    assert st.updates == 30 and st.weight == pytest.approx(
        sum(n * decay ** (29 - k) for k, n in enumerate(counts)))


def test_long_run_renormalises_the_lazy_scale():
    """Past ``s < RENORM`` (hundreds of updates at λ = 0.95) the pending sum is rescaled once
    and stays exact; nothing overflows."""
    decay, d = 0.95, 5
    store = FactorStore("float64", decay, device=CPU, device_budget=1 << 30)
    store.add("f", d, False)
    ups = _updates(700, d, seed=3)
    for x, n in ups:
        store.push_device("f", x, "rows", n, x.shape[0])
    # s has crossed RENORM at least once: (1-η) ≈ λ in steady state
    assert decay ** 700 < RENORM
    assert store._factors["f"].device.s >= RENORM
    ref = ema_closed_form([x.T @ x / n for x, n in ups], [n for _, n in ups], decay)
    assert rel(store.values()["f"], ref) <= 1e-12


@pytest.mark.parametrize("decay", [0.95, 1.0])
def test_fp16_device_path_equals_host_path_within_fp16_rounding(decay, monkeypatch):
    """FP16 storage, activations with outliers (|a| up to 1e4): the device path (a flush
    every 7 updates, several chunks per factor) and the host path are both within the
    FP16 budget (1e-3 relative Frobenius) of the float64 EMA, and within two fp16 roundings of
    each other."""
    monkeypatch.setattr(fold_cost, "CHUNK_ENTRIES", 48 * 13)  # d=48: 13 rows a chunk, 4 chunks
    d = 48
    dev = FactorStore("float16", decay, device=CPU, device_budget=1 << 30)
    host = FactorStore("float16", decay)
    for s in (dev, host):
        s.add("f", d, False)
    ups = _updates(100, d, seed=4, dtype=torch.float32, outlier=1e4)
    for i, (x, n) in enumerate(ups):
        dev.push_device("f", x, "rows", n, x.shape[0])
        dev.end_update()
        host.push_rows("f", x, n)
        if i % 7 == 6:
            dev.flush()
    ref = ema_closed_form([x.double().T @ x.double() / n for x, n in ups],
                          [n for _, n in ups], decay)
    got_dev, got_host = dev.values()["f"], host.values()["f"]
    assert rel(got_dev, ref) <= FP16_BUDGET
    assert rel(got_host, ref) <= FP16_BUDGET
    assert rel(got_dev, got_host) <= 2 * 2.0**-11  # one fp16 rounding per path
    # symmetric to the rounding of one fp16 value (sym(P) is symmetric; F rounds once)
    assert rel(got_dev, got_dev.T) <= 2.0**-11
    assert dev.traffic.flush_chunks == 15 * 4 and dev.traffic.flush_copies == 2 * 15 * 4


def test_restart_drops_what_is_pending():
    """The final window's restart (``decay=0``) makes the factor that update's statistic,
    whatever was pending on the device or folded before."""
    store = FactorStore("float64", 0.9, device=CPU, device_budget=1 << 30)
    store.add("f", 4, False)
    ups = _updates(6, 4, seed=5)
    for x, n in ups[:3]:
        store.push_device("f", x, "rows", n, x.shape[0])
    store.flush()
    for x, n in ups[3:5]:
        store.push_device("f", x, "rows", n, x.shape[0])
    x, n = ups[5]
    store.push_device("f", x, "rows", n, x.shape[0], decay=0.0)
    assert torch.allclose(store.values()["f"], x.T @ x / n, rtol=1e-13, atol=0)


def test_steady_state_update_touches_nothing_on_the_host():
    """Resident factors: updates cost device folds only (0 host entries, 0 bytes either way,
    0 host reads by flushes); the reader's flush moves each factor once each way in chunks
    (two copies a chunk) with one host read for all of them."""
    dims = {"a": (40, False), "g": (24, False), "diag": (300, True)}
    store = FactorStore("float16", 0.95, device=CPU, device_budget=1 << 30)
    for k, (d, g) in dims.items():
        store.add(k, d, g)
    for x, n in _updates(12, 40, seed=6, dtype=torch.float32):
        store.push_device("a", x, "rows", n, x.shape[0])
        store.push_device("g", x[:, :24], "rows", n, x.shape[0])
        store.push_device("diag", torch.rand(300) * n, "stats", n, x.shape[0])
        store.end_update()
    t = store.traffic
    assert t.device_folds == 36 and t.fold_flops > 0
    assert (t.host_entries, t.bytes_to_host, t.bytes_to_device, t.flush_syncs,
            t.flush_copies, t.budget_flushes) == (0, 0, 0, 0, 0, 0)
    assert t.resident_bytes == 4 * (40 * 40 + 24 * 24 + 300)
    store.flush()
    chunks = sum(fold_cost.flush_chunks(d, g) for d, g in dims.values())
    assert t.flush_chunks == chunks and t.flush_copies == 2 * chunks
    assert t.bytes_to_host == t.bytes_to_device == 2 * (40 * 40 + 24 * 24 + 300)
    assert (t.flushes, t.flush_syncs, t.factor_flushes, t.host_entries) == (1, 1, 3, 0)
    store.flush()  # nothing pending: nothing moves
    assert t.flushes == 1 and t.bytes_to_host == 2 * (40 * 40 + 24 * 24 + 300)


def test_budget_plans_residency_largest_first_and_flushes_the_rest_each_update():
    """A budget that holds the large factor only: the small ones fold into the host store at
    every update (streamed, one host read per update), the large one stays pending."""
    store = FactorStore("float32", 0.9, device=CPU, device_budget=0)
    store.add("big", 30, False)
    store.add("small", 10, False)
    store.device_budget = store._work_space() + 8 * 30 * 30  # float64 pending (float32 store)
    store._planned = False
    assert store.is_resident("big") and not store.is_resident("small")
    ups = _updates(5, 30, seed=7)
    for x, n in ups:
        store.push_device("big", x, "rows", n, x.shape[0])
        store.push_device("small", x[:, :10], "rows", n, x.shape[0])
        store.end_update()
    t = store.traffic
    assert t.budget_flushes == 5 and t.flush_syncs == 5 and t.host_entries == 0
    assert t.bytes_to_host == 5 * 4 * 10 * 10
    assert store.pending_updates("big") == 5 and store.pending_updates("small") == 0
    ref_small = ema_closed_form([x[:, :10].T @ x[:, :10] / n for x, n in ups],
                                [n for _, n in ups], 0.9)
    assert rel(store.values()["small"], ref_small) <= 1e-6  # float32 storage


def test_live_traces_include_pending_statistics():
    """Monitoring between snapshots (`traces`, no flush) sees every applied update: equal to
    the trace of the flushed factor within fp16 rounding."""
    store = FactorStore("float16", 0.95, device=CPU, device_budget=1 << 30)
    store.add("f", 16, False)
    for x, n in _updates(9, 16, seed=8, dtype=torch.float32):
        store.push_device("f", x, "rows", n, x.shape[0])
        store.end_update()
    live = store.traces()["f"]
    exact = float(store.values()["f"].diagonal().double().sum())
    assert live == pytest.approx(exact, rel=2.0**-10)
    assert store.traces()["f"] == pytest.approx(exact, rel=1e-6)


def test_out_of_memory_moves_pending_to_host_and_halves_budget(monkeypatch, caplog):
    """An out-of-memory error while accumulating folds everything pending into the host
    store, halves the budget and goes on (the update is not lost)."""
    import kfac_stream.store.factor_store as fs

    store = FactorStore("float64", 0.9, device=CPU, device_budget=1 << 20)
    store.add("f", 6, False)
    ups = _updates(4, 6, seed=9)
    real = fs.accumulate
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(fs, "accumulate", flaky)
    with caplog.at_level("WARNING", logger="kfac_stream"):
        for x, n in ups:
            store.push_device("f", x, "rows", n, x.shape[0])
    assert store.device_budget == (1 << 20) // 2
    assert any("ran out of memory" in r.getMessage() for r in caplog.records)
    ref = ema_closed_form([x.T @ x / n for x, n in ups], [n for _, n in ups], 0.9)
    assert rel(store.values()["f"], ref) <= 1e-13


def test_auto_budget_rule():
    from kfac_stream.store.device_budget import device_budget_from_memory

    gib = 2**30
    # H200 and the 1.1B run of the first GPU check: 141 GB, 31.1 GB peak → a quarter (35 GB)
    assert device_budget_from_memory(141 * gib, 31 * gib) == int(0.25 * 141 * gib)
    # a nearly full device leaves half of what is free
    assert device_budget_from_memory(80 * gib, 70 * gib) == 5 * gib
    assert device_budget_from_memory(80 * gib, 90 * gib) == 0
    assert math.isclose(device_budget_from_memory(0, 0), 0)


def test_fused_16bit_probe_says_no_where_the_kernel_is_missing():
    """The tensor-core ``addmm`` with float32 output exists on CUDA only: the probe catches
    the CPU build's NotImplementedError and the mm + add fold is used (`is_fused`)."""
    from kfac_stream.store import device_fold

    assert device_fold.fused_16bit(CPU) is False
    rows = torch.zeros(3, 4, dtype=torch.bfloat16)
    assert device_fold.is_fused(rows, torch.zeros(4, 4))  # not CUDA: cast and addmm_


def test_a_lent_state_is_the_store_itself_and_stays_unchanged_until_released():
    """A snapshot's state (``lend``) holds the stored tensors, no copy: the flush writes each
    entry once (two copies per chunk, the stored bytes once each way). Until released, every
    write to a lent factor goes elsewhere: a device flush streams from the lent tensor into a
    new one (no host copy), a host fold copies first; the lent values never change. Released,
    a factor still stored there is written in place again, and a tensor the store moved off
    becomes its spare (reused: no new allocation). Values equal a store that never lent."""
    def fill(store, seed, n_updates=3):
        for x, n in _updates(n_updates, 12, seed=seed, dtype=torch.float32):
            store.push_device("a", x, "rows", n, x.shape[0])
            store.push_device("b", torch.rand(30, generator=torch.Generator().manual_seed(
                seed)) * n, "stats", n, x.shape[0])

    def make():
        s = FactorStore("float16", 0.9, device=CPU, device_budget=1 << 30)
        s.add("a", 12, False)
        s.add("b", 30, True)
        s.add("c", 5, False)  # never updated: lent as it is
        return s

    store, plain = make(), make()  # plain: the same flushes, copies instead of lending
    fill(store, 11)
    fill(plain, 11)
    plain.state_dict()
    copies, to_host = store.traffic.flush_copies, store.traffic.bytes_to_host
    lent = store.state_dict(lend=True)
    assert store.traffic.flush_copies - copies == 2 * 2  # a and b: one chunk each, H2D + D2H
    assert store.traffic.bytes_to_host - to_host == 2 * 12 * 12 + 2 * 30
    held = {k: st.data for k, st in lent.items()}
    before = {k: t.clone() for k, t in held.items()}
    assert all(held[k] is store._factors[k].data for k in held)  # no copy
    assert all(store._factors[k].lent for k in held)

    fill(store, 12, 2)  # a checkpoint's flush while the snapshot is in flight
    fill(plain, 12, 2)
    mid = store.state_dict()
    assert all(torch.equal(held[k], before[k]) for k in held)  # the snapshot's values
    assert store._factors["a"].data is not held["a"] and store._factors["b"].data is not held["b"]
    assert store._factors["c"].data is held["c"] and store._factors["c"].lent  # not written
    expect = plain.state_dict()
    for k in held:
        assert torch.equal(mid[k].data, expect[k].data) and mid[k].scale == expect[k].scale

    store.release(held)
    assert store._factors["a"].spare is held["a"] and not store._factors["c"].lent
    second = store.state_dict(lend=True)
    plain.state_dict()
    fill(store, 13, 1)
    fill(plain, 13, 1)
    store.flush()  # a is lent again: written into its spare, the first snapshot's tensor
    assert store._factors["a"].data is held["a"]
    assert all(torch.equal(second[k].data, mid[k].data) for k in held)
    final, ref = store.state_dict(), plain.state_dict()
    for k in held:
        assert torch.equal(final[k].data, ref[k].data)

    # a host fold (in place) of a lent factor copies it first
    host = FactorStore("float16", 0.9)
    host.add("h", 6, False)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    host.push_rows("h", x, 4)
    kept = host.state_dict(lend=True)["h"].data
    snapshot_values = kept.clone()
    host.push_rows("h", x, 4)
    host.flush()
    assert torch.equal(kept, snapshot_values) and host._factors["h"].data is not kept
