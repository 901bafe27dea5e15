"""``influence_peers.py``'s section of RESULTS.md: the kronfluence agreement, the rank
correlation with exact-curvature influence, the run times and the cost on the demo's model,
each a table from the results, and the verdict lines."""

from __future__ import annotations

BEGIN, END = "<!-- influence-peers:begin -->", "<!-- influence-peers:end -->"
SPEARMAN_BAR = 0.95
#: glibc's ``MALLOC_MMAP_THRESHOLD_`` of the live-set runs of part 4 (bytes): every block from
#: 64 KiB up is mapped on its own and unmapped when freed, so the RSS follows what is alive.
MMAP_THRESHOLD = 65536


def fmt_s(x: float) -> str:
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def report(r: dict, a, info: dict) -> str:
    t, d = r["tiny"], r.get("demo", {})
    L = [BEGIN, "## Influence: kronfluence, exact GGN, cost (`benchmarks/influence_peers.py`)", "",
         f"- date: {info['date']}",
         f"- machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch "
         f"threads); torch {info['torch']}, transformers {info['transformers']}, kronfluence "
         f"{info['kronfluence']}, Python {info['python']}",
         f"- load average (1 min) at start / end: {info['load_start']:.2f} / "
         f"{info['load_end']:.2f} (shared 2-core machine: the timings are noisy; medians)",
         f"- command: `{a.command}` ({info['wall_s']:.0f} s)",
         "- method, mappings and every setting: the script's docstring. Tiny model: byte-level "
         f"GPT-2 2×16, T={a.tiny_seq}, {t['n_train']} training windows, {t['n_queries']} "
         "queries (labelled on their second half), 8 tracked layers; trained "
         f"{a.tiny_steps} steps with the callback at defaults (logged losses "
         f"{', '.join(f'{x:.3f}' for x in t['real_run']['losses'])} nats per byte).", ""]
    if "kronfluence_agreement" in t:
        L += agreement_lines(t)
    if "exact" in t:
        L += exact_lines(t)
    timings = [x for x in (t.get("timing"), d.get("timing")) if x]
    if timings:
        L += timing_lines(timings, a)
    if "cost" in d:
        L += cost_lines(d, a)
    L += verdict_lines(r)
    L.append(END)
    return "\n".join(L)


def agreement_lines(t: dict) -> list[str]:
    """The kronfluence agreement of the tiny model's part 1."""
    L: list[str] = []
    k = t["kronfluence_agreement"]
    L += ["### Agreement with kronfluence (K-FAC, empirical Fisher, float64, fixed weights)",
          "",
          f"Ours: a learning-rate-0 pass ({t['lr0']['counts']['updates']} updates, "
          f"{t['lr0']['counts']['positions_sampled']} positions) with `token_fraction=1, "
          "ema_decay=1, fisher=\"empirical\", update_every=1, final_window=0, "
          "storage_dtype=\"float64\", min_window_sequences=0`; kronfluence: "
          "`fit_all_factors(strategy=\"kfac\", use_empirical_fisher=True)` post hoc on the "
          "same weights (Linear copy). Factors: max relative Frobenius difference A "
          f"{k['factors_worst']['A']:.1e}, G {k['factors_worst']['G']:.1e}.", "",
          "| damping | Spearman, queries 1 … Q | worst | max rel. score diff. | "
          "≥ 0.95 every query |", "|---|---|---|---|---|"]
    for s, label in (("explicit", f"explicit λ = {t['lr0']['explicit_damping']:.3g} "
                                  "(both sides, every layer)"),
                     ("heuristic", "heuristic (ours `\"heuristic\"`, kronfluence "
                                   "`damping_factor=None`)")):
        x = k[s]
        rho = x["spearman"]["per_query"]
        L.append(f"| {label} | {' '.join(f'{v:.6f}' for v in rho)} | {min(rho):.6f} | "
                 f"{x['max_rel_diff']:.1e} | {'yes' if x['ok'] else 'NO'} |")
    hd = k["heuristic_damping"]
    L += ["", "Heuristic damping per layer (ours `0.1·mean(γ αᵀ)`, kronfluence "
          "`HEURISTIC_DAMPING_SCALE·mean(kron(α, γ))` from its eigenvalues): max relative "
          f"difference {max(v['rel_diff'] for v in hd.values()):.1e} (values "
          + ", ".join(f"{v['ours']:.3g}" for v in hd.values()) + ").", ""]
    return L


