"""`kfac-stream` command line: ``inspect SNAPSHOT`` and ``demo``."""

from __future__ import annotations

import argparse
import os
import sys

from .exceptions import SnapshotError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kfac-stream", description="streaming K-FAC tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="per-layer table of a snapshot (or the newest in a dir)")
    ins.add_argument("path")
    sub.add_parser("demo", help="train a small GPT-2 on local text with the callback",
                   add_help=False)
    args, rest = p.parse_known_args(argv)
    if args.cmd == "demo":
        from .demo import main as demo_main

        demo_main(rest)
        return 0
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    from .report import layer_table
    from .snapshot.snapshot import Snapshot

    try:
        is_step_dir = os.path.isfile(os.path.join(args.path, "manifest.json"))
        snap = Snapshot.load(args.path) if is_step_dir else Snapshot.latest(args.path)
    except SnapshotError as e:
        print(f"kfac-stream: {e}", file=sys.stderr)
        return 2
    print(layer_table(snap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
