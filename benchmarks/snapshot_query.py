"""Cost of kfac_stream snapshots and Laplace predictive queries on the overhead.py GPT-2 (CPU).

Method (the model, data and batch of ``benchmarks/overhead.py``, shared through
``benchmarks/_common.py``: GPT-2, 4 layers, n_embd 256, vocab 2048, batch 8 x 256 byte tokens,
AdamW, CPU, flush-denormal). One training run
of ``--every * --snapshots`` steps with ``KFACStreamCallback(token_fraction=0.05, update_every=1,
snapshot_every=--every)`` (every step updates the factors: steps differ only by the snapshot).
16 tracked layers, 32 factors (sides 256..1025), FP16 store. Interleaved jobs run in a fresh
seeded random order each repetition (`interleave`); medians are reported.

1. Snapshot vs eigh, on the final factors: ``capture_snapshot`` (the flush and the manifest's
   figures, on the training thread: "contents") + ``finish_snapshot`` (float64
   ``safe_psd_eigh`` of every factor with its spectrum stats, streamed into the safetensors
   write with fsync and sha256: "write"; a background thread in training), both timed here
   in one thread, vs plain
   ``torch.linalg.eigh`` of the same dequantised matrices summed over the 32 factors, in
   float64, float32, and float64 on one thread. Ratio = snapshot / eigh.
2. Step spike: step time = ``on_step_begin`` -> ``on_step_end`` of a callback placed after the
   kfac callback (whose on_step_end copies the factors and hands the eigendecomposition and the
   write to a background thread). Mean of the steps that start a snapshot vs mean of the
   others, the first ``WARMUP`` steps left out. On 2 cores the background eigh competes with
   the following steps, so "other steps" carry the snapshot's cost: compare both with a plain
   step (``overhead.py``).
3. Query: ``LaplacePosterior(model, Snapshot.load(last), prior_precision=1.0).predictive(batch,
   positions=-1, token_ids=range(K))``, K in {1, 4, 16}, batch 2 x 128, vs a no-grad forward
   of the same batch (eval mode). Goal: query <= (K+2) x forward. A query more than 2x over
   its goal triggers a cProfile top list of one call (largest K), printed and kept in the json.
4. Whole-vocabulary sampled predictive: ``sampled_predictive(post, batch, S,
   labels="next")`` for S in `SAMPLES` on the training batch (BATCH x SEQ tokens, vocabulary
   2048) vs a no-grad forward of the same batch without a key/value cache (``use_cache=False``,
   as the sampled path runs each sample), timed as 16 forwards in a row (per forward), as a
   sampled call runs its S forwards: drawn in the call, with the samples drawn once
   (``posterior_draws``, reused: the cost per batch over a data set), the draws alone, and the
   linearised variant (forward-mode JVPs) on drawn-once samples. Goal: <= (S+1) x that
   forward. Checks beside it: the drawn-once calls against a lone forward (whose time depends
   more on the job before it: its median moved by 5% between runs on 2 cores), and the
   default forward (which also builds GPT-2's cache) against the one without.
5. Exact K-logit predictive vs laplace-torch, side by side: probit probabilities of
   the first K vocabulary logits at the last position of a 2 x 128 batch,
   ``post.predictive_probs`` vs laplace-torch 0.3's ``la(x, pred_type="glm",
   link_approx="probit")`` on ``KronLaplace`` (its default backend) over the same 16 tracked
   layers (a copy whose Conv1D s are equal ``nn.Linear`` s, the only weights with gradients),
   fitted on two training windows (not timed), K in `GLM_KS`. Goal: ours <= 0.5 x theirs.
   Skipped (said so) when laplace-torch does not import (``make .venv/.bench-peers``).

Usage: ``python benchmarks/snapshot_query.py [--reps 7] [--sampled-reps 11] [--snapshots 6]
[--every 5]``; ``--quick`` is a smoke run that writes nothing. Otherwise writes a section of
``benchmarks/RESULTS.md`` and ``results/snapshot_query.json``.
"""

import argparse
import cProfile
import io
import os
import pstats
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot
from kfac_stream.capture.selection import layer_spec
from kfac_stream.snapshot.sequence import capture_snapshot, finish_snapshot

