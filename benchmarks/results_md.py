"""Write one script's section of ``benchmarks/RESULTS.md`` between its markers."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
TITLE = "# Benchmarks\n"


def write_section(begin: str, end: str, section: str, path: Path = RESULTS,
                  top: bool = False) -> None:
    """Replace the text from ``begin`` to ``end`` (markers included in ``section``), or, when the
    markers are not there yet, append ``section`` (``top``: put it right under the title)."""
    old = path.read_text() if path.exists() else TITLE
    if begin in old and end in old:
        new = old[:old.index(begin)] + section + old[old.index(end) + len(end):]
    elif top and old.startswith(TITLE):
        new = TITLE + "\n" + section + "\n\n" + old[len(TITLE):].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(new)
