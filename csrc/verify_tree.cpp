// Tree verification (Engine::verify_tree) and keeping one of the tree's paths (Engine::keep_path).
//
// The verify graph is the one-sequence graph with the DeltaNet layers' conv and recurrence replaced
// by the parent-indexed rows ops (ggml/deltaspec_rows.h), which read the slot's committed state from
// the pool and write nothing back. A row's KV row is written at the slot's length + its index in the
// batch, its RoPE position is the slot's length + its depth, and its mask row shows the committed KV
// rows and its ancestors' (itself included). So every root-to-leaf path computes what that path
// computes as a chain.
//
// keep_path then commits without re-running the target: a small graph moves the path's KV rows to
// consecutive positions (same-type row copies: exact for quantized caches too) and runs the rows ops
// once more over the verify pass's inputs (graph outputs, VerifyStates) with every row off the path
// skipped and the leaf writing its DeltaNet state and conv window back into the pool: the cost of a
// chain of the path's length, nothing stored per row during the verify.
//
// Taps (Engine::set_taps): the verify graph outputs every row's tapped hidden states like any step;
// keep_path copies only the kept rows' out of them, in path order, so that after a round the tapped
// rows are those a plain run over the committed tokens would have tapped (a drafter fed from them,
// DFlash or MTP, never sees a rejected branch).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "deltaspec_rows.h"
#include "engine.h"
#include "ggml-alloc.h"
#include "output_alias.h"