from _common import (
    BATCH,
    MODEL,
    conv1d_to_linear,
    dist_version,
    machine,
    make_data,
    write_json,
    write_section,
)

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- snapshot_query:begin -->", "<!-- snapshot_query:end -->"
WARMUP, KS, QB, QT = 2, (1, 4, 16), 2, 128  # warm-up steps left out; K values; query batch
SAMPLES = (4, 16)  # S of the sampled predictive (part 4)
GLM_KS = (2, 4, 16)  # K of the side-by-side with laplace-torch (part 5; a classifier has K >= 2)


class _Clock(TrainerCallback):
    def __init__(self):
        self.ms: list[float] = []

    def on_step_begin(self, args, state, control, **kw):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.ms.append(1e3 * (time.perf_counter() - self._t0))


def train(a, tmp: str):
    """Part 2: one training run with snapshots every ``a.every`` steps, every step timed."""
    transformers.set_seed(a.seed)
    model = GPT2LMHeadModel(GPT2Config(**MODEL))
    steps, clock = a.every * a.snapshots, _Clock()
    kfac = KFACStreamCallback(KFACConfig(token_fraction=0.05, update_every=1, seed=a.seed,
                                         snapshot_every=a.every, output_dir=tmp + "/kfac"))
    save, save_ms = kfac.save_snapshot, []

    def timed_save(*args, **kw):  # the part of the step spent in save_snapshot
        t0 = time.perf_counter()
        out = save(*args, **kw)
        save_ms.append(1e3 * (time.perf_counter() - t0))
        return out
    kfac.save_snapshot = timed_save
    args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, learning_rate=1e-4,
                             seed=a.seed, per_device_train_batch_size=BATCH, max_steps=steps,
                             dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=make_data(BATCH * steps),
            callbacks=[kfac, clock]).train()
    ms = clock.ms
    snap = [ms[s] for s in range(WARMUP, steps) if (s + 1) % a.every == 0]  # 0-based steps
    other = [ms[s] for s in range(WARMUP, steps) if (s + 1) % a.every != 0]
    mean_s, mean_o = statistics.mean(snap), statistics.mean(other)
    return model, kfac, {
        "steps": steps, "step_ms": ms, "save_snapshot_ms": save_ms, "snapshot_step_ms": mean_s,
        "other_step_ms": mean_o, "extra_ms": mean_s - mean_o, "ratio": mean_s / mean_o,
        "n_snapshot_steps": len(snap), "n_other_steps": len(other),
        "snapshot_bytes": sum(p.stat().st_size for p in Path(kfac.snapshots[-1]).iterdir())}


def interleave(jobs: dict, reps: int, seed: int = 0) -> dict[str, list[float]]:
    """Run each job once per repetition, in a fresh seeded random order each repetition; ms.

    (Not a rotation: rotating a fixed order keeps each job's predecessor the same in every
    repetition, and a job's time depends on it: in two runs a lone forward that always came
    after the linearised S = 16 job measured 5% and 8% slower than the default forward that
    always came after it, though that one also builds a key/value cache.)"""
    out, names = {k: [] for k in jobs}, list(jobs)
    order = random.Random(seed)
    for _ in range(reps):
        for name in order.sample(names, len(names)):
            t0 = time.perf_counter()
            jobs[name]()
            out[name].append(1e3 * (time.perf_counter() - t0))
    return out


def bench_snapshot(kfac, reps: int, tmp: str) -> dict:
    """Part 1: capture_snapshot + finish_snapshot vs plain eigh of the same matrices."""
    tracker, root, split = kfac.tracker, os.path.join(tmp, "bench"), {"contents": [], "write": []}
    mats = [f.value() for f in tracker.export().factors.values()]  # dequantised, float32

    def snapshot():  # as save_snapshot does, both parts on this thread
        t0 = time.perf_counter()
        captured = capture_snapshot(tracker, 10**6)
        split["contents"].append(1e3 * (time.perf_counter() - t0))
        finish_snapshot(captured, root, eigh_device="cpu")
        tracker.release(captured.lent)
        split["write"].append(1e3 * (time.perf_counter() - t0) - split["contents"][-1])
        shutil.rmtree(root)  # timed (small next to the write); every snapshot starts fresh

    def eigh(dtype, threads=None):
        ms, n = [m.to(dtype) for m in mats], torch.get_num_threads()  # conversions: ~1 ms
        torch.set_num_threads(threads or n)
        for m in ms:
            torch.linalg.eigh(m)
        torch.set_num_threads(n)

    eigh(torch.float64)  # warm-up (LAPACK workspaces)
    t = interleave({"snapshot": snapshot, "eigh64": lambda: eigh(torch.float64),
                    "eigh32": lambda: eigh(torch.float32),
                    "eigh64_1thread": lambda: eigh(torch.float64, 1)}, reps)
    t.update(split)
    return {**{k: statistics.median(v) for k, v in t.items()}, "factors": len(mats), "raw_ms": t}


