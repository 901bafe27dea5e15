"""Rows/partial statistics reach their owners exactly (2 and 3 gloo processes, uneven counts)."""

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kfac_stream.distributed.context import agree_with_rank0
from kfac_stream.distributed.exchange import (
    choose_strategy,
    exchange_to_owners,
    rows_bytes,
    stats_bytes,
)
from kfac_stream.distributed.ownership import assign_owners

DIMS = {"l0.A": (7, False), "l0.G": (5, False), "l1.A": (9, True), "l1.G": (300, False)}
COUNTS = {0: {"l0.A": 4, "l0.G": 4, "l1.A": 0, "l1.G": 2},  # a rank with zero rows for a key
          1: {"l0.A": 1, "l0.G": 1, "l1.A": 3, "l1.G": 6},
          2: {"l0.A": 6, "l0.G": 6, "l1.A": 2, "l1.G": 0}}


def local_rows(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    return {k: torch.randn(n, DIMS[k][0], generator=gen, dtype=torch.float64)
            for k, n in COUNTS[rank].items() if n > 0}


def _worker(rank, world, init_file, q):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        for strategy in ("rows", "stats", None):  # forced either way, then chosen per factor
            got = _check(rank, world, strategy)
        _check(rank, world, "rows", transport=torch.float16)
        own = assign_owners(DIMS, world, 8)
        skipped = exchange_to_owners(local_rows(rank), DIMS, own, rank, world, ok=rank != 1)
        assert not skipped.ok and not skipped.owned  # one rank's bad statistics skip all
        # a rank with no rows at all (all padding) still sends buffers of the others' dtype
        local = {} if rank == 1 else local_rows(rank)
        ex = exchange_to_owners(local, DIMS, own, rank, world, strategy="rows",
                                dtype=torch.float64)
        for key, (_, rows) in ex.owned.items():
            union = [local_rows(r)[key] for r in range(world) if r != 1 and key in local_rows(r)]
            assert torch.equal(rows, torch.cat(union)), key
        # the same without telling the empty rank the dtype: the others hold bf16 rows (a GPU
        # with 16-bit activations), the empty rank's own would be float32 (its row_dtype);
        # the wire dtype is agreed from the ranks holding rows (before: mismatched buffers)
        half = {k: v.to(torch.bfloat16) for k, v in local.items()}
        ex = exchange_to_owners(half, DIMS, own, rank, world, strategy="rows",
                                dtype=None if rank != 1 else torch.float32)
        for key, (_, rows) in ex.owned.items():
            union = [local_rows(r)[key].to(torch.bfloat16) for r in range(world)
                     if r != 1 and key in local_rows(r)]
            assert rows.dtype == torch.bfloat16 and torch.equal(rows, torch.cat(union)), key
        # a diagonal factor reduced on each rank (the tracker's hooks do that) arrives summed
        rows = local_rows(rank)
        partial = {"l1.A": rows["l1.A"].square().sum(0)} if "l1.A" in rows else {}
        ex = exchange_to_owners({k: v for k, v in rows.items() if k != "l1.A"}, DIMS, own, rank,
                                world, dtype=torch.float64, sums=partial,
                                weights={"l1.A": 2.5 * COUNTS[rank]["l1.A"]},
                                positions={"l1.A": COUNTS[rank]["l1.A"]})
        if own.owner["l1.A"] == rank:
            kind, (stat, n) = ex.owned["l1.A"]
            union = torch.cat([local_rows(r)["l1.A"] for r in range(world)
                               if "l1.A" in local_rows(r)])
            assert kind == "stats" and n == 2.5 * union.shape[0]
            assert torch.allclose(stat, union.square().sum(0), rtol=1e-13, atol=0)
        assert ex.positions["l1.A"] == sum(COUNTS[r]["l1.A"] for r in range(world))
        assert agree_with_rank0(f"run-dir-of-rank-{rank}") == "run-dir-of-rank-0"
        q.put((rank, sorted(got)))
    finally:
        dist.destroy_process_group()


def _check(rank, world, strategy, transport=None):
    own = assign_owners(DIMS, world, 8)
    ex = exchange_to_owners(local_rows(rank), DIMS, own, rank, world, strategy=strategy,
                            transport=transport)
    got = ex.owned
    assert ex.ok
    assert ex.totals == {k: sum(COUNTS[r][k] for r in range(world)) for k in DIMS}
    for key, (kind, payload) in got.items():
        assert own.owner[key] == rank
        union = torch.cat([local_rows(r)[key] for r in range(world) if key in local_rows(r)])
        d, diag = DIMS[key]
        want = union.square().sum(0) if diag else union.T @ union
        if kind == "rows":
            stat, n = (payload.square().sum(0) if diag else payload.T @ payload), payload.shape[0]
            if transport is None:
                assert torch.equal(payload, union), key  # rows arrive in rank order, exactly
            else:  # fp16 on the wire, power-of-two scaled: only fp16 rounding (2^-11 relative
                # to each rank's largest |entry|, as the exponent targets 2^13..2^14)
                for r in range(world):
                    if key in local_rows(r):
                        x = local_rows(r)[key]
                        lo = sum(COUNTS[q][key] for q in range(r))
                        err = (payload[lo:lo + x.shape[0]] - x).abs().max() / x.abs().max()
                        assert err <= 2.0**-11, (key, float(err))
        else:
            stat, n = payload
        assert n == union.shape[0], (key, n)
        # fp16 transport: each entry carries ≤ 2^-11 of its rank's max, so the Gram matrix
        # carries ≤ ~2^-10 of max|XᵀX| (two factors rounded)
        tol = 1e-13 if transport is None else 2.0**-10 * float(want.abs().max())
        assert torch.allclose(stat, want, rtol=0, atol=tol), (key, float((stat - want).abs().max()))
    return got


def _issue_worker(rank, world, init_file, q, fold_on="host"):
    """The factor updater with its worker thread (``async_updates``, the CUDA default): every
    collective of the exchange is issued by the thread that calls ``submit`` (the training
    thread), none by the worker, and the owner's factor is the union's statistic (folded on the
    host, or on the device path with CPU tensors standing in)."""
    import threading

    import kfac_stream.distributed.exchange as exchange
    from kfac_stream.config import KFACConfig
    from kfac_stream.distributed.context import DistContext
    from kfac_stream.store.folding import Folding
    from kfac_stream.tracking.factor_updates import Counters, FactorUpdater, UpdateJob
    from kfac_stream.tracking.plan import RunPlan

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    callers = []
    for name in ("all_gather", "all_to_all_single", "reduce"):
        real = getattr(exchange.dist, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            callers.append((_name, threading.current_thread().name))
            return _real(*args, **kwargs)

        setattr(exchange.dist, name, spy)
    try:
        cfg = KFACConfig(storage_dtype="float64", async_updates=True, ema_decay=1.0,
                         fold_on=fold_on)
        own = assign_owners(DIMS, world, 8)
        cpu = torch.device("cpu")
        settings = RunPlan.resolve(cfg, device=cpu)
        up = FactorUpdater(settings, DIMS, own, DistContext(rank, world, None, None), cpu,
                           Folding(settings.fold_on, cpu, torch.float64), Counters())
        rows = {k: v for k, v in local_rows(rank).items() if not DIMS[k][1]}
        sums = {k: v.square().sum(0) for k, v in local_rows(rank).items() if DIMS[k][1]}
        job = UpdateJob(0, rows, {k: torch.tensor(float(COUNTS[rank][k])) for k in DIMS
                                  if COUNTS[rank][k]},
                        {k: torch.tensor(COUNTS[rank][k]) for k in DIMS if COUNTS[rank][k]},
                        torch.tensor(True), sums=sums)
        up.submit(job, 0.0)
        up.close()
        assert callers and all(t == "MainThread" for _, t in callers), callers
        assert {n for n, _ in callers} >= {"all_gather", "all_to_all_single"}, callers
        values = up.store.values()
        for key in own.owned_by(rank):
            union = torch.cat([local_rows(r)[key] for r in range(world) if key in local_rows(r)])
            want = union.square().sum(0) if DIMS[key][1] else union.T @ union
            got = values[key]
            # float64 folds in another order: rounding of the largest entry only
            tol = 1e-13 * float(want.abs().max()) / union.shape[0]
            assert torch.allclose(got, want / union.shape[0], rtol=0, atol=tol), (
                key, float((got - want / union.shape[0]).abs().max()), float(got.abs().max()))
        q.put(rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fold_on", ["host", "device"])
def test_exchange_is_issued_by_the_submitting_thread(fold_on):
    _spawn(functools.partial(_issue_worker, fold_on=fold_on), 2)


def _spawn(target, world):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=target, args=(r, world, os.path.join(tmp, "init"), q))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [q.get() for _ in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_owner_receives_the_union_of_all_ranks(world):
    owned = dict(_spawn(_worker, world))
    got_keys = sorted(k for keys in owned.values() for k in keys)
    assert got_keys == sorted(k for k in DIMS if any(COUNTS[r][k] for r in range(world)))


def test_strategy_choice_by_bytes():
    # 5% of 2048 tokens on 2 ranks, d = 1024: rows move ~0.4 MB, statistics 4 MB
    assert rows_bytes([51, 51], 0, 1024, 4) == 51 * 1024 * 4
    assert stats_bytes(2, 1024, False, 4) == 1024 * 1024 * 4
    assert choose_strategy([51, 51], 0, 1024, False, 4) == "rows"
    assert choose_strategy([4096, 4096], 0, 64, False, 4) == "stats"  # many rows, narrow factor
    assert choose_strategy([4096, 4096], 0, 64, True, 4) == "stats"
