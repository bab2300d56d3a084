"""The offline corpus: Python source of the standard library and the installed packages.

Files are deduplicated by content, then split into train and held-out by *package* (the first
path component under its root: `json/`, `torch/`, a single-module name), so no package, and no
file, is on both sides. The split is a hash of the package name: stable across machines that
have the package, independent of which other packages are installed.
"""

from __future__ import annotations

import hashlib
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MAX_FILE_BYTES = 200_000   # larger .py files are mostly generated tables
HELDOUT_PERCENT = 8        # of packages (by hash), not of bytes


@dataclass
class SourceFile:
    root: str      # which search root it came from (for the manifest)
    package: str   # the split unit
    path: str
    text: str


def search_roots() -> list[Path]:
    """The stdlib and every site-packages directory of this interpreter, deduplicated."""
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
             *site.getsitepackages(), *[p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]]
    seen, out = set(), []
    for r in roots:
        p = Path(r).resolve()
        if p.is_dir() and p not in seen:
            seen.add(p)
            out.append(p)
    return out


def package_of(root: Path, path: Path) -> str:
    first = path.relative_to(root).parts[0]
    return first[:-3] if first.endswith(".py") else first


def is_heldout(package: str) -> bool:
    digest = hashlib.sha256(package.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT


def collect(max_bytes: int, roots: list[Path] | None = None) -> list[SourceFile]:
    """Up to `max_bytes` of unique .py files, in a stable order (root, then path).

    A site-packages directory nested in the stdlib's tree (lib/python3.x/site-packages) is walked
    once, as its own root, so its packages are not all one "site-packages" package."""
    roots = search_roots() if roots is None else roots
    seen_hashes: set[bytes] = set()
    out: list[SourceFile] = []
    total = 0
    for root in roots:
        nested = [r for r in roots if r != root and root in r.parents]
        for path in sorted(root.rglob("*.py")):
            if any(n in path.parents for n in nested) or not path.is_file():
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if not data or len(data) > MAX_FILE_BYTES:
                continue
            h = hashlib.sha256(data).digest()
            if h in seen_hashes:
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            seen_hashes.add(h)
            out.append(SourceFile(str(root), package_of(root, path), str(path), text))
            total += len(data)
            if total >= max_bytes:
                return out
    return out


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_heldout(f.package)]
    heldout = [f for f in files if is_heldout(f.package)]
    return train, heldout
