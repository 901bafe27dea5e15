r"""How long the walkthroughs take as a user runs them, and the callback's share of it.

Usage: ``python benchmarks/probes/walkthrough_times.py [--repeats 2] [--only classification ...]``;
``--quick`` is a smoke run (each script shortened by its own step arguments) that writes
nothing. Writes ``benchmarks/results/walkthrough_times.json`` and the ``walkthrough-times``
section of ``benchmarks/RESULTS.md``.

Each walkthrough script in ``examples/`` runs ``--repeats`` times, in turn, as a user runs it:
``python examples/<script> --out <a temporary directory>`` in a fresh process from the
repository root, at its default steps, with the environment this script was started in. Per
run it records:

* the wall time of the process (imports, data, training, the queries; what the docs' stated
  times promise);
* from the callback's end-of-train line (`kfac_stream.tracking.lines.cost_line`): its seconds
  on the training thread, their share of the training time, the training time and the split
  into set-up, steps and end;
* from the held-out fit's line, where the walkthrough has an eval set: its seconds and eval
  examples.

Each run is repeated without the spectra PNG (``KFACStreamCallback(..., spectra_media=False)``,
passed by a wrapper that runs the unchanged script): on these small CPU runs the PNG drawn after
each snapshot (on the snapshot thread, which the end of training waits for) is a large part of
the callback's share, and the difference says how large.

Each walkthrough's stated time (``CLAIMS``: where the docs say it and the bound in seconds)
is judged against the slowest run. Run it on an otherwise quiet machine (the figures are wall
times); the machine and date are recorded.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import HERE, machine, write_json, write_section  # noqa: E402

BEGIN, END = "<!-- walkthrough-times:begin -->", "<!-- walkthrough-times:end -->"
ROOT = HERE.parent

#: walkthrough: (script, its --quick shortening arguments)
WALKTHROUGHS = {
    "classification": ("examples/sequence_classification.py", ["--steps", "20"]),
    "causal_lm": ("examples/causal_lm.py", ["--steps", "20"]),
    "lora": ("examples/lora.py", ["--steps", "10", "--pretrain-steps", "10"]),
}
#: walkthrough: (where the docs state its time, the statement, its bound in seconds)
CLAIMS = {
    "classification": ("docs/classification.md, README.md", "under a minute on 2 cores", 60.0),
    "causal_lm": ("README.md", "under a minute on a CPU (every example)", 60.0),
    "lora": ("docs/lora.md, README.md", "under half a minute on 2 cores", 30.0),
}
COST = re.compile(r"kfac_stream: ([\d.e+-]+) s in the callback \(([\d.]+)% of ([\d.e+-]+) s "
                  r"training, from train begin to this line((?:; [\d.e+-]+ s [\w -]+?)*)\)")
PART = re.compile(r"; ([\d.e+-]+) s ([\w -]+)")
HELDOUT = re.compile(r"held-out fit on (\d+) eval examples: .*?; fit ([\d.]+) s\)")
#: runs the script named by argv[1] unchanged, with the callback's spectra PNG off
NO_PNG = """import runpy, sys
import kfac_stream
class NoPNG(kfac_stream.KFACStreamCallback):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("spectra_media", False)
        super().__init__(*args, **kwargs)
kfac_stream.KFACStreamCallback = NoPNG
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
VARIANTS = ("as shipped", "no spectra PNG")


def parse(text: str) -> dict:
    """The callback's cost line and the held-out fit's line of one run's output (None where
    the run printed none)."""
    out = {"callback_s": None, "callback_share_pct": None, "train_s": None, "parts_s": None,
           "heldout_fit_s": None, "heldout_examples": None}
    cost = COST.search(text)
    if cost is not None:
        out.update(callback_s=float(cost[1]), callback_share_pct=float(cost[2]),
                   train_s=float(cost[3]),
                   parts_s={name: float(s) for s, name in PART.findall(cost[4])})
    fit = HELDOUT.search(text)
    if fit is not None:
        out.update(heldout_examples=int(fit[1]), heldout_fit_s=float(fit[2]))
    return out


