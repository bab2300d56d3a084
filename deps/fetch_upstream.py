"""Fetch the pinned llama-cpp-python source distribution and extract it.

The archive holds ggml (our dependency), llama.cpp (our peer for parity and speed) and its
reference converter. It is obtained with ``pip download`` (so whatever index pip is configured
for is used; no host name lives here), checked against the sha256 recorded next to this file,
and extracted into ``DEST``. Nothing from it is ever committed.

Usage: python deps/fetch_upstream.py DEST   -> prints the path of the extracted llama.cpp tree
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
HERE = pathlib.Path(__file__).resolve().parent
SHA_FILE = HERE / f"{PACKAGE}-{VERSION}.sha256"


def expected_sha256() -> tuple[str, str]:
    digest, name = SHA_FILE.read_text().split()
    return digest, name


def sha256_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(archive_dir: pathlib.Path) -> pathlib.Path:
    # --no-binary only for the package itself: with ':all:' pip would also build the sdist's
    # build requirements (cmake, ...) from source just to read its metadata, which takes minutes.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
           f"{PACKAGE}=={VERSION}", "-d", str(archive_dir)]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return archive_dir / expected_sha256()[1]


def fetch(dest: pathlib.Path) -> pathlib.Path:
    """Return the extracted ``vendor/llama.cpp`` tree under ``dest``, fetching it if needed."""
    tree = dest / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    stamp = dest / f"llama_cpp_python-{VERSION}.verified"
    digest, name = expected_sha256()
    if stamp.exists() and stamp.read_text().strip() == digest and tree.is_dir():
        return tree
    dest.mkdir(parents=True, exist_ok=True)
    cached = dest / name
    if not cached.exists():
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            got = download(pathlib.Path(tmp))
            got.replace(cached)
    actual = sha256_of(cached)
    if actual != digest:
        cached.unlink()
        raise SystemExit(f"{name}: sha256 {actual} does not match the recorded {digest} ({SHA_FILE})")
    extract(cached, dest)
    stamp.write_text(digest + "\n")
    return tree


def extract(archive: pathlib.Path, dest: pathlib.Path) -> None:
    """Extract ``archive`` into ``dest``, refusing any member that is not a plain file or folder
    inside ``dest``. tarfile's "data" filter does that from Python 3.10.12 / 3.11.4 on; earlier
    3.10 releases (which pyproject allows) get the same checks from ``_checked_members``."""
    with tarfile.open(archive) as tar:
        if not hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=_checked_members(tar, dest))
            return
        try:
            tar.extractall(dest, filter="data")
        except tarfile.FilterError as e:
            raise SystemExit(f"{archive}: refusing to extract it: {e}") from None


def _checked_members(tar: tarfile.TarFile, dest: pathlib.Path) -> list[tarfile.TarInfo]:
    """Every member, checked before anything is written, with the data filter's metadata rules:
    owned by whoever extracts, no setuid/setgid/sticky bits, no group or world write."""
    root = dest.resolve()
    members = tar.getmembers()
    for m in members:
        target = (root / m.name).resolve()
        if not (m.isfile() or m.isdir()) or (target != root and root not in target.parents):
            raise SystemExit(f"{tar.name}: refusing to extract it: member {m.name!r} is not a plain file "
                             f"or folder inside {root}")
        m.mode = (m.mode & 0o755) | (0o700 if m.isdir() else 0o600)
        m.uid, m.gid, m.uname, m.gname = os.getuid(), os.getgid(), "", ""
    return members


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(fetch(pathlib.Path(sys.argv[1]).resolve()))
