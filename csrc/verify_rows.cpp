// Verification of rows of several sequence slots in one target pass (Engine::verify_rows) and the
// commit of each slot's accepted path (Engine::keep_paths): speculation for many sequences at once.
//
// The graph is the tree verify graph (verify_tree.cpp: the DeltaNet layers run the parent-indexed
// rows ops over the pool, reading each row's slot's committed state and writing nothing), with
// attention as one FA stream per slot (decode_rows.cpp's layout). FA streams hold equally many
// queries, so a slot with fewer rows than the longest (rounded up to a power of two, so that graphs
// are reused) is padded with copies of its last row: same
// token, parent, position and KV row, so a copy computes exactly what that row computes and writes
// the same KV values to the same place (no row of garbage can reach a KV row). Copies are dropped
// from the logits returned and from every commit.
//
// keep_paths then commits every slot's accepted path in one small graph (commit_paths.cpp, which
// keep_path's one tree shares): the rows ops once more over the verify pass's inputs with every row
// off the paths skipped and each path's leaf writing its slot's DeltaNet state and conv window back,
// and each slot's kept KV rows moved to consecutive positions where a path skipped rows (trees; a
// chain's accepted prefix is already in place).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "deltaspec_rows.h"
#include "engine.h"

namespace deltaspec {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

std::vector<int32_t> Engine::rows_plan(int64_t n_rows, const int32_t * parent, const int32_t * slot,
                                       const int32_t * flags, int64_t n_positions, const char * who,
                                       bool callers_rows, int64_t * n_saved) const {
    std::vector<int32_t> plan(n_positions * DELTASPEC_ROWS_N_COLS, 0);
    char err[256];
    const int64_t saved = deltaspec_rows_plan(n_rows, parent, slot, flags, pool_.n_seq, n_positions, plan.data(), err,
                                              sizeof(err));
    if (saved < 0) {
        const std::string message = std::string(who) + ": " + err;
        if (callers_rows) throw std::invalid_argument(message);
        throw std::logic_error(message);
    }
    if (n_saved) *n_saved = saved;
    return plan;
}

// Read once per process (the tests plant it for a whole run).
RowsBug rows_bug() {
    static const RowsBug bug = [] {
        const char * env = std::getenv("DELTASPEC_TEST_ROWS_BUG");
        const std::string v = env ? env : "";
        if (v.empty()) return RowsBug::none;
        if (v == "swap_keep") return RowsBug::swap_keep;
        if (v == "wrong_parent") return RowsBug::wrong_parent;
        if (v == "no_compaction") return RowsBug::no_compaction;
        if (v == "draft_slot_swap") return RowsBug::draft_slot_swap;
        if (v == "taps_slot_swap") return RowsBug::taps_slot_swap;
        throw std::invalid_argument("DELTASPEC_TEST_ROWS_BUG (test only) must be unset, 'swap_keep', 'wrong_parent', "
                                    "'no_compaction', 'draft_slot_swap' or 'taps_slot_swap', not '" +
                                    v + "'");
    }();
    return bug;
}

void Engine::verify_rows(const RowBatch & rows, LogitsWanted wanted, void * out, const uint32_t * allowed) {
    const int64_t R = rows.size();
    if (wanted != LogitsWanted::all && wanted != LogitsWanted::argmax_all && wanted != LogitsWanted::top_all) {
        throw std::invalid_argument("verify_rows returns the logits, the argmax or the top candidates of every row");
    }
    for (const auto * column : {&rows.pos, &rows.slot, &rows.parent}) {
        if ((int64_t)column->size() != R) throw std::invalid_argument("verify_rows: the row batch's columns differ in length");
    }
    if ((int64_t)rows.wants_logits.size() != R) throw std::invalid_argument("verify_rows: the row batch's columns differ in length");
    if (R < 1) throw std::invalid_argument("verify_rows: no rows");
    if (!deltaspec_rows_cpu_available()) {
        throw std::runtime_error("verify_rows: this ggml-cpu lacks deltaspec's rows ops (ggml/cpu/inject.cmake)");
    }
    settle_verify();
    const RowsBug bug = rows_bug();
    const TreeBug tbug = tree_bug();

    // the slots' runs of rows: slot first, first + 1, ..., each a non-empty run in the batch
    const int64_t first = rows.slot[0];
    std::vector<int64_t> begin;  // begin[i]: the first row of slot first + i
    std::vector<int32_t> depth(R), local(R), n_children(R, 0);
    bool branched = false;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t s = rows.slot[r];
        if (r == 0 || s != rows.slot[r - 1]) {
            if (s != first + (int64_t)begin.size() || s >= pool_.n_seq) {
                throw std::invalid_argument("verify_rows: row " + str(r) + " is in slot " + str(s) + "; the rows must be " +
                                            "grouped by slot, slots consecutive from " + str(first) +
                                            " below n_seq_max = " + str(pool_.n_seq));
            }
            begin.push_back(r);
        }
        const int64_t b = begin.back();
        const int32_t p = rows.parent[r];
        if (p != -1 && (p < b || p >= r)) {
            throw std::invalid_argument("verify_rows: row " + str(r) + " has parent " + str(p) +
                                        "; a parent is an earlier row of the same slot (" + str(b) + ".." + str(r - 1) + ") or -1");
        }
        depth[r] = p < 0 ? 0 : depth[p] + 1;
        local[r] = (int32_t)(r - b);
        if (p >= 0) branched = branched || ++n_children[p] > 1;
        else branched = branched || r > b;  // a second root of the slot
        const SequenceState & st = pool_.slots[s];
        if (rows.pos[r] != st.n_past + depth[r]) {
            throw std::invalid_argument("verify_rows: row " + str(r) + " has position " + str(rows.pos[r]) + "; slot " + str(s) +
                                        " holds " + str(st.n_past) + " tokens and the row's depth is " + str(depth[r]));
        }
        if (rows.token[r] < 0 || rows.token[r] >= hp_.n_vocab) {
            throw std::out_of_range("token id " + str(rows.token[r]) + " at row " + str(r) +
                                    " is outside the vocabulary [0, " + str(hp_.n_vocab) + ")");
        }
    }
    const int64_t N = (int64_t)begin.size();
    begin.push_back(R);
    int64_t Tq = 0, n_kv = 0;
    for (int64_t i = 0; i < N; ++i) {
        const int64_t n = begin[i + 1] - begin[i];
        const SequenceState & st = pool_.slots[first + i];
        if (st.n_past + n > st.n_ctx) {
            throw std::length_error("verify_rows: slot " + str(first + i) + " holds " + str(st.n_past) + " tokens; " + str(n) +
                                    " rows do not fit its context of " + str(st.n_ctx));
        }
        Tq = std::max(Tq, n);
        n_kv = std::max(n_kv, st.n_kv_for(st.n_past + n));
    }
    // Several slots: Tq rounded up to a power of two where it fits, so that the step graph of a
    // shape is kept and reused (a CUDA graph replayed) while draft lengths change every round. One
    // slot (generate()) is not padded: a verify's cost grows with its rows (synthetic 27B on the
    // H100: 1.42 decode steps at 17 rows, 1.49 at 23; bench/results/latest/tree_verify_cost.md).
    int64_t bucket = 1;
    while (bucket < Tq) bucket *= 2;
    if (N > 1 && N * bucket <= opts_.n_ubatch) Tq = bucket;
    const int64_t T = N * Tq;
    if (T > opts_.n_ubatch) {
        throw std::invalid_argument("verify_rows: " + str(N) + " slots of up to " + str(Tq) + " rows make " + str(T) +
                                    " rows, more than n_ubatch = " + str(opts_.n_ubatch));
    }

