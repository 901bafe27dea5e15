"""``kfac-stream demo``: ``kfac-stream train`` with its offline defaults into out/demo."""

from __future__ import annotations

from collections.abc import Sequence

from .train import run_train

#: The shipped conf/demo.yaml (config.yaml into out/demo), as a leading flag, so the user's own
#: flags and overrides follow in any order Hydra accepts.
DEMO_FLAGS = ("--config-name", "demo")


def add_demo_parser(sub) -> None:
    """``demo`` in ``kfac-stream --help`` (its arguments are Hydra's: `run_demo`)."""
    sub.add_parser("demo", help="kfac-stream train with its offline defaults into out/demo "
                   "(= kfac-stream train --config-name demo)", add_help=False)


def run_demo(argv: Sequence[str]) -> int:
    """``kfac-stream demo ...``: the training app with `DEMO_FLAGS` first."""
    return run_train(argv, DEMO_FLAGS)
