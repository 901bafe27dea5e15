r"""Linear datamodeling score (LDS) by the field's protocol: influence from the streamed factors
against every peer at its best, settings chosen on validation queries; and noisy-label detection.

Usage (each part resumable; the full protocol is hours of CPU on 2 cores):

1. ``python benchmarks/lds_truth.py [--budget S]`` — the ground truth (`lds_truth`), cached under
   ``benchmarks/results/lds_truth/`` (committed);
2. ``python benchmarks/influence_lds.py --part scores [--tasks T…] [--seeds S…]`` — the score
   matrices of every method (`lds_methods`: ours; `lds_peers`: kronfluence, dattri, gradient
   dot), cached under ``benchmarks/results/cache/lds_scores/`` (a variant already there is not
   recomputed: a method is added without retraining anything);
3. ``--part noisy`` — noisy-label detection (`lds_noisy`), ``benchmarks/results/lds_noisy/``;
4. ``--part report`` — the LDS of every cached variant against the truth, the settings chosen
   on validation queries, the table: ``benchmarks/results/influence_lds.json`` and the section
   of ``benchmarks/RESULTS.md`` between the ``influence-lds`` markers.

Without ``--part``: scores, noisy and report for the given tasks and seeds. ``--quick``: the
whole pipeline (truth included) on tiny sizes in a temporary folder, writes nothing.
Nothing is downloaded; every model is built from a config.

Protocol
--------
* **Tasks** (`lds_tasks`; recipes fixed by held-out accuracy / loss before any LDS was seen):
  ``digits`` (scikit-learn's 8×8 digits as 8 row-tokens through a 2-layer GPT-2 classifier,
  1,000 training images), ``text`` (a 2-layer byte-level GPT-2 LM on 600 32-byte windows of
  Python's documentation), ``mnist`` (dattri's MNIST-10 logistic regression, 5,000 training
  images, `mnist_task`); a query's output is its loss (cross-entropy; summed next-byte NLL).
* **Split per seed**: the seed draws the training set, the validation and the test queries
  (disjoint; digits and text 100 / 200, mnist 500 / 500, seed 0 dattri's), the scored model's
  initialisation and data order.
* **Truth**: 100 random halves, each retrained 3 times with fresh initialisation and order; a
  query's LDS is the Spearman correlation over the halves between the summed scores of the
  half's members and minus the mean retrained loss. The fixed-seed truth (one retrain with the
  scored run's own initialisation and order) is reported beside.
* **Selection**: every method family's tunable (our damping and K-FAC / EK-FAC / trajectory;
  kronfluence's damping; TRAK's projection; IF's regularisation) is chosen per task and seed
  on the validation queries (`lds_select.choose`); the test queries are read once, for the
  table. **Our recommended setting** is one setting for every task: the one whose worst task
  (validation LDS, mean over seeds) is best (`lds_select.choose_recommended`).
* **Comparison**: per test query, ours (recommended) minus the peer, pooled over the seeds'
  queries, mean with a 95% interval; "ahead" / "tie" / "behind" by the interval.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import lds_methods as M
import lds_noisy as NZ
import lds_select as S
import lds_truth as LT
import torch
from tasks import lds_tasks as T

from _common import machine, write_json, write_section

BEGIN, END = "<!-- influence-lds:begin -->", "<!-- influence-lds:end -->"
#: the families of ours; the recommended setting is chosen among all their variants
OURS = ("ours_kfac", "ours_ekfac", "ours_trajectory")
#: table labels of our families (the peers': lds_peers.family_label)
LABELS = {"ours_kfac": "ours, K-FAC final snapshot (damping share tuned)",
          "ours_ekfac": "ours, EK-FAC final snapshot (damping share tuned)",
          "ours_trajectory": "ours, trajectory_influence (damping share tuned)"}
QUICK_SIZES = {"digits": (64, 6, 8), "text": (64, 4, 6), "mnist": (64, 6, 8)}


def peers_module():
    """`lds_peers` if it imports, else None (the report says the peers are absent)."""
    try:
        import lds_peers
    except ImportError:
        return None
    return lds_peers


# -- part: scores --------------------------------------------------------------------------------

def scores_part(task: str, seed: int, sizes: tuple[int, int, int], a, tmp: str) -> dict:
    """Every missing variant of one task and seed into the cache; returns the runs' facts."""
    d = T.split(task, seed, *sizes)
    queries = d["val"] + d["test"]
    cache = M.ScoreCache(task, seed, a.score_root)
    t0 = time.perf_counter()
    run, ek, info = M.tracked_runs(task, d["train"], seed, tmp)
    model = run["model"]
    info.update(query_accuracy=T.accuracy(model, d["test"]),
                query_loss=float(T.example_losses(model, d["test"]).mean()),
                query_loss_untrained=float(T.example_losses(T.new_model(task, seed),
                                                            d["test"]).mean()))
    # --quick's runs (10-20 steps) may end without an EK-FAC correction: K-FAC's stands in
    M.ours_scores(task, run, ek, queries, d["train"], cache, "auto" if a.quick else "ekfac")
    info.update(ours_s=time.perf_counter() - t0)
    peers = peers_module()
    done = cache.dir / "peers.json"  # the peers ran on this task and seed: not again
    if peers is not None and done.exists():
        info.update(json.loads(done.read_text()))
        if not a.quick and not all(cache.has(f"kronfluence_kfac:mean*{f:g}")
                                   for f in peers.KF_GRID):  # the grid grew: kronfluence again
            sc, secs, _ = peers.kronfluence_scores(run, d["train"], queries,
                                                   str(Path(tmp) / "peers"))
            for v, s in sc.items():
                if not cache.has(v):
                    cache.put(v, s, secs.get(v, float("nan")))
    elif peers is not None:
        val, _ = S.split_truth(LT.load_truth(task, seed, sizes))

        def choose(scores: dict) -> str:  # IF-CG's setting, from its validation rows only
            return next(iter(S.choose(scores, val).values()))

        t1, details = time.perf_counter(), {}
        extra = M.extra_models(task, d["train"], seed, a.trak_models)
        sc, secs, failed = peers.peer_scores(task, run, d["train"], queries, extra,
                                             str(Path(tmp) / "peers"), quick=a.quick,
                                             n_val=len(d["val"]), choose=choose,
                                             details=details)
        for v, s in sc.items():
            cache.put(v, s, secs.get(v, float("nan")))
        facts = dict(peers_failed=failed, peers_details=details,
                     peers_s=time.perf_counter() - t1)
        cache.dir.mkdir(parents=True, exist_ok=True)
        done.write_text(json.dumps(facts, indent=1, default=str))
        info.update(facts)
    info.update(scores_s=time.perf_counter() - t0)
    cache.dir.mkdir(parents=True, exist_ok=True)
    (cache.dir / "info.json").write_text(json.dumps(info, indent=1, default=str))
    return info


