#include "top_rows.h"

#include <stdexcept>
#include <string>

namespace deltaspec {

bool top_rows_serve(const GenerateRequest & req, int64_t k) {
    return req.constraint == nullptr && req.sampling.top_serves(k) && req.n_logprobs <= k;
}

int32_t choose_from_top(const GenerateRequest & req, Sampler & sampler, const TopRow & row, GenerateResult & res) {
    const int32_t token = req.sampling.greedy() ? row.id[0] : sampler.sample_top(row.logit, row.id, row.k);
    if (req.n_logprobs < 0) return token;
    // as the whole row's: (double) logit - log Z, rounded to float once
    int64_t at = 0;
    while (at < row.k && row.id[at] != token) ++at;
    if (at == row.k) throw std::logic_error("token " + std::to_string(token) + " is not among its row's top candidates");
    res.logprobs.push_back((float)((double)row.logit[at] - row.lse));
    for (int64_t i = 0; i < req.n_logprobs; ++i) {
        res.top_ids.push_back(row.id[i]);
        res.top_logprobs.push_back((float)((double)row.logit[i] - row.lse));
    }
    return token;
}

}  // namespace deltaspec
