"""EK-FAC from the stream (``KFACConfig(ekfac=True)``, `kfac_stream.ekfac`).

The reference shares nothing with the tracker but the snapshots' eigenvectors: per-sequence
gradients by autograd on the layers' PARAMETERS (one backward per sequence, Conv1D weights
transposed into ``W̄ = [W b]``), rotated into the previous snapshot's eigenbasis, squared,
summed and divided by the same sequences' usable positions, in float64.
"""

from __future__ import annotations

import hashlib
import json
import math
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from kfac_stream import KFACConfig, Snapshot
from kfac_stream.ekfac import (
    correction_flops,
    correction_order,
    sequence_correction,
)
from kfac_stream.exceptions import KFACConfigError

from harness import run
from models import text_examples, tiny_gpt2, tiny_llama
from reference import moved_into_basis

EXACT_TOL = 1e-9  # float64 end to end
LENGTHS = [12, 9, 12, 7, 10, 12]  # padding in most batches


def _params(model, names):
    modules = dict(model.named_modules())
    out = []
    for n in names:
        m = modules[n]
        out.append(m.weight)
        if getattr(m, "bias", None) is not None:
            out.append(m.bias)
    return out


def _grads(model, names, loss):
    """``{layer: [d_out, d_A]}`` float64 gradient of ``loss`` w.r.t. ``W̄ = [W b]``."""
    modules = dict(model.named_modules())
    params = _params(model, names)
    for p in params:
        p.requires_grad_(True)
    grads = iter(torch.autograd.grad(loss, params, allow_unused=True))
    out = {}
    for n in names:
        m = modules[n]
        w = next(grads)
        w = torch.zeros_like(m.weight) if w is None else w
        w = w.T if type(m).__name__ == "Conv1D" else w
        if getattr(m, "bias", None) is not None:
            b = next(grads)
            w = torch.cat([w, (torch.zeros(w.shape[0], dtype=w.dtype) if b is None
                               else b)[:, None]], dim=1)
        out[n] = w.double()
    return out


def _sum_nll(model, ids, mask, labels):
    """One sequence's loss: the SUM of its token NLLs (labels -100: none)."""
    logits = model(input_ids=ids[None], attention_mask=mask[None]).logits[0]
    return F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")


def _rotated_sq(model, names, snap, ids, mask, labels):
    g = _grads(model, names, _sum_nll(model, ids, mask, labels))
    out = {}
    for n in names:
        qa, qg = snap[n].A_eigvecs.double(), snap[n].G_eigvecs.double()
        out[n] = (qg.T @ g[n] @ qa).square()
    return out


def _usable(labels: torch.Tensor) -> float:
    """``U_n`` of one sequence (``labels [T]``): its positions up to the last scored logit row
    (``labels[t+1] != -100``), by hand; the last real token scores nothing."""
    scored = (labels[1:] != -100).nonzero()
    return float(scored.max() + 1) if scored.numel() else 0.0


def _labels(batch: dict) -> torch.Tensor:
    """The batch's labels; a compute_loss_func's forward gets none: text_examples' are the ids,
    -100 at padding."""
    return batch.get("labels", torch.where(batch["attention_mask"] == 1, batch["input_ids"],
                                           -100))


def _brute_force(model, names, basis_snap, batches, causal: bool = True):
    """``{layer: Σ_n (Q_Gᵀ ∇L_n Q_A)² / Σ_n U_n}`` over the sequences of ``batches`` (``[B,
    T]`` kwargs), on ``basis_snap``'s eigenvectors; ``U_n`` as `_usable` for a causal LM, every
    real position for an encoder (``causal`` False: each reaches the loss both ways)."""
    num = dict.fromkeys(names, 0.0)
    den = 0.0
    for batch in batches:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = _labels(batch)
        for i in range(ids.shape[0]):
            sq = _rotated_sq(model, names, basis_snap, ids[i], mask[i], labels[i])
            for n in names:
                num[n] = num[n] + sq[n]
            den += _usable(labels[i]) if causal else float(mask[i].sum())
    return {n: num[n] / den for n in names}


def _rel(got, want):
    return float((got - want).norm() / want.norm())


