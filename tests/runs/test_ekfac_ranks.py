"""EK-FAC (``KFACConfig(ekfac=True)``) on several ranks, carried by checkpoints and counted in
the device budget (`kfac_stream.ekfac`, `kfac_stream.ekfac.sync`).

The runs are ``tests/support/dist_job.py`` through the real launchers, as in
tests/runs/test_distributed.py: 2 ranks × batch 2 (DeepSpeed ZeRO-3, FSDP2, DDP; gloo on CPU)
against 1 process × batch 4 over the same global batches, sequential data, SGD, rank 1's first
micro-batch all padding; float64 storage, snapshots every 2 steps on the training thread
(``--sync-snapshots``: the basis goes into use at the same step as in one process; the background
path is checked apart).

Tolerances:
* ``RANKS_TOL = 1e-6`` (relative Frobenius per layer and snapshot, as
  tests/runs/test_distributed.py's ``EXACT_TOL``): storage, eigendecompositions and the
  correction's sums are float64, where the order of summation over ranks moves ~1e-16; what is
  left is the float32 training itself (the engines reduce gradients in another order than one
  process sums them: weights ~1e-7 apart after the first step, and both the basis and the
  per-sequence gradients follow them). Measured ≤ 4.3e-7 (ZeRO-3 and FSDP2).
* Resume: bit for bit (``torch.equal``), one process and 2 DDP ranks.

Slow (``make test-slow``): the 2-rank resume and the background-snapshot run (five more
2-process launches, ~5 minutes on 2 cores).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from shared_runs import session_dir
from test_distributed import Runs
from transformers import Trainer, TrainerCallback, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, Snapshot
from kfac_stream.exceptions import KFACConfigError

from models import ListDataset, text_examples, tiny_gpt2, tiny_llama

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (`make test` installs it with --no-build-isolation)")

RANKS_TOL = 1e-6
PAD = ["--pad-rows", "2,3"]
EK = ["--ekfac", "--storage-dtype", "float64", *PAD]
SYNC = [*EK, "--steps", "5", "--snapshot-every", "2", "--sync-snapshots"]
# resume: snapshots at 3 and 6 (and the end), checkpoint at 5 between them
RESUME = [*EK, "--snapshot-every", "3", "--sync-snapshots", "--save-steps", "5"]


class EkfacRuns(Runs):
    SPECS = {
        "ref": (None, ["--batch", "4", *SYNC]),
        "zero3": ("cpu_zero3", SYNC),
        "fsdp2": ("cpu_fsdp2", SYNC),
        # background snapshots (the default): the basis switched where every rank agreed
        "zero3_background": ("cpu_zero3", [*EK, "--steps", "9", "--snapshot-every", "3"]),
        "one_whole": (None, ["--batch", "4", *RESUME, "--steps", "7"]),
        "one_cut": (None, ["--batch", "4", *RESUME, "--steps", "5"]),
        "one_resumed": (None, ["--batch", "4", *RESUME, "--steps", "7", "--resume",
                               "@one_cut/checkpoint-5"]),
        "ddp_whole": ("cpu_ddp", [*RESUME, "--steps", "7"]),
        "ddp_cut": ("cpu_ddp", [*RESUME, "--steps", "5"]),
        "ddp_resumed": ("cpu_ddp", [*RESUME, "--steps", "7", "--resume",
                                    "@ddp_cut/checkpoint-5"]),
        # a state without EK-FAC (what checkpoints written before it hold)
        "plain_cut": (None, ["--batch", "4", "--storage-dtype", "float64", *PAD, "--steps",
                             "2", "--save-steps", "2"]),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return EkfacRuns(session_dir(tmp_path_factory, "dist_ekfac"))


def snapshots(out: str) -> dict[int, Snapshot]:
    root = os.path.join(out, "kfac")
    return {int(e.split("-")[1]): Snapshot.load(os.path.join(root, e))
            for e in sorted(os.listdir(root)) if e.startswith("step-") and "." not in e}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("engine", ["zero3", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_two_ranks_store_what_one_process_stores(runs, engine):
    """Each rank accumulates on its own sequences, the sums meet on each layer's G owner,
    every rank gets every factor's basis from its owner: the snapshots' ``λ`` (and their
    windows) are one process's."""
    got, want = snapshots(runs.get(engine)), snapshots(runs.get("ref"))
    assert sorted(got) == sorted(want) == [2, 4, 5]
    worst, carried = 0.0, 0
    for step, snap in want.items():
        for name in snap.layer_names:
            a, b = got[step][name], snap[name]
            if b.ekfac_eigvals is None:
                assert step == 2 and a.ekfac_eigvals is None
                continue
            assert a.entry.ekfac == b.entry.ekfac
            assert a.entry.ekfac.basis_step == {4: 2, 5: 4}[step]
            worst = max(worst, rel(a.ekfac_eigvals, b.ekfac_eigvals))
            carried += 1
    shards = {got[4][n].entry.G.shard for n in got[4].layer_names}
    print(f"{engine}: EK-FAC eigenvalues vs 1 process, max rel err {worst:.2e} over "
          f"{carried} layer-snapshots, stored in {len(shards)} shards")
    assert carried == 2 * len(want[2].layer_names)
    assert len(shards) == 2  # each layer's correction in its G owner's shard, both ranks own
    assert worst <= RANKS_TOL


