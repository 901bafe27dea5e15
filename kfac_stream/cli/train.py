"""``kfac-stream train``: the Hydra training app (`kfac_stream.train`), which parses its own
command line."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def add_train_parser(sub) -> None:
    """``train`` in ``kfac-stream --help`` (its arguments are Hydra's: `run_train`)."""
    sub.add_parser("train", help="the Hydra training app (kfac_stream.train): "
                   "kfac-stream train [-cd DIR] [-cn NAME] key=value ... (configs shipped in "
                   "conf/; --help: Hydra's help)", add_help=False)


def run_train(argv: Sequence[str], leading: Sequence[str] = ()) -> int:
    """The training app on ``argv`` (``train ...`` or ``demo ...``): Hydra reads ``sys.argv``,
    set to the command's name, the ``leading`` flags, then the user's flags and overrides."""
    from ..train import cli_main as train_main

    sys.argv = [f"kfac-stream {argv[0]}", *leading, *argv[1:]]
    train_main()
    return 0
