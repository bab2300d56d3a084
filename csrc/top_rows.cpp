#include "top_rows.h"

#include "logprobs.h"

namespace deltaspec {

bool top_rows_serve(const GenerateRequest & req, int64_t k, bool masked) {
    return !masked && req.sampling.top_serves(k) && req.n_logprobs <= k;
}

bool masks_rows_along(const GenerateRequest & req, const std::vector<int32_t> & along) {
    return req.constraint != nullptr && !req.constraint->allows_every_token(along);
}

RowNeeds row_needs(const GenerateRequest & req, const std::vector<int32_t> & along, bool top_rows_enabled, int64_t k,
                   bool device_masks) {
    RowNeeds needs;
    needs.masked = masks_rows_along(req, along);
    const bool reducible = !needs.masked || (device_masks && req.n_logprobs < 0);
    needs.argmax = req.sampling.argmax_only() && req.n_logprobs < 0 && reducible;
    needs.top = top_rows_enabled && reducible && top_rows_serve(req, k, /*masked =*/false);
    needs.device_mask = needs.masked && (needs.argmax || needs.top);
    return needs;
}

int32_t choose_from_top(const GenerateRequest & req, Sampler & sampler, const TopRow & row, GenerateResult & res) {
    const int32_t token = req.sampling.greedy() ? row.id[0] : sampler.sample_top(row.logit, row.id, row.k);
    record_top_logprobs(req, row, token, res);
    return token;
}

}  // namespace deltaspec
