"""``kfac-stream inspect``: the per-layer table of a snapshot and its sampling and prior lines."""

from __future__ import annotations

from ..exceptions import QueryInputError
from .loading import first_line, load_snapshot


def add_inspect_parser(sub) -> None:
    """The ``inspect`` sub-command's arguments."""
    ins = sub.add_parser("inspect", help="per-layer table of a snapshot (or the newest in a dir)")
    ins.add_argument("path")
    ins.add_argument("--plot", metavar="PNG", help="also draw the eigenvalue spectra")


def run_inspect(args) -> int:
    from ..snapshot.adequacy import rel_se_verdict, sampling_summary, sampling_warning
    from ..snapshot.layer_table import layer_table

    snap = load_snapshot("path", args.path)
    print(layer_table(snap))
    s = sampling_summary(snap.manifest)
    if s["max_rel_se"] == s["max_rel_se"]:  # recorded (not NaN)
        window = (f"; final window: {s['window_sequences']:,} sequences (min_window_sequences="
                  f"{s['min_window_sequences']:,})" if s["window_sequences"] else "")
        print(f"sampling: largest relative standard error of a factor {rel_se_verdict(s)}, "
              f"factor {s['max_rel_se_factor']}, at least {s['min_effective_updates']:.3g} "
              f"effective updates{window}")
    few = sampling_warning("warning", snap.manifest)
    if few is not None:
        print(few)
    print(_prior_line(snap))
    if args.plot:
        from ..snapshot.media import plot_spectra

        try:
            png = plot_spectra(snap, args.plot)
        except (OSError, ValueError) as e:  # an unwritable path, an unknown image format
            raise QueryInputError(f"--plot={args.plot!r} could not be written ({first_line(e)}):"
                                  " must be a writable image path such as spectra.png") from None
        print(f"spectra: {png}")
    return 0


def _prior_line(snap) -> str:
    """``inspect``'s line on the prior precision a query of this snapshot uses by default:
    the stored held-out fit's verdict, or the rule without held-out data."""
    from ..query.prior_choice import NO_HELDOUT_LINK

    fit = snap.heldout_prior
    if fit is None:
        return ("prior precision: no held-out fit stored; queries use the rule without "
                f"held-out data (tau by marginal likelihood, {NO_HELDOUT_LINK} link)")
    return f"prior precision: {fit.verdict()} (queries use it by default)"
