"""Write one script's section of ``benchmarks/RESULTS.md`` between its markers."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(begin: str, end: str, section: str, path: Path = RESULTS) -> None:
    """Replace the text from ``begin`` to ``end`` (markers included in ``section``) or append
    ``section`` when the markers are not there yet."""
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    new = (old[:old.index(begin)] + section + old[old.index(end) + len(end):]
           if begin in old and end in old else old.rstrip("\n") + "\n\n" + section + "\n")
    path.write_text(new)
