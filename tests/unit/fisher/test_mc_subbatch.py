"""The default Fisher: the MC (type-2) Fisher replayed on a random sub-batch of sequences.

Checked against independent references in float64 on tiny models:

* unbiasedness: the mean over many updates of the per-update statistics (A, G) against the
  EXACT full-batch factors, A from every usable position and G = E_y[g gᵀ] in closed form
  from the softmax (Σ_t Jᵀ(diag p − ppᵀ)J per position, `reference.expected_fisher_G` for a
  causal LM, `_classifier_expected_factors` below for a sequence classifier);
* the sequence selection: deterministic given (seed, rank, step), different per rank,
  uniform over sequences and over pairs of sequences;
* ``mc_sequences = B`` (the sub-batch machinery selecting everything) reproduces the
  full-batch path (``"all"``: in the training forward) exactly, and so does ``1.0``.

Monte-Carlo tolerance (`MC_Z`). With ``ema_decay=0`` the factors after update ``k`` are that
update's statistic ``S_k`` itself; the ``K`` updates of a fixed model (lr 0) on a fixed batch
are i.i.d. draws of the estimator (fresh sequences, positions and labels each time). For an
unbiased estimator ``E‖S̄ − F‖²_F = tr Cov(S)/K``, estimated without the truth by
``se² = Σ_k ‖S_k − S̄‖²_F / (K(K−1))``. The test asserts ``‖S̄ − F‖_F ≤ MC_Z · se`` for every
factor. ``‖S̄ − F‖²/se²`` has mean ≈ 1; for ``MC_Z = 4`` Markov's inequality bounds the chance
of a false alarm per factor by 1/16, and in practice it is far smaller (a sum of many nearly
independent squares concentrates around its mean; measured ratios below, printed). A bias
``β`` shows once ``‖β‖ > MC_Z·se``: `MC_MAX_REL_SE` makes sure ``se`` is small enough (≤ 5%
of ‖F‖; measured ≤ 3.6% at 2000 updates) that a bias of 20% of a factor could not pass,
and the tests check that a sequence-weight error (forgetting the ``B/b`` factor, a 2x bias)
fails the same bound. Measured (printed): max ratio 1.07 (causal LM), 0.54 (classifier).
"""

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from kfac_stream import KFACStreamCallback
from kfac_stream.config import KFACConfig
from kfac_stream.fisher.mc_replay import select_sequences
from kfac_stream.fisher.replay_draws import selection_seed
from kfac_stream.tracking.plan import mc_sequences_of

from harness import run
from models import ListDataset, text_examples, tiny_gpt2
from reference import expected_fisher_G, reference_factors, rel_err

MC_Z = 4.0
MC_MAX_REL_SE = 0.05
UPDATES = 2000


class _EachUpdate(TrainerCallback):
    """After the K-FAC callback's ``on_step_end``: with ``ema_decay=0`` its factors are the
    statistic of the update just made."""

    def __init__(self, kfac) -> None:
        self.kfac, self.stats = kfac, []

    def on_step_end(self, args, state, control, **kwargs):
        self.stats.append({n: (a.clone(), g.clone()) for n, (a, g) in self.kfac.factors().items()})


def _updates(model, examples, cfg, updates, tmp_path):
    """``updates`` i.i.d. statistics of one fixed model (lr 0) on one fixed batch (all
    examples), one update per step, float64."""
    full = {"token_fraction": 1.0, "ema_decay": 0.0, "final_window": 0.0,
            "storage_dtype": "float64", "update_every": 1, "snapshot_every": 10**6, **cfg}
    cb = KFACStreamCallback(KFACConfig(**full))
    each = _EachUpdate(cb)  # after the K-FAC callback: reads the update it just made
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=len(examples),
                             num_train_epochs=updates, learning_rate=0.0, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             use_cpu=True, seed=0, lr_scheduler_type="constant")
    Trainer(model=model, args=args, train_dataset=ListDataset(examples),
            callbacks=[cb, each]).train()
    assert cb.tracker.counters.updates == updates and cb.tracker.counters.skipped_updates == 0
    return cb, each.stats


