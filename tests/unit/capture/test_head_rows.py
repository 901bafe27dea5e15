"""A pooler or classification head on ``[B, d]``: one row per sequence.

BERT's ``pooler.dense`` and ``classifier`` see one row per sequence (the ``[CLS]`` token, then
the pooled vector), not the ``B·T`` token positions of the blocks. kfac_stream takes every
sequence's row, weighted 1 (0 for an all-padding sequence), and counts the layer's ``N`` in
sequences. References, independent of the hooks under test:

* the factors against a float64 brute force: the heads' inputs and the per-sequence gradients
  of the summed loss with respect to their outputs, by autograd on the same weights; ``A`` and
  ``G`` their outer products averaged over the sequences with a usable position;
* the posterior's predictive covariance over the head against dense algebra:
  ``J (N_seq·G⊗A + τI)⁻¹ Jᵀ`` with ``N_seq`` the sequences of the epoch, not the tokens;
* the diagonal factors under the MC sub-batch replay against the dense factors' diagonals
  (the replay's ``1/P(drawn)`` weight reaches the diagonal sums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification

from kfac_stream import LaplacePosterior, Snapshot

from harness import run
from models import text_examples, tiny_gpt2
from reference import rel_err

#: float64 model, float64 storage, one update: the rounding of two float64 paths only.
EXACT_TOL = 1e-10
N_SEQ, SEQ, BATCH, TAU = 8, 10, 4, 0.5
HEADS = ("bert.pooler.dense", "classifier")


def _bert() -> BertForSequenceClassification:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(
            vocab_size=256, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=SEQ, num_labels=3,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).double()
    return model


def _examples() -> list[dict[str, torch.Tensor]]:
    ex = text_examples(N_SEQ, SEQ, seed=5)
    ex[1]["attention_mask"][4:] = 0  # padded at the end: still one usable sequence
    ex[2]["attention_mask"][:] = 0  # all padding: weight 0, not a row of the heads
    for i, e in enumerate(ex):
        e["labels"] = torch.tensor(i % 3)
    return ex


def _brute_force(model, ex) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{head: (A, G)}`` of one batch: float64 outer products over the usable sequences."""
    mods = dict(model.named_modules())
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name):
        def hook(module, args, out):
            seen[name] = [args[0], out]
        return hook

    handles = [mods[n].register_forward_hook(keep(n)) for n in HEADS]
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    labels = torch.stack([e["labels"] for e in ex])
    try:
        logits = model(**batch).logits
    finally:
        for h in handles:
            h.remove()
    loss = F.cross_entropy(logits, labels, reduction="sum")  # Σ_b ℓ_b: row b is ∂ℓ_b/∂z_b
    grads = torch.autograd.grad(loss, [seen[n][1] for n in HEADS])
    usable = batch["attention_mask"].any(1)
    out = {}
    for n, g in zip(HEADS, grads):
        a = torch.cat([seen[n][0], torch.ones(len(ex), 1, dtype=torch.float64)], 1)[usable]
        g = g[usable]
        out[n] = (a.T @ a / len(a), g.T @ g / len(g))
    return out


def test_head_factors_equal_per_sequence_brute_force(tmp_path):
    model, ex = _bert(), _examples()[:BATCH]
    want = _brute_force(model, ex)
    cb, _, _ = run(model, ex, {"include": [r"pooler\.dense", r"^classifier$",
                                           r"output\.dense"]},
                   batch=BATCH, steps=1, lr=0.0, tmp_path=tmp_path, record=False)
    tracker = cb.tracker
    assert tracker.capture.row_space["classifier"] == "sequence"
    assert tracker.capture.row_space["bert.encoder.layer.0.output.dense"] == "position"
    got = tracker.factors()
    for n in HEADS:
        assert rel_err(got[n][0].double(), want[n][0]) <= EXACT_TOL, n
        assert rel_err(got[n][1].double(), want[n][1]) <= EXACT_TOL, n
    counters = tracker.read_counters()  # usable: sequences 0, 1, 3; positions 10 + 4 + 0 + 10
    assert counters.sequences_seen == BATCH - 1
    assert counters.tokens_seen == SEQ + 4 + SEQ


