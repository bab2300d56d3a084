// Committing the accepted paths of a verify pass (Engine::commit_paths): the one implementation
// behind keep_path (verify_tree.cpp: one slot's tree) and keep_paths (verify_rows.cpp: a path per
// slot). Both verify passes leave the same pending batch (Engine::RowsPending: slot i's rows at
// i * tq .., their parents and indices within their slot) and nothing committed.
//
// The commit does not re-run the target. The recurrent states after each path come from the verify
// pass's inputs (its graph outputs, VerifyStates): on one GPU with our kernels two launches for all
// layers (commit_states_cuda.cpp) roll each slot's DeltaNet state along its path and gather its conv
// window; the cost of a chain of the path's length, nothing stored per row during the verify.
// One small graph does the rest:
// * elsewhere (the CPU, a layer split, our kernels off) the recurrent states: the rows ops
//   (ggml/deltaspec_rows.h) run once more over those inputs with every row off the paths skipped
//   and each path's leaf writing its slot's DeltaNet state and conv window back into the pool (as
//   a graph, three launches a layer on a GPU: about 0.9 ms of a 27B's round on the H200, which is
//   why the kernels do it there);
// * moves each slot's kept KV rows to consecutive positions where a path skipped rows (same-type row
//   copies: exact for quantized caches too; a chain's accepted prefix is already in place);
// * gathers the path's tapped hidden states (one slot's tree with taps set: what a DFlash or MTP
//   drafter reads) in path order into one output, read back in one copy.
// The graph stays built and allocated (keep_alloc_) for the next commit of the same shape (the same
// KV moves, path length and verify outputs: every accepted chain of one length), which then only
// sets the rows ops' plan and the gather's rows and computes. A commit with nothing left for it
// (states by the kernels, no KV moves, no taps) runs no graph.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "deltaspec_rows.h"
#include "engine.h"
#include "ggml-alloc.h"
#include "output_alias.h"

