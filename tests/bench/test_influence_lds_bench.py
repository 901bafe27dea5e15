"""benchmarks/influence_lds.py: the LDS and detection metrics on known cases, the tasks'
data and order, and the ``--quick`` dry run end to end (both tasks, every method: the table's
structure and every LDS a finite number in [-1, 1])."""

import math
import re
import sys

import pytest
import torch

pytest.importorskip("dattri", reason="peer not installed (Makefile PEER_PKGS)")
pytest.importorskip("sklearn", reason="peer not installed (Makefile PEER_PKGS)")

from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import influence_lds as il  # noqa: E402
from tasks import lds_tasks as lt  # noqa: E402


def test_lds_is_one_for_additive_truth_and_minus_one_reversed():
    g = torch.Generator().manual_seed(0)
    n, k = 20, 15
    effect = torch.randn(2, n, generator=g, dtype=torch.float64)  # helpfulness per example
    subsets = [sorted(torch.randperm(n, generator=g)[:n // 2].tolist()) for _ in range(k)]
    # a helpful example lowers the loss: output = -Σ effect over the subset
    outputs = torch.stack([-effect[:, s].sum(1) for s in subsets])  # [K, Q]
    assert il.lds(effect, subsets, outputs) == pytest.approx([1.0, 1.0])
    assert il.lds(-effect, subsets, outputs) == pytest.approx([-1.0, -1.0])


def test_auc_and_recall():
    score = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0, -1.0, -2.0, -3.0])
    noisy = [True, False, True] + [False] * 7
    assert il.auc(score, noisy) == pytest.approx((8 + 7) / 16)
    assert il.recall_top(score, noisy, 0.1) == 0.5
    assert il.recall_top(score, noisy, 0.2) == 0.5
    assert il.recall_top(score, noisy, 0.3) == 1.0
    assert il.mean_se([1.0, 3.0]) == (2.0, 1.0)


def test_stream_keeps_the_subsets_relative_order_and_data_are_fixed():
    full = lt.stream(9, None, 27, seed=3)
    sub = [1, 4, 5, 8]
    assert sorted(full[:9]) == list(range(9)) and full[:9] != full[9:18]
    assert lt.stream(9, sub, 8, seed=3) == [i for i in full if i in sub][:8]
    d = lt.build_data("digits", 50, 5, noise=0.1, noise_seed=1)
    clean = lt.build_data("digits", 50, 5)
    assert sum(d["noisy"]) == 5 and not any(clean["noisy"])
    for e, c, bad in zip(d["train"], clean["train"], d["noisy"]):
        assert torch.equal(e["inputs_embeds"], c["inputs_embeds"])
        assert (int(e["labels"]) != int(c["labels"])) == bad
    t = lt.build_data("text", 20, 3, noise=0.1, noise_seed=0)
    assert sum(t["noisy"]) == 2 and t["train"][0]["input_ids"].shape == (lt.TEXT_SEQ,)


def test_quick_run_prints_a_table_of_finite_lds(capsys):
    il.main(["--quick"])
    out = capsys.readouterr().out
    section = out[out.index(il.BEGIN):out.index(il.END)]
    for task in lt.TASKS:
        assert f"**{task}**" in section
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    for key, label in il.METHODS:
        mine = [r for r in rows if r.startswith(f"| {label} |")]
        assert len(mine) == len(lt.TASKS), (label, mine)
        for r in mine:
            if key in il.DATTRI + ("ours_ifcg_queries",) and "did not run" in r:
                continue  # a peer that cannot run says why (and IF-CG's paired row goes too)
            cells = [c.strip() for c in r.strip("|").split("|")][1:]
            assert len(cells) == 2, r  # across seeds, then the one quick seed
            for c in cells:
                m = re.fullmatch(r"\**([+-]\d+\.\d+) ± (\d+\.\d+)\**", c)
                assert m, c
                value = float(m.group(1))
                assert math.isfinite(value) and -1.0 <= value <= 1.0, r
    for _key, label in il.NOISY_METHODS:
        mine = [r for r in rows if r.startswith(f"| {label} |")]
        assert len(mine) == len(lt.TASKS), (label, mine)
        for r in mine:
            if "did not run" in r:
                continue
            for c in [c.strip() for c in r.strip("|").split("|")][1:]:
                assert 0.0 <= float(c.split()[0]) <= 1.0, r
    assert "ours (defaults) ≥ every dattri method" in section