    // the padded batch: slot i's rows at i * Tq + local, then copies of its last row
    RowsPending & pend = rows_pending_;
    pend = RowsPending{};
    pend.first_slot = first;
    pend.n_slots = N;
    pend.tq = Tq;
    pend.row_of.resize(R);
    pend.parent.assign(T, -1);
    pend.slot.assign(T, -1);
    pend.local.assign(T, 0);
    std::vector<int32_t> tokens(T), pos(4 * T, 0);
    std::vector<int64_t> kv_rows(T);
    for (int64_t i = 0; i < N; ++i) {
        const int64_t s = first + i, p0 = pool_.slots[s].n_past, n = begin[i + 1] - begin[i];
        pend.p0.push_back(p0);
        for (int64_t j = 0; j < Tq; ++j) {
            const int64_t r = begin[i] + std::min(j, n - 1);  // the caller's row (its last one for a copy)
            const int64_t t = i * Tq + j;
            if (j < n) pend.row_of[r] = (int32_t)t;
            const int32_t p = rows.parent[r];
            pend.parent[t] = p < 0 ? -1 : (int32_t)(i * Tq + local[p]);
            pend.slot[t] = (int32_t)s;
            pend.local[t] = local[r];
            tokens[t] = rows.token[r];
            const int32_t at = tbug == TreeBug::row_position ? (int32_t)(p0 + std::min(j, n - 1)) : rows.pos[r];
            pos[t] = pos[T + t] = pos[2 * T + t] = at;
            kv_rows[t] = s * pool_.n_ctx + p0 + local[r];
        }
    }
    // the planted bug: the second slot's last row continues its grandparent in the verify graph
    std::vector<int32_t> parent = pend.parent;
    if (bug == RowsBug::wrong_parent && N > 1) {
        const int64_t n = begin[2] - begin[1];
        if (n > 2) parent[Tq + n - 1] -= 1;
    }
    const std::vector<int32_t> plan = rows_plan(T, parent.data(), pend.slot.data(), nullptr, rows_positions(T),
                                                "verify_rows", /*callers_rows =*/true);

