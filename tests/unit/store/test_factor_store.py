"""The EMA rule and the CPU factor store against closed forms and a float32/float64 EMA."""

import pytest
import torch

from kfac_stream.stats.ema import ema_closed_form, ema_step
from kfac_stream.store.factor_store import FactorStore

# FP16 budget: relative Frobenius error against a float32 EMA over 100 updates.
FP16_BUDGET = 1e-3


def rel(x, ref):
    return float(torch.linalg.norm((x - ref).double()) / torch.linalg.norm(ref.double()))


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.95, 1.0])
@pytest.mark.parametrize("path", ["update", "rows"])
@pytest.mark.parametrize("diagonal", [False, True])
def test_ema_matches_closed_form_float64(decay, path, diagonal):
    gen = torch.Generator().manual_seed(0)
    store = FactorStore("float64", decay, flush_every=5)  # 12 updates: folds of 5, 5 and 2
    store.add("f", 6, diagonal=diagonal)
    stats, counts = [], []
    for _ in range(12):
        n = int(torch.randint(1, 5, (1,), generator=gen))  # < d rows: only flush_every folds
        x = torch.randn(n, 6, generator=gen, dtype=torch.float64)
        s = x.T @ x / n
        stats.append(s.diagonal().clone() if diagonal else s)
        counts.append(n)
        if path == "update":
            store.update("f", stats[-1], n)
        else:
            store.push_rows("f", x)
    ref = ema_closed_form(stats, counts, decay)
    assert rel(store.values()["f"], ref) <= 1e-13
    assert store.state_dict()["f"].positions == sum(counts)
    assert store.pending_updates("f") == 0


def test_first_update_is_the_statistic_no_startup_bias():
    store = FactorStore("float64", 0.95)
    store.add("f", 4, diagonal=False)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    s = x.T @ x / 5
    store.update("f", s, 7)
    assert torch.equal(store.state_dict()["f"].value(), s)


def test_ema_weight_recursion():
    w, eta = ema_step(0.0, 10, 0.9)
    assert (w, eta) == (10.0, 1.0)
    w, eta = ema_step(w, 5, 0.9)
    assert w == pytest.approx(14.0) and eta == pytest.approx(5 / 14)


@pytest.mark.parametrize("decay", [0.95, 0.99, 1.0])
def test_fp16_store_within_budget_after_100_updates(decay):
    gen = torch.Generator().manual_seed(2)
    d = 64
    fp16, fp32 = FactorStore("float16", decay), FactorStore("float32", decay)
    for s in (fp16, fp32):
        s.add("f", d, diagonal=False)
    base = torch.randn(d, d, generator=gen, dtype=torch.float64)
    for k in range(100):
        # a slowly drifting statistic plus sampling noise, like real factors
        x = torch.randn(40, d, generator=gen, dtype=torch.float64) @ (base * (1 + 0.01 * k))
        fp16.push_rows("f", x.float())  # the tracker's path: rows, folded every few updates
        fp32.update("f", (x.T @ x / 40).float(), 40)  # reference: a float32 EMA, per update
    err = rel(fp16.state_dict()["f"].value(), fp32.state_dict()["f"].value())
    print(f"decay={decay}: fp16 vs fp32 relative Frobenius error after 100 updates = {err:.2e}")
    assert err <= FP16_BUDGET
    assert fp16.state_dict()["f"].data.dtype == torch.float16


def test_fp16_outlier_activations_do_not_overflow():
    # |a| up to 1e4 gives second moments up to 1e8, beyond fp16's 65504 without the scale.
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(32, 16, generator=gen)
    a[:, 3] = 1e4
    a[5, 7] = -1e4
    stat = a.T @ a / 32
    store = FactorStore("float16", 0.95)
    store.add("f", 16, diagonal=False)
    store.add("d", 16, diagonal=True)
    for _ in range(5):
        store.update("f", stat, 32)
        store.update("d", stat.diagonal().clone(), 32)
    v, dv = store.state_dict()["f"].value(), store.state_dict()["d"].value()
    assert torch.isfinite(v).all() and torch.isfinite(dv).all()
    assert float(v.abs().max()) == pytest.approx(1e8, rel=1e-3)
    assert rel(v, stat) <= FP16_BUDGET
    assert rel(dv, stat.diagonal()) <= FP16_BUDGET


