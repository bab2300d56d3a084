#!/usr/bin/env bash
# Put new benchmark results into bench/results/latest/ and the committed ones they replace into
# bench/results/archive/<date>_<commit>/ (the date and commit that last wrote each of them), then
# stage both; the commit is left to you.
#   bash bench/archive_latest.sh DIR   # results of a GPU session (gpu_session.sh's $OUT, fetched here)
#   bash bench/archive_latest.sh       # results a script already wrote into latest/ (its default)
# Only the result files listed below move; logs and tables in DIR stay where they are.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
NAMES="decode_bench.json stock_vs_injected.json verify_cost.json kernels_bench.json gpu_tests.xml
       profile.md spec_bench.json cpu_batch_invariance.json cuda_batch_invariance.json cuda_batch_invariance.md acceptance.json acceptance.md
       testbed_manifest.json rows_op_bench.json batch_bench.json slot_memory.json tree_verify_cost.json
       tree_verify_cost.md server_bench.json server_bench.md dflash_bench.json mtp_bench.json
       kv_quality.json kv_quality.md tree_acceptance.json batch_spec_bench.json batch_spec_bench.md
       top_rows_bench.json top_rows_bench.md mtp_bench.md tq_cuda_diag.json gpu_tq_tests.xml
       tq_cuda_diag.md dflash_bench.md kv_memory.json kv_decode_bench.json kv_decode_bench.md kv_decode_bench_65536.json kv_decode_bench_65536.md kv_decode_bench_131072.json kv_decode_bench_131072.md tq_decode_ab.md
       server_spec_bench.json server_spec_bench.md host_sampling.json host_sampling.md
       graph_cache_bench.json graph_cache_bench.md graph_cache_bench_cpu.json graph_cache_bench_cpu.md
       batch_spec_sampled_bench.json batch_spec_sampled_bench.md batch_dflash_bench.json batch_dflash_bench.md
       recurrent_state_dtype.json recurrent_state_dtype.md profile_batch_keep_path.md batch_bench.md cpu_batch_invariance.md acceptance_2026-12-04.json acceptance_2026-12-04.md testbed_manifest_2026-12-04.json
       constraint_cost.json constraint_cost.md constraint_cost_cpu.json constraint_cost_cpu.md invariance_shapes.json
       tree_split_walks.json tree_split_walks.md invariance_products.json
       invariance_nodes.json gpu_tests_rows_tree.xml gpu_tests_invariant_stacks.xml gpu_tests_invariant.xml
       gpu_tests_device_masks.xml grammar_mask_threads.json grammar_mask_threads_4.json"
LATEST=bench/results/latest
FROM=${1:-}
if [[ -n $FROM && ! -d $FROM ]]; then
    echo "archive_latest.sh: $FROM is not a folder" >&2
    exit 2
fi
mkdir -p "$LATEST"
changed=0
for name in $NAMES; do
    path=$LATEST/$name
    if [[ -n $FROM ]]; then
        [[ -f $FROM/$name ]] || continue
    elif git diff --quiet HEAD -- "$path" 2>/dev/null && [[ -z $(git ls-files --others -- "$path") ]]; then
        continue  # neither changed nor new
    fi
    blob=$(git rev-parse -q --verify "HEAD:$path" || true)
    copy=""  # the same bytes committed under archive/ already: nothing to keep twice
    [[ -n $blob ]] && copy=$(git ls-tree -r HEAD bench/results/archive |
                             awk -v b="$blob" '$3 == b && !found {print $4; found = 1}')
    if [[ -n $copy ]]; then
        echo "$path is archived already as $copy"
    elif [[ -n $blob ]]; then
        dir=bench/results/archive/$(git log -1 --format='%ad_%h' --date=short -- "$path")
        if [[ -e $dir/$name ]] && ! git show "HEAD:$path" | cmp -s - "$dir/$name"; then
            echo "archive_latest.sh: $dir/$name exists already and differs; not overwriting it" >&2
            exit 1
        fi
        mkdir -p "$dir"
        git show "HEAD:$path" > "$dir/$name"
        git add "$dir/$name"
        echo "archived $path -> $dir/$name"
    fi
    [[ -n $FROM ]] && cp "$FROM/$name" "$path"
    git add "$path"
    echo "latest: $path"
    changed=1
done
[[ $changed == 1 ]] || echo "archive_latest.sh: no new results found" >&2
