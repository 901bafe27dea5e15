"""The app's end-of-run report: the last snapshot's layer table, the tracker's counts and the
uncertainty contrast of held-out against out-of-domain text (``conf/report``)."""

from __future__ import annotations

import os
import time
from typing import Any

from ..query.laplace import LaplacePosterior
from ..snapshot.layer_table import layer_table
from ..snapshot.snapshot import Snapshot
from . import data as appdata
from .contrast import uncertainty_contrasts


def overhead_text(tracker_seconds: float, wall: float, train_seconds: float | None) -> str:
    """The tracker's time on the training thread as a share of the training loop: from the
    callback's ``on_train_begin`` to its ``on_train_end`` (``train_seconds``), not
    ``Trainer.train()``'s ``wall``, which also holds the engine's start-up (DeepSpeed init,
    ZeRO-3 partitioning: tens of seconds at start, no training); that start-up is shown
    apart when it is over a second."""
    train = wall if train_seconds is None else train_seconds
    text = (f"{tracker_seconds:.2f} s on the training thread of {train:.1f} s training "
            f"({100 * tracker_seconds / max(train, 1e-9):.1f}%)")
    start = wall - train
    if start >= 1.0:
        text += f"; engine start-up before training {start:.1f} s, not counted"
    return text


def end_of_run_report(cfg, model, tokenizer, seq_len: int, kfac, wall: float,
                      heldout_docs: list[str], ood_docs: dict[str, list[str]],
                      world_size: int, model_dir: str) -> dict[str, Any]:
    """Print the report of a finished run (rank 0) and return its figures.

    Args:
        cfg: The composed app config (``report`` group: contrast sizes, prior precision).
        model, tokenizer, seq_len: The trained model, its tokenizer and window length.
        kfac: The run's `KFACStreamCallback` (its last snapshot is reported).
        wall: Training wall time in seconds.
        heldout_docs: Held-out in-domain documents.
        ood_docs: ``{set name: documents}`` out of domain.
        world_size: Processes that trained (the contrast is skipped with several).
        model_dir: Where the trained model was saved.

    Returns:
        ``{"snapshot", "spectra_png", "report"[, "contrast"]}``.
    """
    snap = Snapshot.load(kfac.snapshots[-1])
    c = snap.manifest.counts
    lines = ["", "=" * 78, f"kfac_stream report — snapshot {snap.path}", "", layer_table(snap),
             "", f"tracker: {c.updates} updates, {c.positions_sampled} positions sampled "
             f"of {c.tokens_seen} seen, {c.skipped_updates} skipped; "
             + overhead_text(c.tracker_seconds, wall, kfac.train_seconds)]
    png = f"{snap.path}.spectra.png"
    result: dict[str, Any] = {"snapshot": snap.path, "spectra_png": png if os.path.exists(png)
                              else None}
    if result["spectra_png"]:
        lines.append(f"spectra plot: {png}")
    if cfg.report.enabled and heldout_docs and ood_docs:  # ood_docs: {set name: documents}
        if world_size > 1:
            lines.append("uncertainty contrast: skipped with several processes (the model may "
                         "be partitioned); load the snapshot in one process with "
                         "kfac_stream.LaplacePosterior")
        else:
            r = cfg.report

            def windows(docs):
                ids = appdata.encode_documents(docs, tokenizer)
                return [e["input_ids"] for e in appdata.lm_examples(ids, seq_len, r.windows)]

            model.eval()
            dev = next(model.parameters()).device
            held = [w.to(dev) for w in windows(heldout_docs)]
            ood = {name: [w.to(dev) for w in windows(docs)] for name, docs in ood_docs.items()}
            n_pos = (len(held) + sum(map(len, ood.values()))) * r.positions
            print(f"kfac_stream: uncertainty contrast of the last snapshot: {len(held)} held-out "
                  f"and {' + '.join(f'{len(w)} {n}' for n, w in ood.items())} out-of-domain "
                  f"windows x {r.positions} positions ({n_pos} linearised-Laplace predictives "
                  f"of the top-{r.top_k} logits; report.enabled=false skips it)", flush=True)
            t0 = time.perf_counter()
            post = LaplacePosterior(model, snap, prior_precision=r.prior_precision)
            # a bar like the Trainer's: shown unless trainer.disable_tqdm
            show = not cfg.trainer.disable_tqdm
            cons = uncertainty_contrasts(post, held, ood, r.positions, r.top_k, show)
            result["contrast"] = {}
            for name, con in cons.items():
                lines += ["", f"[out-of-domain: {name}]"] + con.lines()
                result["contrast"][name] = {
                    "variance_in": float(con.variance["in"].mean()),
                    "variance_out": float(con.variance["out"].mean()),
                    "entropy_in": float(con.entropy["in"].mean()),
                    "entropy_out": float(con.entropy["out"].mean()),
                    "auroc_variance": con.auroc("variance"),
                    "auroc_entropy": con.auroc("entropy")}
            lines += ["", f"uncertainty contrast: {time.perf_counter() - t0:.1f} s"]
    lines += [f"trained model: {model_dir} (kfac-stream query --snapshot {snap.path} --model "
              f"{model_dir}{' --byte-level' if cfg.model.kind == 'tiny' else ''} --text ...)",
              "=" * 78]
    print("\n".join(lines), flush=True)
    result["report"] = "\n".join(lines)
    return result
