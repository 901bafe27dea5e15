"""The inputs of ``scale.py``'s cost model: the models, the GPUs' datasheet figures and the
rates assumed or measured (with their sources), the per-entry byte counts, and the training
setups the cost is predicted for (`SETUPS`, and the first GPU run's for the reconciliation:
`MEASURED`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kfac_stream import KFACConfig
from kfac_stream.snapshot.eigen_rule import GPU_SINGLE_EIGH

CFG = KFACConfig()  # the defaults
MODELS = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "Llama-2-7B": (4096, 11008, 32, 32, 32, 32000),
    "TinyLlama-1.1B": (2048, 5632, 22, 32, 4, 32000),
}
FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "vocab_size")
EVERY = (CFG.update_every, 1)
GiB = 2**30

GPUS = {  # datasheet figures (SOURCES)
    "H100": {"name": "H100 SXM 80 GB", "memory": 80 * GiB, "bf16": 989e12, "fp32": 67e12,
             "hbm": 3.35e12, "nvlink": 450e9},
    "H200": {"name": "H200 141 GB", "memory": 141e9, "bf16": 989e12, "fp32": 67e12,
             "hbm": 4.8e12, "nvlink": 450e9},
}
#: gpu-check part 3 on the H200 (main at 6a379e5, /work/shared/gpu.md): gram_fp32 of [6560, 4096]
#: bf16 rows in 0.59 ms, the tensor-core Gram the device path runs
GRAM_MEASURED = (6560, 4096, 0.59e-3)
#: benchmarks/snapshot_gpu.py on the H200 (results/snapshot_gpu.json): a periodic snapshot of
#: the ~1.1B model (242 factors, 2.65 G stored entries) held the training thread 0.553 s (the
#: flush, the lent export, the queueing of the write): entries, seconds
SNAPSHOT_HOLD = (2.65e9, 0.553)
#: gpu-check part 2 on the H200: float32 GPU eigh of one factor, side -> seconds
EIGH_MEASURED = GPU_SINGLE_EIGH
RATES = {
    "gemm_fraction": 2 * GRAM_MEASURED[0] * GRAM_MEASURED[1] ** 2 / GRAM_MEASURED[2] / 989e12,
    "fp32_fraction": 0.5,  # the sketch's skinny fp32 GEMMs on CUDA cores
    "hbm_fraction": 0.7,  # elementwise passes and the pending sums' read-modify-write
    "nvlink_fraction": 0.6, "nccl_latency_s": 30e-6,  # per collective
    "pcie_Bps": 25e9, "pcie_duplex": True,  # pinned, each way; H2D and D2H on two streams
    "mfu": 0.40,  # the 7B step (no measured step at that scale)
    "sync_s": 50e-6,  # one host read of a device value on the worker
    "gloo_s": 1e-3,  # the exchange's host-table all_gather (gloo) on the training thread
    "op_s": 5e-6,  # host dispatch of one PyTorch op
    # measured here by `measure` (these defaults: this machine's figures, --quick)
    "host_ema_eps": 1.6e9,  # entries/s of the old flush's host EMA pass, one thread
    "export_eps": 4.4e8,  # entries/s of the snapshot export's host passes, one thread
}
#: Host op dispatches. The update path's are COUNTED by benchmarks/worker_ops.py (every aten op
#: of an update step at the dispatcher, TinyLlama's 22 layers, 6 then 5 factor groups): they do
#: not grow with the factors, only with the layer calls (one gather each) and the groups
#: (factors of one side folded as one, `kfac_stream.store.device_groups`)
OPS = {
    "hook_call": 1,  # capture hooks: one aten.index per captured input / output gradient
    "collect_group": 9,  # tracking.collect per group: stack, scale, where, finiteness (84 -> 75
    "collect_pass": 30,  # ops for 6 -> 5 groups) and per pass: weights, loss-scale fit
    "fold_group": 17,  # FactorUpdater + DeviceGroup per group and update (91 -> 74 ops)
    "held_fold_group": 5,  # the deferred Gram's fold, once per FOLD_DEFER updates (+30 ops / 6)
    "table_key": 4,  # start_exchange: weight and positions into the device table (W > 1)
    "pack_key": 1,  # the all_to_all send buffer fill per rows key (W > 1)
    "regroup_group": 1,  # the owner stacks the exchanged rows of one side (W > 1)
    "flags": 8,  # the worker's one read of the update's flags and weights
    "flush_chunk": 20,  # stream_fold per chunk: copies, events, 10 kernels
    "old_host_chunk": 6,  # the old host EMA per 128-row chunk (slice, to, mul, mul, add, copy_)
}
ROW_COLLECT_BYTES = 34  # tracking.collect per captured entry (stack, bf16 in, fp32 ops, bf16 out)
PACK_BYTES = 4  # send-buffer fill or owner's cat per entry (read 2 + write 2)
FLUSH_DEVICE_BYTES = 60  # stream_fold's kernels per stored entry (fp16 in/out, fp32 work)
OLD_BUDGET = 4 * GiB  # the old fixed device_memory_budget default
OLD_FLUSH_EVERY = 8

SOURCES = [
    "NVIDIA H100 SXM datasheet: BF16 dense 989 TFLOP/s, FP32 67 TFLOP/s, HBM3 3.35 TB/s, 80 GB, "
    "NVLink 4 900 GB/s total (450 GB/s each way); H200: the same compute, HBM3e 4.8 TB/s, 141 GB",
    f"tensor-core Gram: {RATES['gemm_fraction']:.3f} of the BF16 peak, MEASURED on the H200 "
    "(gpu-check part 3 at 6a379e5: gram_fp32 of [6560, 4096] bf16 rows in 0.59 ms), assumed the "
    "same on an H100 and at the smaller row counts here; the rest of the fold FLOPs (the "
    f"sketch's fp32 GEMMs, the add) at {RATES['fp32_fraction']:.0%} of FP32",
    f"HBM: {RATES['hbm_fraction']:.0%} of the spec for the pending sums' read-modify-write and "
    "the elementwise passes (assumed)",
    f"NCCL all_to_all inside one node: {RATES['nvlink_fraction']:.0%} of 450 GB/s each way, "
    f"{RATES['nccl_latency_s'] * 1e6:.0f} us per collective (assumed)",
    f"PCIe 5.0 x16 pinned copies: {RATES['pcie_Bps'] / 1e9:.0f} GB/s each way (assumed "
    "achieved); a flush's H2D and D2H run on two copy streams, double-buffered, so they "
    "OVERLAP: a flush takes the longer of the two directions (the serial sum is in the JSON)",
    f"plain 7B step: 6·P·tokens at MFU {RATES['mfu']} of the BF16 peak; 1.1B steps MEASURED on "
    "the H200 at 6a379e5 (fp32 + bf16 autocast 4 x 1024 x 2: 0.205 s, 31.1 GB peak; pure bf16 "
    "1 x 2048: 7.44 s for 70 steps)",
    "MC replay: 4·P FLOPs per replayed token (forward 2P + backward to the tracked outputs 2P, no "
    "weight gradients) at the training step's FLOP rate, on the compute stream",
    "GPU eigh (float32, one factor at a time): power law through the two H200 measurements "
    f"(side 4096: {EIGH_MEASURED[4096]} s, 11008: {EIGH_MEASURED[11008]} s), assumed the same "
    "on an H100; diagonal factors need none",
    f"host: {RATES['sync_s'] * 1e6:.0f} us per host read on the worker, "
    f"{RATES['op_s'] * 1e6:.0f} us per op dispatched, {RATES['gloo_s'] * 1e3:.0f} ms for the "
    "exchange's gloo host-table all_gather on the training thread (assumed); 0 host reads of "
    "device values on the training thread (tests/unit/tracking/test_host_syncs.py)",
    "training's peak reserved memory, for the auto budget: 7B x 8 ZeRO-3 micro-batch 1 x 4096 "
    "ASSUMED 40 GB (bf16 params and grads 3.4 GB/rank, fp32 Adam 10.1 GB/rank, activations with "
    "flash attention ~18 GB, buffers); 1.1B: MEASURED 31.1 GB (autocast), ASSUMED 20 GB (pure "
    "bf16)",
]


# -- setups ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """One training run the cost is predicted for.

    Attributes:
        key: Short name; model: a `MODELS` key; gpu: a `GPUS` key; world: ranks.
        batch, seq, accum: Sequences per micro-batch, tokens each, accumulation steps.
        precision: Words for the table.
        step_s: Measured plain step (None: ``6·P·tokens / (bf16 peak · MFU)``).
        peak_reserved: Training's peak reserved bytes per GPU (the auto budget's input).
        share: The MC share (None: ``"all"`` taken inside the training forward, no replay).
        every: update_every values; budget: bytes (None: the auto budget).
        measured: The measured ratio to plain (old code), for the reconciliation.
    """

    key: str
    model: str
    gpu: str
    world: int
    batch: int
    seq: int
    accum: int
    precision: str
    step_s: float | None
    peak_reserved: float
    share: float | None = CFG.mc_sequences
    every: tuple[int, ...] = EVERY
    budget: int | None = None
    measured: str = ""


SETUPS = [
    Setup("7B x 8", "Llama-2-7B", "H100", 8, 1, 4096, 4, "bf16, ZeRO-3", None, 40e9),
    Setup("1.1B autocast, H200", "TinyLlama-1.1B", "H200", 1, 4, 1024, 2,
          "fp32 weights + bf16 autocast", 0.205, 31.1e9),
    Setup("1.1B autocast, H100", "TinyLlama-1.1B", "H100", 1, 4, 1024, 2,
          "fp32 weights + bf16 autocast (the H200's step)", 0.205, 31.1e9),
    Setup("1.1B bf16 1x2048, H200", "TinyLlama-1.1B", "H200", 1, 1, 2048, 1, "pure bf16",
          7.44 / 70, 20e9),
]
#: The first GPU run's settings (old code, /work/shared/gpu.md), for reconciliation
MEASURED = [
    replace(SETUPS[1], key="A: autocast, update_every=4", every=(4,),
            measured="4.97x (2 waits, 12.3 s)"),
    replace(SETUPS[1], key="B: A with device_memory_budget=32 GiB", every=(4,), budget=32 * GiB,
            measured="2.76x"),
    replace(SETUPS[3], key="C: bf16 1x2048 defaults (70 steps: share raised to 1)", share=None,
            every=(10,), measured="2.07x; log: 3.452 s per update"),
    replace(SETUPS[3], key="D: C at update_every=1", share=None, every=(1,),
            measured="did not finish; log: 2.447 s per update"),
]
