"""Device names: "cpu", "cuda" (the first GPU) and "cuda:N" (the N-th GPU of ggml's device registry,
CUDA0, CUDA1, ...). Python checks the spelling; whether that GPU exists is the engine's to say
(its error names the index and how many GPUs this build and machine have)."""

from __future__ import annotations

import re

DEVICE_KINDS = ("cpu", "cuda")
_CUDA = re.compile(r"cuda(:[0-9]+)?")


def device_kind(device: object, what: str = "device") -> str:
    """"cpu" or "cuda" for a valid device name; ValueError naming `what` and the value otherwise."""
    if device == "cpu":
        return "cpu"
    if isinstance(device, str) and _CUDA.fullmatch(device):
        return "cuda"
    raise ValueError(f"{what} must be 'cpu', 'cuda' or 'cuda:N' (N: a GPU index, 0 the first), got {device!r}")


def device_arg(value: str) -> str:
    """argparse `type=` for --device: the name as given, or argparse's error naming the flag."""
    import argparse

    try:
        device_kind(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("device must be", "must be")) from None
    return value