def test_dense_fold_is_exactly_symmetric_and_matches_full_product():
    # The fold computes only the upper triangle (half the flops) and mirrors it.
    gen = torch.Generator().manual_seed(4)
    d = 1100  # several CHUNK_ROWS blocks, last one partial
    fp64 = FactorStore("float64", 0.9)
    fp16 = FactorStore("float16", 0.9)
    for s in (fp64, fp16):
        s.add("f", d, diagonal=False)
    stats, counts = [], []
    for _ in range(3):
        x = torch.randn(30, d, generator=gen, dtype=torch.float64)
        fp64.push_rows("f", x)
        fp16.push_rows("f", x.float())
        stats.append(x.T @ x / 30)
        counts.append(30)
    v64, v16 = fp64.values()["f"], fp16.values()["f"]
    assert torch.equal(v64, v64.T) and torch.equal(v16, v16.T)
    assert rel(v64, ema_closed_form(stats, counts, 0.9)) <= 1e-13
    assert rel(v16, v64) <= FP16_BUDGET


def test_outlier_activations_end_to_end_fp16(tmp_path):
    # Real LLMs carry activation outliers of ~1e4 in a few channels: A entries of ~1e8.
    from harness import run
    from models import text_examples, tiny_gpt2

    model = tiny_gpt2(torch.float32)

    def outlier(module, args):
        x = args[0].clone()
        x[..., 5] = 1e4
        return (x,)

    model.get_submodule("transformer.h.0.mlp.c_proj").register_forward_pre_hook(outlier)
    fp16, _, _ = run(model, text_examples(4, 12), {"storage_dtype": "float16"}, batch=2,
                     lr=0.0, tmp_path=tmp_path / "a", record=False)
    ref, _, _ = run(model, text_examples(4, 12), {"storage_dtype": "float64"}, batch=2,
                    lr=0.0, tmp_path=tmp_path / "b", record=False)
    A16 = fp16.factors()["transformer.h.0.mlp.c_proj"][0]
    A64 = ref.factors()["transformer.h.0.mlp.c_proj"][0]
    assert torch.isfinite(A16).all()
    assert float(A16[5, 5]) == pytest.approx(1e8, rel=1e-3)
    assert rel(A16, A64) <= FP16_BUDGET
    for A, G in fp16.factors().values():
        assert torch.isfinite(A).all() and torch.isfinite(G).all()


def test_live_trace_read_mid_fold_is_the_last_completed_one(monkeypatch):
    """``traces()`` is read on the training thread while the worker folds: a read between two
    chunks of a fold (the first chunk written, the scale not yet updated) must give the trace
    of the last completed fold, not a mix of new entries and the old scale."""
    gen = torch.Generator().manual_seed(0)
    store = FactorStore("float16", 0.5, flush_every=1)
    store.add("f", 300, diagonal=False)  # 3 chunks of CHUNK_ROWS = 128 rows
    x = torch.randn(400, 300, generator=gen)
    store.push_rows("f", x)  # first fold
    f = store._factors["f"]
    done = float(f.data.diagonal().double().sum()) * f.scale
    assert store.traces()["f"] == done
    seen, real = [], torch.addmm

    def addmm(*args, **kwargs):  # called once per chunk, after the previous chunk's write
        seen.append(store.traces()["f"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", addmm)
    store.push_rows("f", 1e3 * x)  # the scale changes by ~2^20 in this fold
    monkeypatch.setattr(torch, "addmm", real)
    assert len(seen) == 3 and seen == [done] * 3, (seen, done)
    after = float(f.data.diagonal().double().sum()) * f.scale
    assert store.traces()["f"] == after and after > 1e5 * done
