"""`sampled_predictive`: S posterior weight samples in batched forwards against a
loop over ``sampled_weights``, the linearised variant against the exact linearised predictive,
the entropy decomposition, and its argument checks."""

import math

import pytest
import torch

from kfac_stream import QueryInputError, Snapshot
from kfac_stream.query.laplace import LaplacePosterior
from kfac_stream.query.sampled import SampledPredictive, sampled_predictive

from harness import classifier_posterior, lm_posterior, run, sum_nll_loss
from models import lora_gpt2, padded_batch, text_examples, tiny_gpt2
from reference import rel_err

#: float64 model: batched matmuls (bmm) against F.linear / addmm on the same weights, the same
#: numbers summed in another order (measured ~1e-15).
ROUNDOFF_TOL = 1e-10
N_DATA, TAU = 50.0, 0.7
#: |z| bound of the Monte Carlo checks: a standard normal exceeds 4.5 with probability 7e-6,
#: so a check of 8 mean and 20 covariance entries (B = 2, K = 4) fails a correct
#: implementation with probability < 2e-4 (the draws are seeded: the tests are deterministic).
MC_Z = 4.5
MC_SAMPLES = 2000


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return lm_posterior(tmp_path_factory.mktemp("sampled_lm"), TAU, N_DATA)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return classifier_posterior(tmp_path_factory.mktemp("sampled_cls"), TAU, N_DATA)


def loop_logits(post, batch, n, seed):
    """``[S, *P, V]``: the model's logits inside ``sampled_weights(seed + s)``, one by one."""
    out = []
    for s in range(n):
        with post.sampled_weights(seed=seed + s), torch.no_grad():
            out.append(post.model(**batch).logits)
    return torch.stack(out)


def stats_of(logits, labels=None):
    """The statistics of `SampledPredictive` from per-sample logits ``[S, *P, V]``, directly."""
    logp = torch.log_softmax(logits.double(), -1)
    p = logp.exp()
    probs = p.mean(0)
    out = {"probs": probs, "entropy": -(probs * probs.log()).sum(-1),
           "expected_entropy": -(p * logp).sum(-1).mean(0)}
    if labels is not None:
        lp = logp.gather(-1, labels.clamp(min=0).expand(logits.shape[:-1])[..., None])[..., 0]
        out["label_logprob_mean"], out["label_logprob_var"] = lp.mean(0), lp.var(0)
    return out


def next_tokens(batch):
    """``[B, T]``: the next token at each position, -100 at the last one and at padding."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    nxt = torch.full_like(ids, -100)
    nxt[:, :-1] = ids[:, 1:]
    keep = mask.clone()
    keep[:, :-1] &= mask[:, 1:]
    return nxt.masked_fill(~keep, -100)


TOKENS = [3, 101, 32, 200]


def at_positions(logits, batch, tokens):
    """``[..., B, K]``: per-sample logits ``[..., B, T, V]`` at each example's last token."""
    last = batch["attention_mask"].sum(1) - 1
    rows = logits[..., torch.arange(len(last)), last, :]
    return rows[..., tokens]


def mc_z_scores(f, mean, cov):
    """Standardised Monte Carlo errors of ``S`` draws ``f [S, B, K]`` of ``N(mean, cov)``:
    the sample mean's, in standard errors ``sqrt(Σ_kk / S)``, and the sample covariance's
    distinct entries', in standard errors ``sqrt((Σ_kk Σ_ll + Σ_kl²) / S)`` (Gaussian fourth
    moments). Returns ``(z_mean [B, K], z_cov [B, K(K+1)/2], sample covariance [B, K, K])``."""
    s, k = f.shape[0], f.shape[-1]
    var = torch.diagonal(cov, dim1=1, dim2=2)
    z_mean = (f.mean(0) - mean) / (var / s).sqrt()
    centred = f - f.mean(0)
    emp = torch.einsum("sbk,sbl->bkl", centred, centred) / (s - 1)
    se = ((var[:, :, None] * var[:, None, :] + cov**2) / s).sqrt()
    iu = torch.triu_indices(k, k)
    return z_mean, ((emp - cov) / se)[:, iu[0], iu[1]], emp


# -- 1. batched samples == a loop over sampled_weights -----------------------------------------