def exact_lines(t: dict) -> list[str]:
    """The rank correlations with exact-curvature influence (part 2)."""
    L: list[str] = []
    e = t["exact"]
    L += ["### Rank correlation with exact-curvature influence (tiny model, float64)", "",
          "Exact block-diagonal curvature of the tracked layers (dense blocks of "
          + ", ".join(str(v) for v in e["block_sizes"].values())
          + f" parameters), divided by the {e['positions']} positions as `A⊗G` is; the "
          "same damping per layer. Checks: per-example gradients vs autograd "
          f"{e['per_example_grad_check']:.0e}, GGN (d rows per position) vs the direct "
          f"V-row form {e['ggn_direct_check']:.0e}; dense `G⊗A` through the same solve "
          f"vs our scores {e['explicit']['pipeline_check_rel']:.0e} (explicit λ), "
          f"{e['heuristic']['pipeline_check_rel']:.0e} (heuristic).", "",
          "| damping | scores | vs exact GGN: median / worst Spearman | vs exact empirical "
          "Fisher: median / worst |", "|---|---|---|---|"]
    names = {"ours": "ours (lr-0 pass, empirical-Fisher K-FAC)",
             "kronfluence": "kronfluence K-FAC (empirical Fisher)",
             "ours_real_run": "ours from the real run's snapshot (defaults: MC Fisher, "
                              "token_fraction 0.05, final window)",
             "grad_dot": "gradient dot product (no curvature)",
             "exact_ef": "exact empirical Fisher"}
    for s in ("explicit", "heuristic"):
        row = e[s]
        for key, label in names.items():
            if key == "exact_ef":
                g = row["exact_ef_vs_ggn"]
                L.append(f"| {s} | {label} | {g['median']:.3f} / {g['worst']:.3f} | — |")
                continue
            if f"{key}_vs_ggn" not in row:
                continue
            g, f = row[f"{key}_vs_ggn"], row[f"{key}_vs_ef"]
            L.append(f"| {s} | {label} | {g['median']:.3f} / {g['worst']:.3f} | "
                     f"{f['median']:.3f} / {f['worst']:.3f} |")
    L.append("")
    return L