def test_head_posterior_takes_sequences_as_n(tmp_path):
    model, ex = _bert(), _examples()
    run(model, ex, {"include": [r"^classifier$", r"output\.dense"]}, batch=BATCH, steps=2,
        tmp_path=tmp_path, record=False)
    model.eval()
    snap = Snapshot.latest(tmp_path / "kfac")
    assert snap.manifest.layers["classifier"].rows == "sequence"
    assert snap.manifest.layers["bert.encoder.layer.0.output.dense"].rows is None
    counts = snap.manifest.counts
    assert counts.sequences_seen == N_SEQ - 1  # one epoch; the all-padding one not counted
    post = LaplacePosterior(model, snap, prior_precision=TAU, layers=["classifier"])
    n_seq = post.layer_num_data["classifier"]  # a posterior of sequence rows: N in sequences
    assert n_seq == post.num_data == N_SEQ - 1 and post.num_data_unit == "sequence"
    both = LaplacePosterior(model, snap, prior_precision=TAU)  # mixed: N in token positions
    assert both.num_data_unit == "position" and both.num_data == counts.tokens_seen
    assert both.layer_num_data == {n: N_SEQ - 1 if n == "classifier" else counts.tokens_seen
                                   for n in snap.layer_names}
    half = LaplacePosterior(model, snap, prior_precision=TAU, num_data=counts.tokens_seen / 2)
    assert half.layer_num_data["classifier"] == (N_SEQ - 1) / 2  # your N rescales every layer
    batch = {k: torch.stack([e[k] for e in ex[:2]]) for k in ("input_ids", "attention_mask")}
    _, cov = post.predictive(batch)
    # dense: logits = W̄ x̄ (x̄ = [pooled; 1]); row-major vec(W̄): J_k = e_k ⊗ x̄
    pooled = {}
    h = model.classifier.register_forward_pre_hook(lambda m, a: pooled.update(x=a[0]))
    with torch.no_grad():
        model(**batch)
    h.remove()
    x = torch.cat([pooled["x"], torch.ones(2, 1, dtype=torch.float64)], 1)  # [2, d+1]
    lf = snap["classifier"]
    prec = n_seq * torch.kron(lf.G.double(), lf.A.double()) + TAU * torch.eye(
        lf.G.shape[0] * lf.A.shape[0], dtype=torch.float64)
    eye = torch.eye(3, dtype=torch.float64)
    for b in range(2):
        J = torch.stack([torch.kron(eye[k], x[b]) for k in range(3)])  # [3, 3·(d+1)]
        ref = J @ torch.linalg.solve(prec, J.T)
        assert rel_err(cov[b], ref) <= 1e-8, b  # float16 snapshot factors, same in both


def test_diagonal_factors_under_mc_subbatch_replay_equal_dense_diagonals(tmp_path):
    ex = text_examples(8, 12)

    def factors(max_dense_dim: int):
        model = tiny_gpt2()
        cb, _, _ = run(model, ex, {"fisher": "mc", "mc_sequences": 2, "seed": 0,
                                   "max_dense_dim": max_dense_dim},
                       batch=8, steps=1, lr=0.0, tmp_path=tmp_path / str(max_dense_dim),
                       record=False)
        return cb.tracker.factors()

    dense, diag = factors(8192), factors(4)
    assert any(f.dim() == 1 for pair in diag.values() for f in pair)  # diagonals were made
    for n, pair in dense.items():
        for full, d in zip(pair, diag[n]):
            d = d if d.dim() == 1 else d.diagonal()
            assert rel_err(d.double(), full.diagonal().double()) <= EXACT_TOL, n


# -- the reduce form: one row per sequence for a position-space layer ------------------------

BLOCK = "bert.encoder.layer.0.output.dense"  # input [B, T, 32], output [B, T, 16]