@pytest.mark.parametrize("head,slices", [("lm", "one"), ("lm", "many"), ("classifier", "one")])
def test_batched_samples_equal_a_loop_over_sampled_weights(request, monkeypatch, head, slices):
    """``slices="many"``: the statistics over row slices of 5 positions (7 + 1 partial over the
    36 positions; on a CPU the slices are cache-sized, one per sample in these tiny models)."""
    from kfac_stream.query.sample_stats import PredictiveAccumulator as _Accumulator

    post = request.getfixturevalue(head)
    if slices == "many":
        monkeypatch.setattr(_Accumulator, "CACHE_ELEMENTS", 5 * post.model.config.vocab_size)
    batch = padded_batch([12, 9, 6]) if head == "lm" else padded_batch([12, 7])
    labels = next_tokens(batch) if head == "lm" else torch.tensor([2, 0])
    before = {k: v.clone() for k, v in post.model.state_dict().items()}
    n, seed = 5, 11
    got = sampled_predictive(post, batch, n_samples=n, seed=seed, chunk=3,  # chunks of 3 and 2
                             linearized=False,
                             labels="next" if head == "lm" else labels, return_logits=True)
    ref = loop_logits(post, batch, n, seed)
    with torch.no_grad():
        map_logits = post.model(**batch).logits
    spread = rel_err(ref, map_logits.expand_as(ref))
    err = rel_err(got.sample_logits, ref)
    print(f"{head}: batched vs loop logits {err:.1e} (samples differ from the MAP by {spread:.2f})")
    assert got.sample_logits.shape == (n, *map_logits.shape)
    assert spread > 1e-3  # the samples are no MAP copies: the comparison means something
    assert err <= ROUNDOFF_TOL
    want = stats_of(ref, labels.to(torch.long))
    missing = labels == -100
    for name, value in want.items():
        have = getattr(got, name)
        assert have.shape == value.shape and have.dtype == torch.float64, name
        if name.startswith("label"):
            assert bool(have[missing].isnan().all()), name
            have, value = have[~missing], value[~missing]
        assert rel_err(have, value) <= ROUNDOFF_TOL, (name, rel_err(have, value))
    assert (got.n_samples, got.seed, got.linearized) == (n, seed, False)
    # nothing of the model changed: its weights bit for bit, no forward left replaced
    for k, v in post.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all("forward" not in m.__dict__ for m in post.modules.values())


@pytest.mark.parametrize("kind", ["diagonal", "lora"])
def test_batched_samples_equal_the_loop_for_diagonal_and_lora_layers(tmp_path, kind):
    """Diagonal-fallback factors (``Q = I``: no rotation) and peft LoRA adapters (the tracked
    ``lora_A``/``lora_B`` ``nn.Linear`` layers, no bias, inside peft's LoRA forward)."""
    model = lora_gpt2() if kind == "lora" else tiny_gpt2()
    cfg = {"max_dense_dim": 20} if kind == "diagonal" else {}
    run(model, text_examples(8, 12), {"snapshot_every": 10**6, **cfg}, batch=2,
        loss=sum_nll_loss, tmp_path=tmp_path, record=False)
    post = LaplacePosterior(model, Snapshot.latest(tmp_path / "kfac"), TAU, N_DATA)
    if kind == "diagonal":
        assert sum(post.eig[n][0] is None or post.eig[n][2] is None for n in post.modules) == 6
    else:
        assert len(post.modules) == 8 and all(".lora_" in n for n in post.modules)
    batch = padded_batch([10, 7])
    got = sampled_predictive(post, batch, n_samples=4, seed=3, chunk=3, return_logits=True,
                             linearized=False)
    ref = loop_logits(post, batch, 4, 3)
    with torch.no_grad():
        spread = rel_err(ref, post.model(**batch).logits.expand_as(ref))
    err = rel_err(got.sample_logits, ref)
    print(f"{kind}: batched vs loop logits {err:.1e} (samples differ from the MAP by {spread:.2f})")
    assert spread > 1e-3 and err <= ROUNDOFF_TOL
    lin = sampled_predictive(post, batch, n_samples=2000, seed=0, chunk=1000, linearized=True,
                             return_logits=True)
    mean, cov = post.predictive(batch, -1, TOKENS)
    z_mean, z_cov, _ = mc_z_scores(at_positions(lin.sample_logits, batch, TOKENS), mean, cov)
    print(f"{kind}: linearised S=2000: max |z| mean {z_mean.abs().max():.2f}, "
          f"covariance {z_cov.abs().max():.2f}")
    assert z_mean.abs().max() <= MC_Z and z_cov.abs().max() <= MC_Z


