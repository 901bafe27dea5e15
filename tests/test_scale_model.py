"""The pure cost functions of ``benchmarks/scale.py`` on hand-computed numbers (no measurements):
rows of one layer, the fold FLOPs of one factor, and the owner-balanced loads of Llama-2-7B."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import scale


@pytest.fixture(scope="module")
def llama7b():
    return scale.layout("Llama-2-7B")


def test_rows_of_one_layer_and_fold_flops_of_one_factor():
    assert scale.N_R == 820  # ceil(0.05 * 4 * 4096)
    q_proj = {"q.A": (4096, False), "q.G": (4096, False)}
    assert scale.rows_bytes(q_proj, 820, 2) == 820 * (4096 + 4096) * 2 == 13_434_880
    down = {"down.A": (11008, True), "down.G": (4096, False)}  # a diagonal A keeps its [d] sum
    assert scale.rows_bytes(down, 820, 2, diagonal_as_sums=True) == 4 * 11008 + 820 * 4096 * 2
    assert scale.fold_flops(6560, 4096, False) == 2 * 6560 * 4096**2 == 220_117_073_920
    assert scale.fold_flops(6560, 4096, False, upper=True) == 6560 * 4096 * 4097
    assert scale.fold_flops(6560, 11008, True) == 2 * 6560 * 11008
    assert scale.plain_step_s(6_738_415_616) == pytest.approx(1.675, abs=1e-3)


def test_llama7b_layout_and_balanced_loads(llama7b):
    after, before = llama7b["after"], llama7b["before"]
    assert llama7b["layers"] == 224 and llama7b["groups"] == 64  # q/k/v and gate/up per block
    assert len(before) == 2 * 224 and len(after) == 2 * 224 - 32 * 3
    dense = [d for d, diag in after.values() if not diag]
    assert set(dense) == {4096} and len(dense) == 256  # 11008 > max_dense_dim: diagonal
    total = 256 * 4096**2 + 96 * 11008
    ranks = scale.rank_loads(after, 8, 820)
    assert sum(r["entries"] for r in ranks) == total
    assert all(r["entries"] == 32 * 4096**2 + 12 * 11008 for r in ranks)  # equal sizes: exact
    assert sum(r["sent"] for r in ranks) == sum(r["recv"] for r in ranks)
    # dense: rows to the owner (820·4096·2 B from each rank), folded there over N = 8·820 rows;
    # diagonal: fp32 partial sums (11008·4 B), every rank folds its own 820 rows of all 96
    r0 = ranks[0]
    assert r0["sent"] == (256 - 32) * 820 * 4096 * 2 + (96 - 12) * 11008 * 4
    assert r0["recv"] == 7 * (32 * 820 * 4096 * 2 + 12 * 11008 * 4)
    assert r0["fold"] == 32 * 2 * 6560 * 4096**2 + 96 * 2 * 820 * 11008


def test_flush_interval_and_overhead_per_update(llama7b):
    rates = {"gemm": 1e11, "ema": 1e9, "eigh": 3e10, "gloo_Bps": 1e9}  # any CPU figures
    r10, r1 = (scale.predict(llama7b, 8, k, rates) for k in (10, 1))
    a = r1["after"]
    # 7B on 8 ranks: the owned fp32 sums (2.1 GB) fit 4 GiB -> shipped once per 8 updates
    assert a["K"] == 8 and a["host"] == 4 * (32 * 4096**2 + 12 * 11008) / 8
    assert a["fold_s"] == pytest.approx(a["fold"] / (989e12 * 0.6))
    # no worker excess and no snapshot excess: the GPU time per update spread over k steps
    assert a["excess_s"] == 0 and a["snapshot"] == 0
    assert a["overhead"] == pytest.approx((a["gpu_s"] + a["mc_s"]) / r1["step_s"])
    assert a["overhead"] == pytest.approx(10 * r10["after"]["overhead"])
    # the MC replay of 0.05 of 4 micro-batches of one 4096-token sequence: 0.2 sequences at
    # 4P FLOPs per token against the step's 6P per token of 4 sequences: 0.2·4 / (6·4)
    assert a["mc_sequences"] == pytest.approx(0.2)
    assert a["mc_s"] / r1["step_s"] == pytest.approx(0.2 * 4 / (6 * 4))
    assert r10["after"]["mc_share"] == pytest.approx(0.2 * 4 / (6 * 4) / 10)  # ≤ 1% per step
    # before issue 29 every sequence was replayed at micro-batch 1: 4·4 / (6·4) per update
    assert a["old_mc_overhead"] == pytest.approx((a["gpu_s"] + 4 * 4 / (6 * 4) * r1["step_s"])
                                                 / r1["step_s"])

    # 70B on 8 ranks: 16 GB of owned sums exceed the budget -> every update is shipped
    assert scale.predict(scale.layout("Llama-2-70B"), 8, 1, rates)["after"]["K"] == 1


def test_replayed_sequences_per_setting():
    assert scale.replayed_sequences(0.05) == pytest.approx(0.2)  # share of 1 x 4 sequences
    assert scale.replayed_sequences(1) == scale.replayed_sequences("all") == 4.0
    assert scale.replayed_sequences(2, micro_batch=8, accum=2) == 4.0  # int: per micro-batch
    assert scale.MC_DEFAULT == 0.05