def _check_unbiased(stats, exact_A, exact_G, label):
    """Mean of the per-update statistics within MC_Z standard errors of the exact factors,
    for every factor; a forgotten 1/P(sequence) weight must fail the same bound."""
    K = len(stats)
    rows = []  # (factor, ‖mean − exact‖/se, se/‖exact‖, the same ratio with G halved)
    for n in exact_A:
        for i, exact in ((0, exact_A[n]), (1, exact_G[n])):
            draws = torch.stack([s[n][i] for s in stats])  # [K, d, d]
            mean = draws.mean(0)
            se = ((draws - mean).square().sum() / (K * (K - 1))).sqrt()
            # power: the same draws without the sequence weight B/b ≥ 2 (G halved) must fail
            half = float((mean / 2 - exact).norm() / se) if i == 1 else math.inf
            rows.append((f"{n}.{'AG'[i]}", float((mean - exact).norm() / se),
                         float(se / exact.norm()), half))
    worst = max(rows, key=lambda r: r[1])
    print(f"{label}, {K} updates: max ‖mean − exact‖/se {worst[1]:.2f} ({worst[0]}; bound "
          f"{MC_Z}), max se/‖exact‖ {max(r[2] for r in rows):.4f} (bound {MC_MAX_REL_SE}), "
          f"a 2x sequence-weight error: ≥ {min(r[3] for r in rows):.1f}")
    for name, ratio, rel_se, half in rows:
        assert rel_se <= MC_MAX_REL_SE, (label, name, rel_se)
        assert ratio <= MC_Z, (label, name, ratio)
        assert half > MC_Z, (label, name, half)


def test_subbatch_mc_fisher_is_unbiased_for_the_exact_expected_fisher(tmp_path):
    # 4 sequences with padding; 2 of them per update (B/b = 2) and inside them
    # ceil(0.3·48) = 15 of their ≤ 24 positions: both sampling stages are exercised.
    model = tiny_gpt2()
    ex = text_examples(4, 12, lengths=[12, 9, 12, 7])
    cfg = {"fisher": "mc", "mc_sequences": 2, "token_fraction": 0.3}
    cb, stats = _updates(model, ex, cfg, UPDATES, tmp_path)
    layers = list(cb.tracker.specs)
    batch = {k: torch.stack([e[k] for e in ex]) for k in ex[0]}
    exact_G = expected_fisher_G(model, batch, layers)
    ref, _ = reference_factors(model, [{"kwargs": batch}], layers)
    exact_A = {n: ref[n][0] for n in layers}
    _check_unbiased(stats, exact_A, exact_G, "causal LM, 2 of 4 sequences, tf 0.3")
    # the counts are the empirical path's: n = usable positions of the micro-batch (36: the
    # real tokens but each sequence's last, which scores nothing), sampled positions = the
    # usable slots taken (15 a pass, fewer where the two sequences drawn hold fewer)
    state = cb.tracker.store.state_dict()
    assert all(abs(float(s.weight) - 36) < 1e-9 for s in state.values())
    assert cb.tracker.counters.tokens_seen == 36 * UPDATES
    assert 13 * UPDATES <= cb.tracker.counters.positions_sampled <= 15 * UPDATES
    # not the empirical Fisher: the observed labels' G is a different matrix
    assert max(rel_err(ref[n][1], exact_G[n]) for n in layers) > 0.5


def _classifier():
    from transformers import GPT2Config, GPT2ForSequenceClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2ForSequenceClassification(GPT2Config(
            n_layer=2, n_embd=16, n_head=2, vocab_size=256, n_positions=64, num_labels=3,
            pad_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
            summary_first_dropout=0.0))
    return model.double().train()


