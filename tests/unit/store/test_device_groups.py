"""The device path's fold batched by shape (`FactorStore.push_group`), CPU tensors standing in
for the accelerator.

Each member of a group must end exactly where it would on its own: the float64 closed-form
EMA of its statistics, and field for field the state `push_device` gives one factor at a time
(the sketch ``F Z``, its norm sum, the EMA weight and counts). The group's device ops do not
grow with the number of members.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kfac_stream.stats.ema import ema_closed_form
from kfac_stream.store.factor_store import FactorStore

CPU = torch.device("cpu")


def rel(x, ref):
    return float(torch.linalg.norm((x - ref).double()) / torch.linalg.norm(ref.double()))


def _stacks(count, g, d, seed=0):
    """``count`` updates of ``g`` members: ``([G, m, d] weighted rows, n)``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        m = int(torch.randint(1, 9, (1,), generator=gen))
        x = torch.randn(g, m, d, generator=gen, dtype=torch.float64)
        w = torch.rand(m, generator=gen, dtype=torch.float64) + 0.5
        out.append((x * w.sqrt()[None, :, None], float(w.sum())))
    return out


def _pair(storage="float64", decay=0.9, g=3, d=6):
    """Two stores with the same ``g`` factors: one for `push_group`, one for `push_device`."""
    stores = [FactorStore(storage, decay, device=CPU, device_budget=1 << 30) for _ in range(2)]
    keys = tuple(f"l{i}.A" for i in range(g))
    for s in stores:
        for k in keys:
            s.add(k, d, False)
    return stores, keys


def _same_state(a: FactorStore, b: FactorStore, tol: float, spread_tol: float = 1e-9) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        x, y = sa[k], sb[k]
        assert rel(x.data.double() * x.scale, y.data.double() * y.scale) <= tol, k
        assert rel(x.sketch, y.sketch) <= tol, k
        assert x.sq_norm_sum == pytest.approx(y.sq_norm_sum, rel=tol), k
        assert (x.weight, x.updates, x.positions) == pytest.approx(
            (y.weight, y.updates, y.positions), rel=1e-15), k
        assert x.spread == pytest.approx(y.spread, rel=spread_tol, abs=1e-12), k


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.95, 1.0])
def test_group_equals_float64_closed_form_and_one_factor_at_a_time(decay):
    (grouped, single), keys = _pair(decay=decay)
    stats = collections.defaultdict(list)
    counts = []
    for x, n in _stacks(25, len(keys), 6):
        grouped.push_group(keys, x, n, x.shape[1])
        for i, k in enumerate(keys):
            single.push_device(k, x[i], "rows", n, x.shape[1])
            stats[k].append(x[i].T @ x[i] / n)
        counts.append(n)
        grouped.end_update()
        single.end_update()
    assert grouped.traces() == pytest.approx(single.traces(), rel=1e-12)
    assert all(grouped.pending_updates(k) == 25 for k in keys)  # resident until read
    values = grouped.values()
    for k in keys:
        assert rel(values[k], ema_closed_form(stats[k], counts, decay)) <= 1e-13
    # float64 rounding of the same sums taken in another order (batched GEMMs, fused adds)
    _same_state(grouped, single, 1e-12)


def test_diverged_members_flushes_loads_and_restarts_stay_exact():
    """A member updated on its own (its coefficients then differ from the others': the
    vector path), a flush in the middle (the norm sums read to the host and linked again), a
    load, and the window's restart (``decay=0``): still the per-factor result."""
    (grouped, single), keys = _pair(decay=0.9)
    updates = _stacks(24, len(keys), 6, seed=1)
    for step, (x, n) in enumerate(updates):
        if step == 5:  # member 1 alone: its EMA weight and lazy scale leave the others'
            for s in (grouped, single):
                s.push_device(keys[1], x[1], "rows", n, x.shape[1])
                s.end_update()
            continue
        if step == 9:
            _same_state(grouped, single, 1e-12)  # a flush and a read in the middle
        if step == 14:
            state = single.state_dict()
            for s in (grouped, single):
                s.load_state_dict(state)
        decay = 0.0 if step == 18 else None
        grouped.push_group(keys, x, n, x.shape[1], decay)
        for i, k in enumerate(keys):
            single.push_device(k, x[i], "rows", n, x.shape[1], decay)
        grouped.end_update()
        single.end_update()
    _same_state(grouped, single, 1e-12)


def test_fp16_group_equals_one_factor_at_a_time_within_fp16_rounding():
    (grouped, single), keys = _pair(storage="float16", g=4, d=40)  # d > 32: Gaussian probes
    for x, n in _stacks(12, len(keys), 40, seed=2):
        x = x.float()
        grouped.push_group(keys, x, n, x.shape[1])
        for i, k in enumerate(keys):
            single.push_device(k, x[i], "rows", n, x.shape[1])
    # the same float32 sums in another order, rounded once to float16 (2^-11 relative); the
    # spread is a difference of two float32 sketch sums (1e-7 relative each)
    _same_state(grouped, single, 2e-3, spread_tol=1e-6)