    StepGraph & g = step_graph(T, n_kv, wanted, /*keep_states =*/true, N, first, /*tree =*/true, allowed != nullptr);
    set_input(g.in.tokens, tokens.data(), T * sizeof(int32_t));
    set_input(g.in.pos, pos.data(), pos.size() * sizeof(int32_t));
    set_input(g.in.kv_rows, kv_rows.data(), T * sizeof(int64_t));
    set_rows_input(g.in, plan, "verify_rows");
    // mask {n_kv, Tq, 1, N}: row t of stream i sees slot i's committed rows and its own ancestors'
    std::vector<ggml_fp16_t> mask(n_kv * T);
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), neg_inf = ggml_fp32_to_fp16(-INFINITY);
    for (int64_t t = 0; t < T; ++t) {
        const int64_t p0 = pend.p0[t / Tq];
        ggml_fp16_t * m = mask.data() + t * n_kv;
        for (int64_t j = 0; j < n_kv; ++j) m[j] = j < p0 ? zero : neg_inf;
        if (tbug == TreeBug::sibling_visible) {  // the planted bug: every earlier row of the slot
            for (int64_t a = t - t % Tq; a <= t; ++a) m[p0 + pend.local[a]] = zero;
        } else {
            for (int64_t a = t; a >= 0; a = parent[a]) m[p0 + pend.local[a]] = zero;
        }
    }
    set_input(g.in.kq_mask, mask.data(), mask.size() * sizeof(ggml_fp16_t));
    if (allowed && T == R) {  // no copies: the callers' rows are the graph's, in order
        set_allowed_input(g, allowed);
    } else if (allowed) {  // the callers' rows' masks at their graph rows (a slot's copies repeat its last row's)
        const int64_t W = allowed_words();
        std::vector<uint32_t> graph_allowed(T * W);
        for (int64_t i = 0; i < N; ++i) {
            const int64_t n = begin[i + 1] - begin[i];
            for (int64_t j = 0; j < Tq; ++j) {
                const uint32_t * src = allowed + (begin[i] + std::min(j, n - 1)) * W;
                std::copy(src, src + W, graph_allowed.data() + (i * Tq + j) * W);
            }
        }
        set_allowed_input(g, graph_allowed.data(), /*count =*/false);
        count_masked_rows(allowed, R);
    }

    compute(g);
    rows_stats_.calls += 1;
    rows_stats_.multi_slot_calls += N > 1;
    rows_stats_.branched_calls += branched;
    rows_stats_.rows += R;
    rows_stats_.padded_rows += T - R;
    rows_stats_.max_slots = std::max(rows_stats_.max_slots, N);

    const size_t row_bytes = wanted == LogitsWanted::all       ? hp_.n_vocab * sizeof(float)
                             : wanted == LogitsWanted::top_all ? top_row_words() * sizeof(int32_t)
                                                               : sizeof(int32_t);
    if (wanted == LogitsWanted::top_all) decode_stats_.top_rows += R;
    const bool every_row = std::all_of(rows.wants_logits.begin(), rows.wants_logits.end(), [](uint8_t w) { return w != 0; });
    if (!every_row) {  // the rows asked for, in row order (a drafter reads each slot's last row)
        char * dst = static_cast<char *>(out);
        for (int64_t r = 0; r < R; ++r) {
            if (!rows.wants_logits[r]) continue;
            get_result_rows(g, pend.row_of[r], 1, dst);
            dst += row_bytes;
        }
    } else if (T == R) {
        get_result_rows(g, 0, T, out);
    } else {
        char * dst = static_cast<char *>(out);
        for (int64_t i = 0; i < N; ++i) {  // each slot's own rows are consecutive in both layouts
            const int64_t n = begin[i + 1] - begin[i];
            get_result_rows(g, i * Tq, n, dst + begin[i] * row_bytes);
        }
    }
    pend.active = true;
}