namespace deltaspec {

namespace {

// DELTASPEC_TEST_TREE_BUG (test only) plants a bug so that the tree tests (tests/test_tree_verify.py)
// can show they notice it: "sibling_visible" shows each row every earlier row of the batch (a
// causal mask, so siblings and cousins leak into each other), "row_position" gives a row the
// position length + its index instead of length + its depth, "no_compaction" leaves the kept KV rows
// where the verify wrote them, "parent_state" commits the recurrent state after the leaf's parent
// instead of after the leaf, "taps_uncompacted" keeps the tapped rows of the batch's first rows
// instead of the path's (the unaccepted rows' features). Read once per process; unset or empty in
// every real use, anything else throws std::invalid_argument.
enum class TreeBug { none, sibling_visible, row_position, no_compaction, parent_state, taps_uncompacted };

TreeBug read_tree_bug() {
    const char * env = std::getenv("DELTASPEC_TEST_TREE_BUG");
    const std::string v = env ? env : "";
    if (v.empty()) return TreeBug::none;
    if (v == "sibling_visible") return TreeBug::sibling_visible;
    if (v == "row_position") return TreeBug::row_position;
    if (v == "no_compaction") return TreeBug::no_compaction;
    if (v == "parent_state") return TreeBug::parent_state;
    if (v == "taps_uncompacted") return TreeBug::taps_uncompacted;
    throw std::invalid_argument("DELTASPEC_TEST_TREE_BUG (test only) must be unset, 'sibling_visible', 'row_position', "
                                "'no_compaction', 'parent_state' or 'taps_uncompacted', not '" + v + "'");
}

TreeBug tree_bug() {
    static const TreeBug bug = read_tree_bug();
    return bug;
}

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

void Engine::verify_tree(const RowBatch & rows, LogitsWanted wanted, void * out) {
    const int64_t T = rows.size();
    if (wanted != LogitsWanted::all && wanted != LogitsWanted::argmax_all && wanted != LogitsWanted::top_all) {
        throw std::invalid_argument("verify_tree returns the logits, the argmax or the top candidates of every row");
    }
    if (T < 1 || T > opts_.n_ubatch) {
        throw std::invalid_argument("a tree verify batch holds 1 to " + str(opts_.n_ubatch) + " rows (n_ubatch), got " + str(T));
    }
    for (const auto * column : {&rows.pos, &rows.slot, &rows.parent}) {
        if ((int64_t)column->size() != T) throw std::invalid_argument("verify_tree: the row batch's columns differ in length");
    }
    if (!deltaspec_rows_cpu_available()) {
        throw std::runtime_error("verify_tree: this ggml-cpu lacks deltaspec's rows ops (ggml/cpu/inject.cmake)");
    }
    settle_verify();
    const TreeBug bug = tree_bug();
    const int64_t p0 = seq().n_past;
    if (p0 + T > seq().n_ctx) {
        throw std::length_error("sequence of " + str(p0 + T) + " tokens does not fit the context of " + str(seq().n_ctx));
    }
    std::vector<int32_t> depth(T), n_children(T, 0);
    for (int64_t i = 0; i < T; ++i) {
        const int32_t p = rows.parent[i];
        if (rows.slot[i] != cur_) {
            throw std::invalid_argument("verify_tree: row " + str(i) + " is in slot " + str(rows.slot[i]) +
                                        "; every row must be in the current slot " + str(cur_));
        }
        if (p < -1 || p >= i) {
            throw std::invalid_argument("verify_tree: row " + str(i) + " has parent " + str(p) +
                                        "; a parent is an earlier row (0.." + str(i - 1) + ") or -1");
        }
        depth[i] = p < 0 ? 0 : depth[p] + 1;
        if (p >= 0) ++n_children[p];
        if (rows.pos[i] != p0 + depth[i]) {
            throw std::invalid_argument("verify_tree: row " + str(i) + " has position " + str(rows.pos[i]) +
                                        "; the slot holds " + str(p0) + " tokens and the row's depth is " + str(depth[i]));
        }
        if (rows.token[i] < 0 || rows.token[i] >= hp_.n_vocab) {
            throw std::out_of_range("token id " + str(rows.token[i]) + " at row " + str(i) +
                                    " is outside the vocabulary [0, " + str(hp_.n_vocab) + ")");
        }
    }

    // the rows ops' plan: every row in this slot, nothing written back
    std::vector<int32_t> plan(T * DELTASPEC_ROWS_N_COLS);
    char err[256];
    if (deltaspec_rows_plan(T, rows.parent.data(), rows.slot.data(), nullptr, pool_.n_seq, plan.data(), err, sizeof(err)) < 0) {
        throw std::invalid_argument(std::string("verify_tree: ") + err);
    }

    const int64_t n_kv = seq().n_kv_for(p0 + T);
    StepGraph & g = step_graph(T, n_kv, wanted, /*keep_states =*/true, 0, 0, /*tree =*/true);
    set_input(g.in.tokens, rows.token.data(), T * sizeof(int32_t));
    std::vector<int32_t> pos(4 * T, 0);
    std::vector<int64_t> kv_rows(T);
    for (int64_t t = 0; t < T; ++t) {
        const int32_t p = bug == TreeBug::row_position ? (int32_t)(p0 + t) : rows.pos[t];
        pos[t] = pos[T + t] = pos[2 * T + t] = p;
        kv_rows[t] = p0 + t;  // a row's KV row is its index: siblings share a position, not a KV row
    }
    set_input(g.in.pos, pos.data(), pos.size() * sizeof(int32_t));
    set_input(g.in.kv_rows, kv_rows.data(), kv_rows.size() * sizeof(int64_t));
    set_input(g.in.rows, plan.data(), plan.size() * sizeof(int32_t));
    // mask row t: the committed rows, then the batch's rows that are t or its ancestors
    std::vector<ggml_fp16_t> mask(n_kv * T);
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), neg_inf = ggml_fp32_to_fp16(-INFINITY);
    for (int64_t t = 0; t < T; ++t) {
        ggml_fp16_t * m = mask.data() + t * n_kv;
        for (int64_t j = 0; j < n_kv; ++j) m[j] = j < p0 ? zero : neg_inf;
        if (bug == TreeBug::sibling_visible) {
            for (int64_t a = 0; a <= t; ++a) m[p0 + a] = zero;
        } else {
            for (int64_t a = t; a >= 0; a = rows.parent[a]) m[p0 + a] = zero;
        }
    }
    set_input(g.in.kq_mask, mask.data(), mask.size() * sizeof(ggml_fp16_t));

