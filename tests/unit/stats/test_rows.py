"""Pure pieces: loss-scale recovery, position sampling, ownership, bias column."""

import pytest
import torch

from kfac_stream.distributed.ownership import assign_owners
from kfac_stream.stats.covariance import gram, with_bias_column
from kfac_stream.stats.loss_scale import FIT_ROWS, cross_entropy_scale
from kfac_stream.stats.rows import sample_positions, usable_positions


@pytest.mark.parametrize("c", [1.0, 1 / 37, 65536.0 / 123])
def test_cross_entropy_scale_recovers_c_without_labels(c):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(20, 11, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 11, (20,), generator=gen)
    p = torch.softmax(logits, -1)
    grad = p.clone()
    grad[torch.arange(20), y] -= 1
    grad *= c
    grad[3] = 0  # a position without a loss term
    est, resid, used = cross_entropy_scale(logits, grad)  # 0-dim tensors (no host read)
    assert int(used) == 19
    assert float(est) == pytest.approx(c, rel=1e-12)
    assert float(resid) < 1e-12
    est, _, _ = cross_entropy_scale(logits, grad, max_rows=3)  # the first live rows suffice
    assert float(est) == pytest.approx(c, rel=1e-12)
    none, _, used = cross_entropy_scale(logits, torch.zeros_like(grad))
    assert int(used) == 0 and torch.isnan(none)


def test_cross_entropy_scale_finds_loss_rows_after_a_long_masked_prompt():
    # 200 prompt positions without a loss term, then 100 with: the fit must use the latter
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(300, 50, generator=gen, dtype=torch.float64)
    grad = torch.softmax(logits, -1)
    grad[torch.arange(300), torch.randint(0, 50, (300,), generator=gen)] -= 1
    grad *= 0.25
    grad[:200] = 0
    c, resid, used = cross_entropy_scale(logits, grad, max_rows=128)  # 100 of 128 live
    assert int(used) == 100 and float(c) == pytest.approx(0.25, rel=1e-12)
    c, _, used = cross_entropy_scale(logits, grad)  # the default FIT_ROWS: all of them live
    assert int(used) == FIT_ROWS and float(c) == pytest.approx(0.25, rel=1e-12)
    assert float(resid) < 1e-12


def test_cross_entropy_scale_flags_label_smoothing():
    logits = torch.randn(30, 7, dtype=torch.float64)
    target = torch.full((30, 7), 0.1 / 7, dtype=torch.float64)
    target[torch.arange(30), torch.randint(0, 7, (30,))] += 0.9
    grad = torch.softmax(logits, -1) - target
    _, resid, _ = cross_entropy_scale(logits, grad)
    assert float(resid) > 1e-2


def test_sample_positions_full_and_fraction():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    usable = usable_positions(mask, (2, 4), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    index, weight = sample_positions(usable, 1.0, gen)
    assert index.tolist() == list(range(8))  # every slot; padding weighted 0
    assert weight.tolist() == [1, 1, 1, 0, 1, 1, 0, 0]
    state = gen.get_state()
    assert torch.equal(gen.get_state(), state)  # fraction 1 draws nothing
    big = usable_positions(None, (64, 64), torch.device("cpu"))
    index, weight = sample_positions(big, 0.25, gen)
    assert index.numel() == 1024 and index.unique().numel() == 1024  # fixed size, no repeats
    assert torch.all(weight == 4.0)  # 1/π with π = m/U = 1/4
    padded = usable_positions(torch.tensor([[1, 0] * 32] * 64), (64, 64), torch.device("cpu"))
    index, weight = sample_positions(padded, 0.25, gen)
    assert (index % 2 == 0).all()  # padding never sampled while usable slots remain
    assert float(weight.sum()) == 2048  # weights sum to the usable count U exactly
    sparse = torch.zeros(64, 64, dtype=torch.long)
    sparse[:, 0] = 1  # U = 64 < m = 205: every usable position, padding slots weighted 0
    index, weight = sample_positions(usable_positions(sparse, (64, 64), torch.device("cpu")),
                                     0.05, gen)
    assert index.numel() == 205 and float(weight.sum()) == 64
    assert set(index[weight > 0].tolist()) == set(range(0, 4096, 64))


def test_sampling_weights_make_an_unbiased_estimator():
    # Horvitz-Thompson: E[Σ_s w_s f(s)] = Σ_{usable} f(s) exactly, whatever the padding
    gen = torch.Generator().manual_seed(1)
    usable = torch.rand(300, generator=gen) < 0.6
    f = torch.randn(300, generator=gen, dtype=torch.float64)
    draws = []
    for _ in range(3000):
        index, weight = sample_positions(usable, 0.1, gen)
        draws.append(float((weight.double() * f[index]).sum()))
    draws = torch.tensor(draws, dtype=torch.float64)
    err = abs(float(draws.mean()) - float(f[usable].sum()))
    assert err <= 4 * float(draws.std()) / 3000**0.5, err  # 4 standard errors


def test_gram_with_bias_and_diagonal():
    x = torch.randn(5, 3, dtype=torch.float64)
    xb = with_bias_column(x)
    dense = gram(xb) / 5
    manual = sum(torch.outer(r, r) for r in xb) / 5
    assert torch.allclose(dense, manual, rtol=1e-14, atol=1e-15)
    assert torch.allclose(dense[-1, -1], torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(gram(xb, diagonal=True) / 5, manual.diagonal(), rtol=1e-14)


def test_assign_owners_balances_bytes_and_is_deterministic():
    dims = {f"l{i}.{f}": (d, False) for i, d in enumerate([768, 256, 1024, 256, 64])
            for f in "AG"}
    own = assign_owners(dims, 3, 2)
    assert own == assign_owners(dims, 3, 2)
    total = sum(own.bytes_per_rank)
    largest = max(d * d * 2 for d, _ in dims.values())
    assert all(abs(b - total / 3) <= largest for b in own.bytes_per_rank)
    assert set(own.owner) == set(dims)
    assert "rank" in str(own)
    single = assign_owners(dims, 1, 2)
    assert set(single.owner.values()) == {0}


def test_training_without_attention_mask_uses_every_scored_position(tmp_path):
    from harness import run
    from models import text_examples, tiny_gpt2

    ex = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in text_examples(4, 12)]
    cb, _, _ = run(tiny_gpt2(), ex, batch=2, tmp_path=tmp_path, record=False)
    # 4 x 11: every position but each sequence's last, which scores nothing
    assert cb.tracker.counters.positions_sampled == 44 == cb.tracker.counters.tokens_seen
