"""``gpu_check.py``'s summary: one row per part and training setting with its figures, the
target (`gpu_check_plan`) and the verdict, and the table printed last."""

from __future__ import annotations

import statistics

from gpu_check_plan import (
    FINAL_RUN,
    FOLD_TOL,
    RATIO_DEFAULTS,
    RATIO_EVERY_STEP,
    RUNS,
    STORE_TOL,
    TOTAL_S,
)


def fmt_gb(n: float | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f} GB"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def timed_steps(seconds: list[float], warmup: int) -> list[float]:
    """The timed steps' seconds (``seconds[i-1]`` is step ``i``'s; the timed steps are
    ``warmup, warmup+1, ...``: whole update cycles when ``warmup`` and their number are
    multiples of ``update_every``)."""
    return seconds[warmup - 1:]


def _verdict(ok: bool | None, dry: bool = False, judged_in_dry: bool = True) -> str:
    if ok is None:
        return "—"
    if dry and not judged_in_dry:
        return "n/a (dry)"
    return "PASS" if ok else "MISS"


class SummaryRows(list):
    """The summary's rows (``{part, status, figures, target, verdict}`` dicts), added with the
    verdict of a dry run or a GPU run."""

    def __init__(self, dry: bool):
        super().__init__()
        self.dry = dry

    def add(self, part, status, figures, target="", ok=None, perf=False) -> None:
        verdict = _verdict(ok, self.dry, judged_in_dry=not perf)
        if status in ("timeout", "error", "failed", "missing") and ok is None:
            verdict = "MISS"
        self.append({"part": part, "status": status, "figures": figures, "target": target,
                     "verdict": verdict})


def summarise(report: dict, dry: bool) -> list[dict]:
    """The summary's rows: part, status, figures, target, verdict (``gate``: counts for the
    exit status)."""
    rows = SummaryRows(dry)
    parts = report["parts"]
    cuda_test_rows(rows, parts.get("cuda_tests", {}))
    micro_rows(rows, parts.get("micro", {}), report["sizes"])
    for key, label in (("train_fp32_autocast", "3a fp32+autocast"), ("train_bf16", "3b bf16")):
        training_rows(rows, label, parts.get(key, {}))
    x = parts.get("exchange", {})
    st = x.get("status", "missing")
    fig = (f"{x.get('backend', '?')}: {x.get('exchange_seconds', 0) * 1e3:.1f} ms, rows back "
           f"exactly: {x.get('exact')}") if "exact" in x else "not reached"
    rows.add("4 exchange", st, fig, "exact", x.get("exact") if "exact" in x else None)
    rows.add("total", "ok", f"{report['seconds']:.0f} s", f"≤ {TOTAL_S} s",
             report["seconds"] <= TOTAL_S, perf=True)
    for row in rows:  # a part that did not finish is missed, whatever it measured
        if row["status"] != "ok" and row["part"] != "total" and row["verdict"].startswith("PASS"):
            row["verdict"] = "MISS"
    return list(rows)


def cuda_test_rows(rows: SummaryRows, r: dict) -> None:
    """Part 1's row: the CUDA tests collected (dry run) or run."""
    st = r.get("status", "missing")
    if rows.dry:
        rows.add("1 CUDA tests", st, f"{r.get('collected', 0)} collected in "
                 f"{len(r.get('files', []))} files (dry run: not run)", "collect",
                 st == "ok" and r.get("collected", 0) > 0)
    else:
        rows.add("1 CUDA tests", st, f"{r.get('passed', 0)} passed, {r.get('failed', 0)} "
                 f"failed, {r.get('skipped', 0)} skipped, {r.get('errors', 0)} errors "
                 f"({r.get('seconds', 0):.0f} s)", "0 failed, 0 skipped",
                 st == "ok" and r.get("passed", 0) > 0 and not r.get("failed")
                 and not r.get("skipped") and not r.get("errors"))


