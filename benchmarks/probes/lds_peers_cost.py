"""What each peer of `benchmarks/lds_peers.py` costs at the LDS benchmark's real sizes, on one
core, and how much IF-CG can afford.

Method: the task's seed-0 split of `lds_truth.SIZES` (digits: 1,000 training examples, 100
validation + 200 test queries; text: 600, 100 + 200), the scored model trained by
`lds_tasks.train_tracked` (``--stage train``: cached under ``--cache``, so the families run in
separate, short processes). The extra models of TRAK-k are stand-ins: the final weights plus
Gaussian noise (std 1e-3), ``--models`` of them: a model's TRAK features cost the same whatever
its weights, and the costs are what is measured here, not the scores. ``--stage FAMILY``
(``kronfluence``, ``tracin``, ``trak``) runs that part of `lds_peers.peer_scores` with its real
settings and prints each variant's seconds (``details``: the shared fit / features and each
setting's own work). ``--stage ifcg`` times dattri's IF-CG on the first ``--if-queries`` queries,
query batch ``--if-batch``, at one regularisation, and its Hessian scale estimate; it prints
the seconds per query and the queries × settings that 300 s afford.

Usage: ``python benchmarks/probes/lds_peers_cost.py --task digits --stage train``, then
``--stage kronfluence`` etc. One torch thread throughout (``--threads``). Writes
``benchmarks/results/lds_peers_cost.json`` (each stage's figures merged in).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import lds_peers as P  # noqa: E402
from lds_truth import SIZES  # noqa: E402
from tasks import lds_tasks as T  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "lds_peers_cost.json"


class Ckpt:
    def __init__(self, states, lrs, at):
        self.states, self.lrs, self.at = states, lrs, at


def load(a) -> tuple[dict, dict, list, list, dict]:
    d = T.split(a.task, 0, *SIZES[a.task])
    path = Path(a.cache) / f"{a.task}.pt"
    if a.stage == "train":
        t0 = time.perf_counter()
        run = T.train_tracked(a.task, d["train"], 0, tempfile.mkdtemp(prefix="lds-cost-"))
        ck = run["ckpt"]
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"final": run["model"].state_dict(), "states": ck.states, "lrs": ck.lrs,
                    "at": ck.at, "train_s": time.perf_counter() - t0}, path)
    saved = torch.load(path)
    model = T.new_model(a.task, 0)
    model.load_state_dict(saved["final"])
    run = {"model": model.eval(), "ckpt": Ckpt(saved["states"], saved["lrs"], saved["at"]),
           "train_s": saved["train_s"]}
    gen = torch.Generator().manual_seed(1)
    fake = [{k: v + 1e-3 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
             for k, v in saved["final"].items()} for _ in range(a.models)]
    return run, d, d["train"], d["val"] + d["test"], {"subset_models": fake}


def stage_family(a, run, d, train, queries, extra) -> dict:
    P.quiet_peers()
    cfg = dict(kf_grid=P.KF_GRID, trak_dims=P.TRAK_DIMS, trak_regs=P.TRAK_REGS,
               trak_models=P.TRAK_MODELS)
    inputs = P.Inputs.of(train[0])
    view = P.DattriView(run["model"], inputs)
    rec = P.Recorder({})
    t0 = time.perf_counter()
    if a.stage == "kronfluence":
        P.kronfluence_family(run["model"], inputs, train, queries, tempfile.mkdtemp(), cfg, rec)
    elif a.stage == "tracin":
        ck = run["ckpt"]
        keep = [i for i, lr in enumerate(ck.lrs) if lr > 0]
        rec.run("dattri_tracin:exact", lambda: P.dattri_tracin(
            view, [ck.states[i] for i in keep], [ck.lrs[i] for i in keep], train, queries))
        rec.run("grad_dot:final", lambda: P.dattri_tracin(view, [view.final], [1.0], train,
                                                           queries))
    elif a.stage == "trak":
        P.trak_families(view, run, extra, train, queries, cfg, rec)
    elif a.stage == "if":
        cfg.update(if_regs=P.IF_REGS, if_rows=tuple(a.if_rows or P.IF_BUDGET[a.task]))
        P.ifcg_family(view, train, queries, SIZES[a.task][1], cfg, rec, lambda c: sorted(c)[0])
    total = time.perf_counter() - t0
    for k, v in rec.details.items():
        print(f"{k}: {rec.seconds[k]:.1f} s (shared {v['shared_s']:.1f}, own {v['own_s']:.2f})",
              flush=True)
    print(f"{a.stage}: {total:.1f} s in all; failed {rec.failed}", flush=True)
    return {"total_s": total, "seconds": rec.seconds, "details": rec.details,
            "failed": rec.failed}


def stage_ifcg(a, run, d, train, queries) -> dict:
    P.quiet_peers()
    view = P.DattriView(run["model"], P.Inputs.of(train[0]))
    scale, scale_s = P.timed(lambda: P.hessian_scale(view, train))
    print(f"Hessian mean eigenvalue {scale:.3e} ({scale_s:.1f} s)", flush=True)
    P.IF_QUERY_BATCH = a.if_batch
    P.IF_MODE = a.if_mode
    rows = list(range(a.if_queries))
    out, secs = P.timed(lambda: P.dattri_ifcg(view, train, queries, rows, a.if_reg * scale,
                                              a.if_iter, a.if_mode))
    per_q = secs / len(rows)
    dot = P.dattri_tracin(view, [view.final], [1.0], train, queries[:len(rows)])
    from scipy.stats import spearmanr

    rho = [float(spearmanr(out[i].numpy(), dot[i].numpy()).statistic) for i in rows]
    afford = 300 / per_q
    print(f"IF-CG ({a.if_iter} iterations, batch {a.if_batch}, r={a.if_reg}): {secs:.1f} s for "
          f"{len(rows)} queries = {per_q:.2f} s per query: 300 s afford {afford:.0f} "
          f"query-settings; Spearman vs grad dot {rho}", flush=True)
    return {"hessian_scale": scale, "hessian_scale_s": scale_s, "queries": len(rows),
            "batch": a.if_batch, "iterations": a.if_iter, "reg_relative": a.if_reg,
            "seconds": secs, "per_query_s": per_q, "affordable_in_300s": afford,
            "spearman_vs_grad_dot": rho}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=list(SIZES), required=True)
    p.add_argument("--stage", required=True,
                   choices=["train", "kronfluence", "tracin", "trak", "ifcg", "if"])
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "lds-peers-cost"))
    p.add_argument("--models", type=int, default=P.TRAK_MODELS)
    p.add_argument("--if-queries", type=int, default=2)
    p.add_argument("--if-batch", type=int, default=1)
    p.add_argument("--if-reg", type=float, default=0.1)
    p.add_argument("--if-iter", type=int, default=10)
    p.add_argument("--if-mode", default="rev-rev", choices=["rev-rev", "rev-fwd"])
    p.add_argument("--if-rows", type=int, nargs=2, metavar=("VAL", "TEST"),
                   help="--stage if: its rows (default: lds_peers.IF_BUDGET)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    run, d, train, queries, extra = load(a)
    if a.stage == "train":
        res = {"train_s": run["train_s"], "steps": run["ckpt"].at[-1]}
        print(f"trained in {run['train_s']:.1f} s", flush=True)
    elif a.stage == "ifcg":
        res = stage_ifcg(a, run, d, train, queries)
    else:
        res = stage_family(a, run, d, train, queries, extra)
    allres = json.loads(OUT.read_text()) if OUT.exists() else {}
    key = f"{a.task}/{a.stage}"
    if a.stage == "ifcg":
        key += f"/b{a.if_batch}/it{a.if_iter}/{a.if_mode}"
    allres[key] = {"threads": a.threads, "sizes": SIZES[a.task], **res}
    OUT.write_text(json.dumps(allres, indent=1, default=str))


if __name__ == "__main__":
    main()
