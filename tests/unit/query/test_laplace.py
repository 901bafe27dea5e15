"""LaplacePosterior against dense linear algebra: predictive, samples, evidence."""

import math

import pytest
import torch
from torch.func import functional_call, jacrev

from kfac_stream import QueryInputError, Snapshot, SnapshotMismatchError
from kfac_stream.query.kron_eigen import sample_block
from kfac_stream.query.laplace import LaplacePosterior

from harness import run, sum_nll_loss
from models import text_examples, tiny_gpt2
from reference import rel_err

DENSE_TOL = 1e-8  # float64 throughout; eigh vs inverse rounding only
N_DATA, TAU = 50.0, 0.7


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("laplace")
    model = tiny_gpt2()
    run(model, text_examples(8, 12), {"snapshot_every": 10**6}, batch=2, loss=sum_nll_loss,
        tmp_path=tmp, record=False)
    return model, Snapshot.latest(tmp / "kfac")


def dense_block(lf, num_data, tau):
    """N·(G ⊗ A) + τI in the row-major vec order of W̄ = [W b] ([d_out, d_A])."""
    G = lf.G if lf.G.dim() == 2 else torch.diag(lf.G)
    A = lf.A if lf.A.dim() == 2 else torch.diag(lf.A)
    return num_data * torch.kron(G.double(), A.double()) + tau * torch.eye(G.shape[0] * A.shape[0],
                                                                          dtype=torch.float64)


def dense_jacobian(model, names, batch, pos, token_ids):
    """d f / d W̄ per layer by torch.func on the functional model: {name: [B, K, d_out, d_A]}."""
    mods = dict(model.named_modules())

    def params_of(wbar):
        out = {}
        for n, w in wbar.items():
            m = mods[n]
            d_in = w.shape[1] - 1
            weight = w[:, :d_in]
            out[n + ".weight"] = weight.T if type(m).__name__ == "Conv1D" else weight
            out[n + ".bias"] = w[:, d_in]
        return out

    def f(wbar):
        logits = functional_call(model, params_of(wbar), (), {"input_ids": batch["input_ids"],
                                 "attention_mask": batch["attention_mask"]}).logits
        return logits[torch.arange(logits.shape[0]), pos][:, token_ids]  # [B, K]

    post = None
    wbar = {}
    for n in names:
        m = mods[n]
        w = m.weight.detach().double()
        w = w.T if type(m).__name__ == "Conv1D" else w
        wbar[n] = torch.cat([w, m.bias.detach().double()[:, None]], 1)
    del post
    return jacrev(f)(wbar)


def test_predictive_covariance_equals_dense_J_Sigma_Jt(trained):
    model, snap = trained
    post = LaplacePosterior(model, snap, prior_precision=TAU, num_data=N_DATA)
    ex = text_examples(2, 10, seed=5, lengths=[10, 7])
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    tokens = [3, 101, 32]
    mean, cov = post.predictive(batch, positions=-1, token_ids=tokens)
    jac = dense_jacobian(model, snap.layer_names, batch, torch.tensor([9, 6]), tokens)
    ref = torch.zeros(2, 3, 3, dtype=torch.float64)
    for n in snap.layer_names:
        J = jac[n].reshape(2, 3, -1)  # [B, K, P]
        sigma = torch.linalg.inv(dense_block(snap[n], N_DATA, TAU))
        ref += J @ sigma @ J.transpose(1, 2)
    print(f"predictive covariance vs dense: {rel_err(cov, ref):.1e}")
    assert rel_err(cov, ref) <= DENSE_TOL
    with torch.no_grad():
        logits = model(**batch).logits
    assert torch.allclose(mean, logits[[0, 1], [9, 6]][:, tokens].double(), rtol=1e-12)