def test_chunking_does_not_change_the_result(lm):
    batch = padded_batch([10, 8])
    runs = [sampled_predictive(lm, batch, n_samples=7, seed=2, chunk=c, labels="next")
            for c in (1, 3, None, 100)]
    for r in runs[1:]:
        for name in ("probs", "entropy", "expected_entropy", "mutual_information"):
            assert rel_err(getattr(r, name), getattr(runs[0], name)) <= ROUNDOFF_TOL, name
        ok = ~runs[0].label_logprob_mean.isnan()
        assert rel_err(r.label_logprob_var[ok], runs[0].label_logprob_var[ok]) <= ROUNDOFF_TOL


# -- 2. the linearised variant == the exact linearised predictive ------------------------------


def test_linearized_samples_are_the_jvp_of_the_loop_weight_draws(lm):
    """``f_lin,s − f* = Σ_layers ⟨M, Q_Gᵀ ΔW̄_s Q_A⟩`` (M from `jacobian_features`, ΔW̄_s the
    weights inside ``sampled_weights(seed + s)``): the forward-mode JVP, to round-off."""
    batch = padded_batch([10, 7])
    n, seed = 3, 5
    got = sampled_predictive(lm, batch, n_samples=n, seed=seed, linearized=True,
                             return_logits=True)
    f_map, feats = lm.jacobian_features(batch, -1, TOKENS)
    feats = dict(feats)  # {layer: M [B, K, d_out, d_A]}
    trained = {name: lm.weights(name) for name in lm.modules}
    for s in range(n):
        with lm.sampled_weights(seed=seed + s):
            deltas = {name: lm.weights(name) - trained[name] for name in lm.modules}
        ref = f_map.clone()
        for name, m in feats.items():
            qa, _, qg, _ = lm.eig[name]
            ref += torch.einsum("bkij,ij->bk", m, qg.T @ deltas[name] @ qa)
        have = at_positions(got.sample_logits[s], batch, TOKENS)
        err = rel_err(have - f_map, ref - f_map)
        print(f"sample {s}: linearised logits vs J·ΔW {err:.1e}")
        assert err <= ROUNDOFF_TOL
    assert got.linearized


def test_linearized_sample_moments_match_the_exact_linearised_predictive(lm):
    """At S = 2000: sample mean within `MC_Z` standard errors ``sqrt(Σ_kk / S)`` of the MAP
    logits, each sample covariance entry within `MC_Z` of its standard error
    ``sqrt((Σ_kk Σ_ll + Σ_kl²) / S)`` (Gaussian fourth moments) of the exact ``J Σ Jᵀ``."""
    batch = padded_batch([10, 7])
    got = sampled_predictive(lm, batch, n_samples=MC_SAMPLES, seed=0, chunk=500,
                             linearized=True, return_logits=True)
    mean, cov = lm.predictive(batch, -1, TOKENS)  # [B, K], [B, K, K]
    f = at_positions(got.sample_logits, batch, TOKENS)  # [S, B, K]
    z_mean, z_cov, emp = mc_z_scores(f, mean, cov)
    s = MC_SAMPLES
    print(f"S={s}: max |z| mean {z_mean.abs().max():.2f}, covariance {z_cov.abs().max():.2f}; "
          f"covariance rel. error {rel_err(emp, cov):.3f} (expected ~sqrt(2/S) = "
          f"{math.sqrt(2 / s):.3f})")
    assert z_mean.abs().max() <= MC_Z
    assert z_cov.abs().max() <= MC_Z


# -- 3. entropy decomposition ------------------------------------------------------------------