namespace deltaspec {

namespace {

// What a tensor a commit graph reads looks like: equal signatures give an equal alias or view.
void push_signature(std::vector<int64_t> & key, const ggml_tensor * t) {
    for (const ggml_tensor * u : {t, (const ggml_tensor *)t->view_src}) {
        if (u == nullptr) {
            key.push_back(0);
            continue;
        }
        key.insert(key.end(), {(int64_t)(intptr_t)u, (int64_t)(intptr_t)u->data, (int64_t)(intptr_t)u->buffer,
                               (int64_t)u->type, u->ne[0], u->ne[1], u->ne[2], u->ne[3], (int64_t)u->nb[1],
                               (int64_t)u->nb[2], (int64_t)u->nb[3], (int64_t)u->view_offs});
    }
}

}  // namespace

void Engine::KeepGraph::drop() {
    if (ctx) ggml_free(ctx);
    ctx = nullptr;
    gf = nullptr;
    input = taps = nullptr;
    key.clear();
}

Engine::Committed Engine::commit_paths(const std::vector<std::vector<int32_t>> & paths, const CommitBugs & bugs,
                                       const std::vector<int32_t> & tap_rows, float * taps) {
    RowsPending & pend = rows_pending_;
    const int64_t N = pend.n_slots, T = N * pend.tq;
    if (!pend.active || (int64_t)paths.size() != N) throw std::logic_error("commit_paths: no pending batch of these slots");

    // KV moves: slot i's row p0 + local(path[d]) -> p0 + d, in runs that move by the same distance
    struct Move { int64_t slot, from, to, n; };
    std::vector<Move> moves;
    int64_t n_moved = 0;  // counted with compaction switched off too: the tests must see it in the tokens
    for (int64_t i = 0; i < N; ++i) {
        const std::vector<int32_t> & path = paths[i];
        const int64_t n = (int64_t)path.size();
        for (int64_t d = 0; d < n;) {
            int64_t e = d + 1;
            while (e < n && pend.local[path[e]] - e == pend.local[path[d]] - d) ++e;
            if (pend.local[path[d]] != d) {
                n_moved += e - d;
                if (!bugs.no_compaction) moves.push_back({pend.first_slot + i, pend.p0[i] + pend.local[path[d]], pend.p0[i] + d, e - d});
            }
            d = e;
        }
    }

    const VerifyStates & vs = step_.verify;
    const int64_t n_taps = taps == nullptr ? 0 : (int64_t)taps_.out.size(), n_tap_rows = (int64_t)tap_rows.size();
    if (n_taps > 0 && (N != 1 || n_tap_rows < 1 || n_tap_rows > T)) {
        throw std::logic_error("commit_paths: taps are gathered for one slot's 1 to " + std::to_string(T) + " rows");
    }

    // each slot's recurrent state after its path's leaf (planted: after the leaf's parent), by our
    // kernels where they serve, else by the rows ops in the graph below
    Committed done;
    done.kv_rows_moved = n_moved;
    std::vector<std::vector<int32_t>> state_paths = paths;
    for (std::vector<int32_t> & path : state_paths) {
        if (bugs.parent_state && path.size() > 1) path.pop_back();
    }
    const bool states_change = std::any_of(vs.q.begin(), vs.q.end(), [](const ggml_tensor * q) { return q != nullptr; }) &&
                               std::any_of(paths.begin(), paths.end(), [](const std::vector<int32_t> & p) { return !p.empty(); });
    done.states_by_kernels = states_change && commit_states_cuda(state_paths);
    const bool rows_ops = states_change && !done.states_by_kernels;

    // the rows ops' plan: the state paths' rows in their slots, every other row skipped, each leaf
    // written back (zeros when no rows op reads it: the input keeps its layout for the taps' rows)
    std::vector<int32_t> plan(T * DELTASPEC_ROWS_N_COLS, 0);
    int64_t n_saved = 0;
    if (rows_ops) {
        std::vector<int32_t> slot(T, -1), flags(T, 0);
        for (int64_t i = 0; i < N; ++i) {
            for (int32_t t : state_paths[i]) slot[t] = (int32_t)(pend.first_slot + i);
            if (!state_paths[i].empty()) flags[state_paths[i].back()] = DELTASPEC_ROW_WRITE_BACK;
        }
        plan = rows_plan(T, pend.parent.data(), slot.data(), flags.data(), T, "commit_paths", /*callers_rows =*/false,
                         &n_saved);
        if (deltaspec_rows_count_walks(plan.data(), T) > N) {  // its recurrence nodes look at N walks
            throw std::logic_error("commit_paths: the plan has more walks than slots");
        }
    }
    if (!rows_ops && moves.empty() && n_taps == 0) {
        for (int64_t i = 0; i < N; ++i) pool_.slots[pend.first_slot + i].n_past += (int64_t)paths[i].size();
        pend.active = false;
        return done;
    }

    // the graph of this shape, the one kept when the last commit had it
    std::vector<int64_t> key = {T, N, pend.first_slot, n_saved, n_taps, n_tap_rows, pool_.n_seq, pool_.n_ctx, rows_ops};
    if (!bugs.stale_graph) {  // (planted: a graph reused for other moves)
        for (const Move & m : moves) key.insert(key.end(), {m.slot, m.from, m.to, m.n});
    }
    for (int il = 0; il < hp_.n_layer; ++il) {
        if (vs.q[il] && rows_ops) {
            for (const ggml_tensor * t : {vs.conv_x[il], vs.q[il], vs.k[il], vs.v[il], vs.g[il], vs.beta[il], pool_.conv[il], pool_.ssm[il]}) {
                push_signature(key, t);
            }
        } else if (pool_.k[il] && !moves.empty()) {
            push_signature(key, pool_.k[il]);
            push_signature(key, pool_.v[il]);
        }
    }
    for (int64_t i = 0; i < n_taps; ++i) push_signature(key, taps_.out[i]);

    KeepGraph & kg = keep_graph_;
    done.graph_built = kg.ctx == nullptr || kg.key != key;
    if (done.graph_built) {
        kg.drop();
        // per recurrent layer 6 aliases (each a view of its base), 2 reshapes and the 2 ops, the views
        // and reshapes being graph nodes too; per attention layer 2 views and a copy for K and for V
        // per move; per tap an alias (and its base), a gather and a concat; the input and its views
        const size_t per_layer = std::max<size_t>(16, 6 * moves.size());
        const size_t n_tensors = per_layer * (size_t)hp_.n_layer + 4 * (size_t)n_taps + 16, n_nodes = n_tensors;
        ggml_init_params params = {ggml_tensor_overhead() * n_tensors + ggml_graph_overhead_custom(n_nodes, false), nullptr,
                                   /*no_alloc =*/true};
        kg.ctx = ggml_init(params);
        ggml_context * ctx = kg.ctx;
        try {
            kg.gf = ggml_new_graph_custom(ctx, n_nodes, false);
            // one input, the rows ops' plan then the gathered taps' rows: one upload per commit
            const int64_t n_plan = DELTASPEC_ROWS_N_COLS * T;
            kg.input = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_plan + n_tap_rows);
            ggml_set_input(kg.input);
            ggml_tensor * rows_t = ggml_view_2d(ctx, kg.input, DELTASPEC_ROWS_N_COLS, T, DELTASPEC_ROWS_N_COLS * sizeof(int32_t), 0);
            for (int il = 0; il < hp_.n_layer; ++il) {
                if (vs.q[il] && rows_ops) {
                    const LayerWeights & l = weights_.layers[il];
                    ggml_tensor * windows = ggml_reshape_3d(ctx, pool_.conv[il], hp_.ssm_conv_kernel - 1, hp_.conv_channels(), pool_.n_seq);
                    ggml_build_forward_expand(kg.gf, deltaspec_rows_ssm_conv(ctx, windows, output_alias(ctx, vs.conv_x[il]), l.conv1d, rows_t));
                    const int64_t S = hp_.ssm_state_size, Hv = hp_.ssm_n_v_heads;
                    ggml_tensor * states = ggml_reshape_4d(ctx, pool_.ssm[il], S, S, Hv, pool_.n_seq);
                    ggml_tensor * recurrence =
                        deltaspec_rows_gated_delta_net(ctx, output_alias(ctx, vs.q[il]), output_alias(ctx, vs.k[il]),
                                                       output_alias(ctx, vs.v[il]), output_alias(ctx, vs.g[il]),
                                                       output_alias(ctx, vs.beta[il]), states, rows_t, n_saved);
                    deltaspec_rows_set_max_walks(recurrence, N);  // a walk per slot: its plan has no room to split
                    ggml_build_forward_expand(kg.gf, recurrence);
                } else if (pool_.k[il]) {
                    // a source row is never an earlier run's destination (local >= depth), so order is enough
                    for (const Move & m : moves) {
                        for (ggml_tensor * cache : {pool_.k[il], pool_.v[il]}) {
                            auto rows_at = [&](int64_t first_row) {
                                return ggml_view_2d(ctx, cache, cache->ne[0], m.n, cache->nb[1],
                                                    (m.slot * pool_.n_ctx + first_row) * cache->nb[1]);
                            };
                            ggml_build_forward_expand(kg.gf, ggml_cpy(ctx, rows_at(m.from), rows_at(m.to)));
                        }
                    }
                }
            }
            if (n_taps > 0) {
                // tap i is {E, T}: its path rows gathered {E, n}, the taps side by side {n_taps * E, n}, the
                // layout tapped() holds
                ggml_tensor * tap_ids = ggml_view_1d(ctx, kg.input, n_tap_rows, n_plan * sizeof(int32_t));
                ggml_tensor * rows = nullptr;
                for (int64_t i = 0; i < n_taps; ++i) {
                    ggml_tensor * g = ggml_get_rows(ctx, output_alias(ctx, taps_.out[i]), tap_ids);
                    rows = rows == nullptr ? g : ggml_concat(ctx, rows, g, 0);
                }
                kg.taps = rows;
                ggml_set_output(kg.taps);
                ggml_build_forward_expand(kg.gf, kg.taps);
            }
            // the rows tensors and the results, in a buffer kept from one commit to the next (a device
            // allocation per round would cost more than the replay)
            if (split_.active()) {  // its nodes run on the devices of their layers: a scheduler of its own
                if (keep_sched_) ggml_backend_sched_free(keep_sched_);
                std::vector<ggml_backend_t> backends = sched_backends();
                keep_sched_ = ggml_backend_sched_new(backends.data(), nullptr, (int)backends.size(), n_tensors, false, false);
                if (!keep_sched_ || !ggml_backend_sched_alloc_graph(keep_sched_, kg.gf)) {
                    throw std::runtime_error("cannot allocate the accepted paths' commit");
                }
            } else {
                if (keep_alloc_ == nullptr) keep_alloc_ = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend_));
                if (!ggml_gallocr_alloc_graph(keep_alloc_, kg.gf)) throw std::runtime_error("cannot allocate the accepted paths' commit");
            }
        } catch (...) {
            kg.drop();
            throw;
        }
        kg.key = std::move(key);
    }
    if (kg.input->buffer) {  // none without DeltaNet layers and taps
        if (n_taps > 0) plan.insert(plan.end(), tap_rows.begin(), tap_rows.end());
        ggml_backend_tensor_set(kg.input, plan.data(), 0, plan.size() * sizeof(int32_t));
    }
    const bool skipped = split_.active() && split_bug() == SplitBug::no_side_graph;  // the planted bug
    const ggml_status status = skipped            ? GGML_STATUS_SUCCESS
                               : split_.active() ? ggml_backend_sched_graph_compute(keep_sched_, kg.gf)
                                                 : ggml_backend_graph_compute(backend_, kg.gf);
    if (status != GGML_STATUS_SUCCESS) {
        kg.drop();
        throw std::runtime_error("committing the accepted paths failed");
    }
    if (kg.taps) ggml_backend_tensor_get(kg.taps, taps, 0, ggml_nbytes(kg.taps));
    for (int64_t i = 0; i < N; ++i) pool_.slots[pend.first_slot + i].n_past += (int64_t)paths[i].size();
    pend.active = false;
    return done;
}

}  // namespace deltaspec
