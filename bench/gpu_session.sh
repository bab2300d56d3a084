#!/usr/bin/env bash
# Everything the H200 machine does in one call (it has no network and starts bare):
#   1. build llama.cpp (CUDA, sm_90a) from the carried pinned tree: llama-bench + its shared ggml,
#      whose ggml-cuda also carries deltaspec's kernels, switched off (llama.cpp runs ggml's own)
#   2. build deltaspec against that ggml (one ggml-cuda compile serves both); it switches ours on
#   3. GPU parity tests (CUDA vs CPU on the tiny models)
#   4. a shape-faithful synthetic 27B Q4_K_M GGUF, then deltaspec and llama-bench on it, same run
#   5. verify: what verifying a draft chain and rolling back cost next to a decode step (27B)
#   6. profile: GPU time per kernel group of one decode step and one 17-token verify (Nsight Compute)
#   kernels: deltaspec's CUDA kernels alone (bench/kernels/kernels_bench.py): compiled while the
#   builds run, timed after them (timed during a 16-job build, its small launches came out
#   host-bound: 30 us for an 11 us mat-vec)
#   build-ours / bench-ours: deltaspec alone (its own ggml-cuda compile, no llama.cpp; about 4
#   minutes less), for checks on a short device budget; the peer then comes from another run
#   ab: tg128 (f16 KV) of deltaspec alone under each environment of AB_CONFIGS ('|'-separated
#   lists of VAR=VALUE, e.g. "DELTASPEC_CUDA_KERNELS=1|DELTASPEC_CUDA_KERNELS=0"), one process each
# Usage (repo root, carry .deps/gpu-src and .whl): OUT=/some/dir bash bench/gpu_session.sh [steps]
# steps: any of kernels build build-ours test bench bench-ours ab verify profile (default: build test bench)
set -euo pipefail
steps=" ${*:-build test bench} "
has_step() { [[ $steps == *" $1 "* ]]; }
export DELTASPEC_GGML_SOURCE=$PWD/.deps/gpu-src/llama.cpp
OUT=${OUT:-$PWD/bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
LLAMA_BUILD=/tmp/llama-cuda

if has_step kernels; then  # one more compile beside the builds below
    nvcc -O3 -arch=sm_90a -shared -Xcompiler -fPIC bench/kernels/kernels_capi.cu -o /tmp/libdskernels.so \
        > "$OUT/kernels_bench.md" 2>&1 &
    kernels_pid=$!
fi

install_deltaspec() {  # $1: what it builds against (for the log), $2: its CMAKE_ARGS
    local t0=$(date +%s)
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DDELTASPEC_GGML_SOURCE=$DELTASPEC_GGML_SOURCE $2" \
        python3 -m pip install -q --no-build-isolation --no-deps .
    echo "deltaspec build ($1): $(( $(date +%s) - t0 )) s"
}
if has_step build; then
    t0=$(date +%s)
    python3 bench/peers/llama_cpp.py build --cuda --deltaspec-kernels --build-dir "$LLAMA_BUILD" -j "$(nproc)"
    echo "llama.cpp CUDA build: $(( $(date +%s) - t0 )) s"
    install_deltaspec "llama.cpp's ggml" "-DDELTASPEC_GGML_LIB_DIR=$LLAMA_BUILD/bin"
fi
if has_step build-ours; then
    install_deltaspec "own ggml-cuda" "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a"
fi
if [[ -n ${kernels_pid:-} ]]; then  # on an idle host, before anything else uses the GPU
    if wait "$kernels_pid"; then
        # shellcheck disable=SC2086  # KERNELS_BENCH_ARGS: more options, e.g. --row-tiles 1,2,4
        python3 bench/kernels/kernels_bench.py /tmp/libdskernels.so --out "$OUT/kernels_bench.json" \
            ${KERNELS_BENCH_ARGS:-} \
            >> "$OUT/kernels_bench.md" 2>&1 || echo "kernels_bench failed (exit $?)"
    else
        echo "kernels_capi.cu did not compile"
    fi
    cat "$OUT/kernels_bench.md"
fi
cd /tmp  # import the installed deltaspec, not the source tree
REPO=$OLDPWD
needs_model() { has_step bench || has_step bench-ours || has_step ab || has_step verify || has_step profile; }
if needs_model && [[ ! -f /tmp/q27.gguf ]]; then  # write the model while the tests run
    ( t0=$(date +%s); python3 -m deltaspec synth --preset 27b --quant q4_k_m /tmp/q27.gguf.part > "$OUT/synth.log" 2>&1 \
      && mv /tmp/q27.gguf.part /tmp/q27.gguf; echo "synth 27B q4_k_m: $(( $(date +%s) - t0 )) s" >> "$OUT/synth.log" ) &
fi
if has_step test; then
    # a failing test is reported, not fatal: the benchmarks below still run
    python3 -m pytest -q -m gpu -p no:cacheprovider "$REPO/tests/test_gpu.py" -rA --junitxml="$OUT/gpu-tests.xml" \
        > "$OUT/gpu-tests.log" 2>&1 || echo "GPU tests failed (see gpu-tests.log)"
    tail -25 "$OUT/gpu-tests.log"
fi
if needs_model; then
    wait
    cat "$OUT/synth.log" 2>/dev/null || true
fi
if has_step ab; then
    IFS='|' read -ra configs <<< "${AB_CONFIGS:-}"
    for config in "${configs[@]}"; do
        # shellcheck disable=SC2086  # a config is a list of VAR=VALUE words
        env $config python3 "$REPO/bench/decode_bench.py" ours /tmp/q27.gguf --tests tg128 --cache-types f16 \
            --out /tmp/ab.json 2>> "$OUT/ab.log" | sed "s/^/[$config] /" | tee -a "$OUT/ab.md" \
            || echo "[$config] failed (see ab.log)" | tee -a "$OUT/ab.md"
    done
fi
if has_step verify; then
    python3 "$REPO/bench/verify_cost.py" /tmp/q27.gguf --device cuda --out "$OUT/verify_cost.json" \
        | tee "$OUT/verify_cost.md"
fi
if has_step profile; then  # one decode step and one 17-token verify, kernel by kernel
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    for what in decode verify; do
        "$NCU" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
            python3 "$REPO/bench/kernel_profile.py" run /tmp/q27.gguf --what $what > "$OUT/kernels_$what.csv" \
            2> "$OUT/kernels_$what.log" || tail -5 "$OUT/kernels_$what.log"
    done
    python3 "$REPO/bench/kernel_profile.py" report "$OUT/kernels_decode.csv" "$OUT/kernels_verify.csv" \
        | tee "$OUT/kernels.md"
fi
if has_step bench-ours; then
    python3 "$REPO/bench/decode_bench.py" ours /tmp/q27.gguf --device cuda --reps 1 --out "$OUT/ours.json"
fi
if has_step bench; then
    python3 "$REPO/bench/decode_bench.py" ours /tmp/q27.gguf --device cuda --reps 1 --out "$OUT/ours.json"
    python3 "$REPO/bench/decode_bench.py" peer /tmp/q27.gguf --llama-bench "$LLAMA_BUILD/bin/llama-bench" --reps 1 \
        --out "$OUT/peer.json"
    python3 "$REPO/bench/decode_bench.py" report "$OUT/ours.json" "$OUT/peer.json" --model /tmp/q27.gguf \
        --out "$OUT/report.md"
fi
