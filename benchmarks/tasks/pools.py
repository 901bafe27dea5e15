"""Item pools of the suite's tasks: fixed-length byte windows of text files on this machine
(standard-library source, license texts, pydoc, ten kinds of file) and their balanced, disjoint
train / val / test splits. Nothing is downloaded."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from kfac_stream.app import data as app_data


def windows(text: bytes, n: int) -> list[bytes]:
    """Non-overlapping ``n``-byte windows of ``text`` that are not mostly whitespace and hold no
    byte 0 (the classifiers' padding token)."""
    out = []
    for i in range(0, len(text) - n + 1, n):
        w = text[i:i + n]
        if 0 not in w and len(w.split()) >= 3:
            out.append(w)
    return out


def source_pool(packages: tuple[str, ...], n: int) -> list[bytes]:
    """``n``-byte windows of the ``.py`` files of stdlib ``packages`` (test folders left out),
    files in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[bytes] = []
    for package in packages:
        path = root / package
        files = sorted(path.rglob("*.py")) if path.is_dir() else [root / f"{package}.py"]
        for f in files:
            if any(p.startswith("test") for p in f.relative_to(root).parts[:-1]):
                continue
            out += windows(f.read_bytes(), n)
    return out


def license_pool(name: str, n: int, root: str = "/usr/share/common-licenses") -> list[bytes]:
    """``n``-byte windows of one license text, whitespace collapsed."""
    text = b" ".join(Path(root, name).read_bytes().split())
    return windows(text, n)


def split_pools(pools: list[list], sizes: tuple[int, int, int], seed: int
                ) -> dict[str, list[tuple]]:
    """``{"train" | "val" | "test": [(item, class)]}``: per class ``sizes`` items drawn without
    replacement (shuffled with ``seed``), so the three sets are disjoint and balanced."""
    rng = random.Random(seed)
    out: dict[str, list[tuple]] = {"train": [], "val": [], "test": []}
    need = sum(sizes)
    for c, pool in enumerate(pools):
        if len(pool) < need:
            raise SystemExit(f"class {c}: {len(pool)} items, {need} needed")
        items = rng.sample(pool, need)
        a, b = sizes[0], sizes[0] + sizes[1]
        out["train"] += [(x, c) for x in items[:a]]
        out["val"] += [(x, c) for x in items[a:b]]
        out["test"] += [(x, c) for x in items[b:]]
    for v in out.values():
        rng.shuffle(v)
    return out


def file_windows(files, n: int = 64, cap: int = 4000) -> list[bytes]:
    """``n``-byte windows (whitespace collapsed per file) of ``files`` in sorted order, until
    more than ``cap`` are gathered; unreadable files are skipped."""
    out: list[bytes] = []
    for f in sorted(files):
        try:
            text = b" ".join(Path(f).read_bytes().split())
        except OSError:
            continue
        out += windows(text, n)
        if len(out) > cap:
            break
    return out


def sh_scripts(root: str = "/usr/bin") -> list[Path]:
    out = []
    for p in Path(root).iterdir():
        try:
            if p.is_file() and p.open("rb").read(9) == b"#!/bin/sh":
                out.append(p)
        except OSError:
            continue
    return out


def file_kind_pools(n: int = 64) -> list[list[bytes]]:
    """``n``-byte windows of 10 kinds of text file a Debian machine with Python holds: Python
    source (asyncio), C headers, license texts, pydoc text, Perl modules, ``/bin/sh``
    scripts, JSON, CSS, glibc locale definitions, HTML documentation."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    pydoc = b" ".join(" ".join(app_data.pydoc_documents()[:300]).encode().split())
    return [file_windows((lib / "asyncio").glob("*.py"), n),
            file_windows(Path("/usr/include").glob("*.h"), n),
            file_windows([Path("/usr/share/common-licenses", x)
                           for x in ("GPL-3", "Apache-2.0", "MPL-2.0", "Artistic")], n),
            windows(pydoc, n)[:4000],
            file_windows(Path("/usr/share/perl5").rglob("*.pm"), n),
            file_windows(sh_scripts(), n),
            file_windows(lib.rglob("*.json"), n),
            file_windows(Path("/usr/share").rglob("*.css"), n),
            file_windows(Path("/usr/share/i18n/locales").glob("*"), n),
            file_windows(Path("/usr/share/doc").glob("*/*.html"), n)]
