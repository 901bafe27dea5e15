"""Sharded factors under DeepSpeed ZeRO-3 on this CPU: W = 1 and 2 processes (gloo).

Method
------
* The overhead.py GPT-2 (4 x 256, vocabulary 2048; ``benchmarks/_common.py``), batch 8 x 256
  tokens per rank, AdamW, launched with ``accelerate launch --config_file
  launch/cpu_zero3.yaml --num_processes W`` (parameters really partitioned), one torch thread
  per process (2 cores here, so W = 2 uses both and W = 1 one). Tracker: token_fraction 0.05,
  ema_decay 0.95, empirical Fisher, float16 storage, ``update_every`` = 1 (every step an
  update, so the per-update figures are per step) and 10 (the default).
* Overhead: inside ONE training run per (W, update_every), ``--pairs`` pairs of plain and
  tracked blocks of ``--timed-steps`` steps, order alternating (``_common.BlockClock``, as in
  overhead.py: plain blocks have the hooks removed; a tracked block's last step also pays for
  folding its rows). Ratio = mean tracked step / mean plain step of a pair, median over pairs
  [min-max], per rank; the slower rank's median is reported.
* Per update, per rank: stored factor bytes, fold FLOPs (``Σ_owned n·d(d+1)``, the upper
  triangles the store computes, ``n`` = rows of the union), the time in the exchange
  collectives and in folding (tracker counters), and the bytes each exchange strategy moves
  (from the row counts every rank shares; the tracker's ``exchange_bytes_rows`` /
  ``exchange_bytes_stats`` counters over its updates): rows to owners, partial statistics
  reduced to owners, the per-factor choice, and a ring all-reduce of every full factor (float32,
  ``2(W-1)/W · Σ d² · 4`` bytes per rank, what an optimizer-style K-FAC would move).
* Extrapolation to Llama-7B on 8 GPUs: formulas in `extrapolate`, printed with the numbers.

Usage: ``python benchmarks/distributed.py [--pairs 3] [--timed-steps 10]``; ``--quick`` is a
smoke run that writes nothing. Writes the section of ``benchmarks/RESULTS.md`` between the
``distributed`` markers and ``benchmarks/results/distributed.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback
from kfac_stream.distributed.ownership import assign_owners

from _common import (
    BATCH,
    MODEL,
    BlockClock,
    GatedKFAC,
    StartClock,
    StopClock,
    free_port,
    machine,
    make_data,
    write_json,
    write_section,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BEGIN, END = "<!-- distributed:begin -->", "<!-- distributed:end -->"
TOKEN_FRACTION = 0.05


# -- worker (one per rank, started by accelerate launch) ----------------------------------------

def worker(a) -> None:
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    k = a.update_every
    block = -(-a.timed_steps // k) * k
    schedule = ["tracked"] * (2 * k)
    for i in range(a.pairs):
        for mode in (("plain", "tracked") if i % 2 == 0 else ("tracked", "plain")):
            schedule += [mode] * block
    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODEL))
    tmp = a.out  # the same directory on every rank (snapshots are written jointly)
    kfac = KFACStreamCallback(KFACConfig(
        token_fraction=TOKEN_FRACTION, ema_decay=0.95, update_every=k, fisher="empirical",
        storage_dtype="float16", snapshot_every=10**9, seed=0,
        output_dir=os.path.join(tmp, "kfac")))
    clock = BlockClock(schedule, kfac)
    args = TrainingArguments(
        output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, learning_rate=1e-4, seed=0,
        per_device_train_batch_size=BATCH, max_steps=len(schedule), optim="adamw_torch")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = make_data(BATCH * world * len(schedule))
    cbs = [StartClock(clock), GatedKFAC(kfac, schedule), StopClock(clock)]
    Trainer(model=model, args=args, train_dataset=data, callbacks=cbs).train()
    record = kfac.tracker.export()  # flushed: every update folded, counters final
    pos, pairs = 2 * k, []
    for i in range(a.pairs):
        res = {}
        for mode in (("plain", "tracked") if i % 2 == 0 else ("tracked", "plain")):
            res[mode] = sum(clock.times[pos:pos + block]) / block
            pos += block
        pairs.append(res["tracked"] / res["plain"])
    ds_partitioned = [p for p in model.parameters() if hasattr(p, "ds_tensor")]
    out = {
        "rank": record.rank, "world_size": record.world_size, "update_every": k,
        "ratios": pairs, "plain_step_s": statistics.median(clock.times),
        "stored_bytes": sum(f.data.numel() * f.data.element_size()
                            for f in record.factors.values()),
        "largest_factor_bytes": max(d * d * 2 if not diag else d * 2
                                    for d, diag in record.dims.values()),
        "total_bytes": sum(record.ownership.bytes_per_rank),
        "owned": len(record.factors), "factors": len(record.dims),
        "counters": {k2: v for k2, v in vars(record.counters).items() if k2 != "skipped_steps"},
        "dims": {key: list(v) for key, v in record.dims.items()},
        "owner": record.ownership.owner,
        "zero3_partitioned_params": len(ds_partitioned),
    }
    with open(os.path.join(a.out, f"rank-{record.rank}.json"), "w") as f:
        json.dump(out, f)


# -- driver -------------------------------------------------------------------------------------

def launch(world: int, k: int, a, out: str) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "launch" / "cpu_zero3.yaml"), "--num_processes", str(world),
           "--main_process_port", str(free_port()), __file__, "--worker", "--out", out,
           "--update-every", str(k), "--pairs", str(a.pairs), "--timed-steps",
           str(a.timed_steps)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    print(f"[W={world} update_every={k}] {' '.join(cmd[3:8])} ...", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"launch failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [json.load(open(os.path.join(out, f"rank-{r}.json"))) for r in range(world)]


def fold_flops(rank_info: dict, rows_per_update: float) -> float:
    """``Σ_owned n·d(d+1)`` (dense; ``2·n·d`` diagonal) per update for one rank."""
    total = 0.0
    for key, (d, diag) in rank_info["dims"].items():
        if rank_info["owner"][key] == rank_info["rank"]:
            total += rows_per_update * (2 * d if diag else d * (d + 1))
    return total


def allreduce_bytes(dims: dict, world: int) -> float:
    """Ring all-reduce of every full factor in float32, bytes sent per rank."""
    if world == 1:
        return 0.0
    return 2 * (world - 1) / world * sum((d if diag else d * d) * 4 for d, diag in dims.values())


def summarise(ranks: list[dict]) -> dict:
    r0 = ranks[0]
    c = r0["counters"]
    updates = max(c["updates"], 1)
    rows = c["positions_sampled"] / updates
    return {
        "world_size": r0["world_size"], "update_every": r0["update_every"],
        "ratio_median": max(statistics.median(r["ratios"]) for r in ranks),
        "ratio_min": min(min(r["ratios"]) for r in ranks),
        "ratio_max": max(max(r["ratios"]) for r in ranks),
        "plain_step_ms": 1e3 * max(r["plain_step_s"] for r in ranks),
        "rows_per_update": rows,
        "per_rank": [{
            "rank": r["rank"], "owned": r["owned"], "stored_bytes": r["stored_bytes"],
            "fold_gflop_per_update": fold_flops(r, rows) / 1e9,
            "fold_ms_per_update": 1e3 * r["counters"]["fold_seconds"] / updates,
            "exchange_ms_per_update": 1e3 * r["counters"]["exchange_seconds"] / updates,
            "sent_bytes_per_update": r["counters"]["comm_bytes"] / updates,
        } for r in ranks],
        "total_bytes": r0["total_bytes"], "largest_factor_bytes": r0["largest_factor_bytes"],
        "bytes_per_update": {
            # the exchange counters are totals over updates, the same on every rank
            "rows_strategy": c["exchange_bytes_rows"] / updates,
            "stats_strategy": c["exchange_bytes_stats"] / updates,
            "chosen": sum(r["counters"]["comm_bytes"] for r in ranks) / updates,
            "allreduce_full_factors_per_rank": allreduce_bytes(r0["dims"], r0["world_size"]),
            "allreduce_full_factors_total": allreduce_bytes(r0["dims"], r0["world_size"])
            * r0["world_size"]},
        "zero3_partitioned_params": r0["zero3_partitioned_params"],
    }


def llama7b_factors(max_dense_dim: int = 8192) -> dict[str, tuple[int, bool]]:
    """Factor sides of Llama-2-7B's tracked linears (32 layers; q,k,v,o 4096→4096, gate/up
    4096→11008, down 11008→4096; no biases): ``{key: (d, diagonal)}``."""
    layer = {"q": (4096, 4096), "k": (4096, 4096), "v": (4096, 4096), "o": (4096, 4096),
             "gate": (4096, 11008), "up": (4096, 11008), "down": (11008, 4096)}
    out = {}
    for i in range(32):
        for name, (d_in, d_out) in layer.items():
            out[f"{i}.{name}.A"] = (d_in, d_in > max_dense_dim)
            out[f"{i}.{name}.G"] = (d_out, d_out > max_dense_dim)
    return out


def extrapolate(world: int = 8, tokens_per_rank: int = 4 * 4096,
                token_fraction: float = TOKEN_FRACTION) -> list[dict]:
    """Per-rank CPU bytes and bytes per update for Llama-7B on ``world`` GPUs.

    * CPU bytes per rank ≈ ``Σ_keys s_k · 2 / W`` (fp16; ``s_k = d²`` dense, ``d`` diagonal),
      within one largest factor (greedy LPT assignment);
    * rows strategy, bytes each rank sends per update = ``n_r · Σ_{keys not owned} d · 2``
      with ``n_r = token_fraction · tokens_per_rank`` (fp16 rows), i.e. about
      ``(W-1)/W · n_r · Σ_keys d · 2``;
    * all-reduce of full float32 factors, per rank = ``2 (W-1)/W · Σ_keys s_k · 4``.
    """
    rows = []
    for mdd in (8192, 11008):
        dims = llama7b_factors(mdd)
        own = assign_owners(dims, world, 2)
        n_r = token_fraction * tokens_per_rank
        sum_d = sum(d for d, _ in dims.values())
        rows.append({
            "max_dense_dim": mdd, "world_size": world, "tokens_per_rank": tokens_per_rank,
            "rows_per_rank": n_r,
            "cpu_gb_per_rank_max": max(own.bytes_per_rank) / 1e9,
            "cpu_gb_total": sum(own.bytes_per_rank) / 1e9,
            "rows_gb_per_rank_update": (world - 1) / world * n_r * sum_d * 2 / 1e9,
            "allreduce_gb_per_rank_update": 2 * (world - 1) / world * sum(
                (d if diag else d * d) * 4 for d, diag in dims.values()) / 1e9,
            "eigh_tflop_per_rank_max": max(own.eigh_flops_per_rank) / 1e12,
        })
    return rows


def mb(x: float) -> str:
    return f"{x / 1e6:.2f} MB"


def report(results: list[dict], extra: list[dict], a, info: dict) -> str:
    lines = [BEGIN, "## Sharded factors under ZeRO-3 (`benchmarks/distributed.py`)", "",
             f"- date: {info['date']}; machine: {info['cpu']}, {info['cores']} cores; torch "
             f"{info['torch']}, deepspeed {info['deepspeed']}; 1 torch thread per process",
             f"- command: `{a.command}`",
             f"- GPT-2 4x256 (overhead.py model), batch 8x256 per rank, token_fraction "
             f"{TOKEN_FRACTION}, fp16 storage, empirical Fisher, `accelerate launch` with "
             "launch/cpu_zero3.yaml (ZeRO-3, parameters partitioned); "
             f"{a.pairs} interleaved plain/tracked pairs of {a.timed_steps} steps per run.", "",
             "| W | update_every | step overhead (median [min-max]) | plain step |",
             "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['world_size']} | {r['update_every']} | {r['ratio_median']:.3f} "
                     f"[{r['ratio_min']:.3f}-{r['ratio_max']:.3f}] | {r['plain_step_ms']:.0f} ms |")
    lines += ["", "Per rank, per update (update_every=1 runs):", "",
              "| W | rank | factors owned | stored bytes | fold GFLOP | fold ms | exchange ms "
              "| sent |", "|---|---|---|---|---|---|---|---|"]
    for r in (x for x in results if x["update_every"] == 1):
        for p in r["per_rank"]:
            lines.append(f"| {r['world_size']} | {p['rank']} | {p['owned']} | "
                         f"{mb(p['stored_bytes'])} | {p['fold_gflop_per_update']:.3f} | "
                         f"{p['fold_ms_per_update']:.1f} | {p['exchange_ms_per_update']:.1f} | "
                         f"{mb(p['sent_bytes_per_update'])} |")
    lines += ["", "Fold GFLOP per rank per update stays the same from W=1 to W=2 because each "
              "update folds the union of both ranks' rows (twice as many) into half the factors: "
              "per token trained, each rank's factor FLOPs and stored bytes halve. The exchange "
              "takes one all_gather of the count table and one all_to_all of all rows (plus one "
              "reduce per owner for statistics-strategy factors) over loopback gloo.", "",
              "Bytes moved per update, all ranks together (update_every=1 runs):", "",
              "| W | rows to owners | partial statistics to owners | per-factor choice | "
              "all-reduce of full fp32 factors |", "|---|---|---|---|---|"]
    for r in (x for x in results if x["update_every"] == 1):
        b = r["bytes_per_update"]
        lines.append(f"| {r['world_size']} | {mb(b['rows_strategy'])} | "
                     f"{mb(b['stats_strategy'])} | {mb(b['chosen'])} | "
                     f"{mb(b['allreduce_full_factors_total'])} |")
    lines += ["", "Llama-7B on 8 GPUs (extrapolated; formulas in `extrapolate`): CPU bytes per "
              "rank = Σ_k s_k·2/W (fp16, s_k = d² dense or d diagonal, within one largest "
              "factor); rows strategy, sent per rank per update = (W-1)/W · n_r · Σ_k d · 2 with "
              "n_r = token_fraction · tokens per rank; all-reduce of fp32 factors = 2(W-1)/W · "
              "Σ_k s_k · 4 per rank. Tokens per rank per step: 4 x 4096.", "",
              "| max_dense_dim | CPU GB / rank (max) | CPU GB total | rows sent / rank / "
              "update | all-reduce / rank / update | eigh TFLOP / rank |",
              "|---|---|---|---|---|---|"]
    for e in extra:
        lines.append(f"| {e['max_dense_dim']} | {e['cpu_gb_per_rank_max']:.2f} | "
                     f"{e['cpu_gb_total']:.1f} | {e['rows_gb_per_rank_update']:.2f} GB | "
                     f"{e['allreduce_gb_per_rank_update']:.1f} GB | "
                     f"{e['eigh_tflop_per_rank_max']:.1f} |")
    lines.append(END)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--update-every", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--timed-steps", type=int, default=10)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 pair of 2 steps per run; writes nothing")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the RESULTS.md section from results/distributed.json")
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return
    if a.report_only:
        saved = json.loads((HERE / "results" / "distributed.json").read_text())
        a.command, a.pairs, a.timed_steps = (saved["command"], saved["args"]["pairs"],
                                             saved["args"]["timed_steps"])
        write_section(BEGIN, END, report(saved["results"], saved["llama7b_w8"], a,
                                         saved["machine"]))
        return
    if a.quick:
        a.pairs, a.timed_steps = 1, 2
    a.command = "python benchmarks/distributed.py " + shlex.join(argv or sys.argv[1:])
    import deepspeed  # version for the report (the workers import it anyway)

    info = dict(machine(), deepspeed=deepspeed.__version__,
                date=datetime.date.today().isoformat())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in (1, 10):
            for world in (1, 2):
                ranks = launch(world, k, a, os.path.join(tmp, f"w{world}k{k}"))
                s = summarise(ranks)
                results.append(s)
                print(json.dumps(s, indent=1), flush=True)
    extra = extrapolate()
    for e in extra:
        print(json.dumps(e), flush=True)
    section = report(results, extra, a, info)
    print(section)
    if a.quick:
        return
    write_json("distributed",
        {"machine": info, "command": a.command, "results": results, "llama7b_w8": extra,
         "args": {"pairs": a.pairs, "timed_steps": a.timed_steps}})
    write_section(BEGIN, END, section)


if __name__ == "__main__":
    main()