# -- part: report --------------------------------------------------------------------------------

def evaluate(task: str, seed: int, a) -> dict:
    """One task and seed: every cached variant's per-query LDS on the validation and test
    queries (seed-averaged truth) and on the test queries (fixed-seed truth), the settings
    chosen on validation queries only, and the run facts."""
    truth = LT.load_truth(task, seed, a.sizes[task])
    val, test = S.split_truth(truth)
    cached = M.ScoreCache(task, seed, a.score_root).all()
    if not cached:
        raise SystemExit(f"{task} seed {seed}: no cached scores; run --part scores first")
    scores = {v: c["scores"] for v, c in cached.items()}
    chosen = S.choose(scores, val)  # reads the validation queries only
    r = {"seed": seed, "chosen": chosen, "variants": {}}
    for v, s in scores.items():
        vq, tq, fq = val.lds(s), test.lds(s), test.lds(s, fixed=True)
        r["variants"][v] = {"val": S.nanmean(vq), "test": S.nanmean(tq),
                            "test_fixed": S.nanmean(fq), "seconds": cached[v]["seconds"],
                            "test_per_query": [round(x, 5) for x in tq],
                            "test_fixed_per_query": [round(x, 5) for x in fq]}
    info = M.ScoreCache(task, seed, a.score_root).dir / "info.json"
    r["info"] = json.loads(info.read_text()) if info.exists() else {}
    r["truth_cpu_s"] = truth.seconds
    return r