def bench_query(model, path: str, reps: int) -> dict:
    """Part 3: predictive(K) vs one no-grad forward of a 2 x 128 batch."""
    model.eval()
    post = LaplacePosterior(model, Snapshot.load(path), prior_precision=1.0)
    data = make_data(2 * QB)  # windows QB.. (not the first training batch's start)
    ids = torch.stack([data[QB + i]["input_ids"][:QT] for i in range(QB)])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    forward = torch.no_grad()(lambda: model(**batch))
    jobs = {"forward": forward, **{k: lambda k=k: post.predictive(
        batch, positions=-1, token_ids=list(range(k))) for k in KS}}
    interleave(jobs, 1)  # warm-up
    t = interleave(jobs, reps)
    med = {k: statistics.median(v) for k, v in t.items()}
    res = {"forward_ms": med["forward"], "raw_ms": t, "per_k": {k: {
        "ms": med[k], "ratio": med[k] / med["forward"], "goal": k + 2,
        "met": med[k] / med["forward"] <= k + 2} for k in KS}}
    worst = max(res["per_k"].values(), key=lambda v: v["ratio"] / v["goal"])
    if worst["ratio"] > 2 * worst["goal"]:
        prof = cProfile.Profile()
        prof.runcall(post.predictive, batch, positions=-1, token_ids=list(range(KS[-1])))
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        res["profile"] = out.getvalue()
        print(f"cProfile of one predictive(K={KS[-1]}) call, top 12 by tottime:\n{res['profile']}")
    return res


def bench_sampled(model, path: str, reps: int) -> dict:
    """Part 4: the whole-vocabulary sampled predictive of S posterior samples vs one no-grad
    forward of the same batch (the training batch, BATCH x SEQ tokens)."""
    from kfac_stream import posterior_draws, sampled_predictive

    model.eval()
    post = LaplacePosterior(model, Snapshot.load(path), prior_precision=1.0)
    data = make_data(2 * BATCH)
    ids = torch.stack([data[BATCH + i]["input_ids"] for i in range(BATCH)])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    draws = {s: posterior_draws(post, s, seed=1) for s in SAMPLES}
    # flops of one draw (the rotation Q_G Z Q_Aᵀ, 2·d_out·d_A·(d_out + d_A) per layer) over
    # those of the batch's forward through the same layers (2·T·d_out·d_A)
    specs = [layer_spec(n, m) for n, m in post.modules.items()]
    draw_flops = sum(2 * s.g_dim * s.a_dim * (s.g_dim + s.a_dim) for s in specs)
    layer_flops = sum(2 * ids.numel() * s.g_dim * s.a_dim for s in specs)
    # the denominator: the forward each sample runs, at the trained weights (no KV cache), 16
    # in a row as a sampled call runs its S forwards (a lone one depends more on the job
    # before it); beside it, a lone forward, and the default forward (which builds a cache)
    forward = torch.no_grad()(lambda: model(**batch, use_cache=False))
    row = f"forward x{max(SAMPLES)} in a row"
    jobs = {row: lambda: [forward() for _ in range(max(SAMPLES))], "forward": forward,
            "forward, default": torch.no_grad()(lambda: model(**batch))}
    for s in SAMPLES:
        jobs[f"draws S={s}"] = lambda s=s: posterior_draws(post, s, seed=1)
        jobs[f"sampled S={s}, drawn here"] = lambda s=s: sampled_predictive(
            post, batch, s, seed=1, labels="next")
        jobs[f"sampled S={s}, drawn once"] = lambda s=s: sampled_predictive(
            post, batch, draws=draws[s], labels="next")
        jobs[f"linearised S={s}, drawn once"] = lambda s=s: sampled_predictive(
            post, batch, draws=draws[s], labels="next", linearized=True)
    interleave(jobs, 1)  # warm-up
    t = interleave(jobs, reps)
    med = {k: statistics.median(v) for k, v in t.items()}
    fwd, lone = med[row] / max(SAMPLES), med["forward"]
    rows = {k: {"ms": v, "ratio": v / fwd, "ratio_lone": v / lone,
                "S": int(k.split("S=")[1].split(",")[0])}
            for k, v in med.items() if not k.startswith("forward")}
    for k, v in rows.items():
        v["goal"] = v["S"] + 1 if not k.startswith("draws") else None
        v["met"] = None if v["goal"] is None else v["ratio"] <= v["goal"]
    return {"forward_ms": fwd, "forward_lone_ms": lone,
            "draw_over_layer_forward_flops": draw_flops / layer_flops,
            "forward_default_ms": med["forward, default"],
            "batch": [BATCH, int(ids.shape[1])], "rows": rows, "raw_ms": t}


