"""Write a file under a temporary name and rename it into place only once it is complete, so an
interrupted conversion never leaves a truncated GGUF where a good one is expected."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import gguf


@contextmanager
def gguf_written_to(out: Path, writer: gguf.GGUFWriter) -> Iterator[Path]:
    """Yields the temporary path for `writer` to write; closes the writer, then renames the file
    to `out` on success or removes it on any failure."""
    tmp = out.with_name(out.name + ".part")
    try:
        yield tmp
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
