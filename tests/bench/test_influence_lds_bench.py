"""benchmarks/influence_lds.py and its parts: the LDS and detection metrics on known cases, the
split and the cached ground truth, the rule that settings are chosen on validation queries
only (never reading the test queries' truth), and the ``--quick`` run end to end."""

import math
import re
import sys

import pytest
import torch

pytest.importorskip("dattri", reason="peer not installed (Makefile PEER_PKGS)")
pytest.importorskip("sklearn", reason="peer not installed (Makefile PEER_PKGS)")
pytest.importorskip("kronfluence", reason="peer not installed (Makefile PEER_PKGS)")

from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import influence_lds as il  # noqa: E402
import lds_noisy as nz  # noqa: E402
import lds_peers as peers  # noqa: E402
import lds_select as sel  # noqa: E402
import lds_truth as lt  # noqa: E402
from tasks import lds_tasks as tasks  # noqa: E402


def test_lds_is_one_for_additive_truth_and_minus_one_reversed():
    g = torch.Generator().manual_seed(0)
    n, k = 20, 15
    effect = torch.randn(3, n, generator=g, dtype=torch.float64)  # helpfulness per example
    members = [sorted(torch.randperm(n, generator=g)[:n // 2].tolist()) for _ in range(k)]
    # a helpful example lowers the loss: output = -Σ effect over the half
    outputs = torch.stack([-effect[:, m].sum(1) for m in members])  # [K, Q]
    assert sel.lds_per_query(effect, members, outputs) == pytest.approx([1.0] * 3)
    assert sel.lds_per_query(-effect, members, outputs) == pytest.approx([-1.0] * 3)
    partial = effect.clone()
    partial[1] = float("nan")  # a method that did not score query 1
    got = sel.lds_per_query(partial, members, outputs)
    assert got[0] == pytest.approx(1.0) and math.isnan(got[1]) and sel.nanmean(got) == 1.0


def test_lds_equals_scipy_spearman_per_query_with_ties_and_constant_sides():
    """The vectorised LDS against ``scipy.stats.spearmanr`` query by query: rounded scores
    (ties on the prediction side), a query whose outputs are constant (0, as spearmanr's NaN
    is read) and a NaN row."""
    from scipy.stats import spearmanr

    g = torch.Generator().manual_seed(2)
    n, k, q = 30, 25, 6
    scores = torch.randn(q, n, generator=g, dtype=torch.float64).round()
    scores[4] = float("nan")
    members = [sorted(torch.randperm(n, generator=g)[:n // 2].tolist()) for _ in range(k)]
    outputs = torch.randn(k, q, generator=g, dtype=torch.float64).round(decimals=1)
    outputs[:, 2] = 1.5
    got = sel.lds_per_query(scores, members, outputs)
    pred = torch.stack([scores[:, m].sum(1) for m in members])
    for j in range(q):
        if j == 4:
            assert math.isnan(got[j])
            continue
        want = spearmanr(pred[:, j].numpy(), (-outputs[:, j]).numpy()).statistic
        assert got[j] == pytest.approx(0.0 if math.isnan(want) else want, abs=1e-12), j


def test_paired_interval_and_verdict():
    a = [[0.5, 0.6, 0.7], [0.4, float("nan")]]
    b = [[0.4, 0.4, 0.4], [0.4, 0.1]]
    p = sel.paired(a, b)  # differences 0.1, 0.2, 0.3, 0.0 (the NaN pair dropped)
    se = math.sqrt(sum((x - 0.15) ** 2 for x in (0.1, 0.2, 0.3, 0.0)) / 3 / 4)
    assert p["n"] == 4 and p["mean"] == pytest.approx(0.15)
    assert (p["lo"], p["hi"]) == pytest.approx((0.15 - 1.96 * se, 0.15 + 1.96 * se))
    assert p["wins"] == 0.75 and sel.verdict(p) == "ahead"
    assert sel.verdict({"lo": -0.1, "hi": 0.2}) == "tie"
    assert sel.verdict({"lo": -0.3, "hi": -0.1}) == "behind"


def test_auc_and_recall():
    score = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0, -1.0, -2.0, -3.0])
    noisy = [True, False, True] + [False] * 7
    assert nz.auc(score, noisy) == pytest.approx((8 + 7) / 16)
    assert nz.recall_top(score, noisy, 0.1) == 0.5
    assert nz.recall_top(score, noisy, 0.3) == 1.0
    assert nz.ranks(torch.tensor([3.0, 1.0, 2.0])).tolist() == [2.0, 0.0, 1.0]


def test_split_is_disjoint_and_varies_with_the_seed():
    def key(e):
        return tuple(e["inputs_embeds"].flatten().tolist())

    a, b = tasks.split("digits", 0, 40, 5, 7), tasks.split("digits", 1, 40, 5, 7)
    keys = [key(e) for part in ("train", "val", "test") for e in a[part]]
    assert [len(a[p]) for p in ("train", "val", "test")] == [40, 5, 7]
    assert len(set(keys)) == len(keys)  # the digits have no duplicate images among 52 draws
    assert [key(e) for e in a["train"]] != [key(e) for e in b["train"]]
    t = tasks.split("text", 2, 10, 3, 4)
    assert t["test"][0]["input_ids"].shape == (tasks.TEXT_SEQ,)
    train, noisy = nz.corrupt("digits", a["train"], 0.1, seed=3)
    assert sum(noisy) == 4
    for e, c, bad in zip(train, a["train"], noisy):
        assert torch.equal(e["inputs_embeds"], c["inputs_embeds"])
        assert (int(e["labels"]) != int(c["labels"])) == bad


def test_truth_file_round_trip_and_its_identity(tmp_path, monkeypatch):
    monkeypatch.setattr(lt, "TRUTH_DIR", tmp_path)
    monkeypatch.setattr(lt, "SUBSETS", 3)
    monkeypatch.setattr(lt, "RETRAINS", 2)
    t = lt.load_truth("digits", 4, (10, 2, 3), create=True)
    assert t.subsets.shape == (3, 10) and t.subsets.sum(1).tolist() == [5, 5, 5]
    assert len(t.missing()) == 3 * 3 and not t.complete()
    t.fresh[:] = torch.arange(3 * 2 * 5, dtype=torch.float64).view(3, 2, 5) / 7
    t.fixed[:] = 1.0 / 3
    t.save()
    back = lt.load_truth("digits", 4, (10, 2, 3))
    assert back.complete() and torch.equal(back.subsets, t.subsets)
    assert torch.allclose(back.fresh, t.fresh, rtol=1e-7)  # stored float32: 7 digits
    with pytest.raises(SystemExit, match="differ"):
        lt.load_truth("digits", 4, (12, 2, 3))
    val, test = sel.split_truth(back)
    assert val.rows == range(0, 2) and test.rows == range(2, 5)
    assert torch.allclose(test.mean, back.fresh.mean(1)[:, 2:])


def fake_truth(tmp_path, monkeypatch, seed=0):
    """A complete truth whose outputs are a known linear function of the halves."""
    monkeypatch.setattr(lt, "TRUTH_DIR", tmp_path)
    monkeypatch.setattr(lt, "SUBSETS", 12)
    monkeypatch.setattr(lt, "RETRAINS", 3)
    t = lt.load_truth("digits", seed, (16, 4, 6), create=True)
    g = torch.Generator().manual_seed(seed)
    effect = torch.randn(10, 16, generator=g, dtype=torch.float64)
    base = -(t.subsets.double() @ effect.T)  # [K, Q]
    t.fresh[:] = base[:, None, :] + 0.01 * torch.randn(12, 3, 10, generator=g,
                                                        dtype=torch.float64)
    t.fixed[:] = base
    return t, effect


def test_selection_reads_validation_truth_only(tmp_path, monkeypatch):
    t, effect = fake_truth(tmp_path, monkeypatch)
    val, test = sel.split_truth(t)
    g = torch.Generator().manual_seed(1)
    scores = {"fam_a:good": effect.clone(), "fam_a:noise": torch.randn(10, 16, generator=g),
              "fam_b:1": torch.randn(10, 16, generator=g), "fam_b:2": -effect.clone()}
    parts = []
    real_lds = sel.QueryTruth.lds
    monkeypatch.setattr(sel.QueryTruth, "lds",
                        lambda self, s, fixed=False: parts.append(self.part) or
                        real_lds(self, s, fixed))
    chosen = sel.choose(scores, val)
    assert set(parts) == {"val"}
    assert chosen["fam_a"] == "fam_a:good"
    # the test queries' truth replaced by garbage: the same choice
    t.fresh[:, :, 4:] = torch.randn(12, 3, 6, generator=g, dtype=torch.float64)
    assert sel.choose(scores, sel.split_truth(t)[0]) == chosen
    with pytest.raises(ValueError, match="validation"):
        sel.choose(scores, test)


def test_recommended_setting_is_chosen_from_validation_means_only():
    def seed(val, test):
        return {"variants": {v: {"val": x, "test": test} for v, x in val.items()}}

    results = {"digits": [seed({"ours_kfac:0.1": 0.3, "ours_ekfac:0.1": 0.5}, 0.9)],
               "text": [seed({"ours_kfac:0.1": 0.4, "ours_ekfac:0.1": 0.2}, 0.0)]}
    assert il.recommend(results) == "ours_kfac:0.1"  # worst task 0.3 beats EK-FAC's 0.2
    for s in results["digits"] + results["text"]:
        for v in s["variants"].values():
            v["test"] = float("nan")  # never read
    assert il.recommend(results) == "ours_kfac:0.1"


def test_quick_run_prints_a_table_of_finite_lds(capsys):
    il.main(["--quick", "--tasks", "digits"])
    out = capsys.readouterr().out
    section = out[out.index(il.BEGIN):out.index(il.END)]
    assert "**digits**" in section and "Recommended" in section
    rec = re.search(r"\*\*`(ours_\w+:[\w.]+)`\*\*", section)
    assert rec, section
    rows = [r for r in section.splitlines() if r.startswith("| ")]
    ours = [r for r in rows if r.startswith("| **ours, recommended** |")]
    assert len(ours) == 1
    value = float(ours[0].split("|")[2].strip().strip("*"))
    assert -1.0 <= value <= 1.0
    for fam in il.OURS:
        mine = [r for r in rows if r.startswith(f"| {il.LABELS[fam]} |")]
        assert len(mine) == 1, (fam, rows)
        cells = [c.strip() for c in mine[0].strip("|").split("|")]
        assert -1.0 <= float(cells[1]) <= 1.0
        m = re.fullmatch(r"([+-]\d\.\d+) \[([+-]\d\.\d+), ([+-]\d\.\d+)\] \(\d+ q\.\)", cells[3])
        assert m and float(m.group(2)) <= float(m.group(1)) <= float(m.group(3)), cells
    # the peers' rows, each with its interval
    for fam in ("kronfluence_kfac", "kronfluence_ekfac", "dattri_tracin", "grad_dot",
                "dattri_trak1", "dattri_ifcg"):
        mine = [r for r in rows if r.startswith(f"| {peers.family_label(fam)} |")]
        assert len(mine) == 1, (fam, rows)
        assert re.search(r"\(\d+ q\.\) \| (ahead|tie|behind) \|", mine[0]), mine[0]
    assert re.search(r"streamed factors .*ours_ekfac − kronfluence_ekfac: [+-]\d\.\d+ \[",
                     section), section
    detect = [r for r in rows if r.startswith(f"| {nz.DETECTORS[0][1]} |")]
    assert len(detect) == 1 and 0.0 <= float(detect[0].split("|")[2].split()[0]) <= 1.0