def test_float64_snapshot_eigendecomposition_is_exact(trained):
    _, snap = trained
    for n in snap.layer_names:
        lf = snap[n]
        for f in ("A", "G"):
            q, w = getattr(lf, f + "_eigvecs"), getattr(lf, f + "_eigvals")
            assert q.dtype == torch.float64
            assert rel_err((q * w) @ q.T, getattr(lf, f)) <= 1e-12


def test_log_marginal_likelihood_equals_dense_logdet(trained):
    model, snap = trained
    post = LaplacePosterior(model, snap, prior_precision=TAU, num_data=N_DATA)
    ref = 0.0
    for n in snap.layer_names:
        w = post.weights(n)
        H = dense_block(snap[n], N_DATA, TAU)
        P = H.shape[0]
        log_prior = 0.5 * P * math.log(TAU / (2 * math.pi)) - 0.5 * TAU * float((w * w).sum())
        ref += log_prior + 0.5 * P * math.log(2 * math.pi) - 0.5 * float(torch.logdet(H))
    got = post.log_marginal_likelihood(TAU, log_likelihood=-12.5)
    assert abs(got - (ref - 12.5)) <= DENSE_TOL * abs(ref)


def test_optimize_prior_precision_finds_the_grid_maximiser(trained):
    model, snap = trained
    post = LaplacePosterior(model, snap, prior_precision="marglik", num_data=N_DATA)
    grid = torch.logspace(-4, 4, 801).tolist()  # spacing 10**0.01 in τ
    vals = [post.log_marginal_likelihood(t) for t in grid]
    best = grid[max(range(len(grid)), key=vals.__getitem__)]
    assert abs(math.log10(post.prior_precision) - math.log10(best)) <= 0.01
    assert post.log_marginal_likelihood() >= max(vals) - 1e-9


# 20k draws of a 272-parameter block: the empirical covariance's relative Frobenius error is
# ~sqrt(P/S) = 0.12 (measured 0.12); per-entry variances are good to ~sqrt(2/S) = 0.01 each,
# max over 272 entries ~0.04.
SAMPLE_FRO_TOL, SAMPLE_VAR_TOL, N_SAMPLES = 0.16, 0.06, 20_000


def test_posterior_samples_have_the_analytic_covariance(trained):
    model, snap = trained
    name = "transformer.h.0.attn.c_proj"  # [16, 17]
    post = LaplacePosterior(model, snap, prior_precision=TAU, num_data=N_DATA)
    qa, aval, qg, gval = post.eig[name]
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_block(qg, gval, qa, aval, N_DATA, TAU, gen).reshape(-1)
                         for _ in range(N_SAMPLES)])  # [S, P]
    emp = draws.T @ draws / N_SAMPLES
    sigma = torch.linalg.inv(dense_block(snap[name], N_DATA, TAU))
    fro = rel_err(emp, sigma)
    var = float(((emp.diagonal() - sigma.diagonal()) / sigma.diagonal()).abs().max())
    print(f"sample covariance vs analytic: fro {fro:.3f}, max variance error {var:.3f}")
    assert fro <= SAMPLE_FRO_TOL and var <= SAMPLE_VAR_TOL


def test_sampled_weights_are_the_same_draws_and_restore_exactly(trained):
    model, snap = trained
    post = LaplacePosterior(model, snap, prior_precision=TAU, num_data=N_DATA)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    name = snap.layer_names[0]
    with post.sampled_weights(seed=3):
        delta = post.weights(name) - torch.cat(
            [before[name + ".weight"].T, before[name + ".bias"][:, None]], 1)
    gen = torch.Generator().manual_seed(3)
    qa, aval, qg, gval = post.eig[name]
    expect = sample_block(qg, gval, qa, aval, N_DATA, TAU, gen)
    assert rel_err(delta, expect) <= 1e-12
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ZeroDivisionError):
        with post.sampled_weights(seed=4):
            1 / 0  # noqa: B018 (the body raises on purpose)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_probit_and_mc_probabilities_agree():
    from kfac_stream.query.calibration import probs_from_gaussian

    mean = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64)
    cov = torch.tensor([[[0.5, 0.1, 0.0], [0.1, 0.3, 0.0], [0.0, 0.0, 0.2]]], dtype=torch.float64)
    p_mc = probs_from_gaussian(mean, cov, "mc", n_samples=200_000)
    p_probit = probs_from_gaussian(mean, cov, "probit")
    assert torch.allclose(p_mc.sum(-1), torch.ones(1, dtype=torch.float64))
    # probit is an approximation: agreement to ~1e-2 for variances below 1
    assert (p_mc - p_probit).abs().max() < 2e-2
    assert (p_probit[0, 0] < torch.softmax(mean, -1)[0, 0])  # uncertainty flattens


