#include "top_rows.h"

#include "logprobs.h"

namespace deltaspec {

bool top_rows_serve(const GenerateRequest & req, int64_t k, bool masked) {
    return !masked && req.sampling.top_serves(k) && req.n_logprobs <= k;
}

int32_t choose_from_top(const GenerateRequest & req, Sampler & sampler, const TopRow & row, GenerateResult & res) {
    const int32_t token = req.sampling.greedy() ? row.id[0] : sampler.sample_top(row.logit, row.id, row.k);
    record_top_logprobs(req, row, token, res);
    return token;
}

}  // namespace deltaspec
