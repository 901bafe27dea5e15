"""Task data of the classification benchmark (`uncertainty_classification.py`) that is not the
docstring task: *which section of the manual is this man page from?*, with out-of-distribution
text. Everything comes from files on this machine (nothing downloaded).

* In distribution: the English man pages in ``/usr/share/man/man<S>`` of the sections
  `SECTIONS` (1 user commands, 2 system calls, 5 file formats, 8 administration; the
  generated ``gcloud`` pages, 16,000 of man1's, left out: `SKIP_PREFIXES`). One example
  per page: its text from the ``DESCRIPTION`` heading on (troff requests and escapes removed by
  `troff_text`, whitespace collapsed), the first `SNIPPET_BYTES` UTF-8 bytes; pages whose text
  is shorter, ``.so`` redirects and snippets that occur twice are dropped. Per section the
  pages are visited in a fixed pseudo-random order (seed 0) until `POOL_PER_CLASS` examples
  are found: the pool is the same for every seed, the seed only splits it (`manpage_splits`).
* Out of distribution (`ood_snippets`), `SNIPPET_BYTES` bytes each: ``"man-de"``: the German
  man pages (``/usr/share/man/de``, any section, ``BESCHREIBUNG`` on: the same genre in another
  language); ``"pydoc"``: Python's reference documentation (``pydoc_data.topics``, English
  prose about another subject).
"""

from __future__ import annotations

import gzip
import random
import re
from pathlib import Path
from typing import Any

MAN_ROOT = Path("/usr/share/man")
SECTIONS = ("1", "2", "5", "8")
SECTION_NAMES = {"1": "user commands", "2": "system calls", "5": "file formats",
                 "8": "administration"}
SNIPPET_BYTES = 128
POOL_PER_CLASS = 200

_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)")
_NAMED = re.compile(r"\\\((..)|\\\[([^\]]*)\]")
_SIZE = re.compile(r"\\s[+-]?\d+")
_NAMED_CHARS = {"aq": "'", "dq": '"', "em": "--", "en": "-", "hy": "-", "bu": "*", "lq": '"',
                "rq": '"', "oq": "'", "cq": "'", "mi": "-", "ti": "~", "ha": "^", "rs": "\\",
                "co": "(c)", "tm": "(tm)", "ga": "`", "ua": "^", "da": "v", "<=": "<=",
                ">=": ">=", "->": "->", "<-": "<-", "mu": "x", "pl": "+", "eq": "=",
                ":a": "ä", ":o": "ö", ":u": "ü", ":A": "Ä", ":O": "Ö", ":U": "Ü", "ss": "ß",
                "'e": "é", "`e": "è", "'E": "É"}
#: generated page families that would make up most of a section (the Google Cloud SDK's
#: 16,000 ``gcloud`` pages in man1): left out
SKIP_PREFIXES = ("gcloud",)
#: requests whose arguments are text (font changes, paragraph tags)
_TEXT_REQUESTS = {"B", "I", "R", "BR", "RB", "BI", "IB", "IR", "RI", "SM", "SB", "IP", "TP",
                  "SS", "HP", "UR", "MT", "Nm", "Nd", "Ar", "Fl", "Dq", "Sq", "Em", "Pa"}


def troff_text(source: str) -> str:
    """Plain text of a man page's troff ``source``: comments and requests dropped (the text
    arguments of font and paragraph macros kept, quotes removed), escapes replaced by their
    character or removed, whitespace collapsed."""
    out = []
    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"", '\\"')):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].strip().split(None, 1)
            if not parts or parts[0] not in _TEXT_REQUESTS or len(parts) < 2:
                continue
            line = parts[1].replace('"', "")
        line = _FONT.sub("", line)
        line = _SIZE.sub("", line)
        line = _NAMED.sub(lambda m: _NAMED_CHARS.get(m.group(1) or m.group(2) or "", ""), line)
        line = (line.replace("\\-", "-").replace("\\&", "").replace("\\e", "\\")
                .replace("\\ ", " ").replace("\\~", " ").replace("\\|", "").replace("\\^", "")
                .replace("\\c", "").replace("\\%", "").replace("\\/", "").replace("\\,", ""))
        line = re.sub(r"\\.", "", line)
        out.append(line)
    return re.sub(r"\s+", " ", " ".join(out)).strip()


def page_snippet(path: Path, headings: tuple[str, ...] = ("DESCRIPTION",),
                 nbytes: int = SNIPPET_BYTES) -> bytes | None:
    """The first ``nbytes`` bytes of a page's text from its first heading in ``headings`` on
    (`troff_text`), or None (unreadable, a ``.so`` redirect, no such heading, too short)."""
    try:
        raw = gzip.open(path, "rt", encoding="utf-8", errors="replace").read() \
            if path.suffix == ".gz" else path.read_text(encoding="utf-8", errors="replace")
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if raw.lstrip().startswith(".so "):
        return None
    lines = raw.splitlines()
    start = None
    for i, line in enumerate(lines):
        if line.startswith((".SH", ".Sh")):
            title = line[3:].strip().strip('"').upper()
            if title in headings:
                start = i + 1
                break
    if start is None:
        return None
    text = troff_text("\n".join(lines[start:])).encode("utf-8")
    if len(text) < nbytes:
        return None
    return text[:nbytes]


