"""The helpers the uncertainty benchmarks rely on: the docstring multiple-choice data,
the per-tau covariance reuse (`LaplacePosterior.predictive_covariances`), and the
answer-position indexing under right padding."""

import sys

import pytest
import torch

from kfac_stream import Snapshot
from kfac_stream.app.models import tiny_gpt2 as app_gpt2
from kfac_stream.query.laplace import LaplacePosterior

from harness import run, sum_nll_loss
from models import text_examples, tiny_gpt2
from reference import rel_err
from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import classification_figures as cf  # noqa: E402
import multiple_choice as mc  # noqa: E402
import uncertainty_classification as uc  # noqa: E402

EXACT_TOL = 1e-12  # the same float64 arithmetic in a different order
PAD_TOL = 1e-5  # float32 model: padded vs unpadded batches take different kernels


def test_choice_splits_balanced_disjoint_and_labelled_by_their_package():
    splits = mc.choice_splits(6, 3, 5, seed=1)
    per = {p: set(mc.docstring_snippets(p)) for p in mc.PACKAGES}
    seen = set()
    for name, n in (("train", 6), ("val", 3), ("test", 5)):
        items = splits[name]
        assert sorted(c for _, c in items) == sorted(list(range(4)) * n)
        for s, c in items:
            assert s in per[mc.PACKAGES[c]]
            assert all(s not in per[p] for p in mc.PACKAGES if p != mc.PACKAGES[c])
            assert 40 <= len(s.encode()) <= mc.SNIPPET_BYTES
            assert s not in seen
            seen.add(s)
    assert mc.choice_splits(6, 3, 5, seed=1) == splits  # deterministic


def test_train_example_loss_only_at_the_answer_and_collate_pads():
    a = mc.train_example("short docstring of something useful here, long enough", 2)
    b = mc.train_example("x" * 60, 0)
    assert a["input_ids"][-1] == ord("C") and b["input_ids"][-1] == ord("A")
    assert (a["labels"][:-1] == -100).all() and a["labels"][-1] == ord("C")
    batch = mc.collate([a, b])
    T = max(len(a["input_ids"]), len(b["input_ids"]))
    assert batch["input_ids"].shape == (2, T)
    n = len(b["input_ids"])
    assert batch["attention_mask"][1].tolist() == [1] * n + [0] * (T - n)
    assert (batch["labels"][1, n:] == -100).all() and (batch["input_ids"][1, n:] == 0).all()
    assert len(mc.prompt_ids("y" * mc.SNIPPET_BYTES)) + 1 <= 128  # fits the base LM


def test_answer_logits_under_right_padding_equal_unpadded_ones():
    model = app_gpt2(seed=3).eval()
    items = [("a fairly long docstring about event loops, futures and their tasks", 0),
             ("short one, yet forty characters long....", 1)]
    batch, y = mc.prompt_batch(items)
    assert y.tolist() == [0, 1]
    got = mc.map_answer_logits(model, batch)
    head = mc.AnswerHead(model)
    head.answers_only = True
    with torch.no_grad():
        via_head = head(batch["input_ids"]).double()
    for i, (s, _) in enumerate(items):
        ids = torch.tensor([mc.prompt_ids(s)])
        with torch.no_grad():
            ref = model(input_ids=ids).logits[0, -1, mc.ANSWER_IDS].double()
        assert (got[i] - ref).abs().max() < PAD_TOL
        assert (via_head[i] - ref).abs().max() < PAD_TOL


