"""Device names: "cpu", "cuda" (the first GPU) and "cuda:N" (the N-th GPU of ggml's device registry,
CUDA0, CUDA1, ...). Python checks the spelling; whether that GPU exists is the engine's to say
(its error names the index and how many GPUs this build and machine have)."""

from __future__ import annotations

import math
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


# --- one model over several devices (a layer split) -------------------------------------------
SPLIT_MODES = ("layer",)


def _canonical(device: str) -> str:
    """The device a name means: "cuda" is "cuda:0"."""
    return "cuda:0" if device == "cuda" else device


def parse_layer_split(devices: object, split: object = None, tensor_split: object = None,
                      device: object = None) -> tuple[list[str], list[float]] | None:
    """Model's `devices`, `split` and `tensor_split` checked: None without devices, else the device
    names (in the order given) and the shares (empty: by each device's free memory, llama.cpp's
    default without -ts). ValueError / TypeError naming the parameter for anything else.

    `devices` is a list of device names ("cpu", "cuda", "cuda:N"; a string "cuda:0,cpu" works too),
    each once, every one present in this build and machine; "rpc:HOST:PORT" is the first device of
    ggml's RPC server there (`rpc-server` of the same ggml, or deltaspec._core.start_rpc_server); `split` is "layer" (llama.cpp's
    `-sm layer`: whole layers per device; the default) and nothing else; `tensor_split` has one
    number >= 0 per device, not all 0 (llama.cpp's `-ts`); `device` must not be given as well."""
    if devices is None:
        for name, value in (("split", split), ("tensor_split", tensor_split)):
            if value is not None:
                raise ValueError(f"{name}={value!r} needs devices=[...] (the devices to split the model over)")
        return None
    if device is not None:
        raise ValueError(f"pass device= (one device) or devices= (a layer split over several), not both: "
                         f"device={device!r}, devices={devices!r}")
    if isinstance(devices, str):
        devices = [d.strip() for d in devices.split(",")]
    if not isinstance(devices, (list, tuple)) or not devices:
        raise TypeError(f"devices must be a non-empty list of device names ('cpu', 'cuda', 'cuda:N'), got {devices!r}")
    seen: dict[str, str] = {}
    for i, d in enumerate(devices):
        if not (isinstance(d, str) and d.startswith("rpc:")):
            device_kind(d, f"devices[{i}]")
        elif not _RPC.fullmatch(d):
            raise ValueError(f"devices[{i}] must be 'rpc:HOST:PORT' for an RPC device, got {d!r}")
        if _canonical(d) in seen:
            raise ValueError(f"devices: {d!r} names the same device as {seen[_canonical(d)]!r} listed before it; "
                             "list each device once")
        seen[_canonical(d)] = d
    from . import _core

    for i, d in enumerate(devices):
        if d.startswith("rpc:"):
            _check_rpc(d, f"devices[{i}]")
        elif not _core.has_device(d):
            raise ValueError(f"devices[{i}]={d!r} is not available here: this build of deltaspec or this machine "
                             f"has no such device (a CPU-only build has only 'cpu')")
    if split is None:
        split = "layer"
    if split not in SPLIT_MODES:
        raise ValueError(f"split={split!r} is not supported: only 'layer' (llama.cpp's -sm layer: whole layers, "
                         f"with their weights, KV cache and recurrent state, per device)")
    if tensor_split is None:
        return list(devices), []
    return list(devices), parse_shares(tensor_split, len(devices))