@pytest.mark.parametrize("linearized", [False, True], ids=["sampled", "linearised"])
def test_mutual_information_is_total_minus_expected_entropy(lm, linearized):
    batch = padded_batch([12, 9])
    got = sampled_predictive(lm, batch, n_samples=16, seed=1, linearized=linearized,
                             return_logits=True)
    assert isinstance(got, SampledPredictive)
    assert got.probs.shape == (2, 12, 256) and got.entropy.shape == (2, 12)
    assert torch.allclose(got.probs.sum(-1), torch.ones(2, 12, dtype=torch.float64), atol=1e-12)
    want = stats_of(got.sample_logits)
    assert rel_err(got.entropy, want["entropy"]) <= ROUNDOFF_TOL
    assert rel_err(got.expected_entropy, want["expected_entropy"]) <= ROUNDOFF_TOL
    gap = got.entropy - got.expected_entropy
    assert (gap >= -1e-12).all()  # Jensen: the entropy of the mean is at least the mean entropy
    assert (got.mutual_information - gap).abs().max() <= 1e-12
    assert (got.mutual_information >= 0).all()
    assert got.mutual_information.max() > 1e-4  # at τ = 0.7 the weights matter
    assert (got.entropy <= math.log(256) + 1e-12).all()
    assert got.label_logprob_mean is None and got.label_logprob_var is None


#: τ = 1e12 ≫ N·γ·α: weight perturbations of std τ^-1/2 = 1e-6, probabilities moving by first
#: order in them (measured 6e-9) and MI by second order (measured 1e-13).
HUGE_TAU, MAP_PROBS_TOL, MAP_MI_TOL = 1e12, 1e-6, 1e-10


@pytest.mark.parametrize("linearized", [False, True], ids=["sampled", "linearised"])
def test_huge_prior_precision_gives_the_map_predictive(lm, linearized):
    post = LaplacePosterior(lm.model, lm.snapshot, HUGE_TAU, N_DATA)
    batch = padded_batch([12, 9])
    got = sampled_predictive(post, batch, n_samples=8, linearized=linearized)
    with torch.no_grad():
        map_probs = torch.softmax(lm.model(**batch).logits, -1)
    dp, mi = float((got.probs - map_probs).abs().max()), float(got.mutual_information.max())
    print(f"tau={HUGE_TAU:g}: max |probs - MAP softmax| {dp:.1e}, max MI {mi:.1e}")
    assert dp <= MAP_PROBS_TOL and mi <= MAP_MI_TOL
    assert rel_err(got.entropy, got.expected_entropy) <= 1e-6


def test_label_logprob_variance_grows_with_the_posterior_width(lm):
    batch = padded_batch([12, 9])
    wide = sampled_predictive(lm, batch, n_samples=16, labels="next")
    narrow = sampled_predictive(LaplacePosterior(lm.model, lm.snapshot, 1e3, N_DATA), batch,
                                n_samples=16, labels="next")
    ok = ~wide.label_logprob_var.isnan()
    assert ok.sum() == 11 + 8  # every position but the last of each example
    assert (wide.label_logprob_var[ok] > narrow.label_logprob_var[ok]).float().mean() > 0.9


def test_progress_bar_counts_samples(lm, capsys):
    sampled_predictive(lm, padded_batch([6]), n_samples=4, chunk=2, show_progress=True)
    assert "sampled predictive (4 samples of 1x6, linearised)" in capsys.readouterr().err


def test_default_is_the_linearised_predictive(lm):
    """Without ``linearized`` the predictive is the linearised model's (the one measured best
    on fine-tuned language models), the same draws as ``linearized=True``."""
    batch = padded_batch([8, 5])
    default = sampled_predictive(lm, batch, n_samples=3, seed=4, labels="next",
                                 return_logits=True)
    lin = sampled_predictive(lm, batch, n_samples=3, seed=4, labels="next", linearized=True,
                             return_logits=True)
    weights = sampled_predictive(lm, batch, n_samples=3, seed=4, labels="next",
                                 linearized=False, return_logits=True)
    assert default.linearized and torch.equal(default.sample_logits, lin.sample_logits)
    assert not torch.equal(default.sample_logits, weights.sample_logits)


# -- 4. argument errors ------------------------------------------------------------------------