def test_meanfield_link_against_closed_forms_and_mc():
    """The pairwise mean-field link: softmax(μ) under no or fully shared noise (where probit
    moves), the probit sigmoid of the difference at K = 2, and the MC predictive at moderate
    variances (an approximation: within 2e-2, like probit's)."""
    from kfac_stream.query.calibration import probs_from_gaussian

    mean = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64)
    soft = torch.softmax(mean, -1)
    zero = torch.zeros(1, 3, 3, dtype=torch.float64)
    assert torch.allclose(probs_from_gaussian(mean, zero, "meanfield"), soft, atol=1e-15)
    shared = torch.full((1, 3, 3), 25.0, dtype=torch.float64)  # one noise on every logit
    assert torch.allclose(probs_from_gaussian(mean, shared, "meanfield"), soft, atol=1e-12)
    assert (probs_from_gaussian(mean, shared, "probit") - soft).abs().max() > 0.1

    m2 = torch.tensor([[0.7, -0.4]], dtype=torch.float64)
    c2 = torch.tensor([[[2.0, 0.5], [0.5, 1.0]]], dtype=torch.float64)
    s2 = 2.0 + 1.0 - 2 * 0.5
    p1 = torch.sigmoid(torch.tensor(1.1 / math.sqrt(1 + math.pi / 8 * s2), dtype=torch.float64))
    got = probs_from_gaussian(m2, c2, "meanfield")
    assert abs(got[0, 0].item() - p1.item()) < 1e-14 and abs(got.sum().item() - 1) < 1e-14

    cov = torch.tensor([[[0.5, 0.1, 0.0], [0.1, 0.3, 0.0], [0.0, 0.0, 0.2]]], dtype=torch.float64)
    p_mc = probs_from_gaussian(mean, cov, "mc", n_samples=200_000)
    p_mf = probs_from_gaussian(mean, cov, "meanfield")
    assert (p_mc - p_mf).abs().max() < 2e-2


def test_mismatched_model_names_the_first_mismatch(trained):
    _, snap = trained
    with pytest.raises(SnapshotMismatchError, match=r"layer 'transformer.h.0.attn.c_attn' has"):
        LaplacePosterior(tiny_gpt2(n_embd=32), snap)
    with pytest.raises(SnapshotMismatchError, match="is not a module of the model"):
        LaplacePosterior(tiny_gpt2(n_layer=1), snap)


def test_fit_confidence_beta_recovers_the_generating_beta():
    from kfac_stream.query.calibration import fit_confidence_beta

    gen = torch.Generator().manual_seed(0)
    var = torch.rand(200_000, generator=gen, dtype=torch.float64) * 4
    beta0 = 2.5
    correct = torch.rand(200_000, generator=gen, dtype=torch.float64) < 1 / (1 + beta0 * var)
    beta = fit_confidence_beta(var, correct)
    # maximum-likelihood estimate from 2e5 Bernoulli draws: standard error ~1% here
    assert beta == pytest.approx(beta0, rel=0.05)


