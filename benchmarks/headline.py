"""The headline table at the top of ``benchmarks/RESULTS.md``, built from ``results/*.json``.

``make bench`` runs it last: every figure comes from the JSON the other scripts wrote in the
same ``make bench`` (their sections below the headline hold the method, machine and command).
A script whose JSON is missing is named as missing, not filled in. Usage:
``python benchmarks/headline.py``; ``--quick`` prints the table and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from _common import write_section

HERE = Path(__file__).resolve().parent

BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"
RESULTS = HERE / "results"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def overhead_rows(d: dict) -> list[str]:
    """The token_fraction 0.05 rows, labelled by their Fisher; "(the default)" only where the
    config is `KFACConfig`'s default (a results file from before the MC sub-batch default has no
    ``mc_sequences``: its "mc" ran on the whole batch, and its default was empirical)."""
    from kfac_stream import KFACConfig

    default = KFACConfig()
    rows = []
    for r in d["results"]:
        c = r["config"]
        if c["token_fraction"] != 0.05:
            continue
        seqs = c.get("mc_sequences", "all")
        label = "empirical" if c["fisher"] == "empirical" else (
            "mc, whole batch" if seqs in ("all", 1.0) else f"mc, mc_sequences {seqs}")
        is_default = c["fisher"] == default.fisher and (
            c["fisher"] != "mc" or seqs == default.mc_sequences)
        rows.append(
            f"| training step with the callback ÷ plain step, token_fraction 0.05, {label}"
            f"{' (the default)' if is_default else ''}, update_every={c['update_every']} | "
            f"{r['ratio_median']:.3f} [{r['ratio_min']:.3f}–{r['ratio_max']:.3f}] over "
            f"{len(r['pairs'])} pairs (FLOP bound {r['bound']['ratio']:.4f}) | GPT-2 4×256, "
            "batch 8×256, CPU | "
            "[overhead](#training-overhead-of-kfacstreamcallback-benchmarksoverheadpy) |")
    return rows


def peer_rows(d: dict) -> list[str]:
    rows = []
    for r in d["results"]:
        for key, label in (("default", "defaults"), ("full", "token_fraction=1, update_every=1")):
            e = r[key]["extra_used_ms"]
            ratios = {p: ms / e for p, ms in r["peers_ms"].items()}
            lo = min(ratios, key=ratios.get)
            rows.append(f"| cheapest post-hoc peer's pass for one batch ÷ kfac_stream's extra "
                        f"per step, {label} (goal ≥ 20×) | {ratios[lo]:.1f}× ({lo}) | "
                        f"{r['model']}, batch 8×256 | [peers](#kfac_stream-vs-post-hoc-k-fac-"
                        "peers-benchmarkspeerspy) |")
    return rows


def lm_rows(d: dict) -> list[str]:
    """MAP and the stream Laplace with the lowest mean held-out NLL (NLL / ECE), and per OOD set
    the AUROC of MAP entropy and of the Laplace variance with the highest mean, as mean ± std
    over the seeds (``summary`` of the multi-seed JSON; a single-seed JSON from before has the
    figures at the top level and is shown as one seed)."""
    if "summary" in d:
        s, n = d["summary"], len(d["seeds"])
        cal = {m: {k: (c["nll"], c["ece"]) for k, c in v.items()}
               for m, v in s["calibration"].items()}
        auc = s["auroc"]
    else:  # single seed: (value, 0)
        n = 1
        cal = {m: {k: ((x[0], 0.0), (x[1], 0.0)) for k, x in v.items()}
               for m, v in d["calibration"].items()}
        auc = {m: {k: None if x is None else (x, 0.0) for k, x in v.items()}
               for m, v in d["auroc"].items()}

    def pm(ms, scale=1.0, fmt=".4f"):
        return f"{scale * ms[0]:{fmt}} ± {scale * ms[1]:{fmt}}" if n > 1 else \
            f"{scale * ms[0]:{fmt}}"

    base = cal["MAP"]
    laps = {m: v for m, v in cal.items() if m.startswith("Laplace")}
    best = min(laps, key=lambda m: laps[m]["id"][0][0])
    ood = [k for k in ("python_source", "licenses") if k in base]
    best_auc = {k: max(((m, s[k]) for m, s in auc.items()
                        if s[k] is not None and m != "MAP entropy"), key=lambda t: t[1][0])
                for k in ood}
    link = "[uncertainty](#predictive-uncertainty-on-real-text-benchmarksuncertaintypy)"
    seeds = f"{n} seed{'s' if n > 1 else ''}"
    return [
        f"| next-token NLL / ECE on held-out docs: MAP → best stream Laplace by mean NLL "
        f"({best}) | {pm(base['id'][0])} / {pm(base['id'][1], 100, '.2f')}% → "
        f"{pm(laps[best]['id'][0])} / {pm(laps[best]['id'][1], 100, '.2f')}% | tiny GPT-2, "
        f"byte tokens, {seeds} | {link} |",
        *(f"| ID-vs-OOD AUROC, held-out docs vs {k}: MAP entropy, best Laplace variance by mean | "
          f"{pm(auc['MAP entropy'][k], 1, '.3f')}, {pm(best_auc[k][1], 1, '.3f')} "
          f"({best_auc[k][0]}) | tiny GPT-2, {seeds} | {link} |" for k in ood)]


def cls_rows(d: dict) -> list[str]:
    """Per classification task: MAP, the default configuration's Laplace predictive (marglik
    tau) and laplace-torch KronLaplace (default GGN), accuracy / NLL / ECE as mean ± std over
    the seeds, and the acceptance verdicts."""
    link = ("[classification](#small-data-classification-map-vs-laplace-from-the-stream-vs-"
            "post-hoc-over-seeds-benchmarksuncertainty_classificationpy)")

    def cell(v):
        def pm(key, scale, fmt):
            m, s = v[key]
            return f"{scale * m:{fmt}} ± {scale * s:{fmt}}"
        return f"{pm('accuracy', 100, '.1f')}% / {pm('nll', 1, '.3f')} / {pm('ece', 100, '.1f')}%"

    rows = []
    labels = {"MAP": "MAP", "Laplace stream (default), tau=marglik":
              "Laplace from the stream, defaults, tau by marglik",
              "laplace-torch KronLaplace (default GGN), tau=marglik":
              "laplace-torch KronLaplace (default GGN), tau by marglik, the stream's default "
              "link on its covariance"}
    for t in d["tasks"].values():
        n = len(t["per_seed"])
        for m, label in labels.items():
            if m in t["summary"]:
                rows.append(f"| {t['title']}: accuracy / NLL / ECE, {label} | "
                            f"{cell(t['summary'][m])} | {n} seeds, "
                            f"{t['per_seed'][0]['splits']['train']} training examples | {link} |")
        inv = t["summary"].get("laplace-torch KronLaplace (default GGN), tau=marglik", {})
        if "investigation/nll_probit" in inv:  # laplace-torch as a user runs it: la(x), probit
            m, s = inv["investigation/nll_probit"]
            rows.append(f"| {t['title']}: NLL, laplace-torch KronLaplace (default GGN), its own "
                        f"default predictive (GLM, probit) | {m:.3f} ± {s:.3f} | {n} seeds | "
                        f"{link} |")
        met = sum(c["met"] is True for c in t["acceptance"])
        rows.append(f"| {t['title']}: acceptance criteria met | {met} of "
                    f"{len(t['acceptance'])} | {n} seeds | {link} |")
    return rows


def scale_rows(d: dict) -> list[str]:
    rows = []
    for every, r in d["results"]["Llama-2-7B"]["8"].items():
        rows.append(f"| predicted per-step overhead at scale, update_every={every} (goal ≤ "
                    f"{1 if every == '10' else 5}%; a cost model, not a GPU measurement) | "
                    f"{100 * r['after']['overhead']:.3g}% (old code, 6a379e5: "
                    f"{100 * r['before']['overhead']:,.3g}%) | Llama-2-7B, ZeRO-3 on 8 H100 | "
                    "[scale](#predicted-overhead-at-scale-benchmarksscalepy) |")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="print the table; write nothing")
    a = p.parse_args(argv)
    parts = {"overhead": overhead_rows, "peers": peer_rows, "uncertainty": lm_rows,
             "uncertainty_classification": cls_rows, "scale": scale_rows}
    rows, missing = [], []
    for name, fn in parts.items():
        d = load(name)
        if d is None:
            missing.append(name)
        else:
            rows += fn(d)
    lines = [BEGIN, "## Headline", "",
             f"- built {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}"
             " by `python benchmarks/headline.py` from `benchmarks/results/*.json`; each "
             "figure's date, machine, versions and exact command are in its section below.",
             "", "| measurement | figure | setting | section |", "|---|---|---|---|", *rows]
    if missing:
        lines += ["", "Not run yet: " + ", ".join(f"`benchmarks/{m}.py`" for m in missing)]
    lines.append(END)
    section = "\n".join(lines)
    print(section)
    if a.quick:
        print("--quick: nothing written")
        return
    write_section(BEGIN, END, section, top=True)


if __name__ == "__main__":
    main()