def micro_rows(rows: SummaryRows, m: dict, sizes: dict) -> None:
    """Part 2's rows: eigh, the fold, the store's device path."""
    st = m.get("status", "missing")
    if "eigh" in m:
        e = m["eigh"]
        fig = ", ".join(f"{d}: {v['seconds']:.3f} s (err {v['max_err_rel_to_top']:.1e})"
                        for d, v in e.items())
        cpu = next((v["cpu_float64_seconds"] for v in e.values()
                    if "cpu_float64_seconds" in v), None)
        if cpu is not None:
            fig += f"; CPU float64 {next(iter(e))}: {cpu:.2f} s"
        rows.add("2 eigh", st, fig, "err ≤ d·2^-24", all(v["ok"] for v in e.values()))
    else:
        rows.add("2 eigh", st, "not reached")
    if "fold" in m:
        f = m["fold"]
        rows.add("2 fold (gram_fp32)", st, f"[{sizes['fold_rows']}, "
                 f"{sizes['fold_d']}] bf16: {f['seconds'] * 1e3:.2f} ms, err "
                 f"{f['rel_err']:.1e}", f"err ≤ {FOLD_TOL:.0e}", f["ok"])
    else:
        rows.add("2 fold (gram_fp32)", st, "not reached")
    if "store" in m:
        s = m["store"]
        rows.add("2 store device path", st,
                 f"{s['updates']} x [{s['rows']}, {s['d']}]: {s['update_ms']:.2f} ms/update "
                 f"({fmt_bytes(s['bytes_moved_by_updates'])} moved, "
                 f"{s['traffic_before_flush']['host_entries']} host entries); flush "
                 f"{s['flush_ms']:.2f} ms, {s['flush_gb_per_s'] or 0:.1f} GB/s both ways; err "
                 f"{s['rel_err']:.1e}"
                 f" (rounded rows {s['rel_err_rounded_rows']:.1e})",
                 f"err ≤ {STORE_TOL:.0e}, 0 B/update", s["ok"])
    else:
        rows.add("2 store device path", st, "not reached")


def training_rows(rows: SummaryRows, label: str, t: dict) -> None:
    """Part 3's rows of one training setting: the plain runs, each tracked run against them
    (``r`` gains its ratio, extra memory and seconds per update), the ablation."""
    st = t.get("status", "missing")
    runs = t.get("runs", {})
    blocks = t.get("blocks", {name: [row] for name, row in runs.items()})
    plains = blocks.get("plain", []) + blocks.get(FINAL_RUN, [])
    if not plains:
        rows.add(f"{label} plain", st, "not reached")
        return
    plain = statistics.fmean(
        [s for q in plains for s in timed_steps(q["step_seconds"], q["warmup"])])
    peak_plain = min((q["peak_bytes"] for q in plains if "peak_bytes" in q), default=None)
    rows.add(f"{label} plain", st, f"{plain * 1e3:.1f} ms/step mean"
             + (" (" + " / ".join(f"{q['mean_s_per_step'] * 1e3:.1f}" for q in plains)
                + " before / after)" if len(plains) > 1 else "")
             + f", median {plains[0]['median_s_per_step'] * 1e3:.1f}"
             + (f", peak {fmt_gb(peak_plain)}" if peak_plain is not None else ""))
    ratio_of = {name: block_ratio(blocks, name) for name in RUNS if name != "plain"}
    for name, target in (("defaults", RATIO_DEFAULTS), ("update_every=1", RATIO_EVERY_STEP)):
        r = runs.get(name)
        tgt = f"≤ {target:.2f}x" + (" (and projected), no waits" if name == "defaults"
                                    else "") + \
            ", extra mem ≤ budget, 0 kfac syncs"
        if r is None:
            rows.add(f"{label} {name}", st, "not reached", tgt)
            continue
        ratio = ratio_of[name] or r["mean_s_per_step"] / plain
        extra = r["peak_bytes"] - peak_plain if "peak_bytes" in r and \
            peak_plain is not None else None
        n_upd = r.get("updates_in_timed_steps")
        per_update = (r["mean_s_per_step"] - plain) * (len(
            timed_steps(r["step_seconds"], r["warmup"]))) / n_upd if n_upd else None
        # the defaults' ratio projected from update_every=1's (every step an update step,
        # 10x the update steps: lower variance): 1 + (r1 - 1)/update_every
        projected = None
        if name == "defaults" and ratio_of["update_every=1"] and r.get("update_every"):
            projected = 1 + (ratio_of["update_every=1"] - 1) / r["update_every"]
        r.update(ratio_to_plain=ratio, extra_peak_bytes=extra,
                 extra_seconds_per_update=per_update, projected_ratio=projected)
        fig = tracked_figures(r, ratio, len(blocks.get(name, [])), projected, extra)
        perf_ok = ratio <= target and (projected is None or projected <= target) and \
            (name != "defaults" or r.get("waits", 1) == 0)
        mem_ok = extra is None or r.get("device_budget", -1) < 0 or \
            extra <= r["device_budget"]
        sync_ok = not r["kfac_host_syncs"] and r.get("updates", 0) > 0
        if rows.dry:  # the timing targets are not judged on a tiny CPU model
            rows.add(f"{label} {name}", st, fig, tgt, sync_ok)
            rows[-1]["verdict"] += " (ratio n/a: dry)"
        else:
            rows.add(f"{label} {name}", st, fig, tgt, perf_ok and mem_ok and sync_ok)

    for name in ("replay only", "fold only"):  # the ablation: figures, no target
        if ratio_of.get(name):
            rows.add(f"{label} {name}", st, f"{ratio_of[name]:.3f}x plain at update_every=1 "
                     f"(update_every=1 with both: {ratio_of['update_every=1'] or 0:.3f}x)")


