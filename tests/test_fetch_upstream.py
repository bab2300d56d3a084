"""deps/fetch_upstream.py extracts safely on every Python deltaspec supports: with tarfile's "data"
filter where it exists (3.10.12+), with its own checks before that."""

import importlib.util
import io
import tarfile
from pathlib import Path

import pytest

FETCH = Path(__file__).resolve().parent.parent / "deps" / "fetch_upstream.py"


@pytest.fixture(scope="module")
def fetch_upstream():
    spec = importlib.util.spec_from_file_location("fetch_upstream", FETCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["data filter", "no data filter"])
def python(request, monkeypatch):
    """Run as this Python (if it has the filter) and as a 3.10 release before 3.10.12 (without)."""
    if request.param == "no data filter":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tarfile data filter")
    return request.param


def _archive(path: Path, *members: tarfile.TarInfo, data: bytes = b"ggml") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(data) if m.isfile() else None)
    return path


def _file(name: str, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode = 4, mode
    return info


def test_plain_files_are_extracted(fetch_upstream, python, tmp_path):
    folder = tarfile.TarInfo("pkg/vendor")
    folder.type, folder.mode = tarfile.DIRTYPE, 0o755
    archive = _archive(tmp_path / "a.tar.gz", folder, _file("pkg/vendor/ggml.h"), _file("pkg/run.sh", 0o4777))
    dest = tmp_path / "out"
    fetch_upstream.extract(archive, dest)
    assert (dest / "pkg/vendor/ggml.h").read_bytes() == b"ggml"
    mode = (dest / "pkg/run.sh").stat().st_mode
    assert mode & 0o7022 == 0, oct(mode)  # no setuid, no group/world write


@pytest.mark.parametrize("member", ["../escape.txt", "symlink"])
def test_members_outside_or_not_plain_are_refused(fetch_upstream, python, tmp_path, member):
    if member == "symlink":
        bad = tarfile.TarInfo("pkg/link")
        bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/passwd"
    else:
        bad = _file(member)
    archive = _archive(tmp_path / "a.tar.gz", _file("pkg/ok.txt"), bad)
    dest = tmp_path / "out"
    with pytest.raises(SystemExit, match="refusing to extract"):
        fetch_upstream.extract(archive, dest)
    assert not (tmp_path / "escape.txt").exists()
    if python == "no data filter":  # checked before anything is written
        assert not dest.exists() or not any(dest.rglob("*"))


def test_absolute_member_stays_inside(fetch_upstream, python, tmp_path):
    """The data filter strips the leading '/', the fallback refuses: either way nothing lands outside."""
    outside = tmp_path / "absolute.txt"
    archive = _archive(tmp_path / "a.tar.gz", _file(str(outside)))
    try:
        fetch_upstream.extract(archive, tmp_path / "out")
    except SystemExit as e:
        assert "refusing to extract" in str(e)
    assert not outside.exists()