def recommend(results: dict[str, list[dict]]) -> str:
    """`lds_select.choose_recommended` over our variants' validation means (mean over seeds)."""
    val_means = {}
    for task, seeds in results.items():
        ours = [v for v in seeds[0]["variants"] if S.family(v) in OURS]
        val_means[task] = {v: sum(s["variants"][v]["val"] for s in seeds) / len(seeds)
                           for v in ours if all(v in s["variants"] for s in seeds)}
    return S.choose_recommended(val_means)


def compare(results: dict[str, list[dict]], rec: str) -> dict[str, dict]:
    """``{task: {family: {"test", "test_fixed", "pair", "pair_fixed", "verdict"}}}``: each
    family at its validation-chosen setting (per seed), ours at the recommended one, the paired
    test-query differences ours − family."""
    out = {}
    for task, seeds in results.items():
        fams = sorted({S.family(v) for s in seeds for v in s["variants"]})
        ours_q = [s["variants"][rec]["test_per_query"] for s in seeds]
        ours_f = [s["variants"][rec]["test_fixed_per_query"] for s in seeds]
        rows = {"recommended": {"test": [s["variants"][rec]["test"] for s in seeds],
                                "seconds": [s["variants"][rec]["seconds"] for s in seeds],
                                "test_fixed": [s["variants"][rec]["test_fixed"] for s in seeds],
                                "setting": [rec] * len(seeds)}}
        for fam in fams:
            picks = [s["chosen"].get(fam) for s in seeds]
            if None in picks:
                continue
            q = [s["variants"][p]["test_per_query"] for s, p in zip(seeds, picks)]
            qf = [s["variants"][p]["test_fixed_per_query"] for s, p in zip(seeds, picks)]
            pair = S.paired(ours_q, q)
            rows[fam] = {"setting": picks, "seconds": [s["variants"][p]["seconds"]
                                                       for s, p in zip(seeds, picks)],
                         "test": [s["variants"][p]["test"] for s, p in zip(seeds, picks)],
                         "test_fixed": [s["variants"][p]["test_fixed"]
                                        for s, p in zip(seeds, picks)],
                         "pair": pair, "pair_fixed": S.paired(ours_f, qf),
                         "verdict": S.verdict(pair)}
        out[task] = rows
    return out


#: streamed against refitted factors: (ours' family, kronfluence's family)
REFIT = (("ours_kfac", "kronfluence_kfac"), ("ours_ekfac", "kronfluence_ekfac"),
         ("ours_kfac", "kronfluence_kfac_labelled"), ("ours_ekfac", "kronfluence_ekfac_labelled"))


def refit(results: dict[str, list[dict]]) -> dict[str, dict[str, dict]]:
    """``{task: {"ours − kronfluence": paired}}``: our streamed final-snapshot factors against
    kronfluence's refitted at the final weights, each family at its validation-chosen setting
    per seed (`REFIT`; pairs a task lacks are left out)."""
    out = {}
    for task, seeds in results.items():
        out[task] = {}
        for ours, peer in REFIT:
            picks = [(s["chosen"].get(ours), s["chosen"].get(peer)) for s in seeds]
            if any(a is None or b is None for a, b in picks):
                continue
            out[task][f"{ours} − {peer}"] = S.paired(
                [s["variants"][a]["test_per_query"] for s, (a, _) in zip(seeds, picks)],
                [s["variants"][b]["test_per_query"] for s, (_, b) in zip(seeds, picks)])
    return out