void Engine::keep_paths(const std::vector<std::vector<int32_t>> & paths) {
    RowsPending & pend = rows_pending_;
    // (a verify_tree batch is keep_path's: its taps are kept with it)
    if (!pend.active || pend.tree) throw std::logic_error("keep_paths(paths) needs the rows just verified (verify_rows)");
    const int64_t N = pend.n_slots, Tq = pend.tq, R = (int64_t)pend.row_of.size();
    if ((int64_t)paths.size() != N) {
        throw std::invalid_argument("keep_paths: one path per verified slot (" + str(N) + "), got " + str(paths.size()));
    }
    // each path in the padded batch's rows, checked against the verified parents
    std::vector<std::vector<int32_t>> padded(N);
    for (int64_t i = 0; i < N; ++i) {
        const std::vector<int32_t> & path = paths[i];  // empty: the slot keeps nothing
        for (size_t d = 0; d < path.size(); ++d) {
            if (path[d] < 0 || path[d] >= R) throw std::invalid_argument("keep_paths: row " + str(path[d]) + " was not verified");
            const int32_t t = pend.row_of[path[d]];
            const int32_t want = d == 0 ? -1 : padded[i].back();
            if (t / Tq != i || pend.parent[t] != want) {
                throw std::invalid_argument("keep_paths: path of slot " + str(pend.first_slot + i) + ": row " + str(path[d]) +
                                            (t / Tq != i ? std::string(" is another slot's") :
                                             " does not continue " + (d == 0 ? std::string("the committed state") : "row " + str(path[d - 1]))));
            }
            padded[i].push_back(t);
        }
    }

    // each path's tapped rows (runs of consecutive padded rows: a chain's path is one), read
    // before the commit runs anything
    const TreeBug tbug = tree_bug();
    std::vector<TapRun> taps;
    for (int64_t i = 0; i < N; ++i) {
        const int64_t s = pend.first_slot + i;
        for (size_t d = 0; d < padded[i].size(); ++d) {
            if (d > 0 && padded[i][d] == padded[i][d - 1] + 1) {
                taps.back().n += 1;
            } else {
                taps.push_back({s, pend.p0[i] + (int64_t)d, padded[i][d], 1});
            }
            if (tbug == TreeBug::taps_uncompacted) {  // the planted bug: the slot's first rows' taps
                taps.back().row = (int32_t)(i * Tq + d - (taps.back().n - 1));
            }
        }
    }
    if (rows_bug() == RowsBug::taps_slot_swap && N > 1) {  // the planted bug: slot 0 and 1 trade their tapped rows
        for (TapRun & t : taps) {
            if (t.slot - pend.first_slot < 2) t.row = (t.row + Tq) % (2 * Tq);
        }
    }
    append_tap_runs(taps);

    CommitBugs bugs;
    bugs.no_compaction = rows_bug() == RowsBug::no_compaction || tbug == TreeBug::no_compaction;
    bugs.parent_state = tbug == TreeBug::parent_state;
    bugs.stale_graph = tbug == TreeBug::stale_keep_graph;
    const Committed done = commit_paths(padded, bugs, {}, nullptr);
    rows_stats_.kv_rows_moved += done.kv_rows_moved;
    for (const std::vector<int32_t> & path : padded) rows_stats_.kept_rows += (int64_t)path.size();
    rows_stats_.keep_calls += 1;
    rows_stats_.keep_graph_builds += done.graph_built;
    rows_stats_.kernel_commits += done.states_by_kernels;
}

}  // namespace deltaspec