class _LastLogits(torch.nn.Module):
    """laplace-torch's view of the LM: ``input_ids [B, T]`` -> the first ``K`` logits at the
    last position ``[B, K]`` (a copy whose tracked Conv1D s are equal ``nn.Linear`` s, the only
    weights with gradients)."""

    def __init__(self, model, layers: list[str], k: int):
        super().__init__()
        self.m, self.k = conv1d_to_linear(model, layers).eval(), k
        keep = {f"{name}.{p}" for name in layers for p in ("weight", "bias")}
        for n, p in self.m.named_parameters():
            p.requires_grad_(n in keep)

    def forward(self, input_ids):
        return self.m(input_ids=input_ids).logits[:, -1, :self.k]


def bench_glm(model, path: str, reps: int) -> dict:
    """Part 5: the exact K-logit predictive (probit probabilities from the linearised
    covariance) vs laplace-torch's ``la(x, pred_type="glm", link_approx="probit")`` on the same
    model, layers, batch and K (KronLaplace fitted on two training windows; the fit is not
    timed)."""
    import laplace

    model.eval()
    snap = Snapshot.load(path)
    post = LaplacePosterior(model, snap, prior_precision=1.0)
    data = make_data(2 * QB)
    ids = torch.stack([data[QB + i]["input_ids"][:QT] for i in range(QB)])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    fit_x = torch.stack([data[i]["input_ids"][:QT] for i in range(QB)])
    jobs, las = {}, {}
    for k in GLM_KS:
        head = _LastLogits(model, snap.layer_names, k)
        la = laplace.KronLaplace(head, "classification", prior_precision=1.0)
        la.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
            fit_x, torch.zeros(QB, dtype=torch.long)), batch_size=QB))
        las[k] = la
        jobs[f"kfac_stream K={k}"] = lambda k=k: post.predictive_probs(  # laplace-torch's link
            batch, positions=-1, token_ids=list(range(k)), method="probit")
        jobs[f"laplace-torch K={k}"] = lambda k=k: las[k](ids, pred_type="glm",
                                                          link_approx="probit")
    interleave(jobs, 1)  # warm-up
    t = interleave(jobs, reps)
    med = {k: statistics.median(v) for k, v in t.items()}
    per_k = {k: {"ms": med[f"kfac_stream K={k}"], "peer_ms": med[f"laplace-torch K={k}"]}
             for k in GLM_KS}
    for v in per_k.values():
        v["ratio"] = v["ms"] / v["peer_ms"]
        v["met"] = v["ratio"] <= 0.5
    return {"per_k": per_k, "raw_ms": t, "laplace_torch": dist_version("laplace-torch"),
            "tracked_params": sum(p.numel() for p in las[GLM_KS[0]].model.parameters()
                                  if p.requires_grad)}


