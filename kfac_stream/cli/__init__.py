"""`kfac-stream` command line: ``train`` (Hydra app), ``inspect``, ``query``, ``influence``
and ``demo``.

One module per sub-command (`train`, `demo`, `inspect`, `query` with `classify` for a sequence
classifier, `influence` with `influence_data`), the loading of snapshots, models and
tokenizers they share (`loading`), their data pipeline (`data`: inputs read, tokenised, padded)
and what they print (`output`)."""

from __future__ import annotations

import argparse
import sys

from ..exceptions import KFACStreamError
from .arguments import CommandParser
from .demo import add_demo_parser, run_demo
from .influence import add_influence_parser, run_influence
from .inspect import add_inspect_parser, run_inspect
from .output import INFLUENCE_EXPLAINED, SELF_INFLUENCE_EXPLAINED, TEXT_WIDTH
from .query import add_query_parser, run_query
from .train import add_train_parser, run_train

__all__ = ["INFLUENCE_EXPLAINED", "SELF_INFLUENCE_EXPLAINED", "TEXT_WIDTH", "build_parser",
           "main"]


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, CommandParser]]:
    """The ``kfac-stream`` parser and its sub-commands' parsers by name (each a
    `CommandParser`: its own usage and "did you mean" on an unknown option)."""
    p = argparse.ArgumentParser(prog="kfac-stream", description="streaming K-FAC tools")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=CommandParser)
    add_inspect_parser(sub)
    add_query_parser(sub)
    add_influence_parser(sub)
    add_demo_parser(sub)
    add_train_parser(sub)
    return p, sub.choices


def main(argv: list[str] | None = None) -> int:
    p, commands = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("train", "demo"):  # Hydra parses its own command line
        return run_demo(argv) if argv[0] == "demo" else run_train(argv)
    args, rest = p.parse_known_args(argv)
    if rest:  # the sub-command's usage, with "did you mean" for a misspelt option
        commands[args.cmd].error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.cmd == "influence":
            return run_influence(args)
        return run_inspect(args) if args.cmd == "inspect" else run_query(args)
    except KFACStreamError as e:  # a user error: one line, no traceback (exit code 2)
        print(f"kfac-stream {args.cmd}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
