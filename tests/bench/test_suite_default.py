"""The default-path suite (`benchmarks/suite_default.py`): its settings are the library's own
posteriors' probabilities, the pre-guard held-out choice is the grid's joint minimum, and the
bar is applied as stated."""

import random
import sys

import torch

from kfac_stream import LaplacePosterior, Snapshot
from kfac_stream.snapshot.heldout_prior import HeldoutPrior

from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import suite_default as sd  # noqa: E402
from tasks import suite_tasks as st  # noqa: E402

#: The suite symmetrises each covariance and adds ``1e-12 · max diag`` (`suite.psd`); the
#: posterior's own probabilities take the covariance as it is. The NLLs then differ by
#: float64 round-off and that jitter only.
ROUTE_TOL = 1e-9


class TinyTask(st.Classifier):
    """A 3-class byte classifier small enough for a test: class ``c``'s sequences hold bytes
    of one range (``1 + 80c`` to ``80 + 80c``) with random noise bytes, 12 tokens."""

    name, title = "tiny", "tiny"
    layers, width, steps, batch_size, lr = 1, 16, 12, 8, 3e-3
    n_head = 2

    def __init__(self, seed: int):
        rng = random.Random(seed)
        pools = [[bytes(rng.randrange(1 + 80 * c, 81 + 80 * c) if rng.random() < 0.7
                        else rng.randrange(1, 241) for _ in range(12)) for _ in range(40)]
                 for c in range(3)]
        super().__init__(seed, pools, (16, 12, 12))


def test_settings_are_the_library_posteriors_probabilities(tmp_path):
    task = TinyTask(0)
    model, snap_dir, _ = sd.train(task, str(tmp_path))
    assert Snapshot.load(snap_dir).heldout_prior is not None  # the callback fitted on val
    part = sd.library_part(task, model, snap_dir)
    test, y = task.evals["test"]
    for name, prior in (("default", "auto"), ("no_eval", "marglik")):
        post = LaplacePosterior(model, Snapshot.load(snap_dir), prior)
        ref = sd.scored(post.predictive_probs(test, -1), y)["nll"]
        print(f"{name}: suite {part[name]['nll']:.12f} vs predictive_probs {ref:.12f} "
              f"({post.describe()})")
        assert abs(part[name]["nll"] - ref) < ROUTE_TOL
    assert part["choice"]["no_eval"][1] == "probit"
    assert part["choice"]["old_no_eval"] == (part["choice"]["no_eval"][0], "meanfield")
    with torch.no_grad():
        p_map = torch.softmax(model(**test).logits.double(), -1)
    assert abs(part["map"]["nll"] - sd.scored(p_map, y)["nll"]) < ROUTE_TOL


def fit(link_nll: dict, grid=(0.1, 1.0, 10.0)) -> HeldoutPrior:
    return HeldoutPrior(tau=1.0, nll=0.0, marglik_tau=1.0, marglik_nll=0.0, examples=5,
                        link="probit", grid=grid, grid_nll=link_nll.get("probit", (0,) * 3),
                        link_nll=link_nll)


def test_old_heldout_is_the_joint_grid_minimum_ties_to_the_larger_tau():
    f = fit({"probit": (0.9, 0.5, 0.7), "meanfield": (0.8, 0.6, 0.4)})
    assert sd.old_heldout(f) == (10.0, "meanfield")
    f = fit({"probit": (0.9, 0.4, 0.4), "meanfield": (0.8, 0.6, 0.5)})
    assert sd.old_heldout(f) == (10.0, "probit")  # tie at 0.4: the larger tau
    assert sd.old_heldout(fit({"mc": (0.9, 0.4, 0.5)})) is None  # per-token: no old fit
    assert sd.old_heldout(None) is None


def seed_row(nll: dict, conf: float, acc: float = 0.5) -> dict:
    return {"overconfident": conf > acc, "scores": {
        k: {"nll": v, "accuracy": acc, "confidence": conf} for k, v in nll.items()}}


def test_bar_per_seed_and_against_laplace_torch_on_the_mean():
    under = seed_row({"map": 1.0, "default": 1.009, "laplace_torch": 1.0}, conf=0.4)
    over = seed_row({"map": 1.0, "default": 1.001, "laplace_torch": 1.0}, conf=0.6)
    assert sd.meets(under, "default") and not sd.meets(over, "default")
    assert sd.meets(under, "old_heldout") is None
    v = sd.task_verdict([under, under], "default")
    assert abs(v["score"] - 1.009 / 1.01) < 1e-12 and v["meets"]
    v = sd.task_verdict([under, over], "default")
    assert abs(v["score"] - 1.001) < 1e-12 and not v["meets"]
    far = seed_row({"map": 1.2, "default": 1.1, "laplace_torch": 1.0}, conf=0.6)
    v = sd.task_verdict([far], "default")  # beats MAP, misses 1.05 x laplace-torch
    assert abs(v["lt_ratio"] - 1.1 / 1.05) < 1e-12 and not v["meets"]