@pytest.fixture(scope="module")
def posterior(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    model = tiny_gpt2()
    run(model, text_examples(8, 12), {"snapshot_every": 10**6}, batch=2, loss=sum_nll_loss,
        tmp_path=tmp, record=False)
    return LaplacePosterior(model, Snapshot.latest(tmp / "kfac"), num_data=40.0)


def test_covs_for_many_tau_equal_the_librarys_predictive(posterior):
    ex = text_examples(3, 10, seed=4, lengths=[10, 8, 6])
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    tokens = mc.ANSWER_IDS
    taus = [1e-3, 0.7, 50.0]
    covs = mc.stream_covs(posterior, batch, taus)  # one predictive_covariances pass
    for t in taus:
        posterior.prior_precision = t
        _, ref = posterior.predictive(batch, -1, tokens)
        err = rel_err(covs[t], ref)
        print(f"tau {t}: covariance vs predictive {err:.1e}")
        assert err < EXACT_TOL


# -- the man-page task (benchmarks/tasks/classification_tasks.py) ----------------------------------

from tasks import classification_tasks as ct  # noqa: E402


def test_troff_text_keeps_macro_text_and_drops_requests_and_escapes():
    src = "\n".join([
        '.\\" a comment', ".TH FOO 1", ".SH DESCRIPTION", ".B foo",
        "copies \\fIsource\\fR to \\fBdest\\fP \\- fast\\&.", ".PP",
        '.BR "bar" (1)', "it\\(aqs \\(:uber\\e", ".IP", ".sp 2"])
    assert ct.troff_text(src) == "foo copies source to dest - fast. bar (1) it's über\\"


def test_page_snippet_from_the_heading_on_fixed_length_or_none(tmp_path):
    body = "word " * 40
    page = tmp_path / "x.1"
    page.write_text(f".TH X 1\n.SH NAME\nx \\- y\n.SH DESCRIPTION\n{body}\n.SH SEE ALSO\nz\n")
    s = ct.page_snippet(page, nbytes=32)
    assert s == b"word word word word word word wo"
    (tmp_path / "short.1").write_text(".SH DESCRIPTION\nshort\n")
    assert ct.page_snippet(tmp_path / "short.1", nbytes=32) is None
    (tmp_path / "so.1").write_text(".so man1/x.1\n")
    assert ct.page_snippet(tmp_path / "so.1", nbytes=32) is None
    assert ct.page_snippet(page, ("BESCHREIBUNG",), nbytes=32) is None


def test_manpage_splits_balanced_disjoint_seeded_and_cross_section_duplicates_dropped():
    pools = {s: [f"{s}-{i}".encode() for i in range(12)] + [b"shared"] for s in ct.SECTIONS}
    splits = ct.manpage_splits(5, 2, 3, seed=1, pools=pools)
    seen = set()
    for name, n in (("train", 5), ("val", 2), ("test", 3)):
        items = splits[name]
        assert sorted(c for _, c in items) == sorted(list(range(len(ct.SECTIONS))) * n)
        for s, c in items:
            assert s.startswith(ct.SECTIONS[c].encode() + b"-")  # labelled by its section
            assert s not in seen
            seen.add(s)
    assert ct.manpage_splits(5, 2, 3, seed=1, pools=pools) == splits
    assert ct.manpage_splits(5, 2, 3, seed=2, pools=pools) != splits
    with pytest.raises(SystemExit):
        ct.manpage_splits(10, 2, 3, seed=1, pools=pools)  # 12 usable per section, 15 needed


def test_text_windows_distinct_fixed_length_deterministic():
    text = " ".join(f"w{i}" for i in range(500))
    w = ct.text_windows(text, 10, seed=3, nbytes=16)
    assert len(w) == 10 and all(len(x) == 16 for x in w)
    assert all(x in text.encode() for x in w)
    assert ct.text_windows(text, 10, seed=3, nbytes=16) == w


def test_tracker_settings_default_first_and_distinct():
    import dataclasses

    from kfac_stream import KFACConfig

    settings = uc.tracker_settings(mc_all=True)
    assert next(iter(settings)) == "default" and settings["default"] == {}
    fields = {f.name: f.default for f in dataclasses.fields(KFACConfig)}
    configs = [{**fields, **ov} for ov in settings.values()]
    assert all(a != b for i, a in enumerate(configs) for b in configs[i + 1:])
    assert any(c["fisher"] == "empirical" for c in configs)
    assert any(c["fisher"] == "mc" for c in configs)
    for ov in settings.values():
        KFACConfig(**ov)  # every setting is a valid config


def test_mean_std_and_acceptance_from_numbers():
    assert cf.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert cf.mean_std([4.0]) == (4.0, 0.0)

    def seed(map_nll, lap_nll, map_ece, lap_ece, map_acc, lap_acc, kron_nll):
        # laplace-torch's own default predictive (probit) is the peer of the NLL criterion; its
        # covariance under our link (here 0.5, which would fail every ratio) is only printed
        return {"results": {
            "MAP": {"nll": map_nll, "ece": map_ece, "accuracy": map_acc},
            cf.MAIN: {"nll": lap_nll, "ece": lap_ece, "accuracy": lap_acc},
            cf.KRON: {"nll": 0.5, "ece": 0.1, "accuracy": 0.5,
                      "investigation": {"nll_probit": kron_nll}}},
            "taus": {}, "cost_seconds": {"MAP": 0.0, cf.MAIN: 0.0, cf.KRON: 0.0}}

    per = [seed(1.5, 1.4, 0.2, 0.05, 0.6, 0.595, 1.45), seed(1.6, 1.61, 0.3, 0.1, 0.5, 0.5, 1.55)]
    acc = cf.acceptance(per, cf.summarise(per))
    assert [c["met"] for c in acc] == [False, True, True, True]
    assert "vs 1.5000 (ratio 1.003)" in acc[3]["figures"]
    assert "0.5000 (ratio 3.010)" in acc[3]["figures"]  # the same-link figure, printed
    per[1]["results"][cf.MAIN]["nll"] = 1.59
    per[1]["results"][cf.MAIN]["accuracy"] = 0.47
    per[0]["results"][cf.KRON]["investigation"]["nll_probit"] = 1.2
    acc = cf.acceptance(per, cf.summarise(per))
    assert [c["met"] for c in acc] == [True, True, False, False]  # 1.495 / 1.375 > 1.03


def test_sample_kinds_compares_both_kinds_per_seed_and_by_the_worst_seed():
    w, lin = cf.kind_rule(False, 32), cf.kind_rule(True, 32)
    assert "linearized=False" in w and "linearized=True" in lin

    def seed(s, w_acc, l_acc, w_nll, l_nll):
        figs = {"agrees_with_map": 0.5, "ece": 0.1, "aurc": 0.4}
        return {"seed": s, "selective": {w: {**figs, "accuracy": w_acc, "nll": w_nll},
                                         lin: {**figs, "accuracy": l_acc, "nll": l_nll}}}

    # linearised better by accuracy on every seed; by NLL on one seed only, yet its worst NLL
    # (1.3) is below the weight samples' worst (1.5)
    per = [seed(0, 0.25, 0.50, 1.5, 1.3), seed(1, 0.30, 0.45, 1.2, 1.25)]
    c = cf.sample_kinds(per, 32)
    assert [r["seed"] for r in c["per_seed"]] == [0, 1]
    assert c["per_seed"][1]["linearised"]["nll"] == 1.25
    v = c["verdict"]
    assert v["accuracy"] == {"every_seed": "linearised", "worst_seed": "linearised",
                             "worst": {"weight": 0.25, "linearised": 0.45}}
    assert v["nll"]["every_seed"] is None and v["nll"]["worst_seed"] == "linearised"
    assert v["nll"]["worst"] == {"weight": 1.5, "linearised": 1.3}
    assert v["ece"] == {"every_seed": None, "worst_seed": None,
                        "worst": {"weight": 0.1, "linearised": 0.1}}  # ties: neither
    line = cf.kinds_verdict(c)
    assert "by majority accuracy **linearised**" in line and "NLL of the mean probabilities " \
        "**neither**" in line and "NLL **linearised (1.3000 linearised vs 1.5000 weight)**" in line
    assert uc.kinds_table(c)[-1].startswith("- sample kinds: ")
    del per[1]["selective"][lin]  # a run from before both kinds were run
    assert cf.sample_kinds(per, 32) is None and uc.kinds_table(None) == []


# -- over seeds (benchmarks/_common.py, uncertainty.py, headline.py) ---------------------------

import headline  # noqa: E402
import uncertainty as un  # noqa: E402

import _common  # noqa: E402


def test_mean_std_is_shared_by_both_uncertainty_scripts():
    assert cf.mean_std is _common.mean_std and un.mean_std is _common.mean_std
    m, s = _common.mean_std([1.0, 4.0])
    assert m == 2.5 and abs(s - 1.5 * 2 ** 0.5) < 1e-12


def test_pick_seeded_phase_one_distinct_window_per_stretch_deterministic():
    windows = [torch.tensor([i]) for i in range(37)]
    assert _common.pick(windows, 5)[:, 0].tolist() == [0, 9, 18, 27, 36]  # no seed: as before
    picks = {}
    for seed in range(6):
        idx = _common.pick(windows, 5, seed=seed)[:, 0].tolist()
        assert idx == _common.pick(windows, 5, seed=seed)[:, 0].tolist()
        assert len(set(idx)) == 5
        for i, j in enumerate(idx):  # one window in each stretch [floor(i L/n), (i+1) L/n)
            assert i * 37 // 5 <= j < (i + 1) * 37 / 5
        picks[seed] = idx
    assert len({tuple(v) for v in picks.values()}) > 1
    assert _common.pick(windows, 37, seed=3)[:, 0].tolist() == list(range(37))
    with pytest.raises(SystemExit):
        _common.pick(windows, 38, seed=0)


def _lm_seed(seed, map_nll, lap_nll, map_auc, lap_auc):
    return {"seed": seed,
            "calibration": {"MAP": {"id": [map_nll, 0.10], "licenses": [3.0, 0.2]},
                            "Laplace empirical, tau=marglik": {"id": [lap_nll, 0.05],
                                                               "licenses": [3.0, 0.2]}},
            "auroc": {"MAP entropy": {"licenses": map_auc},
                      "Laplace empirical, tau=marglik": {"licenses": lap_auc},
                      un.MC_DROPOUT: {"licenses": None}},
            "taus": {"Laplace empirical, tau=marglik": 100.0 * (seed + 1)},
            "cost_seconds": {"MAP": 0.1, "Laplace empirical, tau=marglik": 1.0 + seed},
            "train_seconds": {"empirical": 10.0, "mc": 12.0}}


def test_uncertainty_summary_paired_calls_and_headline_rows():
    per = [_lm_seed(0, 2.0, 1.9, 0.6, 0.5), _lm_seed(1, 2.2, 2.1, 0.7, 0.71),
           _lm_seed(2, 2.1, 2.0, 0.5, 0.4)]
    s = un.summarise(per)
    lap = "Laplace empirical, tau=marglik"
    assert s["calibration"]["MAP"]["id"]["nll"] == pytest.approx((2.1, 0.1))
    assert s["calibration"][lap]["id"]["ece"] == pytest.approx((0.05, 0.0))
    assert s["auroc"][un.MC_DROPOUT]["licenses"] is None
    assert s["taus"][lap] == [100.0, 200.0, 300.0]
    assert s["cost_seconds"][lap] == pytest.approx((2.0, 1.0))
    assert s["train_seconds"]["mc"] == (12.0, 0.0)

    cmp = un.comparisons(per)
    nll = cmp["calibration"][lap]["id"]["nll"]
    assert nll["diffs"] == pytest.approx([-0.1, -0.1, -0.1])
    assert nll["lower"] == 3 and nll["call"] == "lower"  # every seed, std 0 < |mean|
    assert cmp["calibration"][lap]["id"]["ece"]["call"] == "lower"
    auc = cmp["auroc"][lap]["licenses"]
    assert (auc["lower"], auc["higher"], auc["call"]) == (2, 1, "noise")  # signs disagree
    assert cmp["calibration"][lap]["licenses"]["nll"]["call"] == "noise"  # no difference
    assert un.MC_DROPOUT not in cmp["auroc"]
    assert un.paired([1.0, 1.0, 1.0], [1.1, 1.3, 1.01])["call"] == "noise"  # |mean| < std
    assert un.paired([1.0, 1.0, 1.0], [1.2, 1.3, 1.25])["call"] == "higher"
    assert un.paired([1.0], [0.5])["call"] == "one seed"

    r = {"seeds": [0, 1, 2], "sets": {"val": [4, 128], "id": [4, 128], "licenses": [4, 128]},
         "summary": s, "vs_map": cmp, "per_seed": per}
    text = un.tables(r) + "\n" + un.verdict(r)
    assert "2.1000 ± 0.1000" in text and "100, 200, 300" in text
    assert f"better than MAP (lower): {lap} id NLL, {lap} id ECE" in text
    assert "worse than MAP (higher): none" in text
    assert "within noise of MAP entropy" in text

    import json

    rows = headline.lm_rows(json.loads(json.dumps(r)))  # as read back from the JSON
    assert "2.1000 ± 0.1000 / 10.00 ± 0.00% → 2.0000 ± 0.1000 / 5.00 ± 0.00%" in rows[0]
    assert "3 seeds" in rows[0] and len(rows) == 2
    assert f"0.600 ± 0.100, 0.537 ± 0.158 ({lap})" in rows[1]