@pytest.fixture(scope="module")
def trained_diag(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("laplace_diag")
    model = tiny_gpt2()
    run(model, text_examples(8, 12), {"max_dense_dim": 20}, batch=2, loss=sum_nll_loss,
        tmp_path=tmp, record=False)
    return model, Snapshot.latest(tmp / "kfac")


def test_diagonal_fallback_layers_take_part_with_their_diagonal_structure(trained_diag):
    model, snap = trained_diag
    assert sum(snap[n].A.dim() == 1 or snap[n].G.dim() == 1 for n in snap.layer_names) == 6
    post = LaplacePosterior(model, snap, prior_precision=TAU, num_data=N_DATA)
    ex = text_examples(2, 10, seed=7)
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    mean, cov = post.predictive(batch, positions=-1, token_ids=[5, 40])
    jac = dense_jacobian(model, snap.layer_names, batch, torch.tensor([9, 9]), [5, 40])
    ref = torch.zeros(2, 2, 2, dtype=torch.float64)
    logdet = 0.0
    for n in snap.layer_names:
        J = jac[n].reshape(2, 2, -1)
        H = dense_block(snap[n], N_DATA, TAU)
        ref += J @ torch.linalg.inv(H) @ J.transpose(1, 2)
        w = post.weights(n)
        logdet += 0.5 * H.shape[0] * math.log(TAU) - 0.5 * TAU * float((w * w).sum()) \
            - 0.5 * float(torch.logdet(H))
    assert rel_err(cov, ref) <= DENSE_TOL
    assert abs(post.log_marginal_likelihood() - logdet) <= DENSE_TOL * abs(logdet)
    with post.sampled_weights(seed=1):
        pass


def test_sequence_classification_head(tmp_path):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=256, n_positions=64, num_labels=4,
        pad_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).double()
    ex = text_examples(8, 12)
    for i, e in enumerate(ex):
        e["labels"] = torch.tensor(i % 4)
    cb, _, _ = run(model, ex, batch=2, tmp_path=tmp_path, record=False)
    assert cb.tracker.counters.updates == 4 and cb.tracker.counters.skipped_updates == 0
    snap = Snapshot.latest(tmp_path / "kfac")
    post = LaplacePosterior(model, snap, prior_precision=TAU, num_data=N_DATA)
    batch = {k: torch.stack([e[k] for e in ex[:2]]) for k in ("input_ids", "attention_mask")}
    mean, cov = post.predictive(batch)  # all 4 classes
    assert mean.shape == (2, 4) and cov.shape == (2, 4, 4)

    mods = dict(model.named_modules())

    def f(wbar):
        params = {}
        for n, w in wbar.items():
            params[n + ".weight"] = w[:, :-1].T  # Conv1D
            params[n + ".bias"] = w[:, -1]
        return functional_call(model, params, (), dict(batch)).logits

    wbar = {n: torch.cat([mods[n].weight.detach().T, mods[n].bias.detach()[:, None]], 1)
            for n in snap.layer_names}
    jac = jacrev(f)(wbar)
    ref = torch.zeros(2, 4, 4, dtype=torch.float64)
    for n in snap.layer_names:
        J = jac[n].reshape(2, 4, -1)
        ref += J @ torch.linalg.inv(dense_block(snap[n], N_DATA, TAU)) @ J.transpose(1, 2)
    assert rel_err(cov, ref) <= DENSE_TOL
    probs = post.predictive_probs(batch, method="probit")
    assert torch.allclose(probs.sum(-1), torch.ones(2, dtype=torch.float64))
    # the default link is the probit (the rule without held-out data), on the dense reference
    # covariance; the mean-field link likewise
    from kfac_stream.query.calibration import probs_from_gaussian
    assert torch.equal(post.predictive_probs(batch), probs)
    assert rel_err(probs, probs_from_gaussian(mean, ref, "probit")) <= DENSE_TOL
    assert rel_err(post.predictive_probs(batch, method="meanfield"),
                   probs_from_gaussian(mean, ref, "meanfield")) <= DENSE_TOL
    heldout = [{"batch": batch, "token_ids": [0, 1, 2, 3], "labels": torch.tensor([0, 1])}]
    beta = post.fit_beta(heldout)
    assert beta > 0 and post.confidence(torch.tensor(1.0)) == pytest.approx(1 / (1 + beta))