BAD = [
    ({"post": "posterior"}, r"post='posterior' \(a str\) is not allowed: must be a kfac_stream"),
    ({"batch": {"attention_mask": torch.ones(1, 4)}}, "has neither 'input_ids'"),
    ({"batch": {"input_ids": torch.tensor([[1, 300]])}}, "outside the model's 256 input"),
    ({"n_samples": 1}, r"n_samples=1 is not allowed: must be an int >= 2"),
    ({"n_samples": 4.0}, r"n_samples=4.0 \(a float\)"),
    ({"seed": "0"}, r"seed='0' \(a str\).*the random seed"),
    ({"chunk": 0}, r"chunk=0 is not allowed: must be an int >= 1"),
    ({"labels": "prev"}, r"labels='prev' is not allowed: must be None, 'next'"),
    ({"labels": torch.zeros(2, 5, dtype=torch.long)},
     r"does not fit the batch \[B, T\] = \[1, 6\]"),
    ({"labels": torch.zeros(1, 6)}, r"labels=<tensor \[1, 6\] float32> is not allowed"),
    ({"labels": torch.tensor([[1, 2, 3, 4, 5, 256]])}, "holds 256, outside the logits' 256"),
    ({"labels": torch.tensor([1])}, r"is \[1\], but the logits of a language-model head are "
                                     r"\[1, 6, 256\]"),
    ({"labels": "next", "batch": {"inputs_embeds": torch.zeros(1, 6, 16, dtype=torch.float64)}},
     "needs the batch's input_ids"),
    ({"linearized": 1}, r"linearized=1 \(a int\) is not allowed: must be True or False"),
    ({"return_logits": None}, r"return_logits=None \(a NoneType\)"),
    ({"show_progress": "yes"}, r"show_progress='yes' \(a str\)"),
]


@pytest.mark.parametrize("bad,match", BAD, ids=[f"{next(iter(b))}-{i}" for i, (b, _) in
                                                 enumerate(BAD)])
def test_bad_arguments_raise_one_line_query_input_errors(lm, bad, match):
    kw = {"post": lm, "batch": padded_batch([6]), "n_samples": 2, **bad}
    with pytest.raises(QueryInputError, match=match) as info:
        sampled_predictive(**kw)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("sampled_predictive: ")


def test_classifier_labels_must_be_one_per_example(classifier):
    batch = padded_batch([8, 6])
    with pytest.raises(QueryInputError, match=r"labels='next'.* is \[2, 8\], but the logits of "
                                              r"a classification head are \[2, 4\]"):
        sampled_predictive(classifier, batch, labels="next")
    with pytest.raises(QueryInputError, match="holds 4, outside the logits' 4 classes"):
        sampled_predictive(classifier, batch, labels=torch.tensor([0, 4]))
    got = sampled_predictive(classifier, batch, labels=torch.tensor([0, -100]))
    assert got.probs.shape == (2, 4) and got.label_logprob_mean[1].isnan()


def test_sample_rows_forward_and_greedy_generation_equal_the_loop(lm):
    """`sample_rows`: rows ``[s·B, (s+1)·B)`` of one call see sample ``s``: the logits of one
    forward of the repeated batch, and greedy decoding with the key/value cache, equal a loop
    over ``sampled_weights`` (float64 round-off; the decoded tokens exactly)."""
    from kfac_stream import sample_rows

    post, n, seed = lm, 3, 11
    batch = padded_batch([7, 7])  # equal lengths: generate() needs no left padding
    expected = loop_logits(post, batch, n, seed)
    ids = batch["input_ids"]
    with torch.no_grad():
        before = post.model(**batch).logits
    with sample_rows(post, n, seed):
        got = post.model(input_ids=ids.repeat(n, 1)).logits.reshape(expected.shape)
        gen = post.model.generate(ids.repeat(n, 1), max_new_tokens=4, do_sample=False,
                                  pad_token_id=0)
    assert rel_err(got, expected) < ROUNDOFF_TOL
    for s in range(n):
        with post.sampled_weights(seed=seed + s), torch.no_grad():
            one = post.model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(gen[s * 2:(s + 1) * 2], one)
    # the context leaves the model as it was
    with torch.no_grad():
        after = post.model(**batch).logits
    assert "forward" not in post.model.transformer.h[0].attn.c_attn.__dict__
    assert torch.equal(after, before)


