"""The helpers of `benchmarks/influence_quality.py`: the planted-fact
task, the exact random baseline, the hit counting and the fixed data order that a removal
leaves as it was; ``--quick`` end to end under ``-m slow``."""

import itertools
import math
import sys

import pytest
import torch

from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import influence_quality as iq  # noqa: E402


def test_task_plants_facts_that_open_their_sequences_and_queries_label_the_value():
    task = iq.build_task(3, n_real=40, n_facts=5, plants=3, seq=64)
    text = iq.doc_text()
    assert len(task["train"]) == 40 + 15 and len(task["no_plants"]) == 40
    assert sorted(task["owner"]) == [-1] * 40 + sorted(list(range(5)) * 3)
    keys = [k for k, _ in task["facts"]]
    syllables = [k[:3] for k in keys] + [k[3:] for k in keys]
    assert len(set(syllables)) == 10 and all(k.encode() not in text for k in keys)
    for ex, f, j in zip(task["train"], task["owner"], task["template"]):
        assert ex["input_ids"].shape == (64,) and torch.equal(ex["labels"], ex["input_ids"])
        if f >= 0:
            key, value = task["facts"][f]
            sentence = iq.PLANT_TEMPLATES[j].format(key=key, value=value).encode()
            assert bytes(ex["input_ids"].tolist()).startswith(sentence)
    b = iq.completion_batch(task["queries"]["query"])
    for i, (key, value) in enumerate(task["facts"]):
        labelled = b["labels"][i][b["labels"][i] != -100]
        assert bytes(labelled.tolist()).decode() == value
        n = int(b["attention_mask"][i].sum())
        assert bytes(b["input_ids"][i, :n].tolist()).decode() == iq.QUERY_TEMPLATE.format(
            key=key, value=value)
    assert iq.build_task(3, 40, 5, 3, 64)["facts"] == task["facts"]


def test_random_hit_rate_is_the_exact_expectation():
    n, k = 9, 3
    for p in (1, 2, 4):
        hit = sum(any(i < p for i in top) for top in itertools.combinations(range(n), k))
        assert iq.random_hit_rate(n, [p], k) == pytest.approx(hit / math.comb(n, k), rel=1e-12)


def test_hits_count_own_plants_other_wordings_and_best_rank():
    owner = [-1, 0, 1, 0, -1, 1]
    template = [-1, 0, 0, 1, -1, 1]
    scores = torch.tensor([[5.0, 4.0, 3.0, 0.0, 1.0, 2.0],   # fact 0: own plant (wording 0) 2nd
                           [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])  # fact 1: own plant (wording 1) 1st
    h = iq.hits(scores, owner, template, k=2)
    assert h["hit"] == [True, True]
    assert h["hit_other_wording"] == [False, True]
    assert h["any_plant"] == [True, True]
    assert h["best_rank"] == [2, 1]


def test_fixed_order_drops_removed_examples_and_keeps_the_others_order():
    ex = [{"i": torch.tensor(i)} for i in range(7)]
    full = [int(e["i"]) for e in iq.FixedOrder(ex, 40, seed=4)]
    cut = [int(e["i"]) for e in iq.FixedOrder(ex, 20, seed=4, removed=frozenset({2, 5}))]
    assert sorted(full[:7]) == list(range(7)) and full[:7] != full[7:14]  # epochs differ
    assert cut == [i for i in full if i not in (2, 5)][:20]


@pytest.mark.slow
def test_quick_run_prints_the_section(capsys):
    iq.main(["--quick"])
    out = capsys.readouterr().out
    assert iq.BEGIN in out and iq.END in out
