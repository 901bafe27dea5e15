"""`make gpu-check`: everything about the CUDA path that a machine without a GPU cannot show,
in one command (≤ 10 minutes on one H100). See docs/gpu.md.

Parts (each prints its figures; all go into ``benchmarks/results/gpu_check.json``):

1. ``cuda_tests``: ``pytest -rs -m "not slow"`` on the test files with CUDA-only tests
   (`CUDA_TEST_FILES`); none may skip for want of CUDA.
2. ``eigh``: snapshot eigendecompositions (`eigh_factors`) of factors of side 4096 and 11008
   (Llama-2-7B's) on the GPU (float32, one reused stream) against float64 on the CPU (the
   4096 one; 11008 is timed on the GPU only): seconds and reconstruction error.
3. ``fold``: the bf16 tensor-core fold ``Σ rowsᵀrows`` (`gram_fp32`) of 6560 rows of 4096
   (one 7B factor's update on 8 ranks), and the `FactorStore` device path (``push_stat`` +
   flush through pinned memory) against the host path (``push_rows`` + flush).
4. ``train``: 60 steps (10 more as warm-up) of a ~1.1B Llama built from a config (TinyLlama's
   shapes, random weights and tokens: nothing downloaded), bf16, micro-batch 1 x 2048 tokens,
   plain / KFACConfig defaults / ``update_every=1``: seconds per step and its ratio to
   plain, the tracker's waits, peak GPU memory, and host syncs counted on the training thread
   in the warm-up steps (an update step of each setting; the counting mode slows every op, so
   the timed steps run without it) by a thread-local counter (``tests/syncs.py``:
   kfac_stream's own must be 0).
5. ``exchange``: a one-rank NCCL exchange (`start_exchange` from a side stream, the way the
   tracker issues it, then `finish_exchange`): the owner must get its rows back exactly.

On a machine without CUDA (or with ``--dry-run``) it says so and runs the CPU parts on small
sizes (eigh, fold and store on the CPU, 2 timed steps of a tiny Llama per setting with the
factor worker on (``async_updates=True``, the CUDA default), the exchange on gloo): a check
that the script itself works (CI runs it: tests/test_gpu_check.py). A dry run writes nothing
and exits 0 (1 if a check fails).

Usage: ``python benchmarks/gpu_check.py [--dry-run] [--steps 60] [--skip-tests]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # syncs.py: the thread-local sync counter

from _common import free_port, machine, write_json  # noqa: E402

CUDA_TEST_FILES = ["tests/test_hot_path.py", "tests/test_lifecycle.py"]
FULL = {"eigh": (4096, 11008), "fold_rows": 6560, "fold_d": 4096, "steps": 60, "warmup": 10,
        "seq": 2048, "llama": dict(hidden_size=2048, intermediate_size=5632,
                                   num_hidden_layers=22, num_attention_heads=32,
                                   num_key_value_heads=4, vocab_size=32000)}
DRY = {"eigh": (64, 96), "fold_rows": 64, "fold_d": 128, "steps": 2, "warmup": 1, "seq": 32,
       "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256)}
SETTINGS = {"plain": None, "defaults": {}, "update_every=1": {"update_every": 1}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> tuple[float, object]:
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def cuda_tests() -> dict:
    """Part 1: the CUDA-only tests (pytest in a subprocess)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "not slow", "-p",
           "no:cacheprovider", *CUDA_TEST_FILES]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = -1, f"{e.stdout or ''}\ntimed out after 300 s"
    tail = str(text).strip().splitlines()[-15:]
    no_cuda = [line for line in tail if "needs a CUDA GPU" in line]
    return {"command": " ".join(cmd[1:]), "rc": rc, "tail": tail,
            "skipped_for_cuda": len(no_cuda), "seconds": time.perf_counter() - t}


def eigh_part(sizes, device: torch.device) -> dict:
    """Part 2: `eigh_factors` on ``device`` (and the CPU float64 reference for the smallest)."""
    from kfac_stream.stats.spectrum import eigh_factors

    out = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for i, d in enumerate(sizes):
        x = torch.randn(d + 64, d, generator=gen, device=device)  # built where it is fast
        f_dev = x.T @ x / d  # [d, d] SPD
        f = f_dev.double().cpu()  # factors reach eigh_factors as float64 on the CPU
        if i == 0:
            eigh_factors({"warm": f[:64, :64]}, device=device)  # stream, handles, kernels
        secs, res = _timed(lambda f=f: eigh_factors({"f": f}, device=device), device)
        w, q = (t.to(device, f_dev.dtype) for t in res["f"])
        err = float(((q * w) @ q.T - f_dev).abs().max() / w.max())
        row = {"seconds": secs, "max_err_rel_to_top": err}
        if i == 0 and device.type == "cuda":
            row["cpu_float64_seconds"] = _timed(lambda f=f: eigh_factors({"f": f}),
                                                torch.device("cpu"))[0]
        out[str(d)] = row
        print(f"  eigh {d}: {secs:.3f} s on {device.type}, reconstruction error "
              f"{err:.2e} of the top eigenvalue"
              + (f"; CPU float64: {row['cpu_float64_seconds']:.2f} s"
                 if "cpu_float64_seconds" in row else ""))
    return out