def _exact_run(tmp_path, ekfac=True, loss=None, steps=6, model=None):
    model = model or tiny_gpt2()
    # every snapshot decomposed in the run, as EK-FAC's are (the run without it compares)
    cb, recs, _ = run(model, text_examples(2 * steps, 12, lengths=LENGTHS * (steps // 3)),
                      {"snapshot_every": 2, "ekfac": ekfac, "eigendecompose": "always"},
                      batch=2, lr=0.0, loss=loss,
                      tmp_path=tmp_path, record=True,
                      callback_kwargs={"background_snapshots": False})
    return model, cb, [r["kwargs"] for r in recs]


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    # transformers' semantics (sum / tokens of the batch) in float64 (its own loss casts the
    # logits to float32): the hooks see c·g, the correction divides by c²
    from harness import hf_like_loss

    return _exact_run(tmp_path_factory.mktemp("exact"), loss=hf_like_loss)


def test_stored_correction_equals_brute_force(exact):
    """lr 0, token_fraction 1, the empirical Fisher, ema_decay 1: the snapshot at step 4
    holds the mean over update steps 2 and 3 on snapshot 2's basis, the one at step 6 over 4
    and 5 on snapshot 4's, equal to the autograd reference."""
    model, cb, batches = exact
    assert len(batches) == 6  # one forward per step (no replay, no probe)
    snaps = [Snapshot.load(p) for p in cb.snapshots]
    assert [s.step for s in snaps] == [2, 4, 6]
    names = snaps[0].layer_names
    worst = 0.0
    for prev, snap, steps in ((snaps[0], snaps[1], (2, 3)), (snaps[1], snaps[2], (4, 5))):
        want = _brute_force(model, names, prev, [batches[s] for s in steps])
        for n in names:
            got = snap[n].ekfac_eigvals
            assert got is not None and got.dtype == torch.float64
            entry = snap[n].entry.ekfac
            assert entry.basis_step == prev.step
            assert (entry.first_step, entry.last_step, entry.updates) == \
                (steps[0], steps[1], 2)
            assert entry.weight == sum(_usable(row) for s in steps
                                          for row in _labels(batches[s]))
            worst = max(worst, _rel(got, want[n]))
    print(f"streamed EK-FAC correction vs autograd reference: max rel Frobenius err "
          f"{worst:.2e} over {len(names)} layers x 2 snapshots")
    assert worst <= EXACT_TOL


def test_a_layer_called_twice_squares_its_summed_gradient(tmp_path):
    """ALBERT's shared layer group runs twice per forward: a tracked layer's per-sequence
    gradient is the SUM over its calls (what autograd on the shared parameters gives), and the
    stored correction is the square of that sum over ``2·N`` (its factors count each call's
    positions: ``N`` once per call), not the sum of each call's squares. The layer called once
    (``embedding_hidden_mapping_in``) divides by ``N``."""
    from harness import sum_nll_loss
    from models import tiny_albert

    model, steps = tiny_albert(), 6
    shared = r"albert_layers\.0\.(ffn|ffn_output|attention\.(query|key|dense))$"
    cb, recs, _ = run(model, text_examples(2 * steps, 12, lengths=LENGTHS * (steps // 3)),
                      {"snapshot_every": 2, "ekfac": True, "eigendecompose": "always",
                       "include": [shared, r"embedding_hidden_mapping_in$"]},
                      batch=2, lr=0.0, loss=sum_nll_loss, tmp_path=tmp_path, record=True,
                      callback_kwargs={"background_snapshots": False})
    batches = [r["kwargs"] for r in recs]
    assert len(batches) == steps
    snaps = [Snapshot.load(p) for p in cb.snapshots]
    names = snaps[0].layer_names
    calls = {n: 2 if "albert_layers" in n else 1 for n in names}
    assert sorted(calls.values()) == [1] + [2] * 5
    worst = 0.0
    for prev, snap, window in ((snaps[0], snaps[1], (2, 3)), (snaps[1], snaps[2], (4, 5))):
        # ALBERT is an encoder: every real position is a row (none is cut after the last scored)
        want = _brute_force(model, names, prev, [batches[s] for s in window], causal=False)
        positions = sum(float(batches[s]["attention_mask"].sum()) for s in window)
        for n in names:
            got = snap[n].ekfac_eigvals
            assert snap[n].entry.ekfac.weight == calls[n] * positions
            worst = max(worst, _rel(got, want[n] / calls[n]))
    # what squaring each call apart would store: per-call gradients from the calls' own
    # inputs and output gradients (hooks), not the parameters' summed one
    ffn = next(n for n in names if n.endswith(".ffn"))
    apart = _per_call_squares(model, ffn, snaps[0], [batches[s] for s in (2, 3)])
    off = _rel(snaps[1][ffn].ekfac_eigvals, apart / (2 * positions_of(batches, (2, 3))))
    print(f"layer called twice: streamed EK-FAC vs autograd (square of the summed "
          f"gradient) max rel err {worst:.2e} over {len(names)} layers x 2 snapshots; the "
          f"calls squared apart would be {off:.2f} off")
    assert worst <= EXACT_TOL
    assert off > 0.05


def positions_of(batches, steps) -> float:
    return sum(float(batches[s]["attention_mask"].sum()) for s in steps)


def _per_call_squares(model, name, snap, batches):
    """``Σ_n Σ_calls (Q_Gᵀ g_cᵀ ā_c Q_A)²`` of layer ``name`` over ``batches``' sequences,
    float64: each call's input and output gradient (forward hook, ``autograd.grad``)."""
    module = dict(model.named_modules())[name]
    qa, qg = snap[name].A_eigvecs.double(), snap[name].G_eigvecs.double()
    total = 0.0
    for batch in batches:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = batch.get("labels", torch.where(mask == 1, ids, -100))
        for i in range(ids.shape[0]):
            seen: list = []
            handle = module.register_forward_hook(
                lambda m, a, out, seen=seen: seen.append((a[0], out)))
            try:
                loss = _sum_nll(model, ids[i], mask[i], labels[i])
            finally:
                handle.remove()
            grads = torch.autograd.grad(loss, [out for _, out in seen])
            for (x, _), g in zip(seen, grads):
                a = torch.cat([x[0], torch.ones(x.shape[1], 1, dtype=x.dtype)], 1)
                a = a * mask[i][:, None].to(a.dtype)
                total = total + (qg.T @ (g[0].T @ a) @ qa).square().detach()
    return total


def test_first_snapshot_has_none(exact):
    _, cb, _ = exact
    first = Snapshot.load(cb.snapshots[0])
    assert all(first[n].ekfac_eigvals is None for n in first.layer_names)
    assert all(entry.ekfac is None for entry in first.manifest.layers.values())
    assert first.manifest.config["ekfac"] is True


def _shard_hashes(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).glob("*.safetensors"))}


def test_default_writes_no_correction_and_the_same_snapshot(exact, tmp_path):
    """ekfac off (the default): no tensor, no manifest key, not even in the config; the shards
    are byte for byte those of the EK-FAC run's first snapshot (same factors, same
    eigendecompositions: the option changes nothing it does not add)."""
    _, cb_on, _ = exact
    from harness import hf_like_loss

    _, cb_off, _ = _exact_run(tmp_path, ekfac=False, loss=hf_like_loss)
    assert cb_off.tracker.extension("ekfac") is None and not cb_off.tracker.capture.extensions
    for path in cb_off.snapshots:
        text = (Path(path) / "manifest.json").read_text()
        assert "ekfac" not in text
        snap = Snapshot.load(path)
        assert all(snap[n].ekfac_eigvals is None for n in snap.layer_names)
    assert _shard_hashes(cb_off.snapshots[0]) == _shard_hashes(cb_on.snapshots[0])
    on = json.loads((Path(cb_on.snapshots[0]) / "manifest.json").read_text())
    off = json.loads((Path(cb_off.snapshots[0]) / "manifest.json").read_text())
    assert set(on["config"]) - set(off["config"]) == {"ekfac"}
    assert on["layers"] == off["layers"]


def test_shared_inputs_and_sum_loss(tmp_path):
    """A Llama (q/k/v and gate/up share one A; no bias) with a SUM loss (c = 1)."""
    from harness import sum_nll_loss

    model, cb, batches = _exact_run(tmp_path, loss=sum_nll_loss, steps=3,
                                    model=tiny_llama())
    assert cb.tracker.plan.groups
    batches = batches[-3:]  # the probe forward at train begin is not a training pass
    snaps = [Snapshot.load(p) for p in cb.snapshots]
    assert [s.step for s in snaps] == [2, 3]
    names = snaps[0].layer_names
    want = _brute_force(model, names, snaps[0], [batches[2]])
    worst = max(_rel(snaps[1][n].ekfac_eigvals, want[n]) for n in names)
    print(f"llama, shared A: max rel err {worst:.2e}")
    assert worst <= EXACT_TOL


class _RecordReplays(TrainerCallback):
    """Wraps the MC replay's forward pass and label sampler: each replayed sub-batch, the
    labels drawn for it and the optimizer step it belongs to (a callback: the step)."""

    def __init__(self, monkeypatch):
        import kfac_stream.fisher.mc_replay as mc

        self.passes, self.step = [], None
        real_pass, real_sample = mc.mc_fisher_pass, mc.sample_labels

        def mc_pass(model, capture, inputs, generator, mode=mc.MC_REPLAY):
            self.passes.append({"inputs": {k: v.clone() for k, v in inputs.items()},
                                "step": self.step})
            return real_pass(model, capture, inputs, generator, mode)

        def sample(logits, generator):
            y = real_sample(logits, generator)
            self.passes[-1]["labels"] = y.clone()
            return y

        monkeypatch.setattr(mc, "mc_fisher_pass", mc_pass)
        monkeypatch.setattr(mc, "sample_labels", sample)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def test_mc_share_replay_equals_brute_force_with_its_sampled_labels(tmp_path, monkeypatch):
    """The default Fisher: the MC replay of a share of each update step's sequences (0.5
    here, systematic over the step's 2 x 2 sequences). The correction is the replayed
    sequences' (with the labels drawn for them at every loss-bearing position), each weighted
    1/share, over their usable positions (up to the last scored one) times 1/share: the
    replayed sequences' ratio."""
    rec = _RecordReplays(monkeypatch)
    model = tiny_gpt2()
    cfg = {"snapshot_every": 2, "ekfac": True, "fisher": "mc", "mc_sequences": 0.5,
           "min_window_sequences": 0}
    cb, _, _ = run(model, text_examples(16, 12, lengths=[12, 9, 12, 7] * 4), cfg, batch=2,
                   accum=2, lr=0.0, tmp_path=tmp_path, record=False, callbacks=[rec],
                   callback_kwargs={"background_snapshots": False})
    snaps = [Snapshot.load(p) for p in cb.snapshots]
    assert [s.step for s in snaps] == [2, 4]
    names = snaps[0].layer_names
    entry = snaps[1][names[0]].entry.ekfac
    window = [p for p in rec.passes if p["step"] in (2, 3)]
    assert window and (entry.basis_step, entry.updates) == (2, 2)
    num = dict.fromkeys(names, 0.0)
    den = 0.0
    for p in window:
        ids, mask = p["inputs"]["input_ids"], p["inputs"]["attention_mask"]
        y = p["labels"].reshape(ids.shape[0], ids.shape[1] - 1)
        keep = p["inputs"]["labels"][:, 1:] != -100
        for i in range(ids.shape[0]):
            labels = torch.cat([torch.full((1,), -100), torch.where(keep[i], y[i], -100)])
            sq = _rotated_sq(model, names, snaps[0], ids[i], mask[i], labels)
            for n in names:
                num[n] = num[n] + sq[n]
            # N: its positions up to the last one scored (the last real token scores nothing)
            den += float(keep[i].nonzero().max() + 1)
    worst = max(_rel(snaps[1][n].ekfac_eigvals, num[n] / den) for n in names)
    print(f"MC share replay ({len(window)} replayed sub-batches in the window): max rel err "
          f"{worst:.2e}")
    assert entry.weight == pytest.approx(2 * den, rel=1e-12)  # N, each weighted 1/share
    assert worst <= 1e-6  # the MC loss takes the logits in float32 (mc_replay)


class _SetBasis(TrainerCallback):
    """After the K-FAC callback's train begin: a random orthonormal basis for every factor
    (what a snapshot's eigenvectors would give), so the correction runs from step 0."""

    def __init__(self, kfac):
        self.kfac = kfac

    def on_train_begin(self, args, state, control, **kwargs):
        tr = self.kfac.tracker
        gen = torch.Generator().manual_seed(0)
        basis = {k: None if diag else torch.linalg.qr(torch.randn(d, d, generator=gen,
                                                                  dtype=torch.float64))[0]
                 for k, (d, diag) in tr.dims.items()}
        tr.extension("ekfac").state.set_basis(0, basis)


@pytest.mark.parametrize("extra", [{"fisher": "empirical"},
                                   {"fisher": "mc", "mc_sequences": 0.5,
                                    "min_window_sequences": 0}],
                         ids=["empirical", "mc-share-replay"])
def test_correction_adds_no_host_sync(tmp_path, extra, monkeypatch):
    """Counted as in tests/unit/tracking/test_host_syncs.py: the training thread with the correction
    on makes exactly the syncs of the plain Trainer (plus, for the replay, the model's own forward
    syncs, as without EK-FAC); kfac_stream's own code none. The basis is set at step 0
    (`_SetBasis`), so the short run's extra snapshot (`kfac_stream.ekfac.basis_snapshot_step`,
    whose capture syncs as every snapshot's does) is turned off: what is counted is the
    correction's per-step work."""
    monkeypatch.setattr("kfac_stream.ekfac.extension.basis_snapshot_step", lambda *a: None)
    from test_host_syncs import STEPS, StartCounting, StopCounting
    from transformers import Trainer, TrainingArguments

    from kfac_stream import KFACStreamCallback

    from models import ListDataset
    from syncs import SyncCounter

    def count(cfg):
        mode = SyncCounter()
        kfac = [] if cfg is None else [KFACStreamCallback(KFACConfig(**cfg))]
        extra_cb = [_SetBasis(kfac[0])] if kfac and cfg.get("ekfac") else []
        ex = text_examples(16, 12, lengths=[12, 9, 12, 7] * 4)
        args = TrainingArguments(
            str(tmp_path / str(len(kfac)) / str(bool(extra_cb))),
            per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
            learning_rate=1e-3, report_to=[], use_cpu=True, logging_strategy="no",
            save_strategy="no", disable_tqdm=True, seed=0)
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=ListDataset(ex),
                          callbacks=[StopCounting(mode), *kfac, *extra_cb, StartCounting(mode)])
        trainer.train()
        return mode, kfac

    cfg = {"async_updates": True, "snapshot_every": 10_000, **extra}
    plain, _ = count(None)
    without, _ = count(cfg)
    tracked, (cb,) = count({**cfg, "ekfac": True})
    print(f"{extra}: host syncs over {STEPS} steps: plain {plain.count}, K-FAC "
          f"{without.count}, K-FAC + EK-FAC correction {tracked.count}")
    assert not tracked.ours, dict(tracked.ours)
    assert tracked.count == without.count
    assert tracked.count - tracked.replayed == plain.count
    final = Snapshot.load(cb.snapshots[-1])  # the end-of-training snapshot takes it
    entry = final[final.layer_names[0]].entry.ekfac
    assert entry.basis_step == 0 and entry.updates == -(-STEPS // 10)
    assert all(final[n].ekfac_eigvals is not None for n in final.layer_names)


def test_background_snapshots_hand_their_basis_over(tmp_path):
    """The default background snapshots: each snapshot's eigenvectors reach the tracker from
    the snapshot thread and are used from the next update step after they arrive; a
    snapshot's correction is always on the snapshot before it."""
    model = tiny_gpt2()
    cb, _, _ = run(model, text_examples(24, 12), {"snapshot_every": 3, "ekfac": True}, batch=2,
                   lr=1e-2, tmp_path=tmp_path, record=False)
    snaps = [Snapshot.load(p) for p in cb.snapshots]
    assert [s.step for s in snaps] == [3, 6, 9, 12]
    carried = 0
    for prev, snap in zip(snaps, snaps[1:]):
        entries = [snap[n].entry.ekfac for n in snap.layer_names]
        if entries[0] is None:
            assert all(e is None for e in entries)
            continue
        carried += 1
        assert all(e.basis_step == prev.step and prev.step <= e.first_step
                   <= e.last_step < snap.step for e in entries)
    assert snaps[0][snaps[0].layer_names[0]].ekfac_eigvals is None
    assert carried >= 1


def test_config():
    """``ekfac`` must be a bool, and appears in the config's dict only when on (several ranks
    are no longer refused: tests/runs/test_ekfac_ranks.py)."""
    with pytest.raises(KFACConfigError, match="ekfac"):
        KFACConfig(ekfac="yes")
    assert "ekfac" not in KFACConfig().to_dict() and KFACConfig(ekfac=True).to_dict()["ekfac"]


@pytest.mark.parametrize("d_out,d_a,tokens", [(6, 5, 2), (6, 5, 40), (3, 9, 4)])
def test_both_orders_agree_and_their_flops(d_out, d_a, tokens):
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3, tokens, d_a, generator=gen, dtype=torch.float64)
    g = torch.randn(3, tokens, d_out, generator=gen, dtype=torch.float64)
    qa = torch.linalg.qr(torch.randn(d_a, d_a, generator=gen, dtype=torch.float64))[0]
    qg = torch.linalg.qr(torch.randn(d_out, d_out, generator=gen, dtype=torch.float64))[0]
    want = sum((qg.T @ (g[i].T @ a[i]) @ qa).square() for i in range(3))
    got = sequence_correction(a, g, qa, qg, chunk=d_out * d_a)  # one sequence per chunk
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    ident = sequence_correction(a, g, None, None)
    assert torch.allclose(ident, sum((g[i].T @ a[i]).square() for i in range(3)), rtol=1e-12)
    order = correction_order(d_out, d_a, tokens)
    first = tokens * (d_out**2 + d_a**2)
    assert order == ("rotate_first" if first <= d_out * d_a * (d_out + d_a)
                     else "gradient_first")
    assert correction_flops(d_out, d_a, tokens, 3) == 3 * (
        2 * tokens * d_out * d_a + 2 * min(first, d_out * d_a * (d_out + d_a))
        + 2 * d_out * d_a)


def _projected(snap, prev, name):
    """The stored correction moved into ``snap``'s own basis (`moved_into_basis`), checked
    against its definition: the diagonal there of ``Q_old diag(λ) Q_oldᵀ``."""
    old = (prev[name].A_eigvecs.double(), prev[name].G_eigvecs.double())
    new = (snap[name].A_eigvecs.double(), snap[name].G_eigvecs.double())
    lam = snap[name].ekfac_eigvals.double()
    got = moved_into_basis(lam, old, new)
    if lam.numel() <= 300:  # small layers: the dense definition
        q_old, q_new = torch.kron(old[1], old[0]), torch.kron(new[1], new[0])
        dense = (q_new.T @ q_old @ torch.diag(lam.reshape(-1)) @ q_old.T @ q_new).diagonal()
        assert torch.allclose(got.reshape(-1), dense, rtol=1e-9, atol=1e-12 * float(
            dense.abs().max()))
    return got


def _figures(snap, prev, want):
    """Relative Frobenius errors against ``want`` ({layer: [d_out, d_A]}), over all layers
    together and of the worst layer: the stored correction, the same moved into the snapshot's
    own basis (`_projected`) and K-FAC's ``γ αᵀ``."""
    out = {}
    for what, get in (("ekfac", lambda n: snap[n].ekfac_eigvals),
                      ("projected", lambda n: _projected(snap, prev, n)),
                      ("kfac", lambda n: torch.outer(snap[n].G_eigvals, snap[n].A_eigvals))):
        err = {n: (get(n).double() - want[n]).norm() for n in want}
        total = math.sqrt(sum(float(e) ** 2 for e in err.values()) /
                          sum(float(want[n].norm()) ** 2 for n in want))
        out[what] = (total, max(float(err[n] / want[n].norm()) for n in want))
    return out


def test_staleness_against_a_post_hoc_correction(tmp_path):
    """Models that train (AdamW, 40 steps; lr 0 as the control): the final snapshot's
    streamed correction (steps 30-39, on snapshot 30's basis, the weights of those steps)
    against a post-hoc correction at the final weights in the final snapshot's basis, over
    the same sequences (the staleness alone) and over every training sequence (what a
    post-hoc pass over the data fits); beside them the stored correction moved into the final
    basis and K-FAC's ``γ αᵀ`` of the final snapshot. The figures are in docs/computed.md."""
    steps, batch = 40, 2
    table = []
    for lr in (0.0, 1e-3, 1e-2):
        model = tiny_gpt2()
        cb, recs, _ = run(model, text_examples(steps * batch, 12, seed=3),
                          {"snapshot_every": 10, "ekfac": True, "ema_decay": 0.95},
                          batch=batch, lr=lr, tmp_path=tmp_path / str(lr), record=True,
                          callback_kwargs={"background_snapshots": False})
        batches = [r["kwargs"] for r in recs]
        assert len(batches) == steps
        snaps = [Snapshot.load(p) for p in cb.snapshots]
        final, prev = snaps[-1], snaps[-2]
        names = final.layer_names
        assert final[names[0]].entry.ekfac.basis_step == prev.step == 30
        model.eval()
        for label, part in (("window", batches[30:40]), ("all data", batches)):
            f = _figures(final, prev, _brute_force(model, names, final, part))
            table.append((lr, label, f))
    print("\nrelative Frobenius error against the post-hoc correction at the final weights and "
          "basis (all layers; worst layer):")
    print("| lr | post-hoc over | streamed EK-FAC | moved into the final basis | K-FAC γαᵀ |")
    print("| --- | --- | --- | --- | --- |")
    for lr, label, f in table:
        print(f"| {lr:g} | {label} | " + " | ".join(
            f"{f[k][0]:.3f} ({f[k][1]:.2f})" for k in ("ekfac", "projected", "kfac")) + " |")
    for lr, label, f in table:
        assert f["ekfac"][0] < f["kfac"][0], (lr, label)


def test_influence_uses_the_corrected_eigenvalues(exact):
    """``Influence(post, eigenvalues="ekfac")`` (and ``"auto"`` on a snapshot that has them)
    equals the dense solve with ``Q diag(λ + damping) Qᵀ``, ``Q = Q_G ⊗ Q_A`` (row-major
    ``vec(W̄)``); ``"kfac"`` is K-FAC's; the first snapshot has no correction to use."""
    from test_influence import _dense_grads, _lm_loss, _stack

    from kfac_stream import Influence, LaplacePosterior
    from kfac_stream.exceptions import QueryInputError
    from kfac_stream.query.influence import HEURISTIC_FACTOR

    model, cb, _ = exact
    model.eval()
    snap = Snapshot.load(cb.snapshots[-1])
    post = LaplacePosterior(model, snap, 2.0)
    queries = text_examples(2, 10, seed=5, lengths=[10, 7])
    train = text_examples(5, 12, seed=7, lengths=[12, 8, 11, 12, 5])
    inf = Influence(post, eigenvalues="ekfac")
    for n in post.layer_names:
        assert inf.damping[n] == pytest.approx(
            HEURISTIC_FACTOR * float(snap[n].ekfac_eigvals.mean()), rel=1e-12)
    got = inf.scores(_stack(queries), [_stack(train[:3]), _stack(train[3:])]).scores
    gq = [_dense_grads(model, post.layer_names, q, _lm_loss) for q in queries]
    gt = [_dense_grads(model, post.layer_names, t, _lm_loss) for t in train]
    want = torch.zeros(len(queries), len(train), dtype=torch.float64)
    want_self = torch.zeros(len(train), dtype=torch.float64)
    for n in post.layer_names:
        q = torch.kron(snap[n].G_eigvecs.double(), snap[n].A_eigvecs.double())
        lam = snap[n].ekfac_eigvals.double().reshape(-1)
        h = q @ torch.diag(lam + inf.damping[n]) @ q.T
        sol = torch.linalg.solve(h, torch.stack([x[n] for x in gt]).T)
        want += torch.stack([x[n] for x in gq]) @ sol
        want_self += (torch.stack([x[n] for x in gt]) * sol.T).sum(1)
    err = float((got - want).abs().max() / want.abs().max())
    print(f"EK-FAC influence vs the dense solve: rel err {err:.2e}")
    assert err <= 1e-6
    own = inf.self_scores([_stack(train[:2]), _stack(train[2:])])
    err = float((own - want_self).abs().max() / want_self.abs().max())
    print(f"EK-FAC self-influence vs the dense solve: rel err {err:.2e}")
    assert err <= 1e-6
    auto = Influence(post).scores(_stack(queries), [_stack(train)]).scores
    assert torch.allclose(auto, got, rtol=1e-12, atol=0)
    kfac = Influence(post, eigenvalues="kfac").scores(_stack(queries), [_stack(train)]).scores
    assert not torch.allclose(kfac, got, rtol=1e-3)
    first = LaplacePosterior(model, Snapshot.load(cb.snapshots[0]), 2.0)
    with pytest.raises(QueryInputError, match="no EK-FAC correction"):
        Influence(first, eigenvalues="ekfac")
    assert Influence(first).corrected == dict.fromkeys(first.layer_names)


def test_16_bit_training_rotates_in_bfloat16():
    """A 16-bit run's correction (bf16 products, float32 squares) against float64: within
    bf16's precision."""
    from kfac_stream.ekfac import EkfacState

    gen = torch.Generator().manual_seed(2)
    d_in, d_out, B, T = 24, 16, 4, 32
    x = torch.randn(B, T, d_in, generator=gen, dtype=torch.float64)
    g = torch.randn(B, T, d_out, generator=gen, dtype=torch.float64)
    usable = torch.rand(B * T, generator=gen) > 0.2
    qa = torch.linalg.qr(torch.randn(d_in + 1, d_in + 1, generator=gen, dtype=torch.float64))[0]
    qg = torch.linalg.qr(torch.randn(d_out, d_out, generator=gen, dtype=torch.float64))[0]
    spec = types.SimpleNamespace(has_bias=True)
    state = EkfacState({"l": spec}, {"l": ("l.A", "l.G")}, torch.device("cpu"), torch.float32)
    state.set_basis(0, {"l.A": qa.float(), "l.G": qg.float()})
    state.begin_step()
    want = EkfacState({"l": spec}, {"l": ("l.A", "l.G")}, torch.device("cpu"), torch.float64)
    ref = want.correction("l", [(x, g)], usable, B, (qa, qg))
    got = state.correction("l", [(x.to(torch.bfloat16), g.to(torch.bfloat16))], usable, B,
                           state.basis_of("l"))
    assert got.dtype == torch.float32
    assert state.basis_of("l")[0].dtype == torch.bfloat16  # converted once, kept so
    err = _rel(got.double(), ref)
    print(f"bf16 rotations vs float64: rel Frobenius err {err:.2e}")
    assert err < 3e-2


def test_a_basis_that_cannot_be_moved_fails_nothing(monkeypatch, caplog):
    """The sink runs on the snapshot's thread: a basis that cannot reach the device (out of
    memory) is dropped with a warning, the snapshot is not failed, nothing is accumulated."""
    from kfac_stream.ekfac import EkfacState

    spec = types.SimpleNamespace(has_bias=False)
    state = EkfacState({"l": spec}, {"l": ("l.A", "l.G")}, torch.device("cpu"), torch.float32)
    state.take(5, {"l": ("l.A", "l.G")})
    receive = state.sink(5)

    class Broken:
        def to(self, *a, **k):
            raise RuntimeError("CUDA out of memory")

    with caplog.at_level("WARNING", logger="kfac_stream"):
        receive("l.A", Broken())
        receive("l.G", torch.eye(3))
    assert "could not be moved" in caplog.text
    state.begin_step()
    assert state.basis_of("l") is None and state.basis_step is None
