"""Self-checks of the brute-force oracle in tests/support/reference.py and the builders in
tests/support/models.py (no kfac_stream imports)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

try:  # rootdir-relative import when tests/ is a package, plain import otherwise
    from tests.models import ListDataset, lora_gpt2, text_examples, tiny_gpt2, tiny_llama
    from tests.reference import (
        ForwardRecorder,
        expected_fisher_G,
        float64_copy,
        labels_of,
        reference_factors,
        reference_rows,
        rel_err,
        summed_nll,
    )
except ImportError:  # pragma: no cover
    from models import ListDataset, lora_gpt2, text_examples, tiny_gpt2, tiny_llama
    from reference import (
        ForwardRecorder,
        expected_fisher_G,
        float64_copy,
        labels_of,
        reference_factors,
        reference_rows,
        rel_err,
        summed_nll,
    )

from transformers.pytorch_utils import Conv1D

EXACT_TOL = 1e-10  # float64 identities that differ only by summation order
# transformers' ForCausalLMLoss upcasts logits with `.float()`, i.e. to float32 even for a
# float64 model, so the HF loss (and any gradient through it) is only float32-accurate.
HF_FLOAT32_LOSS_TOL = 1e-6
# LlamaRMSNorm (and RoPE) compute in float32 even in a float64 model, so two mathematically
# equal backward routes through a Llama differ at float32 rounding level.
LLAMA_FP32_NORM_TOL = 1e-6


@pytest.fixture(autouse=True)
def _single_thread():
    """These tests run thousands of tiny ops; intra-op threads only add OpenMP contention
    (tens of x slower on a busy 2-core box).  Restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def batch(examples):
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def linear_like(model):
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))]


def lora_names(model):
    return [
        n for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and (".lora_A." in n + "." or ".lora_B." in n + ".")
    ]


# --------------------------------------------------------------------------- models.py


def test_text_examples_and_padding():
    ex = text_examples(3, 8, seed=1, lengths=[8, 5, 3], pad_to=10)
    assert len(ex) == 3
    for e, n in zip(ex, [8, 5, 3]):
        assert set(e) == {"input_ids", "attention_mask", "labels"}
        assert all(v.dtype == torch.long and v.shape == (10,) for v in e.values())
        assert int(e["attention_mask"].sum()) == n
        assert torch.equal(e["labels"][:n], e["input_ids"][:n])
        assert (e["labels"][n:] == -100).all() and (e["input_ids"][n:] == 0).all()
    plain = text_examples(2, 8, seed=1)
    assert all(e["attention_mask"].all() and e["input_ids"].shape == (8,) for e in plain)
    assert torch.equal(text_examples(2, 8, seed=1)[1]["input_ids"], plain[1]["input_ids"])
    ds = ListDataset(plain)
    assert len(ds) == 2 and torch.equal(ds[0]["input_ids"], plain[0]["input_ids"])


