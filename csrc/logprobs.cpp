#include "logprobs.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "env.h"

namespace deltaspec {

namespace {

// `token`'s log-probability in `row` and the k most probable tokens' (ties: the lower id first).
void append_entry(const float * row, int64_t n_vocab, int32_t token, int64_t k, std::vector<float> & logprobs,
                  std::vector<int32_t> & top_ids, std::vector<float> & top_logprobs) {
    const float max_l = *std::max_element(row, row + n_vocab);
    double sum = 0.0;
    for (int64_t i = 0; i < n_vocab; ++i) sum += std::exp((double)row[i] - max_l);
    const double log_z = max_l + std::log(sum);
    logprobs.push_back((float)(row[token] - log_z));
    k = std::min<int64_t>(k, n_vocab);
    if (k == 0) return;
    // the k best in one pass, a heap of k whose front is the worst kept (no n_vocab-sized id array
    // per row: a scored prompt asks this of every row)
    const auto better = [row](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); };
    std::vector<int32_t> best;
    best.reserve(k);
    for (int32_t i = 0; i < (int32_t)n_vocab; ++i) {
        if ((int64_t)best.size() < k) {
            best.push_back(i);
            std::push_heap(best.begin(), best.end(), better);
        } else if (better(i, best.front())) {
            std::pop_heap(best.begin(), best.end(), better);
            best.back() = i;
            std::push_heap(best.begin(), best.end(), better);
        }
    }
    std::sort_heap(best.begin(), best.end(), better);  // best first
    for (const int32_t id : best) {
        top_ids.push_back(id);
        top_logprobs.push_back((float)(row[id] - log_z));
    }
}

}  // namespace

void record_logprobs(const GenerateRequest & req, const float * row, int64_t n_vocab, int32_t token, GenerateResult & res) {
    if (req.n_logprobs < 0) return;
    append_entry(row, n_vocab, token, req.n_logprobs, res.logprobs, res.top_ids, res.top_logprobs);
}

void record_prompt_logprobs(const GenerateRequest & req, const float * row, int64_t n_vocab, int32_t token,
                            LogprobEntries & entries) {
    append_entry(row, n_vocab, token, req.n_logprobs, entries.logprobs, entries.top_ids, entries.top_logprobs);
}

void record_top_logprobs(const GenerateRequest & req, const TopRow & row, int32_t token, GenerateResult & res) {
    if (req.n_logprobs < 0) return;
    // as the whole row's: (double) logit - log Z, rounded to float once
    int64_t at = 0;
    while (at < row.k && row.id[at] != token) ++at;
    if (at == row.k) throw std::logic_error("token " + std::to_string(token) + " is not among its row's top candidates");
    res.logprobs.push_back((float)((double)row.logit[at] - row.lse));
    for (int64_t i = 0; i < req.n_logprobs; ++i) {
        res.top_ids.push_back(row.id[i]);
        res.top_logprobs.push_back((float)((double)row.logit[i] - row.lse));
    }
}

LogprobBug logprob_bug() {
    return static_cast<LogprobBug>(planted_choice("DELTASPEC_TEST_WRONG_LOGPROB_ROW", {"next_row", "prompt_own_row"}));
}

}  // namespace deltaspec
