"""The sub-commands' parser class: a misspelt option is reported under the sub-command's own
usage with the closest of its options ("did you mean --prior-precision?"); the same check of
the Hydra flags of ``train`` and ``demo`` (`cli.train`)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from ..exceptions import did_you_mean

#: A token argparse reads as a negative number (a value), not as an option.
NEGATIVE_NUMBER = re.compile(r"^-\.?\d")


class CommandParser(argparse.ArgumentParser):
    """A sub-command's parser (``kfac-stream query``, ``influence``, ``inspect``). Its errors
    (unrecognized arguments, a required option missing, an option without its value) print its
    own usage and one error line that names every option of the command line it does not have,
    with the closest of its own (`exceptions.did_you_mean`, matched without the dashes) or,
    when none is close, where its options are listed; exit code 2, as argparse's."""

    #: The arguments this parser was last given (argparse hands a sub-command its own).
    given: tuple[str, ...] = ()

    def parse_known_args(self, args=None, namespace=None):
        self.given = tuple(str(a) for a in (args or ()))
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        hints = unknown_option_hints(self.prog, self.option_strings(), self.given)
        super().error(f"{message} ({'; '.join(hints)})" if hints else message)

    def option_strings(self) -> list[str]:
        """Every option string of this parser (``-h``, ``--help``, ``--snapshot``, ...)."""
        return [s for action in self._actions for s in action.option_strings]


def unknown_options(known: list[str], given: Sequence[str]) -> list[str]:
    """The options in ``given`` (a command line's arguments, up to ``--``) that are not in
    ``known`` (a parser's option strings) nor a prefix of one of them (an abbreviation argparse
    accepts), each without its ``=value``."""
    found = []
    for token in given:
        if token == "--":  # what follows is positional
            break
        name = token.split("=", 1)[0]
        if not name.startswith("-") or name == "-" or NEGATIVE_NUMBER.match(name):
            continue  # a value or a positional argument
        if name in known or (name.startswith("--") and any(s.startswith(name) for s in known)):
            continue  # an option, or an abbreviation argparse accepts
        if not name.startswith("--") and any(name.startswith(s) for s in known
                                             if not s.startswith("--")):
            continue  # a short option with its value attached (-cnNAME)
        found.append(name)
    return found


def unknown_option_hints(prog: str, known: list[str], given: Sequence[str],
                         listed: str = "") -> list[str]:
    """For each of ``given``'s `unknown_options`, ``"--x: did you mean --y?"`` (the closest of
    ``known``, matched without the dashes) or, with no close match, that ``prog`` has no such
    option and where its options are listed (``listed``; default: ``prog -h``)."""
    plain = {s.lstrip("-"): s for s in known}
    hints = []
    for name in unknown_options(known, given):
        close = did_you_mean(name.lstrip("-"), plain, shown=plain.__getitem__)
        hints.append(f"{name}: {close}" if close else
                     f"no option {name} in {prog}: {listed or prog + ' -h lists its options'}")
    return hints
