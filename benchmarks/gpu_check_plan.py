"""What ``gpu_check.py`` runs, how big and how long, and its targets: the parts with their time
limits, the full and dry-run sizes, the training runs of each setting, the ratios and
tolerances the summary judges (`gpu_check_summary`)."""

from __future__ import annotations

import dataclasses

#: The whole check's wall-clock budget on a GPU (seconds): 6 minutes less the start-up.
DEADLINE_S = 345


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    title: str
    limit_s: int  # its own limit on a GPU
    reserve_s: int  # kept for it while earlier parts run (a part may overrun into no one's)
    dry_limit_s: int  # its limit in a dry run (CI machines are slow; the test bounds the sum)


PARTS = [
    Part("cuda_tests", "1. CUDA tests", 110, 60, 90),
    Part("micro", "2. eigh, fold, store device path", 45, 20, 90),
    Part("train_fp32_autocast", "3a. Llama 1.1B fp32 + bf16 autocast, 4x1024, accum 2",
         110, 60, 120),
    Part("train_bf16", "3b. Llama 1.1B bf16 weights, 1x2048", 80, 45, 120),
    Part("exchange", "4. one-rank NCCL exchange", 30, 15, 60),
]

CUDA_TEST_FILES = ["tests/unit/tracking/test_worker_eigh_and_cuda.py",
                   "tests/unit/tracking/test_tracker_lifecycle.py"]
#: One CUDA test's limit (pytest-timeout, where installed: it is on the GPU machine).
TEST_TIMEOUT_S = 60
TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
FULL = {"eigh": (4096, 11008), "fold_rows": 6560, "fold_d": 4096,
        "store_d": 4096, "store_rows": 6560, "store_updates": 20,
        "steps": 10, "warmup": 10, "blocks": 3, "llama": TINYLLAMA,
        "settings": {"fp32_autocast": dict(batch=4, seq=1024, accumulation=2,
                                           weights="float32", autocast=True),
                     "bf16": dict(batch=1, seq=2048, accumulation=1, weights="bfloat16",
                                  autocast=False)}}
DRY = {"eigh": (64, 96), "fold_rows": 64, "fold_d": 128,
       "store_d": 128, "store_rows": 64, "store_updates": 5,
       "steps": 10, "warmup": 10, "blocks": 1, "llama": TINY,
       "settings": {"fp32_autocast": dict(batch=2, seq=32, accumulation=2,
                                          weights="float32", autocast=True),
                    "bf16": dict(batch=1, seq=64, accumulation=1, weights="bfloat16",
                                 autocast=False)}}
#: The runs of one training setting, in the order of each block (``sizes["blocks"]`` blocks,
#: interleaved: plain and tracked runs alternate, so a drift of the card's speed shows in each
#: block's plain run instead of in a ratio), then one plain run after the last block. The
#: ablation at ``update_every=1``: "replay only" runs the MC replay, the capture hooks and the
#: collection of the rows but drops each update before the worker (`ABLATION_DROP`); "fold
#: only" is the empirical Fisher (its rows captured in the training backward: no replay;
#: hooks, collection and fold), whose updates fold more rows (every sequence's sampled
#: positions) than the MC share's.
RUNS = {"plain": None, "defaults": {}, "update_every=1": {"update_every": 1},
        "replay only": {"update_every": 1, "ablation": "replay only"},
        "fold only": {"update_every": 1, "fisher": "empirical"}}
FINAL_RUN = "plain-2"
#: The ablation key of a run's config: not a KFACConfig field.
ABLATION_DROP = "replay only"
#: Every tracked run: the long-run MC share on a short run, no snapshot inside the steps.
TRACKED = dict(min_window_sequences=0, snapshot_every=10**6)
#: Steps at the start of a run in which host syncs on the training thread are counted.
SYNC_COUNT_STEPS = 2

# targets (the summary's PASS/MISS)
RATIO_DEFAULTS, RATIO_EVERY_STEP, TOTAL_S = 1.02, 1.10, 360
# ≤ 6560 bf16 products per entry (each exact in fp32), accumulated by the tensor cores: a
# sequential IEEE fp32 sum would give ~2^-24·sqrt(m) ≈ 5e-6 against the Gram of the rounded
# rows, but the tensor cores' accumulation is not that sum: 1.8e-5 measured on an H200 (both
# runs, 2026-11-26). Loose on purpose: what matters is that the fold's error stays well under
# the fp16 storage rounding every stored entry gets (2^-11 = 4.9e-4), 5x here.
FOLD_TOL = 1e-4
# the store's flushed factor against the float64 EMA of the *unrounded* rows: one fp16
# rounding of every stored entry at the flush (unit roundoff 2^-11 = 4.9e-4) plus the rows'
# bf16 rounding (2^-9 per entry; ≤ 1.5e-3 relative Frobenius on the Gram of one update of
# Gaussian rows, tests/unit/tracking/test_worker_eigh_and_cuda.py; less after an EMA of several)
STORE_TOL = 2e-3
# against the EMA of the bf16-rounded rows only the fp16 rounding and fp32 accumulation remain
STORE_ROUNDED_TOL = 2.0**-11 + FOLD_TOL


def eigh_tol(d: int) -> float:
    """float32 eigh, reconstruction ``Q diag(w) Qᵀ`` against the factor: backward error of
    order ``d·2^-24`` of the top eigenvalue at worst (seen: ~5e-7 at d = 4096)."""
    return d * 2.0**-24