def test_builders_are_seeded_and_dtyped():
    a, b = tiny_gpt2(seed=3), tiny_gpt2(seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert a.lm_head.weight is a.transformer.wte.weight
    assert all(p.dtype == torch.float64 for p in tiny_llama().parameters())
    pm = lora_gpt2()
    lb = [p for n, p in pm.named_parameters() if ".lora_B." in n]
    assert lb and all(p.dtype == torch.float64 and p.abs().sum() > 0 for p in lb)


def test_summed_nll_matches_hf_mean_loss():
    m = tiny_gpt2()
    kw = batch(text_examples(2, 12, lengths=[12, 7]))
    out = m(**kw)
    n_tok = int((kw["labels"][:, 1:] != -100).sum())
    assert out.loss.dtype == torch.float32  # see HF_FLOAT32_LOSS_TOL
    assert rel_err(summed_nll(out.logits, kw["labels"]), out.loss * n_tok) <= HF_FLOAT32_LOSS_TOL
    nolab = {k: v for k, v in kw.items() if k != "labels"}
    assert torch.equal(labels_of(nolab), kw["labels"])


# ------------------------------------------------------------------------ (a) rows vs param grads


def _check_rows_against_param_grads(model, names, kw):
    rows, mask = reference_rows(model, kw, names)
    m64 = float64_copy(model)
    out = m64(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"])
    summed_nll(out.logits, kw["labels"]).backward()
    mods = dict(m64.named_modules())
    for n in names:
        a, g = rows[n]
        a, g = a[mask], g[mask]  # padding rows excluded
        mod = mods[n]
        has_bias = getattr(mod, "bias", None) is not None
        d_in = a.shape[1] - int(has_bias)
        if has_bias:
            assert torch.all(a[:, -1] == 1)
            assert rel_err(g.sum(0), mod.bias.grad) <= EXACT_TOL, n
        if isinstance(mod, Conv1D):  # weight [d_in, d_out]
            est = a[:, :d_in].T @ g
        else:  # nn.Linear weight [d_out, d_in]
            est = g.T @ a[:, :d_in]
        assert mod.weight.grad.abs().sum() > 0, n
        assert rel_err(est, mod.weight.grad) <= EXACT_TOL, n


def test_rows_match_param_grads_gpt2_conv1d():
    model = tiny_gpt2(tie_word_embeddings=False)  # untied so lm_head.weight.grad is its own
    kw = batch(text_examples(2, 16, seed=2, lengths=[16, 10]))
    _check_rows_against_param_grads(model, linear_like(model), kw)


def test_rows_match_param_grads_llama_gqa():
    model = tiny_llama()
    kw = batch(text_examples(2, 12, seed=4, lengths=[9, 12]))
    _check_rows_against_param_grads(model, linear_like(model), kw)


def test_rows_match_param_grads_lora():
    model = lora_gpt2()
    names = lora_names(model)
    assert len(names) == 8
    kw = batch(text_examples(2, 12, seed=5, lengths=[12, 8]))
    _check_rows_against_param_grads(model, names, kw)


def test_padding_rows_have_zero_gradient_and_label_free_rows_do_not():
    model = tiny_gpt2()
    kw = batch(text_examples(2, 10, seed=6, lengths=[10, 6]))
    kw["labels"][0, 4] = -100  # logits[0, 3] carry no loss
    names = ["transformer.h.0.mlp.c_fc", "lm_head"]
    rows, mask = reference_rows(model, kw, names)
    g = rows["transformer.h.0.mlp.c_fc"][1].reshape(2, 10, -1)
    g_head = rows["lm_head"][1].reshape(2, 10, -1)
    # the rows that can carry a gradient: real tokens up to each row's last scored logit row
    # (row 0: t ≤ 8, its t = 3 included; row 1: t ≤ 4), by hand
    expect = torch.zeros(2, 10, dtype=torch.bool)
    expect[0, :9], expect[1, :5] = True, True
    assert torch.equal(mask, expect.reshape(-1))
    assert torch.all(g[0, 9] == 0) and torch.all(g[1, 5] == 0)  # the last token scores nothing
    assert torch.all(g[1, 6:] == 0)  # right padding: nothing attends to it
    assert torch.all(g_head[0, 3] == 0)  # no label for that logit row ...
    assert g[0, 3].abs().sum() > 0  # ... but gradient still flows through attention


# --------------------------------------------------------------------------- recorder + factors


def test_recorder_and_reference_factors_with_positions():
    model = tiny_gpt2()
    names = ["transformer.h.1.attn.c_attn", "lm_head"]
    kws = [batch(text_examples(2, 8, seed=s, lengths=[8, 5])) for s in (7, 8)]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with ForwardRecorder(model) as rec:
        for kw in kws:
            opt.zero_grad()
            model(**kw).loss.backward()
            opt.step()
        with torch.no_grad():
            model(**kws[0])  # not recorded: grad disabled
        model.eval()
        model(**kws[0])  # not recorded: eval mode
        model.train()
    model(**kws[0])  # not recorded: hook removed
    assert len(rec.records) == 2
    assert set(rec.records[0]["kwargs"]) == {"input_ids", "attention_mask", "labels"}
    w0 = rec.records[0]["state"]["transformer.h.1.attn.c_attn.weight"]
    w1 = rec.records[1]["state"]["transformer.h.1.attn.c_attn.weight"]
    assert not torch.equal(w0, w1)  # states are per-step snapshots

    factors, count = reference_factors(model, rec.records, names)
    assert count == 2 * (7 + 4)  # real tokens but the last of each row (it scores nothing)
    # manual: token-weighted mean over both records, each with its own weights
    sums = {n: [0, 0] for n in names}
    for r in rec.records:
        rows, mask = reference_rows(model, r["kwargs"], names, state=r["state"])
        for n in names:
            a, g = rows[n][0][mask], rows[n][1][mask]
            sums[n][0] = sums[n][0] + a.T @ a
            sums[n][1] = sums[n][1] + g.T @ g
    for n in names:
        assert factors[n][0].dtype == torch.float64
        assert rel_err(factors[n][0], sums[n][0] / count) <= EXACT_TOL
        assert rel_err(factors[n][1], sums[n][1] / count) <= EXACT_TOL
    assert factors["transformer.h.1.attn.c_attn"][0].shape == (17, 17)  # bias column
    assert factors["lm_head"][0].shape == (16, 16)  # no bias

    # positions: flat indices into B*T, intersected with the non-padding mask
    # 15 is padding (b=1, t=7); 12 (b=1, t=4) is row 1's last token, which scores nothing
    pos = [torch.tensor([0, 3, 9, 15]), torch.tensor([1, 11, 12])]
    sub, c = reference_factors(model, rec.records, names, positions=pos)
    assert c == 3 + 2
    rows, _ = reference_rows(model, rec.records[1]["kwargs"], names, state=rec.records[1]["state"])
    rows0, _ = reference_rows(model, rec.records[0]["kwargs"], names, state=rec.records[0]["state"])
    a = torch.cat([rows0["lm_head"][0][[0, 3, 9]], rows["lm_head"][0][[1, 11]]])
    assert rel_err(sub["lm_head"][0], a.T @ a / 5) <= EXACT_TOL


# --------------------------------------------------------------------------- (b) expected Fisher


def _brute_force_expected_G(model, kw, names):
    """Σ over (b, t, y) of p_t(y) g gᵀ with one backward per (b, t, y)."""
    m64 = float64_copy(model)
    mods = dict(m64.named_modules())
    outs = {}
    hooks = [
        mods[n].register_forward_hook(lambda mod, a, o, n=n: outs.__setitem__(n, o)) for n in names
    ]
    logits = m64(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"]).logits
    for h in hooks:
        h.remove()
    labels = labels_of(kw)
    mask = kw["attention_mask"].bool()
    for b in range(mask.shape[0]):  # none after the row's last scored logit row
        last = max(t for t in range(mask.shape[1] - 1) if labels[b, t + 1] != -100)
        mask[b, last + 1:] = False
    B, T, V = logits.shape
    G = {n: torch.zeros(outs[n].shape[-1], outs[n].shape[-1], dtype=torch.float64) for n in names}
    for b in range(B):
        for t in range(T - 1):
            if labels[b, t + 1] == -100:
                continue
            logp = F.log_softmax(logits[b, t], dim=-1)
            p = logp.exp().detach()
            for y in range(V):
                gs = torch.autograd.grad(-logp[y], [outs[n] for n in names], retain_graph=True)
                for n, g in zip(names, gs):
                    g = g[mask]  # [n_pos, d_out]
                    G[n] += p[y] * (g.T @ g)
    n_pos = int(mask.sum())
    return {n: v / n_pos for n, v in G.items()}


def _small_vocab_batch(V, seq_len, lengths, seed):
    ex = text_examples(len(lengths), seq_len, seed=seed, lengths=lengths)
    for e in ex:  # keep byte ids inside the small vocabulary
        e["input_ids"] %= V
        e["labels"] = torch.where(e["labels"] == -100, e["labels"], e["input_ids"])
    return batch(ex)


@pytest.mark.parametrize(
    "build, tol",
    [
        (lambda: tiny_gpt2(vocab_size=24), EXACT_TOL),
        (lambda: tiny_llama(vocab_size=12), LLAMA_FP32_NORM_TOL),
    ],
    ids=["gpt2", "llama"],
)
def test_expected_fisher_G_matches_per_label_brute_force(build, tol):
    model = build()
    names = linear_like(model)
    kw = _small_vocab_batch(model.config.vocab_size, 6, [6, 4], seed=9)
    kw["labels"][0, 3] = -100  # an unlabelled, non-padding position
    ref = _brute_force_expected_G(model, kw, names)
    got = expected_fisher_G(model, kw, names)
    for n in names:
        assert ref[n].abs().sum() > 0, n
        assert rel_err(got[n], ref[n]) <= tol, n


def test_expected_fisher_G_lora_runs_and_is_psd():
    model = lora_gpt2()
    names = lora_names(model)[:2]
    kw = batch(text_examples(1, 6, seed=10))
    G = expected_fisher_G(model, kw, names)
    for n in names:
        ev = torch.linalg.eigvalsh(G[n])
        assert ev.min() >= -1e-12 * ev.max() and ev.max() > 0
