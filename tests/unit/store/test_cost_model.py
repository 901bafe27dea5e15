"""The cost model's formulas equal the tracker's counters on a real run.

A real ``Trainer`` run of a tiny Llama on the device path (CPU tensors standing in for the
accelerator) counts what its store did (`Traffic` in the tracker's counters); `store.cost_model`
predicts the same fields from the layer shapes, the rows one update folds and the number of
updates and flushes. With ``token_fraction=1`` and no padding the rows of an update are known
in advance (``batch · seq · accumulation``), so prediction and count must agree exactly.
"""

import pytest

from kfac_stream.store.cost_model import ADDITIVE, add, flush_cost, held_fold_cost, update_cost
from kfac_stream.store.traffic import Traffic
from kfac_stream.tracking.plan import FOLD_DEFER

from harness import run
from models import text_examples, tiny_llama

BATCH, SEQ, ACCUM, STEPS, EVERY = 2, 12, 2, 6, 2


def _predicted(cb, resident: bool) -> Traffic:
    tr = cb.tracker
    owned = {k: tr.dims[k] for k in tr.store.keys()}
    rows = dict.fromkeys(owned, BATCH * SEQ * ACCUM)  # every position of the update, no padding
    updates = -(-STEPS // EVERY)
    per_update = update_cost(owned, rows, resident=dict.fromkeys(owned, resident),
                             itemsize=2, in_bytes=4, acc_bytes=4, fused=True,
                             defer=FOLD_DEFER)
    total = add(Traffic(), per_update, updates)
    if resident:  # the held rows fold every FOLD_DEFER updates and at the end-of-training
        # snapshot's flush, which then flushes every factor once
        add(total, held_fold_cost(owned, acc_bytes=4), -(-updates // FOLD_DEFER))
        add(total, flush_cost(owned, itemsize=2))
    return total


@pytest.mark.parametrize("budget", ["auto", 0], ids=["resident", "budget-0"])
def test_cost_formulas_equal_the_counters_of_a_real_run(tmp_path, budget):
    ex = text_examples(STEPS * BATCH * ACCUM, SEQ)
    cfg = {"fold_on": "device", "device_memory_budget": budget, "storage_dtype": "float16",
           "ema_decay": 0.95, "update_every": EVERY, "async_updates": True}
    cb, _, _ = run(tiny_llama(), ex, cfg, batch=BATCH, accum=ACCUM, steps=STEPS,
                   tmp_path=tmp_path, record=False)
    counted = cb.tracker.read_counters()
    assert counted.updates == -(-STEPS // EVERY)
    want = _predicted(cb, resident=budget == "auto")
    got = {name: getattr(counted, name) for name in ADDITIVE}
    assert got == {name: getattr(want, name) for name in ADDITIVE}
    # the device path's steady state: nothing on the host but the flushes' copies
    assert counted.host_entries == 0
    if budget == "auto":
        assert counted.flushes == 1 and counted.budget_flushes == 0
        assert counted.device_budget > 0 and counted.peak_resident_bytes > 0
    else:
        assert counted.flushes == counted.updates  # one host read per update, not per factor
        assert counted.budget_flushes == counted.updates * len(cb.tracker.store.keys())


def test_host_path_counts_its_host_folds(tmp_path):
    """The host path (CPU training's default) touches every entry of a factor at each of its
    folds: counted, and 0 device folds."""
    ex = text_examples(4 * BATCH, SEQ)
    cfg = {"fold_on": "host", "storage_dtype": "float16", "update_every": 1}
    cb, _, _ = run(tiny_llama(), ex, cfg, batch=BATCH, steps=4, tmp_path=tmp_path,
                   record=False)
    c = cb.tracker.read_counters()
    assert c.device_folds == 0 and c.bytes_to_host == 0 and c.host_entries > 0
