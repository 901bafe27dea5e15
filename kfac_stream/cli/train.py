"""``kfac-stream train``: the Hydra training app (`kfac_stream.app.main`), which parses its own
command line."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .arguments import unknown_option_hints, unknown_options


def add_train_parser(sub) -> None:
    """``train`` in ``kfac-stream --help`` (its arguments are Hydra's: `run_train`)."""
    sub.add_parser("train", help="the Hydra training app (kfac_stream.app.main): "
                   "kfac-stream train [-cd DIR] [-cn NAME] key=value ... (configs shipped in "
                   "conf/; --help: Hydra's help)", add_help=False)


def run_train(argv: Sequence[str], leading: Sequence[str] = ()) -> int:
    """The training app on ``argv`` (``train ...`` or ``demo ...``): Hydra reads ``sys.argv``,
    set to the command's name, the ``leading`` flags, then the user's flags and overrides."""
    from ..app.main import cli_main as train_main

    sys.argv = [f"kfac-stream {argv[0]}", *leading, *argv[1:]]
    _check_hydra_flags(sys.argv[1:])
    train_main()
    return 0


def _check_hydra_flags(given: Sequence[str]) -> None:
    """A flag Hydra does not know (``--config-nme``): Hydra's usage and one error line with "did
    you mean" (`arguments.unknown_option_hints`), exit code 2, before Hydra starts. The
    ``--local_rank`` the deepspeed launcher appends is the training app's to take."""
    from hydra._internal.utils import get_args_parser  # what hydra.main parses with

    hydra = get_args_parser()  # its prog: sys.argv[0], "kfac-stream train"
    known = [s for action in hydra._actions for s in action.option_strings]
    flags = [a for a in given if not a.startswith("--local_rank")]
    unknown = unknown_options(known, flags)
    if unknown:
        hints = unknown_option_hints(hydra.prog, known, unknown, listed="an override is "
                                     "key=value, without dashes; kfac-stream train -h lists both")
        hydra.error(f"unrecognized arguments: {' '.join(unknown)} ({'; '.join(hints)})")