    compute(g);
    tree_parents_ = rows.parent;
    tree_stats_.verify_calls += 1;
    tree_stats_.rows += T;
    tree_stats_.max_rows = std::max(tree_stats_.max_rows, T);
    const int64_t n_roots = std::count(rows.parent.begin(), rows.parent.end(), -1);
    tree_stats_.branched_calls += n_roots > 1 || std::any_of(n_children.begin(), n_children.end(), [](int32_t c) { return c > 1; });
    tree_stats_.rows_op_nodes += g.n_rows_op_nodes;
    ggml_backend_tensor_get(g.out, out, 0, ggml_nbytes(g.out));  // every row's logits, argmax or top row
    if (wanted == LogitsWanted::top_all) decode_stats_.top_rows += T;
}

void Engine::keep_path(const int32_t * path, int64_t n) {
    const int64_t T = (int64_t)tree_parents_.size();
    if (T == 0) throw std::logic_error("keep_path(path) needs the tree verify batch just evaluated (verify_tree)");
    if (n < 1 || n > T) throw std::invalid_argument("keep_path: a path holds 1 to " + str(T) + " rows, got " + str(n));
    for (int64_t d = 0; d < n; ++d) {
        const int32_t r = path[d];
        if (r < 0 || r >= T) throw std::invalid_argument("keep_path: path[" + str(d) + "] = " + str(r) + " is not a row of the batch");
        const int32_t want = d == 0 ? -1 : path[d - 1];
        if (tree_parents_[r] != want) {
            throw std::invalid_argument("keep_path: path[" + str(d) + "] = row " + str(r) + " has parent " +
                                        str(tree_parents_[r]) + ", not " + (d == 0 ? std::string("-1 (a root)") : "row " + str(want)));
        }
    }
    const std::vector<int32_t> kept(path, path + n);
    keep_tree_taps(kept);  // before the replay, which computes on the same backend
    replay_tree_path(kept);
    seq().n_past += n;
    tree_parents_.clear();
    tree_stats_.keep_calls += 1;
    tree_stats_.kept_rows += n;
}

void Engine::keep_tree_taps(const std::vector<int32_t> & path) {
    const int64_t E = hp_.n_embd, n_taps = (int64_t)taps_.layers.size(), n = (int64_t)path.size();
    if (n_taps == 0) return;
    const int64_t p0 = seq().n_past;
    if (tapped_pos_ + n_tapped_rows() != p0) {  // positions ran on without taps (as append_taps)
        tapped_.clear();
        tapped_pos_ = p0;
    }
    std::vector<int32_t> rows = path;
    if (tree_bug() == TreeBug::taps_uncompacted) {
        for (int64_t d = 0; d < n; ++d) rows[d] = (int32_t)d;
    }
    const size_t first = tapped_.size();
    tapped_.resize(first + n * n_taps * E);
    // the graph's tap i is {E, T}: a row is E contiguous floats, so a run of consecutive rows (the
    // accepted part of the top-1 chain, mostly) is one read
    std::vector<float> run;
    for (int64_t i = 0; i < n_taps; ++i) {
        for (int64_t d = 0; d < n;) {
            int64_t e = d + 1;
            while (e < n && rows[e] == rows[e - 1] + 1) ++e;
            run.resize((e - d) * E);
            ggml_backend_tensor_get(taps_.out[i], run.data(), (size_t)rows[d] * E * sizeof(float), run.size() * sizeof(float));
            for (int64_t k = d; k < e; ++k) {  // each kept row's taps side by side, as append_taps lays them
                std::copy_n(run.data() + (k - d) * E, E, tapped_.data() + first + (k * n_taps + i) * E);
            }
            d = e;
        }
    }
}

void Engine::replay_tree_path(const std::vector<int32_t> & path) {
    const TreeBug bug = tree_bug();
    const VerifyStates & vs = step_.verify;
    const int64_t T = (int64_t)tree_parents_.size(), n = (int64_t)path.size(), p0 = seq().n_past;
    // the path's rows in this slot, the others skipped; the leaf writes the state back
    std::vector<int32_t> slot(T, -1), flags(T, 0);
    for (int32_t r : path) slot[r] = (int32_t)cur_;
    const int64_t leaf = bug == TreeBug::parent_state && n > 1 ? path[n - 2] : path[n - 1];
    if (bug == TreeBug::parent_state && n > 1) slot[path[n - 1]] = -1;
    flags[leaf] = DELTASPEC_ROW_WRITE_BACK;
    std::vector<int32_t> plan(T * DELTASPEC_ROWS_N_COLS);
    char err[256];
    const int64_t n_saved = deltaspec_rows_plan(T, tree_parents_.data(), slot.data(), flags.data(), pool_.n_seq, plan.data(),
                                                err, sizeof(err));
    if (n_saved < 0) throw std::logic_error(std::string("keep_path: ") + err);

    // per recurrent layer 6 aliases (each a view of its base), 2 reshapes and the 2 ops, the views
    // and reshapes being graph nodes too; per attention layer 2 views and a copy for K and for V
    // per moved run; the rows tensor
    size_t n_moves = 0;
    for (int64_t d = 0; d < n; ++d) n_moves += path[d] != d && (d == 0 || path[d] - d != path[d - 1] - (d - 1));
    const size_t per_layer = std::max<size_t>(16, 6 * n_moves);
    const size_t n_tensors = per_layer * (size_t)hp_.n_layer + 16, n_nodes = n_tensors;
    ggml_init_params params = {ggml_tensor_overhead() * n_tensors + ggml_graph_overhead_custom(n_nodes, false), nullptr,
                               /*no_alloc =*/true};
    ggml_context * ctx = ggml_init(params);
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, n_nodes, false);
    try {
        ggml_tensor * rows_t = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, DELTASPEC_ROWS_N_COLS, T);
        ggml_set_input(rows_t);
        for (int il = 0; il < hp_.n_layer; ++il) {
            if (vs.q[il]) {
                const LayerWeights & l = weights_.layers[il];
                ggml_tensor * windows = pool_.conv[il];
                windows = ggml_reshape_3d(ctx, windows, hp_.ssm_conv_kernel - 1, hp_.conv_channels(), pool_.n_seq);
                ggml_build_forward_expand(gf, deltaspec_rows_ssm_conv(ctx, windows, output_alias(ctx, vs.conv_x[il]), l.conv1d, rows_t));
                const int64_t S = hp_.ssm_state_size, Hv = hp_.ssm_n_v_heads;
                ggml_tensor * states = ggml_reshape_4d(ctx, pool_.ssm[il], S, S, Hv, pool_.n_seq);
                ggml_build_forward_expand(
                    gf, deltaspec_rows_gated_delta_net(ctx, output_alias(ctx, vs.q[il]), output_alias(ctx, vs.k[il]),
                                                       output_alias(ctx, vs.v[il]), output_alias(ctx, vs.g[il]),
                                                       output_alias(ctx, vs.beta[il]), states, rows_t, n_saved));
            } else if (seq().k[il] && bug != TreeBug::no_compaction) {
                // KV row p0 + path[d] -> p0 + d, in runs of rows that move by the same distance. A
                // source row is never an earlier run's destination (path[d] >= d), so order is enough.
                for (int64_t d = 0; d < n;) {
                    int64_t e = d + 1;
                    while (e < n && path[e] - e == path[d] - d) ++e;
                    if (path[d] != d) {
                        for (ggml_tensor * cache : {seq().k[il], seq().v[il]}) {
                            auto rows_of = [&](int64_t first) {
                                return ggml_view_2d(ctx, cache, cache->ne[0], e - d, cache->nb[1], first * cache->nb[1]);
                            };
                            ggml_build_forward_expand(gf, ggml_cpy(ctx, rows_of(p0 + path[d]), rows_of(p0 + d)));
                        }
                    }
                    d = e;
                }
            }
        }
        // the rows tensor and the replays' results, in a buffer kept from one keep_path to the next (a
        // device allocation per round would cost more than the replay)
        if (keep_alloc_ == nullptr) keep_alloc_ = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend_));
        if (!ggml_gallocr_alloc_graph(keep_alloc_, gf)) throw std::runtime_error("cannot allocate keep_path's replay");
        if (rows_t->buffer) ggml_backend_tensor_set(rows_t, plan.data(), 0, plan.size() * sizeof(int32_t));  // none without DeltaNet layers
        if (ggml_backend_graph_compute(backend_, gf) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("keep_path: committing the accepted path failed");
        }
        if (bug != TreeBug::no_compaction) {
            for (int64_t d = 0; d < n; ++d) tree_stats_.kv_rows_moved += path[d] != d;
        }
    } catch (...) {
        ggml_free(ctx);
        throw;
    }
    ggml_free(ctx);
}

}  // namespace deltaspec