def test_a_member_off_the_device_folds_on_its_own():
    """A budget that holds only some members: the group is folded one factor at a time, with
    the same values."""
    (grouped, single), keys = _pair(g=3, d=6)
    grouped.device_budget = single.device_budget = grouped._work_space() + 2 * 36 * 8
    for x, n in _stacks(6, len(keys), 6, seed=3):
        grouped.push_group(keys, x, n, x.shape[1])
        for i, k in enumerate(keys):
            single.push_device(k, x[i], "rows", n, x.shape[1])
        grouped.end_update()
        single.end_update()
    assert sum(grouped.is_resident(k) for k in keys) == 2
    assert not grouped._grouped.groups
    _same_state(grouped, single, 1e-12)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _steady_ops(g: int) -> int:
    (store, _), keys = _pair(storage="float16", g=g, d=40)
    updates = _stacks(3, g, 40, seed=4)
    for x, _ in updates[:2]:  # the first update makes the group
        store.push_group(keys, x.float(), 1.0, 1)
        store.end_update()
    x, n = updates[2]
    with _Ops() as ops:
        store.push_group(keys, x.float(), n, x.shape[1])
        store.end_update()
    return ops.n


def test_a_group_update_takes_the_same_ops_for_any_number_of_members():
    few, many = _steady_ops(2), _steady_ops(24)
    assert few == many <= 24, (few, many)


@pytest.mark.parametrize("defer", [2, 3, 8])
def test_deferred_gram_equals_the_closed_form_and_the_undeferred_fold(defer):
    """Rows of up to ``defer`` updates held and folded in one GEMM: the float64 closed-form
    EMA, and the undeferred group's state, with a member updated on its own, a flush, the
    window's restart and a load in between (each of which folds what is held first)."""
    (held, undeferred), keys = _pair(decay=0.8)
    held.defer = defer
    stats = collections.defaultdict(list)
    counts = []
    for step, (x, n) in enumerate(_stacks(23, len(keys), 6, seed=5)):
        if step == 4:  # member 2 alone
            for s in (held, undeferred):
                s.push_device(keys[2], x[2], "rows", n, x.shape[1])
                s.end_update()
            continue
        if step == 13:
            _same_state(held, undeferred, 1e-12)
        if step == 16:
            state = undeferred.state_dict()
            for s in (held, undeferred):
                s.load_state_dict(state)
        decay = 0.0 if step == 10 else None
        for s in (held, undeferred):
            s.push_group(keys, x, n, x.shape[1], decay)
            s.end_update()
        assert held.traces() == pytest.approx(undeferred.traces(), rel=1e-12)
        if step >= 10:  # from the restart on: the closed form of these updates alone
            for i, k in enumerate(keys):
                stats[k].append(x[i].T @ x[i] / n)
            counts.append(n)
    assert held.traffic.deferred_folds > 0
    values = held.values()
    for k in keys:
        # the restart at step 10 drops all before it; decay 0.8 after it
        assert rel(values[k], ema_closed_form(stats[k], counts, 0.8)) <= 1e-13
    _same_state(held, undeferred, 1e-12)


def test_held_rows_stay_inside_the_device_budget():
    (store, _), keys = _pair(g=2, d=6)
    store.defer = 8
    # the resident sums and work space fit; one update's rows [2, m, 6] float64 do not
    store.device_budget = store._work_space() + 2 * 36 * 8 + 16
    for x, n in _stacks(5, len(keys), 6, seed=6):
        store.push_group(keys, x, n, x.shape[1])
        assert not store._grouped.groups[keys].held  # folded at once: no room to hold them


#: bf16 rows on CUDA, deferred: the reference is the float64 EMA of the rows as rounded to
#: bf16; left are the fp16 storage rounding (2^-11), the held rows' rescaling in bf16 (≤ 2^-9
#: per entry, so ≤ 2·2^-9 on a Gram entry when every error has one sign: a loose bound) and
#: the tensor cores' fp32 accumulation (1.8e-5 measured, gpu-check)
CUDA_BF16_TOL = 2.0**-11 + 2 * 2.0**-9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_group_deferred_equals_the_float64_ema_of_the_rounded_rows():
    dev = torch.device("cuda")
    store = FactorStore("float16", 0.9, device=dev, device_budget=1 << 30, defer=4)
    keys = tuple(f"l{i}.G" for i in range(3))
    for k in keys:
        store.add(k, 256, False)
    stats = collections.defaultdict(list)
    counts = []
    for x, n in _stacks(10, len(keys), 256, seed=7):
        rows = x.to(device=dev, dtype=torch.bfloat16)
        store.push_group(keys, rows, n, x.shape[1])
        store.end_update()
        for i, k in enumerate(keys):
            r = rows[i].double().cpu()
            stats[k].append(r.T @ r / n)
        counts.append(n)
    assert store.traffic.deferred_folds > 0 and store.traffic.group_folds == 10
    values = store.values()
    for k in keys:
        ref = ema_closed_form(stats[k], counts, 0.9)
        assert rel(values[k].cpu(), ref) <= CUDA_BF16_TOL, k