def timing_lines(timings: list[dict], a) -> list[str]:
    """The run-time table of part 3 (the tiny model and the demo's)."""
    L: list[str] = []
    L += ["### Run time: kronfluence fit-factors-then-score vs ours score-from-snapshot",
          "",
          f"Medians of {a.repeats} interleaved repeats after one warm-up (float32, the "
          "trained weights; kronfluence: `strategy=\"kfac\"`, its true Fisher, its "
          "eigendecomposition on one thread, its heuristic damping, its disk writes "
          "included; ours: the real run's final snapshot, heuristic damping, "
          "snapshot load included). The factors came with training: the tracker's own "
          "time in that run is shown beside it.", "",
          "| model | N × Q | kronfluence fit (covariances + eigh) | kronfluence score | "
          "kronfluence total | ours load | ours score | ours total | kronfluence ÷ ours | "
          "tracker in training |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in timings:
        kf, o = x["kronfluence"], x["ours"]
        L.append(f"| {x['model']} | {x['n_train']} × {x['n_queries']} | {fmt_s(kf['fit_s'])} s"
                 f" ({fmt_s(kf['cov_s'])} + {fmt_s(kf['eig_s'])})"
                 f" | {fmt_s(kf['score_s'])} s | {fmt_s(kf['total_s'])} s | "
                 f"{fmt_s(o['load_s'])} s | {fmt_s(o['score_s'])} s | {fmt_s(o['total_s'])} s"
                 f" | {x['speedup_total']:.1f}× | {x['tracker_s']:.2f} s of "
                 f"{x['callback_train_s']:.1f} s ({100 * x['tracker_share']:.1f}%, "
                 f"{x['updates']} updates) |")
    L += ["", "Spearman of ours (streamed MC-Fisher factors) vs kronfluence (its post-hoc "
          "true-Fisher factors) in these timed runs, median / worst over queries: "
          + "; ".join(f"{x['model']} {x['spearman_vs_kf']['median']:.3f} / "
                      f"{x['spearman_vs_kf']['worst']:.3f}" for x in timings)
          + " (different factors: context, not the acceptance comparison).", ""]
    return L


def cost_lines(d: dict, a) -> list[str]:
    """The cost on the demo's model (part 4)."""
    L: list[str] = []
    c = d["cost"]
    fl = c["flops_per_example"]
    L += ["### Cost on the demo's model", "",
          f"`conf/model/tiny.yaml`: GPT-2 {d['config']['n_layer']} × "
          f"{d['config']['n_embd']}, byte vocabulary, T = {d['config']['seq_len']}; "
          f"trained {a.demo_steps} steps with the callback at defaults; scores of N "
          f"training sequences × {a.queries} queries from its snapshot (heuristic damping, "
          f"batches of 8), each N in a fresh process: {a.cost_repeats} timed runs in "
          "rotated order (median time, each run beside it) and one live-set run under "
          f"`MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}` (freed blocks go back to the system, so "
          "the peak RSS increase is what the call holds at once). Under glibc's default "
          "the heap keeps freed blocks (`malloc_trim(0)` returns them; live tensors do not "
          "grow: checked by counting them), so the timed runs' peaks, shown last, drift up "
          "with N by retention, not use.", "",
          "| N | scoring time (median) | per training example | runs | peak RSS increase, "
          "live set | RSS before | [Q, N] scores | peak RSS increase, default allocator "
          "(timed runs) |", "|---|---|---|---|---|---|---|---|"]
    for row in c["rows"]:
        L.append(f"| {row['n']} | {row['score_s']:.1f} s | "
                 f"{1e3 * row['s_per_example']:.1f} ms | "
                 + ", ".join(f"{x['score_s']:.1f}" for x in row["runs"])
                 + f" s | {row['live_peak_increase_mb']:.1f} MB | "
                 f"{row['live_run']['rss_before_mb']:.0f} MB | "
                 f"{row['scores_bytes'] / 1024:.1f} KiB | "
                 + ", ".join(f"{x['peak_increase_mb']:.1f}" for x in row["runs"]) + " MB |")
    L += ["", f"Flop model per training example: forward {fl['forward']:.3g}, backward to "
          f"the tracked outputs ≈ {fl['backward_to_outputs']:.3g}, per-example gradients "
          f"(dense form) {fl['per_example_grads']:.3g}, inner products with the "
          f"{a.queries} preconditioned query rows {fl['inner_products']:.3g}: total "
          f"{fl['total']:.3g} flops ({c['achieved_gflops']:.2f} GFLOP/s achieved at "
          f"N = {c['rows'][-1]['n']}); once per call, the queries' preconditioning "
          f"{fl['queries_once']:.3g}.", ""]
    return L


def verdict_lines(r: dict) -> list[str]:
    t, d = r["tiny"], r.get("demo", {})
    out = []
    k = t.get("kronfluence_agreement")
    if k:
        out.append(f"- kronfluence agreement (Spearman ≥ {SPEARMAN_BAR} for every query): "
                   + ", ".join(f"{s} damping {'MET' if k[s]['ok'] else 'NOT met'} (worst "
                               f"{k[s]['spearman']['worst']:.6f})"
                               for s in ("explicit", "heuristic")))
    e = t.get("exact")
    if e:
        g = e["explicit"]["ours_vs_ggn"]
        out.append(f"- rank correlation with exact-GGN influence (explicit λ): median "
                   f"{g['median']:.3f}, worst {g['worst']:.3f} over {len(g['per_query'])} "
                   "queries (reported, no threshold)")
    if "cost" in d:
        rows = d["cost"]["rows"]
        out.append(f"- cost: {rows[-1]['n']} training sequences × {r['queries']}"
                   f" queries in {rows[-1]['score_s']:.1f} s "
                   f"({1e3 * rows[-1]['s_per_example']:.1f} ms per training example, median); "
                   "peak RSS increase of the live set "
                   + ", ".join(f"{x['live_peak_increase_mb']:.1f} MB at N={x['n']}"
                               for x in rows))
    return out
