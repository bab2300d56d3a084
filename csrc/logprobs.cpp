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
    std::vector<int32_t> ids(n_vocab);
    for (int64_t i = 0; i < n_vocab; ++i) ids[i] = (int32_t)i;
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                      [row](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    for (int64_t i = 0; i < k; ++i) {
        top_ids.push_back(ids[i]);
        top_logprobs.push_back((float)(row[ids[i]] - log_z));
    }
}

}  // namespace

void record_logprobs(const GenerateRequest & req, const float * row, int64_t n_vocab, int32_t token, GenerateResult & res) {
    if (req.n_logprobs < 0) return;
    append_entry(row, n_vocab, token, req.n_logprobs, res.logprobs, res.top_ids, res.top_logprobs);
}

void record_prompt_logprobs(const GenerateRequest & req, const float * row, int64_t n_vocab, int32_t token,
                            GenerateResult & res) {
    append_entry(row, n_vocab, token, req.n_logprobs, res.prompt_logprobs, res.prompt_top_ids, res.prompt_top_logprobs);
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