def test_per_layer_prior_precision(trained):
    model, snap = trained
    ex = text_examples(2, 10, seed=9)
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    same = dict.fromkeys(snap.layer_names, TAU)
    _, c_float = LaplacePosterior(model, snap, TAU, N_DATA).predictive(batch, token_ids=[1, 2])
    post = LaplacePosterior(model, snap, same, N_DATA)
    _, c_dict = post.predictive(batch, token_ids=[1, 2])
    assert torch.allclose(c_float, c_dict, rtol=1e-14)
    stiffer = dict(same, **{snap.layer_names[0]: 1e6})  # one layer pinned near its MAP value
    _, c_stiff = LaplacePosterior(model, snap, stiffer, N_DATA).predictive(batch, token_ids=[1, 2])
    assert (torch.diagonal(c_stiff, dim1=1, dim2=2) < torch.diagonal(c_dict, dim1=1, dim2=2)).all()
    assert post.log_marginal_likelihood(same) == pytest.approx(post.log_marginal_likelihood(TAU),
                                                               rel=1e-14)


def test_k_logit_backwards_loop_on_cpu_batched_by_choice_and_fall_back_exactly(trained,
                                                                              monkeypatch):
    """The K backward passes of a predictive: on the CPU a loop of K backwards (measured
    faster there); batched (one ``is_grads_batched`` backward, vmap over the K cotangents, the
    accelerators' default) the same covariance; where the batched one raises (an op without
    a batching rule) the loop again. Float64 round-off apart: the same products summed in
    another order."""
    from kfac_stream.query import per_example

    model, snap = trained
    post = LaplacePosterior(model, snap, prior_precision=TAU, num_data=N_DATA)
    ex = text_examples(2, 10, seed=5, lengths=[10, 7])
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    tokens = [3, 101, 32, 7]
    real_grad, calls = torch.autograd.grad, []

    def recording(*args, **kw):
        calls.append(bool(kw.get("is_grads_batched", False)))
        return real_grad(*args, **kw)

    monkeypatch.setattr(torch.autograd, "grad", recording)
    mean, cov = post.predictive(batch, positions=-1, token_ids=tokens)
    assert calls == [False] * 4  # the CPU's loop
    real = per_example.logit_gradients
    monkeypatch.setattr(per_example, "logit_gradients",
                        lambda f, outs, batched=None: real(f, outs, True))
    calls.clear()
    mean_b, cov_b = post.predictive(batch, positions=-1, token_ids=tokens)
    assert calls == [True]
    assert torch.equal(mean, mean_b) and rel_err(cov_b, cov) <= DENSE_TOL

    def no_vmap(*args, **kw):
        if kw.get("is_grads_batched"):
            raise RuntimeError("Batching rule not implemented for aten::something")
        return recording(*args, **kw)

    calls.clear()
    monkeypatch.setattr(torch.autograd, "grad", no_vmap)
    mean2, cov2 = post.predictive(batch, positions=-1, token_ids=tokens)
    assert calls == [False] * 4
    assert torch.equal(mean, mean2) and rel_err(cov2, cov) <= DENSE_TOL