def _classifier_expected_factors(model, batch, layers):
    """Exact A (every usable position) and E_y[G] of a sequence classifier, by hand:
    logits f_b [C] at the pooled position, H_b = diag p_b − p_b p_bᵀ, J_c(s) = ∂f_{b,c}/∂z_s
    (sequences are independent), E[g_s g_sᵀ] = Σ_cc' H_b[c,c'] J_c(s) J_c'(s)ᵀ."""
    mods = dict(model.named_modules())
    outs, ins = {}, {}

    def hook(name):
        def f(m, args, out):
            ins[name], outs[name] = args[0].detach(), out
        return f

    handles = [mods[n].register_forward_hook(hook(n)) for n in layers]
    try:
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits  # [B, C]
    finally:
        for h in handles:
            h.remove()
    mask = batch["attention_mask"].to(torch.float64)  # [B, T]
    U = mask.sum()
    p = torch.softmax(logits.detach(), -1)  # [B, C]
    H = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # [B, C, C]
    C = logits.shape[1]
    J = {n: [] for n in layers}
    for c in range(C):
        grads = torch.autograd.grad(logits[:, c].sum(), [outs[n] for n in layers],
                                    retain_graph=True)
        for n, g in zip(layers, grads, strict=True):
            J[n].append(g)  # [B, T, d_out]
    A, G = {}, {}
    for n in layers:
        Jn = torch.stack(J[n])  # [C, B, T, d]
        G[n] = torch.einsum("cbti,bce,ebtj,bt->ij", Jn, H, Jn, mask) / U
        a = torch.cat([ins[n], torch.ones_like(ins[n][..., :1])], -1)  # Conv1D with bias
        A[n] = torch.einsum("bti,btj,bt->ij", a, a, mask) / U
    return A, G


@pytest.mark.slow
def test_subbatch_mc_fisher_unbiased_on_a_sequence_classifier(tmp_path):
    # logits [B, C]: one loss term per sequence; 1 of 4 sequences per update (B/b = 4)
    model = _classifier()
    ex = text_examples(4, 10, lengths=[10, 6, 10, 8], seed=3)
    for i, e in enumerate(ex):
        e["labels"] = torch.tensor(i % 3)
    cb, stats = _updates(model, ex, {"fisher": "mc", "mc_sequences": 1}, UPDATES, tmp_path)
    layers = list(cb.tracker.specs)
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    exact_A, exact_G = _classifier_expected_factors(model, batch, layers)
    _check_unbiased(stats, exact_A, exact_G, "classifier, 1 of 4 sequences")


def test_sequence_selection_is_deterministic_and_uniform():
    B, b, steps = 8, 2, 4000
    gen = torch.Generator()

    def draw(seed, rank, step):
        gen.manual_seed(selection_seed(seed, rank, step))
        return select_sequences(B, b, gen, torch.device("cpu"))

    picks = [draw(0, 0, s) for s in range(steps)]
    assert all(torch.equal(p, draw(0, 0, s)) for s, p in enumerate(picks[:50]))
    assert all(p.shape == (b,) and p.unique().numel() == b and bool((p[1:] > p[:-1]).all())
               for p in picks)
    other_rank = sum(torch.equal(p, draw(0, 1, s)) for s, p in enumerate(picks[:200]))
    other_seed = sum(torch.equal(p, draw(1, 0, s)) for s, p in enumerate(picks[:200]))
    # a coincidence has probability 1/C(8,2) = 1/28 per step: ~7 of 200, not most
    assert other_rank < 30 and other_seed < 30
    # each sequence drawn with probability b/B: counts ~ Binomial(steps, 1/4), sd 27.4
    counts = torch.bincount(torch.cat(picks), minlength=B).double()
    expect = steps * b / B
    sd = math.sqrt(steps * (b / B) * (1 - b / B))
    assert float((counts - expect).abs().max()) <= 5 * sd, counts
    # every pair with probability 1/28: chi-square with 27 degrees of freedom, bound at
    # mean + 6 sd = 27 + 6·sqrt(54) ≈ 71
    pairs = torch.zeros(B, B)
    for p in picks:
        pairs[p[0], p[1]] += 1
    cells = pairs[torch.triu(torch.ones(B, B, dtype=torch.bool), 1)]
    e = steps / 28
    chi2 = float(((cells - e) ** 2 / e).sum())
    assert chi2 <= 27 + 6 * math.sqrt(54), chi2