def _reduce_brute_force(model, ex, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, G)`` of the reduce form for layer ``name`` over one batch: per usable sequence
    ``ā = mean_t [a_t; 1]`` and ``ĝ = Σ_t ∂ℓ_b/∂z_t`` over its usable positions, float64."""
    seen = {}

    def hook(module, args, out):
        seen["x"], seen["z"] = args[0], out

    h = dict(model.named_modules())[name].register_forward_hook(hook)
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    labels = torch.stack([e["labels"] for e in ex])
    try:
        logits = model(**batch).logits
    finally:
        h.remove()
    (g,) = torch.autograd.grad(F.cross_entropy(logits, labels, reduction="sum"), [seen["z"]])
    m = batch["attention_mask"].double()  # [B, T]
    usable = m.sum(1) > 0
    x = torch.cat([seen["x"], torch.ones(*seen["x"].shape[:2], 1, dtype=torch.float64)], 2)
    a = torch.einsum("bt,btd->bd", m, x) / m.sum(1, keepdim=True).clamp(min=1)
    g = torch.einsum("bt,btd->bd", m, g)
    a, g = a[usable], g[usable]
    return a.T @ a / len(a), g.T @ g / len(g)


def test_reduce_form_factors_equal_per_sequence_brute_force(tmp_path):
    model, ex = _bert(), _examples()[:BATCH]
    want_a, want_g = _reduce_brute_force(model, ex, BLOCK)
    cb, _, _ = run(model, ex, {"include": [r"output\.dense$", r"^classifier$"],
                               "factor_form": "reduce", "token_fraction": 0.25},
                   batch=BATCH, steps=1, lr=0.0, tmp_path=tmp_path, record=False)
    tracker = cb.tracker
    assert tracker.curvature.reduces and tracker.capture.row_space[BLOCK] == "sequence"
    got_a, got_g = tracker.factors()[BLOCK]
    # token_fraction < 1 changes nothing: every sequence is reduced over all its positions
    assert rel_err(got_a.double(), want_a) <= EXACT_TOL
    assert rel_err(got_g.double(), want_g) <= EXACT_TOL
    want_head = _brute_force(model, ex)["classifier"]  # a [B, d] head: the same either form
    assert rel_err(tracker.factors()["classifier"][0].double(), want_head[0]) <= EXACT_TOL


def test_auto_form_reduces_for_a_sequence_level_loss_only():
    from transformers import GPT2ForSequenceClassification

    from kfac_stream import KFACConfig
    from kfac_stream.fisher.curvature import Curvature

    auto = KFACConfig(factor_form="auto")
    assert Curvature.of(auto, _bert()).form == "reduce"
    assert Curvature.of(auto, tiny_gpt2()).form == "expand"  # a causal LM: loss per token
    gpt2_cls = GPT2ForSequenceClassification(tiny_gpt2().config)
    assert Curvature.of(auto, gpt2_cls).form == "reduce"
    assert Curvature.of(KFACConfig(), _bert()).form == "expand"  # the default, as given


#: Updates averaged by the unbiasedness test, and its tolerance (loose: a Monte-Carlo mean):
#: the relative Frobenius error of the mean of K = 300 updates, each replaying 2 of a batch's
#: 4 sequences with sampled labels. Measured at seed 3: A 0.0015, G 0.049 (the label draws
#: dominate). 0.2 is 4x the G error, while a missing 1/P(drawn) weight is 0.5 off (b/B).
UNBIASED_UPDATES, UNBIASED_TOL = 300, 0.2


def _expected_mc_reduce(model, ex, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduce form's ``(A, G)`` in expectation over the sampled labels, exactly:
    ``G = mean_b Σ_c p_bc ĝ_b(c) ĝ_b(c)ᵀ`` (one backward per class)."""
    seen = {}

    def hook(module, args, out):
        seen["x"], seen["z"] = args[0], out

    h = dict(model.named_modules())[name].register_forward_hook(hook)
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    try:
        logits = model(**batch).logits  # [B, C]
    finally:
        h.remove()
    m = batch["attention_mask"].double()
    usable = m.sum(1) > 0
    x = torch.cat([seen["x"], torch.ones(*seen["x"].shape[:2], 1, dtype=torch.float64)], 2)
    a = (torch.einsum("bt,btd->bd", m, x) / m.sum(1, keepdim=True).clamp(min=1))[usable]
    p = logits.softmax(-1).detach()
    G = 0.0
    for c in range(logits.shape[1]):
        y = torch.full((len(ex),), c)
        (g,) = torch.autograd.grad(F.cross_entropy(logits, y, reduction="sum"), [seen["z"]],
                                   retain_graph=True)
        g = torch.einsum("bt,btd->bd", m, g)
        G = G + torch.einsum("b,bi,bj->ij", p[:, c][usable], g[usable], g[usable])
    return a.T @ a / len(a), G / int(usable.sum())


def test_reduce_form_under_mc_subbatch_replay_is_unbiased(tmp_path):
    """The MC sub-batch replay of 2 of 4 sequences weighs each by 1/P(drawn) = 2: the mean of
    many updates (ema_decay=1, lr=0: the same batch each step) approaches the expectation
    over sequences drawn and labels sampled, computed exactly."""
    model, ex = _bert(), _examples()[:BATCH]
    want_a, want_g = _expected_mc_reduce(model, ex, BLOCK)
    cb, _, _ = run(model, ex * UNBIASED_UPDATES, {"include": [r"output\.dense$"],
                                                  "factor_form": "reduce", "fisher": "mc",
                                                  "mc_sequences": 2, "seed": 3},
                   batch=BATCH, steps=UNBIASED_UPDATES, lr=0.0, tmp_path=tmp_path,
                   record=False, dataloader_drop_last=True)
    got_a, got_g = cb.tracker.factors()[BLOCK]
    print(f"reduce form, MC sub-batch 2 of 4, {UNBIASED_UPDATES} updates: relative error "
          f"A {rel_err(got_a.double(), want_a):.3g}, G {rel_err(got_g.double(), want_g):.3g}")
    assert rel_err(got_a.double(), want_a) <= UNBIASED_TOL
    assert rel_err(got_g.double(), want_g) <= UNBIASED_TOL