@pytest.mark.slow
def test_background_snapshots_switch_where_every_rank_agreed(runs):
    """Snapshots finished on the snapshot thread: each rank's basis arrives at its own time;
    it goes into use at the update step after the exchange table shows it on both ranks, so
    every layer's correction is over one window of steps on the snapshot before it."""
    snaps = snapshots(runs.get("zero3_background"))
    assert sorted(snaps) == [3, 6, 9]
    carried = 0
    for prev, step in ((3, 6), (6, 9)):
        entries = [snaps[step][n].entry.ekfac for n in snaps[step].layer_names]
        if entries[0] is None:
            assert all(e is None for e in entries)
            continue
        carried += 1
        assert all(e == entries[0] for e in entries)
        e = entries[0]
        assert e.basis_step == prev <= e.first_step <= e.last_step < step
        assert e.updates == e.last_step - e.first_step + 1
    assert carried >= 1


@pytest.mark.parametrize("kind", [pytest.param("one", marks=pytest.mark.slow),
                                  pytest.param("ddp", marks=pytest.mark.slow)])
def test_resume_between_snapshots_is_bit_exact(runs, kind):
    """Killed at step 5 (checkpoint) between the snapshots of steps 3 and 6 and resumed: the
    basis in use, the accumulators and the window's counts come back, and the snapshot of
    step 6 stores the uninterrupted run's ``λ`` bit for bit (each rank its own accumulators;
    every factor's eigenvectors from its owner's file)."""
    whole, resumed = (snapshots(runs.get(f"{kind}_{r}")) for r in ("whole", "resumed"))
    a, b = whole[6], resumed[6]
    for name in a.layer_names:
        assert a[name].ekfac_eigvals is not None, name
        assert torch.equal(a[name].ekfac_eigvals, b[name].ekfac_eigvals), name
        assert a[name].entry.ekfac == b[name].entry.ekfac and \
            a[name].entry.ekfac.first_step < 5  # the window spans the checkpoint
    assert "restored" in open(os.path.join(runs.get(f"{kind}_resumed"), "log.txt")).read()


def test_a_state_without_ekfac_loads_and_the_correction_restarts(runs):
    """An older checkpoint (no EK-FAC state) into a tracker with ``ekfac=True``: it loads,
    and the correction starts over (no basis)."""
    from kfac_stream.capture.selection import select_layers
    from kfac_stream.tracking.tracker import Tracker
    from kfac_stream.tracking.tracker_state import load_tracker_state

    model = tiny_gpt2(torch.float32, n_embd=32, n_layer=2, n_head=2, attn_implementation="eager")
    specs = select_layers(model)
    tracker = Tracker(model, {n: model.get_submodule(n) for n in specs}, specs,
                      KFACConfig(storage_dtype="float64", ekfac=True))
    try:
        msg = load_tracker_state(tracker, os.path.join(runs.get("plain_cut"), "checkpoint-2",
                                                       "kfac_stream"))
        assert "restored" in msg and tracker.counters.updates == 2
        ek = tracker.extension("ekfac").state
        assert ek.basis_step is None and not ek.num
        assert ek.ready_step() == -1
    finally:
        tracker.close()


@pytest.mark.slow
def test_resume_with_another_world_size_sums_onto_rank_0(runs):
    """The 2-rank checkpoint restored into one process: both ranks' accumulators summed (the
    one-process run's own, to the float32 training's difference), the window's counts and
    a basis for every layer from the owners' files."""
    from kfac_stream.capture.selection import select_layers
    from kfac_stream.tracking.tracker import Tracker
    from kfac_stream.tracking.tracker_state import load_tracker_state

    model = tiny_gpt2(torch.float32, n_embd=32, n_layer=2, n_head=2, attn_implementation="eager")
    specs = select_layers(model)
    got = {}
    for name in ("ddp_cut", "one_cut"):
        tracker = Tracker(model, {n: model.get_submodule(n) for n in specs}, specs,
                          KFACConfig(storage_dtype="float64", ekfac=True))
        try:
            msg = load_tracker_state(tracker, os.path.join(runs.get(name), "checkpoint-5",
                                                           "kfac_stream"))
            ek = tracker.extension("ekfac").state
            assert ek.basis_step == 3 and ek.updates == 2 and set(ek.num) == set(specs)
            assert all(q is not None for pair in ek.basis.values() for q in pair)
            got[name] = ({n: t.clone() for n, t in ek.num.items()},
                         {n: float(t) for n, t in ek.den.items()}, msg)
        finally:
            tracker.close()
    (two, two_den, msg), (one, one_den, _) = got["ddp_cut"], got["one_cut"]
    assert "re-sharded from 2 to 1 ranks" in msg and two_den == one_den
    worst = max(rel(two[n], one[n]) for n in specs)
    print(f"2-rank EK-FAC accumulators summed onto 1 process vs its own: max rel {worst:.2e}")
    assert worst <= RANKS_TOL