def run_once(script: str, extra: list[str], png: bool = True) -> dict:
    """One walkthrough run in a fresh process, timed; its parsed lines. ``png`` False: the
    same script with the spectra PNG off (`NO_PNG`)."""
    with tempfile.TemporaryDirectory(prefix="kfac-walkthrough-") as tmp:
        cmd = [sys.executable, *(() if png else ("-c", NO_PNG)), script, "--out", f"{tmp}/out",
               *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return {"wall_s": wall, **parse(proc.stdout + proc.stderr)}


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", nargs="+", choices=sorted(WALKTHROUGHS), default=list(WALKTHROUGHS))
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.repeats = 1
    info = dict(machine({"peft": "peft"}),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    runs: dict[str, list[dict]] = {name: [] for name in a.only}
    for rep in range(a.repeats):  # the walkthroughs in turn, so a slow spell hits each alike
        for name in a.only:
            script, short = WALKTHROUGHS[name]
            for variant in VARIANTS:
                r = run_once(script, short if a.quick else [], png=variant == VARIANTS[0])
                r["variant"] = variant
                runs[name].append(r)
                print(f"{name} ({variant}) run {rep + 1}: {r['wall_s']:.1f} s wall; callback "
                  f"{_fmt(r['callback_s'])} s = {_fmt(r['callback_share_pct'])}% of "
                      f"{_fmt(r['train_s'])} s training; held-out fit "
                      f"{_fmt(r['heldout_fit_s'])} s", flush=True)
    verdicts = {}
    for name, rs in runs.items():
        where, said, bound = CLAIMS[name]
        slowest = max(r["wall_s"] for r in rs if r["variant"] == VARIANTS[0])
        verdicts[name] = {"where": where, "stated": said, "bound_s": bound,
                          "slowest_wall_s": slowest, "holds": slowest <= bound}
    lines = [BEGIN, "## The walkthroughs' times (`benchmarks/probes/walkthrough_times.py`)", "",
             f"- date: {info['date']}",
             f"- machine: {info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch "
             f"threads; torch {info['torch']}, transformers {info['transformers']}, peft "
             f"{info['peft']}, Python {info['python']}",
             f"- command: `python benchmarks/probes/walkthrough_times.py --repeats {a.repeats}"
             + (" --quick" if a.quick else "")
             + ("" if a.only == list(WALKTHROUGHS) else " --only " + " ".join(a.only)) + "`",
             "- each script at its default steps, in a fresh process, as a user runs it; wall: "
             "the process (imports included); callback: the end-of-train line's seconds on the "
             "training thread and their share of the training time; held-out fit: its own "
             "line's seconds (in the callback's end); each run also without the spectra PNG "
             "(`spectra_media=False`, the script unchanged)", "",
             "| walkthrough | variant | run | wall s | training s | callback s | callback share | "
             "set-up / steps / end s | held-out fit s (eval examples) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        for variant in VARIANTS:
            for i, r in enumerate(r for r in rs if r["variant"] == variant):
                parts = " / ".join(_fmt(v, ".2f") for v in (r["parts_s"] or {}).values()) or "–"
                fit = ("–" if r["heldout_fit_s"] is None else
                       f"{r['heldout_fit_s']:.1f} ({r['heldout_examples']})")
                lines.append(f"| {name} | {variant} | {i + 1} | {r['wall_s']:.1f} | "
                             f"{_fmt(r['train_s'])} | {_fmt(r['callback_s'])} | "
                             f"{_fmt(r['callback_share_pct'])}% | {parts} | {fit} |")
    lines += ["", "| walkthrough | stated (where) | slowest wall s, as shipped | holds |",
              "|---|---|---|---|"]
    for name, v in verdicts.items():
        lines.append(f"| {name} | {v['stated']} ({v['where']}) | {v['slowest_wall_s']:.1f} | "
                     f"{'yes' if v['holds'] else 'no'} |")
    lines.append(END)
    section = "\n".join(lines)
    print(section)
    if not a.quick:
        write_json("walkthrough_times", {"machine": info, "args": vars(a), "runs": runs,
                                         "claims": verdicts})
        write_section(BEGIN, END, section)


if __name__ == "__main__":
    main()