def tracked_figures(r: dict, ratio: float, n_blocks: int, projected: float | None,
                    extra: float | None) -> str:
    """One tracked run's figures in one line (``r``: its results, with
    ``extra_seconds_per_update``)."""
    per_update = r["extra_seconds_per_update"]
    return (f"{r['mean_s_per_step'] * 1e3:.1f} ms/step = {ratio:.3f}x"
            + (f" (median of {n_blocks} blocks' ratios)" if n_blocks > 1 else "")
            + (f" (projected from update_every=1: {projected:.3f}x)"
               if projected is not None else "")
            + f" (median {r['median_s_per_step'] * 1e3:.1f}), "
            f"{r.get('updates_in_timed_steps')} updates in the"
            f" timed steps (expected {r.get('expected_updates_in_timed_steps', 0):.1f})"
            + (f", +{per_update * 1e3:.0f} ms each" if per_update is not None else "")
            + f"; waits {r.get('waits', '?')} ({r.get('wait_seconds', 0):.2f} s)"
            f"; fold {r.get('fold_ms_per_update', float('nan')):.1f} ms/upd"
            f", to host {fmt_bytes(r.get('bytes_to_host_per_update'))}/upd"
            f", to dev {fmt_bytes(r.get('bytes_to_device_per_update'))}/upd"
            f"; final flush {r.get('final_flush_seconds', float('nan')):.3f} s"
            f" ({fmt_bytes(r.get('final_flush_bytes_to_host'))} each way"
            f", {r.get('final_flush_syncs', '?')} syncs)"
            f"; host entries {r.get('host_entries', '?')}"
            f", budget flushes {r.get('budget_flushes', '?')}"
            f", budget {fmt_bytes(r.get('device_budget'))}"
            f", resident peak {fmt_bytes(r.get('peak_resident_bytes'))}"
            f", extra peak mem {fmt_bytes(extra) if extra is not None else 'n/a'}"
            f"; kfac syncs {sum(r['kfac_host_syncs'].values())}")


def block_ratio(blocks: dict[str, list[dict]], name: str) -> float | None:
    """The median over the blocks of run ``name``'s mean step time over the same block's
    plain run's (None: not run)."""
    plain = {row["block"]: row["mean_s_per_step"] for row in blocks.get("plain", [])
             if "block" in row}
    ratios = [row["mean_s_per_step"] / plain[row["block"]] for row in blocks.get(name, [])
              if row.get("block") in plain]
    return statistics.median(ratios) if ratios else None


def print_table(rows: list[dict]) -> None:
    cols = ("part", "status", "verdict", "target", "figures")
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols[:-1]}
    line = "  ".join(f"{c:<{width[c]}}" if c in width else c for c in cols)
    print("\n" + "=" * 30 + " gpu_check summary " + "=" * 30)
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(f"{str(r[c]):<{width[c]}}" if c in width else str(r[c]) for c in cols))
