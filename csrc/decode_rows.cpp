// Engine::decode: one graph over one row per sequence, for sequences in consecutive slots. Each row
// starts from its slot's committed state: the DeltaNet states and conv windows of consecutive
// slots sit side by side in the pool (StatePool), so the graph reads and writes them in place as
// one view; attention reads each slot's KV rows as a FA stream.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "engine.h"
#include "env.h"

namespace deltaspec {

namespace {

BatchBug read_batch_bug() {
    return static_cast<BatchBug>(planted_choice("DELTASPEC_TEST_BATCH_BUG",
                                                {"shared_slot", "position", "no_move", "no_reset"}));
}

}  // namespace

// Read once per process (the tests plant it for a whole run), not at every step the scheduler takes;
// a malformed value throws at each call, since a static whose initializer throws is retried.
BatchBug batch_bug() {
    static const BatchBug bug = read_batch_bug();
    return bug;
}

void Engine::decode(const RowBatch & rows, LogitsWanted wanted, void * out, const uint32_t * allowed) {
    const int64_t N = rows.size();
    if (wanted != LogitsWanted::all && wanted != LogitsWanted::argmax_all && wanted != LogitsWanted::top_all) {
        throw std::invalid_argument("decode returns the logits, the argmax or the top candidates of its rows");
    }
    if (N < 1 || N > pool_.n_seq || N > opts_.n_ubatch) {
        throw std::invalid_argument("decode takes 1 to " + std::to_string(std::min(pool_.n_seq, opts_.n_ubatch)) +
                                    " rows (n_seq_max, n_ubatch), got " + std::to_string(N));
    }
    for (const auto * column : {&rows.pos, &rows.slot, &rows.parent}) {
        if ((int64_t)column->size() != N) throw std::invalid_argument("decode: the row batch's columns differ in length");
    }
    if ((int64_t)rows.wants_logits.size() != N) throw std::invalid_argument("decode: the row batch's columns differ in length");
    settle_verify();
    const int64_t first = rows.slot[0];
    int64_t n_kv = 0;
    for (int64_t i = 0; i < N; ++i) {
        if (rows.parent[i] != -1) {
            throw std::invalid_argument("decode: row " + std::to_string(i) + " has a parent row; rows continue their "
                                        "slot's committed state (parent -1) until the parent-indexed recurrence exists");
        }
        if (rows.slot[i] != first + i || rows.slot[i] >= pool_.n_seq) {
            throw std::invalid_argument("decode: row " + std::to_string(i) + " is in slot " + std::to_string(rows.slot[i]) +
                                        "; rows must be in consecutive slots from " + std::to_string(first) +
                                        " below n_seq_max = " + std::to_string(pool_.n_seq));
        }
        const SequenceState & s = pool_.slots[rows.slot[i]];
        if (rows.pos[i] != s.n_past) {
            throw std::invalid_argument("decode: row " + std::to_string(i) + " has position " + std::to_string(rows.pos[i]) +
                                        ", its slot holds " + std::to_string(s.n_past) + " tokens");
        }
        if (s.n_past + 1 > s.n_ctx) {
            throw std::length_error("decode: slot " + std::to_string(rows.slot[i]) + " is full (n_ctx = " +
                                    std::to_string(s.n_ctx) + ")");
        }
        if (rows.token[i] < 0 || rows.token[i] >= hp_.n_vocab) {
            throw std::out_of_range("token id " + std::to_string(rows.token[i]) + " at row " + std::to_string(i) +
                                    " is outside the vocabulary [0, " + std::to_string(hp_.n_vocab) + ")");
        }
        n_kv = std::max(n_kv, s.n_kv_for(rows.pos[i] + 1));
    }

    const BatchBug bug = N > 1 ? batch_bug() : BatchBug::none;
    StepGraph & g = step_graph(N, n_kv, wanted, /*keep_states =*/false, N, first, /*tree =*/false, allowed != nullptr);
    std::vector<int32_t> pos(4 * N, 0);
    std::vector<int64_t> kv_rows(N);
    for (int64_t i = 0; i < N; ++i) {
        const int32_t p = rows.pos[i] + (bug == BatchBug::position && i > 0 ? 1 : 0);
        pos[i] = pos[N + i] = pos[2 * N + i] = p;
        kv_rows[i] = rows.slot[i] * pool_.n_ctx + p;
    }
    if (bug == BatchBug::shared_slot) {  // the first row's recurrent state, in every row's slot
        for (int64_t i = 1; i < N; ++i) copy_recurrent_state(pool_.slots[first], pool_.slots[first + i]);
    }
    set_input(g.in.tokens, rows.token.data(), N * sizeof(int32_t));
    set_input(g.in.pos, pos.data(), pos.size() * sizeof(int32_t));
    set_input(g.in.kv_rows, kv_rows.data(), N * sizeof(int64_t));
    // mask {n_kv, 1, 1, N}: row i sees its own slot's rows 0 .. pos_i
    std::vector<ggml_fp16_t> mask(n_kv * N);
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), neg_inf = ggml_fp32_to_fp16(-INFINITY);
    for (int64_t i = 0; i < N; ++i) {
        for (int64_t j = 0; j < n_kv; ++j) mask[i * n_kv + j] = j <= pos[i] ? zero : neg_inf;
    }
    set_input(g.in.kq_mask, mask.data(), mask.size() * sizeof(ggml_fp16_t));
    set_allowed_input(g, allowed);

    compute(g);
    std::vector<TapRun> taps(N);  // row i is slot first + i's next position
    for (int64_t i = 0; i < N; ++i) taps[i] = {rows.slot[i], rows.pos[i], i, 1};
    append_tap_runs(taps);
    for (int64_t i = 0; i < N; ++i) pool_.slots[rows.slot[i]].n_past += 1;
    decode_stats_.calls += 1;
    decode_stats_.rows += N;
    decode_stats_.max_rows = std::max(decode_stats_.max_rows, N);

    // every row's result came out; keep those asked for, in row order
    const size_t row_bytes = wanted == LogitsWanted::all       ? hp_.n_vocab * sizeof(float)
                             : wanted == LogitsWanted::top_all ? top_row_words() * sizeof(int32_t)
                                                               : sizeof(int32_t);
    if (wanted == LogitsWanted::top_all) decode_stats_.top_rows += N;
    if (std::all_of(rows.wants_logits.begin(), rows.wants_logits.end(), [](uint8_t w) { return w != 0; })) {
        get_result_rows(g, 0, N, out);
        return;
    }
    char * dst = static_cast<char *>(out);
    for (int64_t i = 0; i < N; ++i) {
        if (!rows.wants_logits[i]) continue;
        get_result_rows(g, i, 1, dst);
        dst += row_bytes;
    }
}

}  // namespace deltaspec
