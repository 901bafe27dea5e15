"""`kfac_stream.stats.rows`: which positions are usable, the position sampler's indices and
weights (unbiased), and every scored position used when a batch has no attention mask."""

import torch

from kfac_stream.stats.rows import sample_positions, usable_positions


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


def test_training_without_attention_mask_uses_every_scored_position(tmp_path):
    from harness import run
    from models import text_examples, tiny_gpt2

    ex = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in text_examples(4, 12)]
    cb, _, _ = run(tiny_gpt2(), ex, batch=2, tmp_path=tmp_path, record=False)
    # 4 x 11: every position but each sequence's last, which scores nothing
    assert cb.tracker.counters.positions_sampled == 44 == cb.tracker.counters.tokens_seen