def label(fam: str, peers) -> str:
    if fam in LABELS:
        return LABELS[fam]
    return peers.family_label(fam) if peers is not None else fam


def fmt(p: dict) -> str:
    return f"{p['mean']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}]"


def table(results: dict[str, list[dict]], comp: dict, rec: str, noisy: dict,
          refits: dict) -> list[str]:
    peers = peers_module()
    L = [f"Recommended (one setting for every task, chosen on validation queries by the worst "
         f"task): **`{rec}`**."]
    for task, rows in comp.items():
        seeds = results[task]
        i0 = seeds[0]["info"]
        L += ["", f"**{task}** (seeds {', '.join(str(s['seed']) for s in seeds)}; test query "
              "accuracy " + ", ".join(f"{s['info'].get('query_accuracy', float('nan')):.3f}"
                                      for s in seeds)
              + f"; {i0.get('steps', '?')} steps)", "",
              "| method (setting chosen per seed on validation) | test LDS, mean over seeds | "
              "fixed-seed truth | ours − it, per test query (95%) | | fixed-seed: ours − it |"
              " CPU s | settings |", "|---|---|---|---|---|---|---|---|"]
        rr = rows["recommended"]
        L.append(f"| **ours, recommended** | **{sum(rr['test']) / len(rr['test']):+.3f}** | "
                 f"{sum(rr['test_fixed']) / len(rr['test_fixed']):+.3f} | | | | "
                 f"{sum(rr['seconds']) / len(rr['seconds']):.0f} | `{rec}` |")
        for fam, row in rows.items():
            if fam == "recommended":
                continue
            L.append(f"| {label(fam, peers)} | {sum(row['test']) / len(row['test']):+.3f} | "
                     f"{sum(row['test_fixed']) / len(row['test_fixed']):+.3f} | "
                     f"{fmt(row['pair'])} ({row['pair']['n']} q.) | {row['verdict']} | "
                     f"{fmt(row['pair_fixed'])} | {sum(row['seconds']) / len(row['seconds']):.0f}"
                     " | " + ", ".join(f"`{p.split(':', 1)[-1]}`" for p in row["setting"]) + " |")
        if refits.get(task):
            L += ["", f"{task}, streamed factors (ours, final snapshot) − kronfluence's refitted "
                  "at the final weights, per test query (95%), each at its chosen setting: "
                  + "; ".join(f"{k}: {fmt(p)} ({S.verdict(p)})"
                              for k, p in refits[task].items())]
        L += NZ.noisy_table(task, noisy.get(task, []))
    return L


def report(results: dict, comp: dict, rec: str, noisy: dict, a, info: dict) -> str:
    truth_s = {t: [s["truth_cpu_s"] for s in seeds] for t, seeds in results.items()}
    score_s = {t: [s["info"].get("peers_s", float("nan")) for s in seeds]
               for t, seeds in results.items()}
    L = [BEGIN, "## Influence: LDS by the field's protocol, and noisy labels "
         "(`benchmarks/influence_lds.py`)", "", f"- date: {info['date']}",
         f"- machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, "
         f"transformers {info['transformers']}, dattri {info.get('dattri')}, kronfluence "
         f"{info.get('kronfluence')}", f"- command: `{a.command}`",
         "- CPU time per task and seed (one core): ground truth "
         + "; ".join(f"{t} " + "/".join(f"{x / 60:.0f}" for x in v) + " min"
                     for t, v in truth_s.items())
         + "; every peer (its fits, features and extra models included) " + "; ".join(
             f"{t} " + "/".join(f"{x / 60:.1f}" for x in v) + " min" for t, v in score_s.items()),
         f"- protocol: the script's docstring ({LT.SUBSETS} halves × {LT.RETRAINS} fresh "
         "retrains per task and seed, a different split per seed, settings chosen on the "
         "validation queries; training examples / validation / test queries per seed: "
         + "; ".join(f"{t} {'/'.join(map(str, a.sizes[t]))}" for t in results) + ")", ""]
    L += ["CPU s: scoring the test and validation queries on one core (shared work, e.g. a "
          "fit or TRAK's features, included; the tracked training run not, nor the extra models "
          "TRAK-k trains).", ""]
    L += table(results, comp, rec, noisy, refit(results))
    L.append(END)
    return "\n".join(L)


