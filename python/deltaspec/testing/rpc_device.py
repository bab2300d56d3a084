"""A second backend without a GPU: this process's CPU served as ggml RPC device "rpc:127.0.0.1:PORT"
(ggml's own RPC backend, deltaspec._core.start_rpc_server), so that a layer split between it and the
CPU runs with real copies between two backends (tests/test_layer_split.py)."""

from __future__ import annotations

import socket
import time

_device: str | None = None


def local_rpc_device(n_threads: int = 1) -> str:
    """The device name of this process's RPC server, started on a free port at the first call (it
    serves until the process ends). RuntimeError when this build has no RPC backend."""
    global _device
    if _device is not None:
        return _device
    from .. import _core

    if not _core.rpc_available():
        raise RuntimeError("this build of deltaspec has no RPC backend (a lent ggml without ggml-rpc)")
    with socket.socket() as s:  # a free port (ggml's server binds it right after)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _core.start_rpc_server(f"127.0.0.1:{port}", n_threads)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the RPC server on port {port} did not start") from None
            time.sleep(0.02)
    _device = f"rpc:127.0.0.1:{port}"
    return _device