def table(r) -> str:
    s, st, q, every = r["snapshot"], r["steps"], r["query"], r["args"]["every"]
    rows = ["| measurement | ms | reference | ref ms | ratio | goal |", "|---|---|---|---|---|---|"]
    for ref, key in (("float64", "eigh64"), ("float32", "eigh32"),
                     ("float64, 1 thread", "eigh64_1thread")):
        rows.append(f"| snapshot: contents + write ({s['factors']} factors) | {s['snapshot']:.0f} "
                    f"| eigh {ref}, same matrices | {s[key]:.0f} | "
                    f"{s['snapshot'] / s[key]:.2f} | – |")
    rows += [f"| · of which capture (flush, manifest figures) | {s['contents']:.0f} | eigh "
             f"float64 | {s['eigh64']:.0f} | {s['contents'] / s['eigh64']:.2f} | – |",
             f"| · of which eigh streamed into the write ({st['snapshot_bytes'] / 2**20:.0f} "
             "MiB) | "
             f"{s['write']:.0f} | | | | – |",
             f"| training step writing a snapshot (every {every}; mean) | "
             f"{st['snapshot_step_ms']:.0f} | other steps (mean) | {st['other_step_ms']:.0f} | "
             f"{st['ratio']:.2f} | – |"]
    rows += [f"| predictive, K={k}, {QB}×{QT} tokens | {v['ms']:.0f} | forward, no grad | "
             f"{q['forward_ms']:.1f} | {v['ratio']:.1f} | ≤ {v['goal']} "
             f"({'met' if v['met'] else 'NOT met'}) |" for k, v in q["per_k"].items()]
    if "sampled" in r:
        sp = r["sampled"]
        b, t = sp["batch"]
        for name, v in sp["rows"].items():
            goal = "–" if v["goal"] is None else (
                f"≤ {v['goal']} ({'met' if v['met'] else 'NOT met'})")
            rows.append(f"| {name}, whole vocabulary, {b}×{t} tokens | {v['ms']:.0f} | forward, "
                        f"no grad, no KV cache ({max(SAMPLES)} in a row) | "
                        f"{sp['forward_ms']:.1f} | {v['ratio']:.2f} | {goal} |")
            if "ratio_lone" in v and name.startswith("sampled") and "once" in name:
                rows.append(f"| · the same | {v['ms']:.0f} | a lone such forward | "
                            f"{sp['forward_lone_ms']:.1f} | {v['ratio_lone']:.2f} | (check) |")
        if "forward_default_ms" in sp:
            rows.append(f"| forward, no grad, default (builds the KV cache), {b}×{t} tokens | "
                        f"{sp['forward_default_ms']:.1f} | a lone forward, no KV cache | "
                        f"{sp['forward_lone_ms']:.1f} | "
                        f"{sp['forward_default_ms'] / sp['forward_lone_ms']:.3f} | – |")
    if "glm" in r:
        for k, v in r["glm"]["per_k"].items():
            rows.append(f"| predictive_probs (probit), K={k}, {QB}×{QT} tokens | {v['ms']:.0f} | "
                        f"laplace-torch la(x, pred_type='glm', link_approx='probit') | "
                        f"{v['peer_ms']:.0f} | {v['ratio']:.2f} | ≤ 0.5 "
                        f"({'met' if v['met'] else 'NOT met'}) |")
    return "\n".join(rows)