def fold_part(rows: int, d: int, device: torch.device) -> dict:
    """Part 3: the bf16 fold, and the store's device path against its host path."""
    from kfac_stream.factor_updates import gram_fp32
    from kfac_stream.store.factor_store import FactorStore

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, d, generator=gen)
    xb = x.to(device, torch.bfloat16)
    gram_fp32(xb, False)  # warm-up (cuBLAS handle, kernels)
    fold_s, got = _timed(lambda: gram_fp32(xb, False), device)
    rounded = xb.double().cpu()
    ref = rounded.T @ rounded
    fold_err = float(torch.linalg.norm(got.double().cpu() - ref) / torch.linalg.norm(ref))

    def device_path():
        store = FactorStore("float16", 0.95, device_budget=1 << 34)
        store.add("f", d, False)
        for _ in range(4):
            store.push_stat("f", gram_fp32(xb, False), float(rows), rows)
        store.flush()
        return store.values()["f"]

    def host_path():
        store = FactorStore("float16", 0.95)
        store.add("f", d, False)
        for _ in range(4):
            store.push_rows("f", x, float(rows), rows)
        store.flush()
        return store.values()["f"]

    dev_s, dev_f = _timed(device_path, device)
    host_s, host_f = _timed(host_path, torch.device("cpu"))
    agree = float(torch.linalg.norm(dev_f - host_f) / torch.linalg.norm(host_f))
    print(f"  fold [{rows}, {d}] bf16 on {device.type}: {fold_s * 1e3:.2f} ms, relative error "
          f"{fold_err:.1e} against the rounded rows' Gram; store of 4 updates: device path "
          f"{dev_s:.3f} s, host path {host_s:.3f} s (factors agree to {agree:.1e}: bf16 rows)")
    return {"fold_seconds": fold_s, "fold_rel_err": fold_err, "store_device_seconds": dev_s,
            "store_host_seconds": host_s, "store_rel_diff": agree}


def steps_callback(warmup: int, device: torch.device):
    """A Trainer callback: wall time from the end of warm-up to the last step, and host syncs
    on the training thread inside each warm-up step (`syncs.CudaSyncCounter`; CPU:
    `SyncCounter`), which holds an update step of every setting (step 0)."""
    from transformers import TrainerCallback

    from syncs import CudaSyncCounter, SyncCounter

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = self.t1 = None
            self.count, self.ours, self.mode = 0, {}, None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                _sync(device)
                self.t0 = time.perf_counter()
            if state.global_step < warmup:  # counted in warm-up only: the mode slows ops
                self.mode = CudaSyncCounter() if device.type == "cuda" else SyncCounter()
                self.mode.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
                self.count += self.mode.count
                for k, v in self.mode.ours.items():
                    self.ours[k] = self.ours.get(k, 0) + v
                self.mode = None
            if state.global_step == state.max_steps:
                _sync(device)
                self.t1 = time.perf_counter()

    return Steps()