def test_mc_sequences_values():
    assert [mc_sequences_of(v, 8) for v in (1, 2, 20, 0.125, 0.3, 0.5, 1.0, "all")] == \
        [1, 2, 8, 1, 3, 4, 8, 8]
    assert mc_sequences_of(0.125, 1) == 1 and mc_sequences_of(0.125, 17) == 3
    assert KFACConfig().fisher == "mc" and not KFACConfig().mc_full_batch
    assert KFACConfig(mc_sequences="all").mc_full_batch
    assert KFACConfig(mc_sequences=1.0).mc_full_batch
    assert not KFACConfig(mc_sequences=1).mc_full_batch
    for bad in (0, -1, 0.0, 1.5, float("nan"), True, "half", None, [1]):
        with pytest.raises(ValueError, match="mc_sequences"):
            KFACConfig(mc_sequences=bad)


def test_subbatch_runs_are_reproducible_and_seeded(tmp_path):
    ex = text_examples(8, 12, lengths=[12, 9, 12, 7] * 2)
    cfg = {"fisher": "mc", "mc_sequences": 1, "token_fraction": 0.25}
    f = [run(tiny_gpt2(), ex, {**cfg, "seed": s}, batch=4, epochs=2, tmp_path=tmp_path / str(i),
             record=False)[0].factors() for i, s in enumerate((0, 0, 1))]
    for n in f[0]:
        assert torch.equal(f[0][n][0], f[1][n][0]) and torch.equal(f[0][n][1], f[1][n][1])
    assert any(not torch.equal(f[0][n][1], f[2][n][1]) for n in f[0])


@pytest.mark.parametrize("checkpointing", [False, True], ids=["in-forward", "replayed"])
def test_whole_batch_setting_reproduces_the_full_batch_path(tmp_path, checkpointing):
    # mc_sequences = B runs the sub-batch machinery with every sequence selected: no draw,
    # weights untouched, the same token and label draws in the same order; with lr 0 it must
    # give the full-batch path's factors ("all": the gradient inside the training forward, or
    # replayed after the step under gradient checkpointing), and 1.0 is "all".
    ex = text_examples(8, 12, lengths=[12, 9, 12, 7] * 2)
    kw = dict(batch=4, epochs=2, lr=0.0, record=False, gradient_checkpointing=checkpointing)
    base = {"fisher": "mc", "token_fraction": 0.4}
    got = {v: run(tiny_gpt2(), ex, {**base, "mc_sequences": v}, tmp_path=tmp_path / str(v),
                  **kw)[0] for v in ("all", 4, 1.0)}
    f = {v: cb.factors() for v, cb in got.items()}
    for v in (4, 1.0):
        for n in f["all"]:
            assert rel_err(f[v][n][0], f["all"][n][0]) <= 1e-12, (v, n)
            assert rel_err(f[v][n][1], f["all"][n][1]) <= 1e-12, (v, n)
        assert got[v].tracker.counters.positions_sampled == \
            got["all"].tracker.counters.positions_sampled