class _Held(TrainerCallback):
    """Records the EK-FAC state's device bytes at the end of every step (after its update)."""

    def __init__(self, kfac):
        self.kfac, self.held = kfac, []

    def on_step_end(self, args, state, control, **kwargs):
        ek = self.kfac.tracker.extension("ekfac").state
        self.held.append((ek.basis_step, len(ek.num), ek.device_bytes()))


@pytest.mark.parametrize("model_fn,extra", [
    (tiny_gpt2, {}),
    # q/k/v and gate/up share an A (one basis tensor each); sides > 20 are diagonal
    (tiny_llama, {"max_dense_dim": 20}),
], ids=["gpt2", "llama-shared-diagonal"])
def test_counted_device_bytes_are_the_bytes_held(tmp_path, caplog, model_fn, extra):
    """What the tracker counts in the device budget (`ekfac_device_bytes`) is what the state
    holds once a basis is in use and every layer has accumulated: the sum of its tensors'
    bytes, each once; the train-begin line says it."""
    cb = KFACStreamCallback(KFACConfig(token_fraction=1.0, storage_dtype="float32",
                                       update_every=1, snapshot_every=3, ekfac=True, **extra),
                            background_snapshots=False, spectra_media=False)
    held = _Held(cb)
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, max_steps=5,
                             learning_rate=0.0, report_to=[], use_cpu=True,
                             logging_strategy="no", save_strategy="no", disable_tqdm=True,
                             seed=0)
    with caplog.at_level("INFO", logger="kfac_stream"):
        Trainer(model=model_fn(), args=args, train_dataset=ListDataset(text_examples(8, 12)),
                callbacks=[cb, held]).train()
    counted = cb.tracker.extension("ekfac").bytes
    layers = len(cb.tracker.specs)
    assert any(diag for _, diag in cb.tracker.dims.values()) == bool(extra)
    in_use = [h for h in held.held if h[0] is not None and h[1] == layers]
    assert in_use, held.held
    print(f"{model_fn.__name__}: EK-FAC device bytes counted {counted['total']} "
          f"({counted['basis']} basis, {counted['accumulators']} accumulators), held "
          f"{sorted({h[2] for h in in_use})}")
    assert {h[2] for h in in_use} == {counted["total"]}
    line = next(r.message for r in caplog.records if "kfac_stream: tracking" in r.message)
    assert f"EK-FAC {counted['total'] / 2**10:.3g} KiB on the model's device" in line


def test_an_explicit_budget_too_small_is_refused():
    """A device fold whose explicit budget cannot hold the EK-FAC state is refused with its
    numbers (an ``"auto"`` budget decided later keeps nothing resident instead, logged)."""
    from kfac_stream.tracking.tracker import Tracker, plan_tracking

    model = tiny_gpt2()
    cfg = KFACConfig(ekfac=True, fold_on="device", device_memory_budget=1000)
    specs, plan = plan_tracking(model, cfg)
    modules = dict(model.named_modules())
    with pytest.raises(KFACConfigError, match=r"holds \d+ bytes .* device_memory_budget=1000"):
        Tracker(model, {n: modules[n] for n in specs}, specs, cfg, None, plan)
    assert not getattr(model, "_kfac_stream_handles", None)


def test_the_reserve_comes_before_resident_statistics(caplog):
    """`Residency` plans the pending statistics in what the EK-FAC reserve leaves."""
    from kfac_stream.store.residency import Residency
    from kfac_stream.store.stored_factor import StoredFactor
    from kfac_stream.store.traffic import Traffic

    def plan(budget, reserved):
        factors = {"big": StoredFactor(torch.zeros(20, 20)),
                   "small": StoredFactor(torch.zeros(10, 10))}
        r = Residency(factors, torch.device("cpu"), budget, torch.float32, Traffic(),
                      reserved)
        r.plan()
        return {k: f.resident for k, f in factors.items()}, r

    _, r = plan(0, 0)
    work = r.work_space()
    both = work + 4 * (400 + 100)
    assert plan(both, 0)[0] == {"big": True, "small": True}
    assert plan(both, 4 * 400)[0] == {"big": False, "small": True}
    with caplog.at_level("WARNING", logger="kfac_stream"):
        assert plan(both, both)[0] == {"big": False, "small": False}
    assert "cannot hold the EK-FAC bases" in caplog.text