def slim(results: dict[str, list[dict]], rec: str) -> None:
    """Keep the per-query LDS of the variants the table uses (each seed's chosen ones and the
    recommended one); the others keep their means (the cache and the truth give them back)."""
    for seeds in results.values():
        for s in seeds:
            keep = set(s["chosen"].values()) | {rec}
            for v, r in s["variants"].items():
                if v not in keep:
                    r.pop("test_per_query", None)
                    r.pop("test_fixed_per_query", None)


def report_part(a, info: dict) -> dict:
    results = {t: [evaluate(t, s, a) for s in a.seeds] for t in a.tasks}
    rec = recommend(results)
    comp = compare(results, rec)
    noisy = {t: NZ.load_noisy(t, a.seeds) for t in a.tasks} if not a.quick else a.noisy
    section = report(results, comp, rec, noisy, a, info)
    print(section, flush=True)
    slim(results, rec)
    out = {"machine": info, "command": a.command, "recommended": rec, "comparison": comp,
           "streamed_vs_refit": refit(results),
           "results": results, "noisy": noisy}
    if not (a.quick or a.no_write):
        write_json("influence_lds", out)
        write_section(BEGIN, END, section)
    return out


# -- driver ---------------------------------------------------------------------------------------

def quick_truth(a) -> None:
    """``--quick``: a tiny truth (4 halves × 2 retrains) in ``a.tmp``."""
    LT.TRUTH_DIR = Path(a.tmp) / "truth"
    LT.SUBSETS, LT.RETRAINS = 4, 2
    for task in a.tasks:
        for seed in a.seeds:
            LT.fill(LT.load_truth(task, seed, a.sizes[task], create=True), 2, math.inf)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("scores", "noisy", "report"), nargs="+",
                   default=["scores", "noisy", "report"])
    p.add_argument("--tasks", nargs="+", default=list(LT.SIZES), choices=list(LT.SIZES))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--trak-models", type=int, default=10)
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--quick", action="store_true", help="smoke run on tiny sizes; writes nothing")
    p.add_argument("--no-write", action="store_true", help="print only, write nothing")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    a.command = "python benchmarks/influence_lds.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    a.sizes, a.score_root = dict(LT.SIZES), None
    if a.quick:
        a.seeds, a.trak_models, a.sizes = a.seeds[:1], 2, dict(QUICK_SIZES)
    info = dict(machine({"dattri": "dattri", "kronfluence": "kronfluence"}),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    with tempfile.TemporaryDirectory(prefix="kfac-lds-") as tmp:
        a.tmp = tmp
        if a.quick:
            a.score_root = Path(tmp) / "scores"
            quick_truth(a)
        a.noisy = {}
        for task in a.tasks:
            for seed in a.seeds:
                if "scores" in a.part:
                    i = scores_part(task, seed, a.sizes[task], a, tmp)
                    print(f"{task} seed {seed}: scores in {i['scores_s']:.0f} s; peers failed: "
                          f"{i.get('peers_failed') or 'none'}", flush=True)
                if "noisy" in a.part:
                    nz = NZ.noisy_seed(task, seed, a.sizes[task], a.noise, tmp,
                                       write=not (a.quick or a.no_write))
                    a.noisy.setdefault(task, []).append(nz)
                    print(f"{task} seed {seed} noisy: " + ", ".join(
                        f"{k} AUC {v['auc']:.3f}" for k, v in nz["detect"].items()), flush=True)
        if "report" in a.part:
            report_part(a, info)


if __name__ == "__main__":
    main()