def parse_shares(tensor_split: object, n_devices: int | None = None) -> list[float]:
    """tensor_split (a list of numbers, or "3,1") checked: one finite number >= 0 per device (when
    n_devices is given), not all 0. ValueError / TypeError naming tensor_split otherwise."""
    if isinstance(tensor_split, str):
        tensor_split = [s.strip() for s in tensor_split.split(",")]
    if not isinstance(tensor_split, (list, tuple)) or not tensor_split:
        raise TypeError(f"tensor_split must be a list of numbers, one per device, got {tensor_split!r}")
    if n_devices is not None and len(tensor_split) != n_devices:
        raise ValueError(f"tensor_split has {len(tensor_split)} entries but devices has {n_devices}: "
                         "one share per device")
    shares = []
    for i, x in enumerate(tensor_split):
        try:
            if isinstance(x, bool):
                raise ValueError
            v = float(x)
        except (TypeError, ValueError):
            raise ValueError(f"tensor_split[{i}] must be a number, got {x!r}") from None
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"tensor_split[{i}] must be a finite number >= 0, got {x!r}")
        shares.append(v)
    if sum(shares) <= 0:
        raise ValueError(f"tensor_split must have an entry > 0, got {list(tensor_split)!r}")
    return shares


_RPC = re.compile(r"rpc:[A-Za-z0-9.\-]+:[0-9]{1,5}")


def _check_rpc(device: str, what: str) -> None:
    """An RPC device's server must answer before ggml connects (ggml aborts the process when it does not)."""
    import socket

    from . import _core

    if not _core.rpc_available():
        raise ValueError(f"{what}={device!r}: this build of deltaspec has no RPC backend")
    host, port = device[4:].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ValueError(f"{what}={device!r}: no RPC server answers at {host}:{port} ({e})") from None


def layer_devices(n_blocks: int, tensor_split: list[float]) -> list[int]:
    """The device index (into the split's devices) of blocks 0 .. n_blocks-1 and, last, of the
    output layer: llama.cpp's rule for `-sm layer -ts` with every layer offloaded (src/llama-model.cpp,
    llama_model_base::load_tensors: the split points are the cumulative shares over their sum, and
    layer il of n_blocks + 1 goes to the first device whose point exceeds il / (n_blocks + 1)).
    The engine's own function (csrc/layer_split.cpp), which places the weights."""
    from . import _core

    return list(_core.layer_devices(n_blocks, [float(x) for x in tensor_split]))


def split_arg(value: str) -> list[str]:
    """argparse `type=` for --devices: the names, or argparse's error naming the flag."""
    import argparse

    names = [d.strip() for d in value.split(",")]
    try:
        for d in names:
            device_kind(d)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("device must be", "each device must be")) from None
    return names


def add_split_arguments(p, devices_type=None, devices_note: str = "") -> None:
    """--devices, -sm and -ts, as `deltaspec run` and `deltaspec serve` take them (llama.cpp's -dev,
    -sm layer, -ts); devices_note ends --devices' help."""
    p.add_argument("--devices", default=None, type=devices_type, metavar="DEV,DEV,...",
                   help="one model over several devices (instead of --device), e.g. cuda:0,cpu: whole layers, with "
                        "their KV cache and recurrent state, per device (llama.cpp's -sm layer)" + devices_note)
    p.add_argument("-sm", "--split-mode", default=None, choices=list(SPLIT_MODES),
                   help="how --devices share the model: layer (the only mode; default with --devices)")
    p.add_argument("-ts", "--tensor-split", default=None, metavar="N,N,...",
                   help="--devices' shares of the layers, e.g. 3,1 (default: by each device's free memory)")


def split_from_flags(devices, split_mode, tensor_split, n_gpu_layers) -> tuple[list[str], list[float]] | None:
    """--devices / -sm / -ts / -ngl of the CLIs checked: None without --devices, else parse_layer_split's
    (devices, shares). ValueError naming the flag otherwise (each CLI raises it as its own error; the
    flags a CLI alone has, --device or --replicas beside --devices, it checks itself)."""
    if devices is None:
        for flag, value in (("-sm/--split-mode", split_mode), ("-ts/--tensor-split", tensor_split)):
            if value is not None:
                raise ValueError(f"{flag} needs --devices DEV,DEV,... (the devices to split the model over)")
        return None
    if n_gpu_layers not in (None, "auto", "all", "-1"):
        raise ValueError(f"-ngl/--n-gpu-layers {n_gpu_layers} with --devices: the split places every layer; "
                         "leave -ngl out")
    try:
        return parse_layer_split(devices, split_mode, tensor_split)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--devices / -ts / -sm: {e}") from None