def _pages(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and not p.is_symlink()
                  and not p.name.startswith(SKIP_PREFIXES))


def section_pool(section: str, n: int = POOL_PER_CLASS, root: Path = MAN_ROOT) -> list[bytes]:
    """Up to ``n`` distinct snippets of the English pages of ``section``, pages visited in a
    fixed pseudo-random order (seed 0)."""
    pages = _pages(root / f"man{section}")
    random.Random(0).shuffle(pages)
    out: list[bytes] = []
    seen: set[bytes] = set()
    for p in pages:
        s = page_snippet(p)
        if s is not None and s not in seen:
            seen.add(s)
            out.append(s)
            if len(out) == n:
                break
    return out


def manpage_splits(train_per_class: int, val_per_class: int, test_per_class: int,
                   seed: int = 0, pools: dict[str, list[bytes]] | None = None
                   ) -> dict[str, list[tuple[bytes, int]]]:
    """``{"train"|"val"|"test": [(snippet bytes, class index)]}``: balanced, disjoint, the
    class index is the position of the page's section in `SECTIONS`; ``seed`` shuffles each
    class's pool (`section_pool`, or ``pools``) before the cut and each split after it.
    Snippets found in more than one section are dropped."""
    pools = pools if pools is not None else {s: section_pool(s) for s in SECTIONS}
    count: dict[bytes, int] = {}
    for snippets in pools.values():
        for s in set(snippets):
            count[s] = count.get(s, 0) + 1
    return balanced_splits({f"man{sec}": pool for sec, pool in pools.items()}, count,
                           (train_per_class, val_per_class, test_per_class),
                           random.Random(seed), "usable pages")


def balanced_splits(pools: dict[str, list], count: dict, per_class: tuple[int, int, int],
                    rng: random.Random, what: str) -> dict[str, list[tuple[Any, int]]]:
    """``{"train"|"val"|"test": [(item, class index)]}`` from one pool per class (the class
    index is the pool's position in ``pools``): the items counted once in ``count`` (others
    occur in several pools, or twice), shuffled with ``rng``, cut into ``per_class`` =
    (train, val, test) items per class; each split shuffled after. ``what`` names the items in
    the error when a pool is too small."""
    train, val, _ = per_class
    need = sum(per_class)
    splits: dict[str, list[tuple[Any, int]]] = {"train": [], "val": [], "test": []}
    for c, key in enumerate(pools):
        unique = [s for s in pools[key] if count[s] == 1]
        if len(unique) < need:
            raise SystemExit(f"{key}: {len(unique)} {what}, {need} needed")
        rng.shuffle(unique)
        cuts = (0, train, train + val, need)
        for name, lo, hi in zip(splits, cuts[:-1], cuts[1:], strict=True):
            splits[name] += [(s, c) for s in unique[lo:hi]]
    for v in splits.values():
        rng.shuffle(v)
    return splits


def text_windows(text: str, n: int, seed: int, nbytes: int = SNIPPET_BYTES) -> list[bytes]:
    """``n`` distinct ``nbytes`` windows of ``text`` (whitespace collapsed, UTF-8) starting at
    positions drawn with ``seed``."""
    data = re.sub(r"\s+", " ", text).encode("utf-8")
    if len(data) < nbytes + n:
        raise SystemExit(f"text of {len(data)} bytes is too short for {n} windows")
    starts = sorted(random.Random(seed).sample(range(len(data) - nbytes), n))
    return [data[s:s + nbytes] for s in starts]


def ood_snippets(n: int, seed: int = 0, root: Path = MAN_ROOT) -> dict[str, list[bytes]]:
    """``{"man-de": [...], "pydoc": [...]}``, ``n`` snippets each (`SNIPPET_BYTES` bytes);
    ``"man-de"`` is left out when the machine has fewer than ``n`` usable German pages."""
    from pydoc_data.topics import topics

    out = {}
    de = [p for d in sorted((root / "de").glob("man*")) for p in _pages(d)]
    random.Random(seed).shuffle(de)
    snippets: list[bytes] = []
    for p in de:
        s = page_snippet(p, ("BESCHREIBUNG",))
        if s is not None and s not in snippets:
            snippets.append(s)
            if len(snippets) == n:
                break
    if len(snippets) == n:
        out["man-de"] = snippets
    out["pydoc"] = text_windows("\n".join(topics[k] for k in sorted(topics)), n, seed)
    return out