def test_posterior_draws_drawn_once_give_the_same_samples(lm):
    """`posterior_draws` once, then any batch: the same logits as drawing per call (exactly
    at the same chunking; other chunkings sum the same products in another order:
    `ROUNDOFF_TOL`), in `sample_rows` too; stale or foreign draws and
    conflicting counts are one-line errors."""
    from kfac_stream import posterior_draws, sample_rows

    post, batch = lm, padded_batch([7, 5])
    draws = posterior_draws(post, 5, seed=3)
    assert repr(draws) == "PosteriorDraws(n_samples=5, seed=3, 8 layers)"
    fresh = sampled_predictive(post, batch, 5, seed=3, chunk=2, return_logits=True,
                               linearized=False)  # the weight samples sample_rows runs
    again = sampled_predictive(post, batch, draws=draws, chunk=2, return_logits=True,
                               linearized=False)
    assert torch.equal(fresh.sample_logits, again.sample_logits)
    other_chunks = sampled_predictive(post, batch, draws=draws, chunk=3, return_logits=True,
                                      linearized=False)
    assert rel_err(other_chunks.sample_logits, fresh.sample_logits) < ROUNDOFF_TOL
    assert again.n_samples == 5 and again.seed == 3
    ids = batch["input_ids"]
    with sample_rows(post, draws=draws):
        rows = post.model(input_ids=ids.repeat(5, 1), attention_mask=batch["attention_mask"]
                          .repeat(5, 1)).logits
    assert rel_err(rows.reshape(fresh.sample_logits.shape), fresh.sample_logits) < ROUNDOFF_TOL
    with pytest.raises(QueryInputError, match=r"^sampled_predictive: n_samples=4 differs "):
        sampled_predictive(post, batch, 4, draws=draws)
    with pytest.raises(QueryInputError, match=r"^sampled_predictive: draws=\[1, 2\] \(a list\) "
                       r"is not allowed: must be None or a PosteriorDraws"):
        sampled_predictive(post, batch, draws=[1, 2])
    other = LaplacePosterior(post.model, post.snapshot, TAU * 2, N_DATA)
    with pytest.raises(QueryInputError, match=r"were drawn at prior precision 0.7 and N = 50, "
                       r"but the posterior now has 1.4 and N = 50: must be None or a "
                       r"PosteriorDraws of this posterior \(kfac_stream\.posterior_draws"
                       r"\(post\)\)$"):
        sampled_predictive(other, batch, draws=draws)


@pytest.mark.parametrize("n", [20, 70], ids=["one-block", "three-blocks"])
@pytest.mark.parametrize("rows", [None, 2, 1], ids=["one-slice", "slices-of-2", "slices-of-1"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_statistics_with_minus_infinite_logits_and_many_samples(monkeypatch, dtype, rows, n):
    """The accumulator on hand-made logits: a −∞ logit (a masked token) has probability 0 and
    adds nothing to the entropy (0·log 0 = 0); S = 20 samples fill one block of ``FLUSH`` (32)
    samples (``H[p̄]`` from the block in the work dtype), S = 70 cross two blocks into the
    float64 sum; the 3 positions in one row slice, or in slices of 2 (+ 1) or 1. Reference:
    the statistics in float64 by ``xlogy``. float32 work: 1e-6 (float32 log-softmax and
    sums, ~1e-7 per entry, summed over 6 classes and ≤ 32 samples per block)."""
    from kfac_stream.query.sample_stats import PredictiveAccumulator as _Accumulator

    assert _Accumulator.FLUSH == 32  # the two cases: inside one block, across blocks
    if rows is not None:
        monkeypatch.setattr(_Accumulator, "CACHE_ELEMENTS", rows * 6)

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, 3, 6, generator=gen, dtype=torch.float64)
    logits[:, 0, 2] = float("-inf")
    labels = torch.tensor([1, -100, 5])
    acc = _Accumulator(n, False)
    acc.add(logits[:7].to(dtype), labels)
    acc.add(logits[7:].to(dtype), labels)
    got = acc.result(0, False)
    p = torch.softmax(logits, -1)  # float64 reference, 0·log 0 = 0 by xlogy
    probs = p.mean(0)
    entropy = -torch.special.xlogy(probs, probs).sum(-1)
    expected = -torch.special.xlogy(p, p).sum(-1).mean(0)
    lp = torch.log(p[:, [0, 2], [1, 5]])
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert got.probs[0, 2] == 0 and torch.isfinite(got.expected_entropy).all()
    for value, want in ((got.probs, probs), (got.entropy, entropy),
                        (got.expected_entropy, expected),
                        (got.mutual_information, entropy - expected),
                        (got.label_logprob_mean[[0, 2]], lp.mean(0)),
                        (got.label_logprob_var[[0, 2]], lp.var(0))):
        assert rel_err(value, want) < tol
    assert got.label_logprob_mean[1].isnan()
