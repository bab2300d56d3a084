// Engine::prefill_rows: prompt chunks of several sequences in one graph (the scheduler's admission
// of many requests at once). Each slot's chunk is a chain of rows (parent = the previous row) that
// starts from the slot's committed state, so the graph is verify_rows' (the parent-indexed rows ops
// for the DeltaNet layers, one FA stream per slot for attention), with two differences: nothing is
// kept for a later keep_paths (each slot's last row writes its DeltaNet state and conv window back
// to the pool inside the ops, DELTASPEC_ROW_WRITE_BACK), and the head reads only each slot's last row
// (a prefill needs one token per sequence, not a vocabulary of logits per prompt token).
//
// FA streams hold equally many queries, so every slot brings the same number of rows; the scheduler
// cuts its chunks to that (scheduler.cpp: feed_together) rather than padding, which would spend a
// long chunk's rows on every short one.
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

namespace {

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

// Read once per process (the tests plant it for a whole run).
PrefillBug prefill_bug() {
    static const PrefillBug bug = [] {
        return static_cast<PrefillBug>(planted_choice("DELTASPEC_TEST_PREFILL_BUG", {"position", "shared_state"}));
    }();
    return bug;
}

void Engine::prefill_rows(const RowBatch & rows, LogitsWanted wanted, void * out, const uint32_t * allowed) {
    const int64_t T = rows.size();
    if (wanted != LogitsWanted::none && wanted != LogitsWanted::all && wanted != LogitsWanted::argmax_all &&
        wanted != LogitsWanted::top_all) {
        throw std::invalid_argument("prefill_rows returns nothing, or each slot's last row's logits, argmax or top candidates");
    }
    for (const auto * column : {&rows.pos, &rows.slot, &rows.parent}) {
        if ((int64_t)column->size() != T) throw std::invalid_argument("prefill_rows: the row batch's columns differ in length");
    }
    if (T < 1 || T > opts_.n_ubatch) {
        throw std::invalid_argument("prefill_rows takes 1 to n_ubatch = " + str(opts_.n_ubatch) + " rows, got " + str(T));
    }
    if (!deltaspec_rows_cpu_available()) {
        throw std::runtime_error("prefill_rows: this ggml-cpu lacks deltaspec's rows ops (ggml/cpu/inject.cmake)");
    }
    settle_verify();

    // slots first, first + 1, ..., each a chain of Tq rows continuing its committed sequence
    const int64_t first = rows.slot[0];
    int64_t Tq = 0;
    while (Tq < T && rows.slot[Tq] == first) ++Tq;
    const int64_t N = T / Tq;
    if (N * Tq != T) {
        throw std::invalid_argument("prefill_rows: every slot brings the same number of rows (" + str(Tq) + " in slot " +
                                    str(first) + "), " + str(T) + " rows in all");
    }
    int64_t n_kv = 0;
    for (int64_t r = 0; r < T; ++r) {
        const int64_t i = r / Tq, j = r % Tq, s = first + i;
        if (rows.slot[r] != s || s >= pool_.n_seq) {
            throw std::invalid_argument("prefill_rows: row " + str(r) + " is in slot " + str(rows.slot[r]) + "; slot " + str(s) +
                                        " (below n_seq_max = " + str(pool_.n_seq) + ") was due: " + str(Tq) +
                                        " rows per slot, slots consecutive from " + str(first));
        }
        if (rows.parent[r] != (j == 0 ? -1 : (int32_t)(r - 1))) {
            throw std::invalid_argument("prefill_rows: row " + str(r) + " has parent " + str(rows.parent[r]) +
                                        "; a prompt chunk is a chain (its first row -1, then the previous row)");
        }
        const SequenceState & st = pool_.slots[s];
        if (rows.pos[r] != st.n_past + j) {
            throw std::invalid_argument("prefill_rows: row " + str(r) + " has position " + str(rows.pos[r]) + "; slot " + str(s) +
                                        " holds " + str(st.n_past) + " tokens");
        }
        if (rows.token[r] < 0 || rows.token[r] >= hp_.n_vocab) {
            throw std::out_of_range("token id " + str(rows.token[r]) + " at row " + str(r) + " is outside the vocabulary [0, " +
                                    str(hp_.n_vocab) + ")");
        }
        if (j == 0) {
            if (st.n_past + Tq > st.n_ctx) {
                throw std::length_error("prefill_rows: slot " + str(s) + " holds " + str(st.n_past) + " tokens; " + str(Tq) +
                                        " more do not fit its context of " + str(st.n_ctx));
            }
            n_kv = std::max(n_kv, st.n_kv_for(st.n_past + Tq));
        }
    }

    const PrefillBug bug = N > 1 ? prefill_bug() : PrefillBug::none;
    std::vector<int32_t> parent(rows.parent), slot(rows.slot), flags(T, 0), pos(4 * T, 0);
    std::vector<int64_t> kv_rows(T);
    for (int64_t i = 0; i < N; ++i) flags[i * Tq + Tq - 1] = DELTASPEC_ROW_WRITE_BACK;
    for (int64_t r = 0; r < T; ++r) {
        // the planted bug: slots after the first counted from the first slot's start
        const int32_t p = bug == PrefillBug::position && r >= Tq ? rows.pos[r] - rows.pos[r / Tq * Tq] + rows.pos[0] : rows.pos[r];
        pos[r] = pos[T + r] = pos[2 * T + r] = p;
        kv_rows[r] = rows.slot[r] * pool_.n_ctx + rows.pos[r];
    }
    if (bug == PrefillBug::shared_state) {  // the first slot's committed recurrent state, in every slot
        for (int64_t i = 1; i < N; ++i) copy_recurrent_state(pool_.slots[first], pool_.slots[first + i]);
    }
    // (its graph's rows tensor has the room of a tree batch's; chains never split)
    int64_t n_saved = 0;
    const std::vector<int32_t> plan = rows_plan(T, parent.data(), slot.data(), flags.data(), rows_positions(T),
                                                "prefill_rows", /*callers_rows =*/false, &n_saved);
    if (n_saved != 0) throw std::logic_error("prefill_rows: a chain needed a saved state");  // chains walk in registers

    StepGraph & g = step_graph(T, n_kv, wanted, /*keep_states =*/false, N, first, /*tree =*/true, allowed != nullptr);
    set_input(g.in.tokens, rows.token.data(), T * sizeof(int32_t));
    set_input(g.in.pos, pos.data(), pos.size() * sizeof(int32_t));
    set_input(g.in.kv_rows, kv_rows.data(), T * sizeof(int64_t));
    set_rows_input(g.in, plan, "prefill_rows");
    // mask {n_kv, Tq, 1, N}: row j of stream i sees slot i's rows 0 .. its position (causal)
    std::vector<ggml_fp16_t> mask(n_kv * T);
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), neg_inf = ggml_fp32_to_fp16(-INFINITY);
    for (int64_t r = 0; r < T; ++r) {
        for (int64_t k = 0; k < n_kv; ++k) mask[r * n_kv + k] = k <= rows.pos[r] ? zero : neg_inf;
    }
    set_input(g.in.kq_mask, mask.data(), mask.size() * sizeof(ggml_fp16_t));
    set_allowed_input(g, allowed);

    compute(g);
    std::vector<TapRun> taps(N);  // slot first + i's chunk: rows i * Tq ..
    for (int64_t i = 0; i < N; ++i) taps[i] = {first + i, pool_.slots[first + i].n_past, i * Tq, Tq};
    append_tap_runs(taps);
    for (int64_t i = 0; i < N; ++i) pool_.slots[first + i].n_past += Tq;
    prefill_stats_.passes += 1;
    prefill_stats_.multi_slot_passes += N > 1;
    prefill_stats_.rows += T;
    prefill_stats_.max_slots = std::max(prefill_stats_.max_slots, N);
    if (wanted == LogitsWanted::top_all) decode_stats_.top_rows += N;
    if (wanted != LogitsWanted::none) get_result_rows(g, 0, N, out);
}

}  // namespace deltaspec