def test_replay_counts_draw_each_sequence_with_the_share():
    """A float ``mc_sequences`` is a share ``f`` of the step's sequences: systematic sampling
    draws ``⌊fC⌋`` or ``⌈fC⌉`` of the step's ``C`` sequences, every sequence with probability
    ``f`` (frequency over 4000 steps within `MC_Z` binomial standard errors), the same on
    every rank (no rank in the draw: ZeRO-3 replays are collective); an int is per
    micro-batch; a batch that is not ``[B, T]`` (None) is replayed whole; step 0 (the tracker's
    ``at_least_one``) takes one sequence when the draw is empty, uniform over the step's
    (probability ``1/C``, which the rows' weight then uses)."""
    from kfac_stream.fisher.replay_draws import replay_counts

    assert replay_counts(2, [1, 4, None], 0, 7) == ([1, 2, None], None)
    steps, f = 4000, 0.05
    hits, forced = torch.zeros(4), torch.zeros(4)
    for step in range(steps):
        c, share = replay_counts(f, [1, 1, 1, 1], 0, step)  # micro-batch 1, 4 accumulation
        assert share == f and sum(c) in (0, 1) and all(x in (0, 1) for x in c)
        hits += torch.tensor(c, dtype=torch.float32)
        assert replay_counts(f, [1, 1, 1, 1], 0, step) == (c, f)  # fixed by (seed, step)
        # at_least_one (step 0): exactly one sequence, uniform over the step's 4 (1/C each)
        c1, share1 = replay_counts(f, [1, 1, 1, 1], 0, step, at_least_one=True)
        assert sum(c1) == 1 and (c1 == c if sum(c) else share1 == 0.25)
        forced += torch.tensor(c1, dtype=torch.float32)
    se = math.sqrt(f * (1 - f) / steps)
    assert float((hits / steps - f).abs().max()) <= MC_Z * se, hits / steps
    se1 = math.sqrt(0.25 * 0.75 / steps)
    assert float((forced / steps - 0.25).abs().max()) <= MC_Z * se1, forced / steps
    for step in range(50):
        c, share = replay_counts(0.3, [3, None, 5, 2], 1, step, at_least_one=True)
        assert share == 0.3 and c[1] is None  # f·C ≥ 1: never forced
        assert all(0 <= x <= b for x, b in zip([c[0], c[2], c[3]], [3, 5, 2]))
        assert c[0] + c[2] + c[3] in (3, 4)  # 0.3 · 10


def test_share_weights_rows_by_one_over_the_share(monkeypatch):
    """With a share ``f`` a drawn sequence weighs ``1/f`` (its inclusion probability, by the
    test above) instead of ``B/b``, and the pass's EMA weight is ``Σ w``: the int path's
    estimator (unbiased: the 2000-update tests above) with the sequence stage's weight
    replaced by the inverse of its inclusion probability, hence unbiased too."""
    from kfac_stream.capture.hooks import PassRecord
    from kfac_stream.fisher import mc_replay

    recs = []

    def fake_pass(*args, **kwargs):
        recs.append(PassRecord(index=torch.arange(6), weight=torch.ones(6, dtype=torch.float64),
                               n_positions=12))
        return recs[-1]

    monkeypatch.setattr(mc_replay, "mc_fisher_pass", fake_pass)
    inputs = {"input_ids": torch.zeros(4, 6, dtype=torch.long),
              "attention_mask": torch.ones(4, 6, dtype=torch.long)}
    # the capture's only part used here: every position of the micro-batch usable, no decoder
    capture = SimpleNamespace(streams=lambda kwargs, labels, shape, device: (
        torch.ones(shape[0] * shape[1], dtype=torch.bool), None))
    for share in (None, 0.25):
        mc_replay.mc_subbatch_pass(torch.nn.Module(), capture, inputs, torch.Generator(),
                                   torch.Generator().manual_seed(0), 2, 0.5, share)
    per_b, per_share = recs
    assert torch.equal(per_b.weight, torch.full((6,), 2.0, dtype=torch.float64))  # B/b = 4/2
    assert float(per_b.total) == 24.0  # U of the whole micro-batch
    assert torch.equal(per_share.weight, torch.full((6,), 4.0, dtype=torch.float64))  # 1/f
    assert per_share.total is None  # n = Σ w
