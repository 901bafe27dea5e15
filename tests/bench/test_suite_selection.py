"""The default-selection suite's verdicts (`benchmarks/suite.py`) on hand-made results:
the bar (≤ MAP's NLL where MAP is overconfident, ≤ 1.01 × where underconfident; the mean against
1.05 × laplace-torch's; accuracy within 1 point), the link rules, leave-one-task-out, and the
blended link. Figures are chosen so each ratio is known by hand."""

import sys

import pytest
import torch

from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import suite  # noqa: E402


def _link(nll, acc=0.5):
    return {"nll": nll, "accuracy": acc, "ece": 0.0, "confidence": 0.5}


def seed(map_nll, map_conf, map_acc, links, k=4, val_nll=None, lt=None, train_acc=None,
         epochs=None):
    """One seed's results: MAP, ``links`` = {link: (nll, accuracy)} under the rule ``r``."""
    rule = {"scores": {"marglik": {k2: _link(*v) for k2, v in links.items()}}}
    if val_nll is not None:
        rule["val_nll"] = val_nll
    out = {"MAP": {"nll": map_nll, "accuracy": map_acc, "ece": 0.0, "confidence": map_conf},
           "n_classes": k, "rules": {"r": rule}, "train_accuracy": train_acc, "epochs": epochs}
    if lt is not None:
        out["kron"] = {"scores": {"probit": _link(lt)}}
    return out


def links(mf, probit, acc=0.5):
    return {"meanfield": (mf, acc), "probit": (probit, acc), "mc": (9.0, acc),
            "blend": (9.0, acc)}


def test_underconfident_seed_gets_the_one_percent_slack_and_overconfident_none():
    over = {"per_seed": [seed(2.0, 0.9, 0.5, links(2.01, 3.0))]}  # conf > acc
    under = {"per_seed": [seed(2.0, 0.4, 0.5, links(2.01, 3.0))]}  # conf < acc
    cand = ("r", "meanfield", "marglik")
    assert suite.task_score(over, cand)["parts"]["vs_map"] == pytest.approx(2.01 / 2.0)
    assert suite.task_score(over, cand)["score"] > 1  # 0.5% over MAP: fails
    assert suite.task_score(under, cand)["parts"]["vs_map"] == pytest.approx(2.01 / 2.02)
    assert suite.task_score(under, cand)["score"] <= 1
    assert suite.task_score(under, cand)["map_overconfident"] == [False]


def test_mean_against_laplace_torch_and_accuracy_within_one_point():
    t = {"per_seed": [seed(3.0, 0.9, 0.50, links(1.0, 2.0, acc=0.49), lt=1.0),
                      seed(3.0, 0.9, 0.50, links(1.2, 2.0, acc=0.485), lt=1.0)]}
    s = suite.task_score(t, ("r", "meanfield", "marglik"))
    assert s["parts"]["vs_laplace_torch"] == pytest.approx(1.1 / 1.05)
    assert s["parts"]["accuracy"] == pytest.approx(1 + 0.50 - 0.4875 - 0.01)
    assert s["score"] == pytest.approx(1.1 / 1.05)


def test_link_rules_pick_by_classes_and_by_validation_nll():
    few = seed(2.0, 0.9, 0.5, links(1.0, 1.5), k=4,
               val_nll={"meanfield": 0.9, "probit": 0.8, "mc": 0.1, "blend": 0.1})
    many = seed(2.0, 0.9, 0.5, links(1.0, 1.5), k=10)
    assert suite.chosen_link(few, "r", "by-K") == "meanfield"
    assert suite.chosen_link(many, "r", "by-K") == "probit"
    assert suite.chosen_link(few, "r", "val-link") == "probit"  # only probit and mean-field
    assert suite.seed_scores(many, ("r", "by-K", "marglik"))["nll"] == 1.5
    cands = suite.candidates({"t": {"per_seed": [few]}})
    # none needs held-out data (the held-out default is scored beside, not selected)
    assert ("r", "by-K", "marglik") in cands and ("default", "map", "map") in cands
    assert not [c for c in cands if c[1] in ("val-link", "heldout")]
    assert len(cands) == (len(suite.LINKS) + 1 + len(suite.MEM_RULES) + len(suite.EPOCH_RULES)
                          + 1)


def test_rules_without_held_out_data_switch_to_maps_probabilities():
    """``mem<t>``: the posterior where MAP's training accuracy is >= t, else MAP's own
    probabilities; ``ep<e>``: MAP's after at most e epochs, the posterior after more; ``map``:
    always MAP's."""
    memorised = seed(2.0, 0.9, 0.5, links(1.0, 1.5), train_acc=0.97, epochs=40.0)
    brief = seed(2.0, 0.4, 0.5, links(2.5, 3.0), train_acc=0.6, epochs=1.0)
    for s, mem, ep in ((memorised, 1.0, 1.0), (brief, 2.0, 2.0)):
        assert suite.seed_scores(s, ("r", "mem0.95-meanfield", "marglik"))["nll"] == mem
        assert suite.seed_scores(s, ("r", "ep1-meanfield", "marglik"))["nll"] == ep
        assert suite.seed_scores(s, ("default", "map", "map"))["nll"] == 2.0
    assert suite.chosen_link(memorised, "r", "mem0.95-probit") == "probit"
    assert suite.chosen_link(brief, "r", "mem0.9-probit") == "map"
    assert suite.seed_scores(brief, ("r", "ep3-probit", "marglik"))["nll"] == 2.0
    assert suite.seed_scores(memorised, ("r", "ep3-probit", "marglik"))["nll"] == 1.5


def test_the_held_out_default_scores_its_own_joint_choice():
    s = seed(2.0, 0.9, 0.5, links(1.0, 1.5))
    s["default"] = {"heldout": {"tau": 3.0, "link": "probit", "scores": _link(1.2)}}
    assert suite.chosen_link(s, "default", "heldout") == "probit"
    assert suite.seed_scores(s, suite.HELDOUT)["nll"] == 1.2


def test_leave_one_task_out_scores_the_held_out_task_with_the_others_choice():
    good_mf = {"per_seed": [seed(2.0, 0.9, 0.5, links(1.0, 1.5))]}
    good_probit = {"per_seed": [seed(2.0, 0.9, 0.5, links(2.5, 1.0))]}
    tasks = {"a": good_mf, "b": good_mf, "c": good_probit}
    loto = {}
    for held in tasks:
        rest = [n for n in tasks if n != held]
        chosen, _ = suite.select(tasks, rest)
        s = suite.task_score(tasks[held], chosen)
        loto[held] = (s["links"][0], s["score"])  # by-K on 4 classes ties mean-field
    assert loto["c"] == ("meanfield", pytest.approx(2.5 / 2.0))  # the others pick mean-field
    assert loto["a"][1] <= 1 and loto["b"][1] <= 1


def test_blend_is_the_normalised_geometric_mean():
    p = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.4, 0.4, 0.2]], dtype=torch.float64)
    g = (p * q).sqrt()
    assert torch.allclose(suite.blend_probs(p, q), g / g.sum(), rtol=0, atol=1e-15)