def test_posterior_over_a_preset_or_a_list_of_layers_is_the_block_marginal(trained):
    """``layers=``: the block-diagonal posterior's marginal over some layers: its predictive
    covariance is the sum of those layers' terms of the full posterior (the dense reference of
    `test_predictive_covariance_equals_dense_J_Sigma_Jt`), its log evidence the sum of their
    terms; a preset resolves on the model; unknown names and presets are one-line errors."""
    model, snap = trained
    ex = text_examples(2, 10, seed=5, lengths=[10, 7])
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    tokens = [3, 101, 32]
    mlp = [n for n in snap.layer_names if ".mlp." in n]
    jac = dense_jacobian(model, snap.layer_names, batch, torch.tensor([9, 6]), tokens)
    ref = torch.zeros(2, 3, 3, dtype=torch.float64)
    for n in mlp:
        J = jac[n].reshape(2, 3, -1)
        ref += J @ torch.linalg.inv(dense_block(snap[n], N_DATA, TAU)) @ J.transpose(1, 2)
    by_preset = LaplacePosterior(model, snap, TAU, N_DATA, layers="mlp")
    by_list = LaplacePosterior(model, snap, TAU, N_DATA, layers=list(reversed(mlp)))
    assert by_preset.layer_names == by_list.layer_names == mlp and len(mlp) == 4
    _, cov = by_preset.predictive(batch, positions=-1, token_ids=tokens)
    assert rel_err(cov, ref) <= DENSE_TOL
    full = LaplacePosterior(model, snap, TAU, N_DATA)
    attn = LaplacePosterior(model, snap, TAU, N_DATA, layers="attention")
    assert math.isclose(by_preset.log_marginal_likelihood() + attn.log_marginal_likelihood(),
                        full.log_marginal_likelihood(), rel_tol=1e-12)
    with pytest.raises(QueryInputError, match=r"^LaplacePosterior: layers='lora' selects "
                       r"nothing here \(.*lora.*\): must be None, a preset"):
        LaplacePosterior(model, snap, TAU, N_DATA, layers="lora")
    with pytest.raises(QueryInputError, match=r"^LaplacePosterior: layers='last_layer' selects "
                       r"1 layer\(s\) the snapshot did not track \(e.g. 'lm_head'\)"):
        LaplacePosterior(model, snap, TAU, N_DATA, layers="last_layer")
    with pytest.raises(QueryInputError, match=r"names 'nope', which the snapshot did not track"):
        LaplacePosterior(model, snap, TAU, N_DATA, layers=["nope"])


def test_a_layer_applied_several_times_sums_its_calls(tmp_path):
    """ALBERT applies its one shared layer group at every depth: a tracked Linear runs
    ``num_hidden_layers`` times per forward, and the Jacobian of a logit w.r.t. its weights is
    the sum over the calls (the dense reference: torch.func on the parameters, which sums by
    itself). Keeping only the last call's features fails here."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    torch.manual_seed(0)
    model = AlbertForSequenceClassification(AlbertConfig(
        vocab_size=256, embedding_size=8, hidden_size=16, num_hidden_layers=3,
        num_attention_heads=2, intermediate_size=24, max_position_embeddings=64, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0)).double()
    ex = text_examples(8, 12)
    for i, e in enumerate(ex):
        e["labels"] = torch.tensor(i % 3)
    shared = "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn"
    run(model, ex, {"include": [shared + "$"]}, batch=2, tmp_path=tmp_path, record=False)
    snap = Snapshot.latest(tmp_path / "kfac")
    assert snap.layer_names == [shared]
    model.eval()
    post = LaplacePosterior(model, snap, prior_precision=TAU, num_data=N_DATA)
    batch = {k: torch.stack([e[k] for e in ex[:2]]) for k in ("input_ids", "attention_mask")}
    _, cov = post.predictive(batch)
    m = dict(model.named_modules())[shared]

    def f(wbar):
        return functional_call(model, {shared + ".weight": wbar[:, :-1],
                                       shared + ".bias": wbar[:, -1]}, (), dict(batch)).logits

    J = jacrev(f)(torch.cat([m.weight.detach(), m.bias.detach()[:, None]], 1)).reshape(2, 3, -1)
    ref = J @ torch.linalg.inv(dense_block(snap[shared], N_DATA, TAU)) @ J.transpose(1, 2)
    print(f"shared layer: predictive covariance vs dense {rel_err(cov, ref):.1e}")
    assert rel_err(cov, ref) <= DENSE_TOL