def train_part(sizes: dict, device: torch.device, tmp: Path) -> dict:
    """Part 4: plain / defaults / update_every=1 on a Llama built from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from kfac_stream import KFACConfig, KFACStreamCallback

    steps, warmup, seq = sizes["steps"], sizes["warmup"], sizes["seq"]
    gen = torch.Generator().manual_seed(0)
    vocab = sizes["llama"]["vocab_size"]
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in
            torch.randint(0, vocab, (steps + warmup, seq), generator=gen)]
    cuda = device.type == "cuda"
    out = {}
    for name, cfg in SETTINGS.items():
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it will train
            model = LlamaForCausalLM(LlamaConfig(**sizes["llama"], max_position_embeddings=seq))
        model = model.to(torch.bfloat16 if cuda else torch.float32)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        timer = steps_callback(warmup, device)
        # on CPU the worker thread as on CUDA (async_updates=None is off there, and reading
        # CPU tensors on the training thread would count as syncs)
        extra = {} if cuda else {"async_updates": True}
        kfac = [] if cfg is None else [KFACStreamCallback(KFACConfig(
            snapshot_every=10**6, output_dir=str(tmp / f"kfac-{len(out)}"), **cfg, **extra))]
        args = TrainingArguments(
            str(tmp / f"run-{len(out)}"), per_device_train_batch_size=1,
            max_steps=steps + warmup, learning_rate=1e-5, report_to=[], use_cpu=not cuda,
            logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=0,
            dataloader_pin_memory=False, logging_nan_inf_filter=False, max_grad_norm=0.0)
        trainer = Trainer(model=model, args=args, train_dataset=data,
                          callbacks=[*kfac, timer])
        trainer.train()
        row = {"seconds_per_step": (timer.t1 - timer.t0) / steps, "host_syncs": timer.count,
               "kfac_host_syncs": dict(timer.ours)}
        if cuda:
            row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        if kfac:
            c = kfac[0].tracker.counters if kfac[0].tracker else None
            if c is not None:
                row.update(updates=c.updates, waits=c.waits, wait_seconds=c.wait_seconds)
        out[name] = row
        del trainer, model
        if cuda:
            torch.cuda.empty_cache()
    plain = out["plain"]["seconds_per_step"]
    for name, row in out.items():
        row["ratio_to_plain"] = row["seconds_per_step"] / plain
        print(f"  {name}: {row['seconds_per_step'] * 1e3:.1f} ms/step ({row['ratio_to_plain']:.3f}"
              f"x plain), waits {row.get('waits', 0)} ({row.get('wait_seconds', 0.0):.3f} s), "
              f"host syncs on the training thread in warm-up {row['host_syncs']} (kfac_stream's: "
              f"{sum(row['kfac_host_syncs'].values())})"
              + (f", peak {row['peak_memory_gb']:.2f} GB" if "peak_memory_gb" in row else ""))
    return out


def exchange_part(device: torch.device) -> dict:
    """Part 5: a one-rank exchange, issued from a side stream as the tracker issues it."""
    import torch.distributed as dist

    from kfac_stream.distributed.exchange import finish_exchange, start_exchange
    from kfac_stream.distributed.ownership import assign_owners

    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:"
                            f"{free_port()}", rank=0, world_size=1,
                            **({"device_id": device} if cuda else {}))
    try:
        plan = dist.new_group(backend="gloo") if cuda else None
        dims = {"l.A": (256, False), "l.G": (128, False), "d.A": (64, True)}
        own = assign_owners(dims, 1, 2)
        gen = torch.Generator().manual_seed(2)
        rows = {k: torch.randn(40, d, generator=gen).to(device, torch.bfloat16)
                for k, (d, diag) in dims.items() if not diag}
        sums = {"d.A": torch.rand(64, generator=gen).to(device)}
        side = torch.cuda.Stream(device) if cuda else None
        t = time.perf_counter()
        if cuda:
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                pending = start_exchange(rows, dims, own, 0, 1, None, "rows", device=device,
                                         sums=sums, plan_group=plan,
                                         weights={"d.A": torch.tensor(40.0, device=device)},
                                         positions={"d.A": 40})
                ex = finish_exchange(pending)
        else:
            ex = finish_exchange(start_exchange(rows, dims, own, 0, 1, None, "rows",
                                                device=device, sums=sums, weights={"d.A": 40.0},
                                                positions={"d.A": 40}))
        secs = time.perf_counter() - t
        exact = all(torch.equal(ex.owned[k][1], rows[k]) for k in rows) and \
            torch.equal(ex.owned["d.A"][1][0], sums["d.A"].float()) and ex.ok
        print(f"  one-rank {'NCCL' if cuda else 'gloo'} exchange from "
              f"{'a side stream' if cuda else 'the CPU'}: {secs * 1e3:.1f} ms, rows back "
              f"exactly: {exact}")
        return {"backend": "nccl" if cuda else "gloo", "seconds": secs, "exact": exact}
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="small CPU parts only, write nothing")
    p.add_argument("--steps", type=int, default=None, help="timed steps per setting")
    p.add_argument("--skip-tests", action="store_true", help="leave out part 1 (pytest)")
    a = p.parse_args(argv)
    dry = a.dry_run or not torch.cuda.is_available()
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine: a dry run of the CPU parts "
              "(small sizes, nothing written); run `make gpu-check` on a GPU for the figures.")
    sizes = dict(DRY if dry else FULL)
    if a.steps:
        sizes["steps"] = a.steps
    device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    import tempfile

    report: dict = {"dry_run": dry, "device": torch.cuda.get_device_name(device)
                    if device.type == "cuda" else "cpu", "sizes": sizes}
    t0 = time.perf_counter()
    ok = True
    with tempfile.TemporaryDirectory(prefix="kfac-gpu-check-") as tmp:
        if not dry and not a.skip_tests:
            print("1. CUDA tests")
            report["cuda_tests"] = r = cuda_tests()
            print("  " + "\n  ".join(r["tail"][-4:]))
            ok &= r["rc"] == 0 and r["skipped_for_cuda"] == 0
        print("2. eigh")
        report["eigh"] = eigh_part(sizes["eigh"], device)
        print("3. fold and store")
        report["fold"] = fold_part(sizes["fold_rows"], sizes["fold_d"], device)
        print("4. training steps")
        report["train"] = train_part(sizes, device, Path(tmp))
        ok &= all(not r["kfac_host_syncs"] for r in report["train"].values())
        print("5. exchange")
        report["exchange"] = exchange_part(device)
        ok &= report["exchange"]["exact"]
    report["seconds"] = time.perf_counter() - t0
    report["ok"] = bool(ok)
    print(f"gpu_check: {'OK' if ok else 'FAILED'} in {report['seconds']:.0f} s"
          + (" (dry run: nothing written)" if dry else ""))
    if not dry:
        report["machine"] = machine()
        path = write_json("gpu_check", report)
        print(f"wrote {path.relative_to(ROOT)}")
    elif os.environ.get("GPU_CHECK_JSON"):  # tests read the dry run's figures
        Path(os.environ["GPU_CHECK_JSON"]).write_text(json.dumps(report, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
