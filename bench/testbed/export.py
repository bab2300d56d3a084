"""Write the testbed's files from the trained HF folders (OUT/hf/{target,draft,dflash}):

  target.gguf  qwen35 target with its MTP layer, deltaspec's converter (which keeps MTP, as llama.cpp's does)
  draft.gguf   qwen35 2-layer draft model, deltaspec's converter
  dflash.gguf  DFlash drafter, deltaspec's converter (byte-identical to llama.cpp's: test_testbed.py)
  mtp.gguf     the target's MTP head alone (`--mtp`: blk.{n_layer}.nextn.* + embedding + final
               norm), llama.cpp's converter (an MTP-only file, for llama.cpp)
  hf_target.tar, hf_drafters.tar   the HF folders (f16) the torch reference loads
  manifest.json  sizes, sha256, losses, seed, times (training.json merged in)

    python bench/testbed/export.py --out /tmp/testbed [--llama-cpp DIR] [--returned DIR]

With --returned DIR the files the GPU machine can hand back (at most 6, each at most 15 MB: the
manifest, target.gguf, draft.gguf, dflash.gguf and the two tars) are copied there. When a later
call finds /tmp lost, `--rebuild DIR` needs only the manifest and the two tars (what fits the 64 MiB
a call can carry beside the ggml source): it unpacks them and converts every GGUF again; the
converters are deterministic, and every sha256 is checked against the manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RETURNED = ("manifest.json", "target.gguf", "draft.gguf", "dflash.gguf", "hf_target.tar", "hf_drafters.tar")
MAX_RETURNED_BYTES = 15 * 1024 * 1024


def default_llama_cpp() -> Path:
    for p in (REPO / ".deps/gpu-src/llama.cpp", REPO / ".deps/llama_cpp_python-0.3.36/vendor/llama.cpp"):
        if (p / "convert_hf_to_gguf.py").is_file():
            return p
    raise FileNotFoundError("no pinned llama.cpp tree under .deps/ (needed for its convert_hf_to_gguf.py)")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def llama_convert(llama_dir: Path, args: list[str]) -> None:
    r = subprocess.run([sys.executable, str(HERE / "llama_convert.py"), str(llama_dir), *args],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp convert_hf_to_gguf.py {' '.join(args)} failed:\n{r.stderr[-3000:]}")


def convert_all(out: Path, llama_dir: Path) -> dict[str, float]:
    from deltaspec.convert import convert_hf_to_gguf
    from deltaspec.convert_dflash import convert_dflash_to_gguf
    hf = out / "hf"
    times = {}
    for name in ("target", "draft"):
        t = time.time()
        convert_hf_to_gguf(hf / name, out / f"{name}.gguf", "f16")
        times[f"convert_{name}_s"] = round(time.time() - t, 1)
    t = time.time()
    convert_dflash_to_gguf(hf / "dflash", out / "dflash.gguf", hf / "target", "f16")
    times["convert_dflash_s"] = round(time.time() - t, 1)
    t = time.time()
    llama_convert(llama_dir, [str(hf / "target"), "--mtp", "--outtype", "f16", "--outfile", str(out / "mtp.gguf")])
    times["convert_llama_cpp_s"] = round(time.time() - t, 1)
    return times


def write_tars(out: Path) -> None:
    # fixed member order and metadata: the same folders give the same bytes (and sha256)
    def add(tar, folder: Path):
        for p in sorted(folder.rglob("*")):
            info = tar.gettarinfo(str(p), arcname=str(p.relative_to(out)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(p, "rb") as f:
                tar.addfile(info, f)
    with tarfile.open(out / "hf_target.tar", "w") as tar:
        add(tar, out / "hf/target")
    with tarfile.open(out / "hf_drafters.tar", "w") as tar:
        add(tar, out / "hf/draft")
        add(tar, out / "hf/dflash")


def unpack(src: Path, out: Path) -> None:
    """Lay the manifest and the HF folders of an earlier call out in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("manifest.json", "hf_target.tar", "hf_drafters.tar"):
        if (src / name).resolve() != (out / name).resolve():
            shutil.copy(src / name, out / name)
    for tar_name in ("hf_target.tar", "hf_drafters.tar"):
        with tarfile.open(out / tar_name) as tar:
            tar.extractall(out, filter="data")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--llama-cpp", type=Path, default=None)
    ap.add_argument("--returned", type=Path, default=None, help="copy the returnable files here")
    ap.add_argument("--rebuild", type=Path, default=None,
                    help="a folder with an earlier call's returned files: unpack them into --out, rebuild "
                         "mtp.gguf and check every sha256 against the manifest")
    args = ap.parse_args(argv)
    llama_dir = args.llama_cpp or default_llama_cpp()
    out = args.out
    if args.rebuild is not None:
        unpack(args.rebuild, out)
        manifest = json.loads((out / "manifest.json").read_text())
        convert_all(out, llama_dir)
        for name, entry in manifest["files"].items():
            got = sha256(out / name)
            if got != entry["sha256"]:
                raise RuntimeError(f"{out / name}: sha256 {got} differs from the manifest's {entry['sha256']}")
        print(f"rebuilt {out} from {args.rebuild}: every sha256 matches the manifest")
        return manifest
    times = convert_all(out, llama_dir)
    write_tars(out)
    training = json.loads((out / "training.json").read_text())
    files = {}
    for name in ("target.gguf", "draft.gguf", "dflash.gguf", "mtp.gguf", "hf_target.tar", "hf_drafters.tar"):
        files[name] = {"bytes": (out / name).stat().st_size, "sha256": sha256(out / name),
                       "returned": name in RETURNED}
    manifest = {
        "what": "deltaspec testbed: a Qwen3.5-architecture target trained on offline Python source, and "
                "drafters trained against it (bench/testbed/)",
        "seed": training["seed"], "shapes": training["shapes"],
        "losses": {
            "target_train_ce": training["target"]["train_loss"],
            "target_heldout_ce": training["heldout"]["target_ce"],
            "drafters_train_soft_ce": training["drafters"]["train_loss"],
            "drafters_heldout": {k: v for k, v in training["heldout"].items() if k != "target_ce"},
        },
        "training": training, "export_times": times, "files": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for name in RETURNED:
        size = (out / name).stat().st_size
        if size > MAX_RETURNED_BYTES:
            raise RuntimeError(f"{out / name} is {size} bytes, more than the {MAX_RETURNED_BYTES} the GPU machine returns")
    if args.returned is not None:
        args.returned.mkdir(parents=True, exist_ok=True)
        for name in RETURNED:
            shutil.copy(out / name, args.returned / name)
    for name, f in files.items():
        print(f"{name:16s} {f['bytes']:>10d} B  sha256 {f['sha256'][:16]}")
    return manifest


if __name__ == "__main__":
    main()
