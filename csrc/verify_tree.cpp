// Tree verification (Engine::verify_tree) and keeping one of the tree's paths (Engine::keep_path).
//
// The verify graph is the one-sequence graph with the DeltaNet layers' conv and recurrence replaced
// by the parent-indexed rows ops (ggml/deltaspec_rows.h), which read the slot's committed state from
// the pool and write nothing back. A row's KV row is written at the slot's length + its index in the
// batch, its RoPE position is the slot's length + its depth, and its mask row shows the committed KV
// rows and its ancestors' (itself included). So every root-to-leaf path computes what that path
// computes as a chain.
//
// keep_path then commits without re-running the target: the batch is pending as keep_paths' one
// slot (Engine::RowsPending, unpadded), and the commit is keep_paths' (commit_paths.cpp): the path's
// KV rows moved to consecutive positions, the recurrent state after its leaf replayed by the rows ops.
//
// Taps (Engine::set_taps): the verify graph outputs every row's tapped hidden states like any step;
// keep_path keeps only the kept rows' out of them (gathered in the commit's graph), in path order, so
// that after a round the tapped rows are those a plain run over the committed tokens would have tapped
// (a drafter fed from them, DFlash or MTP, never sees a rejected branch).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "deltaspec_rows.h"
#include "env.h"
#include "engine.h"

namespace deltaspec {

TreeBug tree_bug() {
    static const TreeBug bug = static_cast<TreeBug>(planted_choice(
        "DELTASPEC_TEST_TREE_BUG",
        {"sibling_visible", "row_position", "no_compaction", "parent_state", "taps_uncompacted", "stale_keep_graph"}));
    return bug;
}

namespace {

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

void Engine::verify_tree(const RowBatch & rows, LogitsWanted wanted, void * out, const uint32_t * allowed) {
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
    const int64_t P = rows_positions(T);
    const std::vector<int32_t> plan = rows_plan(T, rows.parent.data(), rows.slot.data(), nullptr, P, "verify_tree",
                                                /*callers_rows =*/true);
    const bool split = deltaspec_rows_count_walks(plan.data(), P) > 1;  // one slot: a second walk is a split

    const int64_t n_kv = seq().n_kv_for(p0 + T);
    StepGraph & g = step_graph(T, n_kv, wanted, /*keep_states =*/true, 0, 0, /*tree =*/true, allowed != nullptr);
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
    set_rows_input(g.in, plan, "verify_tree");
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
    set_allowed_input(g, allowed);

    compute(g);
    // pending until keep_path: one slot, its rows unpadded (commit_paths reads this layout)
    RowsPending & pend = rows_pending_;
    pend = RowsPending{};
    pend.tree = true;
    pend.first_slot = cur_;
    pend.n_slots = 1;
    pend.tq = T;
    pend.parent = rows.parent;
    pend.slot.assign(T, (int32_t)cur_);
    pend.local.resize(T);
    for (int64_t t = 0; t < T; ++t) pend.local[t] = (int32_t)t;
    pend.row_of = pend.local;
    pend.p0 = {p0};
    tree_stats_.verify_calls += 1;
    tree_stats_.rows += T;
    tree_stats_.max_rows = std::max(tree_stats_.max_rows, T);
    const int64_t n_roots = std::count(rows.parent.begin(), rows.parent.end(), -1);
    tree_stats_.branched_calls += n_roots > 1 || std::any_of(n_children.begin(), n_children.end(), [](int32_t c) { return c > 1; });
    tree_stats_.rows_op_nodes += g.n_rows_op_nodes;
    tree_stats_.split_walks += split;
    get_result_rows(g, 0, T, out);  // every row's logits, argmax or top row
    if (wanted == LogitsWanted::top_all) decode_stats_.top_rows += T;
    pend.active = true;
}

void Engine::keep_path(const int32_t * path, int64_t n) {
    const RowsPending & pend = rows_pending_;
    if (!pend.active || !pend.tree) throw std::logic_error("keep_path(path) needs the tree verify batch just evaluated (verify_tree)");
    const int64_t T = pend.tq;
    if (n < 1 || n > T) throw std::invalid_argument("keep_path: a path holds 1 to " + str(T) + " rows, got " + str(n));
    for (int64_t d = 0; d < n; ++d) {
        const int32_t r = path[d];
        if (r < 0 || r >= T) throw std::invalid_argument("keep_path: path[" + str(d) + "] = " + str(r) + " is not a row of the batch");
        const int32_t want = d == 0 ? -1 : path[d - 1];
        if (pend.parent[r] != want) {
            throw std::invalid_argument("keep_path: path[" + str(d) + "] = row " + str(r) + " has parent " +
                                        str(pend.parent[r]) + ", not " + (d == 0 ? std::string("-1 (a root)") : "row " + str(want)));
        }
    }
    const TreeBug bug = tree_bug();
    const std::vector<int32_t> kept(path, path + n);  // the batch is unpadded: its rows are the padded rows

    // the path's tapped rows, in path order, appended to the slot's (the commit gathers them)
    const int64_t n_taps = (int64_t)taps_.layers.size(), p0 = seq().n_past;
    std::vector<int32_t> tap_rows;
    float * taps = nullptr;
    std::vector<float> & tapped = slot_taps_[cur_].rows;
    size_t first_tap = tapped.size();
    if (n_taps > 0) {
        tap_rows = kept;
        if (bug == TreeBug::taps_uncompacted) {
            for (int64_t d = 0; d < n; ++d) tap_rows[d] = (int32_t)d;
        }
        first_tap = extend_taps(cur_, p0, n);
        taps = tapped.data() + first_tap;
    }
    CommitBugs bugs;
    bugs.no_compaction = bug == TreeBug::no_compaction;
    bugs.parent_state = bug == TreeBug::parent_state;
    bugs.stale_graph = bug == TreeBug::stale_keep_graph;
    Committed done;
    try {
        done = commit_paths({kept}, bugs, tap_rows, taps);
    } catch (...) {
        tapped.resize(first_tap);
        throw;
    }
    tree_stats_.keep_calls += 1;
    tree_stats_.kept_rows += n;
    tree_stats_.kv_rows_moved += done.kv_rows_moved;
    tree_stats_.keep_graph_builds += done.graph_built;
    tree_stats_.kernel_commits += done.states_by_kernels;
}

}  // namespace deltaspec