def write_outputs(r, a, info) -> None:
    write_json("snapshot_query",
        {"machine": info, "command": a.command, **r})
    st = r["steps"]
    section = "\n".join([
        BEGIN, "## Snapshot and query cost (`benchmarks/snapshot_query.py`)", "",
        f"- date: {info['date']}",
        f"- machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch "
        f"threads); torch {info['torch']}, transformers {info['transformers']}, "
        f"Python {info['python']}",
        "- load average (1 min) at start / after training / snapshot / query / sampled / glm: "
        + " / ".join(f"{x:.2f}" for x in r["load"].values()),
        f"- command: `{a.command}`",
        f"- medians of {a.reps} interleaved repetitions (snapshot vs eigh; forward vs queries; "
        f"{a.sampled_reps} for the sampled predictive); "
        f"step times: means over one run of {st['steps']} steps with snapshot_every={a.every}, "
        f"token_fraction=0.05, update_every=1 ({st['n_snapshot_steps']} snapshot steps vs "
        f"{st['n_other_steps']} others, first {WARMUP} left out). Method: docstring of the "
        "script.", "", table(r), "",
        f"- steps that start a snapshot minus the others: {st['extra_ms']:+.0f} ms. The training "
        "thread only copies the factors (save_snapshot took "
        + ", ".join(f"{x:.0f}" for x in st["save_snapshot_ms"]) + " ms); the "
        "eigendecomposition and the write run on a background thread, which on 2 cores slows "
        "the following steps instead of stalling one.",
        *([] if "sampled" not in r else [
            "- the sampled predictive's goal, (S + 1) forwards, is for a call given its "
            "samples (drawn once by `posterior_draws` and reused, as over a data set). The rows "
            "drawn in the call add the draws, "
            f"{r['sampled']['rows'][f'draws S={max(SAMPLES)}']['ratio'] / max(SAMPLES):.2f} "
            "forward per sample here: per layer the rotation Q_G Z Q_Aᵀ costs "
            "2·d_out·d_A·(d_out + d_A) flops, "
            f"{r['sampled']['draw_over_layer_forward_flops']:.2f}× the batch's forward through "
            "the tracked layers (2·T·d_out·d_A), plus the normals. The linearised rows carry a "
            "tangent through every activation, with PyTorch's math attention (the kernel with "
            "forward-mode derivatives). Both are printed against the same goal for "
            "comparison."]), END])
    write_section(BEGIN, END, section)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7,
                   help="interleaved repetitions (parts 1, 3, 5)")
    p.add_argument("--sampled-reps", type=int, default=11,
                   help="interleaved repetitions of part 4, whose S = 16 ratio lies within a "
                        "few percent of its goal (more repetitions: a steadier median)")
    p.add_argument("--snapshots", type=int, default=6, help="snapshots in the training run")
    p.add_argument("--every", type=int, default=5, help="snapshot_every of the training run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 reps, 2 snapshots; writes nothing")
    a = p.parse_args(argv)
    a.command = " ".join(["python benchmarks/snapshot_query.py", *map(shlex.quote, sys.argv[1:])])
    if a.quick:
        a.reps, a.sampled_reps, a.snapshots = 2, 2, 2
    sys.stdout.reconfigure(line_buffering=True)  # progress lines appear as they come
    torch.set_flush_denormal(True)  # as overhead.py: denormals slow x86 CPUs ~10x
    info = {**machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    r = {"args": vars(a), "load": {"start": os.getloadavg()[0]}}
    print(f"snapshot_query: {info['cpu']}, {info['cores']} cores, load {r['load']['start']:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        model, kfac, r["steps"] = train(a, tmp)
        r["load"]["train"] = os.getloadavg()[0]
        print(f"[2] step ms: {[round(x) for x in r['steps']['step_ms']]}")
        r["snapshot"] = bench_snapshot(kfac, a.reps, tmp)
        r["load"]["snapshot"] = os.getloadavg()[0]
        print("[1] ms:", {k: [round(x) for x in v] for k, v in r["snapshot"]["raw_ms"].items()})
        r["query"] = bench_query(model, kfac.snapshots[-1], a.reps)
        r["load"]["query"] = os.getloadavg()[0]
        print("[3] forward / predictive ms:", {k: round(v) for k, v in (
            ("forward", r["query"]["forward_ms"]),
            *((f"K={k}", v["ms"]) for k, v in r["query"]["per_k"].items()))})
        r["sampled"] = bench_sampled(model, kfac.snapshots[-1], a.sampled_reps)
        r["load"]["sampled"] = os.getloadavg()[0]
        print("[4] ms:", {k: round(v["ms"]) for k, v in r["sampled"]["rows"].items()},
              f"forward {r['sampled']['forward_ms']:.0f} (16 in a row; lone "
              f"{r['sampled']['forward_lone_ms']:.0f}, default with its KV cache "
              f"{r['sampled']['forward_default_ms']:.0f})")
        try:
            import laplace  # noqa: F401  (the optional peer: make .venv/.bench-peers)
        except ImportError as e:
            print(f"[5] skipped: laplace-torch does not import ({e}); install the peers with "
                  "`make .venv/.bench-peers`")
        else:
            r["glm"] = bench_glm(model, kfac.snapshots[-1], a.reps)
            r["load"]["glm"] = os.getloadavg()[0]
            print("[5] ms (ours, laplace-torch):", {k: (round(v["ms"]), round(v["peer_ms"]))
                                                   for k, v in r["glm"]["per_k"].items()})
    print(f"load averages: {r['load']}\n\n" + table(r))
    if a.quick:
        print("--quick: nothing written")
        return
    write_outputs(r, a, info)
    print(f"wrote {HERE / 'RESULTS.md'} and {HERE / 'results' / 'snapshot_query.json'}")


if __name__ == "__main__":
    main()
