#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "logit_order.h"

namespace deltaspec {

namespace {

bool comparison_sort_planted() {
    const char * env = std::getenv("DELTASPEC_TEST_SAMPLER_SORT");
    const std::string v = env ? env : "";
    if (v.empty()) return false;
    if (v == "comparison") return true;
    throw std::invalid_argument("DELTASPEC_TEST_SAMPLER_SORT (test only) must be unset or 'comparison', not '" + v + "'");
}

}  // namespace

Sampler::Sampler(const SamplingParams & params)
    : params_(params), rng_(params.seed), comparison_sort_(comparison_sort_planted()) {}

void Sampler::apply_penalties(std::vector<float> & logits, const std::vector<int32_t> & history) const {
    const SamplingParams & p = params_;
    if (p.repeat_penalty == 1.0f && p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f) return;
    const size_t n = p.penalty_last_n < 0 ? history.size() : std::min(history.size(), (size_t)p.penalty_last_n);
    std::unordered_map<int32_t, int> counts;
    for (size_t i = history.size() - n; i < history.size(); ++i) counts[history[i]]++;
    for (const auto & [id, count] : counts) {
        float & l = logits[id];
        // as llama.cpp: dividing a negative logit would raise its probability, so multiply it
        l = l <= 0.0f ? l * p.repeat_penalty : l / p.repeat_penalty;
        l -= (float)count * p.frequency_penalty + p.presence_penalty;
    }
}

namespace {

// Softmax over the candidates' logits, in place into probs (candidates sorted by logit, descending).
void softmax(const float * logits, const std::vector<int32_t> & ids, std::vector<float> & probs,
             float temperature = 1.0f) {
    probs.resize(ids.size());
    const float max_l = logits[ids[0]];
    double sum = 0.0;
    for (size_t i = 0; i < ids.size(); ++i) {
        probs[i] = std::exp((logits[ids[i]] - max_l) / temperature);
        sum += probs[i];
    }
    for (float & x : probs) x = (float)(x / sum);
}

}  // namespace

void Sampler::distribution(const float * logits, int64_t n_vocab, const std::vector<int32_t> & history,
                           Distribution & out) {
    const SamplingParams & p = params_;
    const bool reshaped = p.repeat_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f ||
                          !p.logit_bias.empty();
    const float * l = logits;  // the row as it is, unless penalties or bias change a copy of it
    if (reshaped) {
        scratch_.assign(logits, logits + n_vocab);
        apply_penalties(scratch_, history);
        for (const auto & [id, bias] : p.logit_bias) {
            if (id >= 0 && id < n_vocab) scratch_[id] += bias;
        }
        l = scratch_.data();
    }

    out.ids.clear();
    out.probs.clear();
    if (p.greedy()) {
        // first maximum: ties go to the lowest id, as llama.cpp's greedy sampler
        out.ids.push_back((int32_t)(std::max_element(l, l + n_vocab) - l));
        out.probs.push_back(1.0f);
        return;
    }
    int64_t k = p.top_k > 0 ? std::min<int64_t>(p.top_k, n_vocab) : n_vocab;
    if (k > kRadixFrom && !comparison_sort_) {
        order_by_logit(l, n_vocab, out.ids);  // the comparison's order (logit_order.h), in linear time
        sorts_.radix++;
    } else {
        const auto by_logit = [l](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
        out.ids.resize(n_vocab);
        std::iota(out.ids.begin(), out.ids.end(), 0);
        std::partial_sort(out.ids.begin(), out.ids.begin() + k, out.ids.end(), by_logit);
        if (k > kRadixFrom) sorts_.comparison++;
    }
    out.ids.resize(k);

    shape(l, out);
}

void Sampler::shape(const float * l, Distribution & out) const {
    const SamplingParams & p = params_;
    // the temperature-1 probabilities only serve the top-p and min-p cuts; without them the
    // final softmax below recomputes every probability from the logits anyway
    if (p.top_p < 1.0f || p.min_p > 0.0f) softmax(l, out.ids, out.probs);
    if (p.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p
        double cum = 0.0;
        size_t keep = out.ids.size();
        for (size_t i = 0; i < out.ids.size(); ++i) {
            cum += out.probs[i];
            if (cum >= p.top_p) {
                keep = i + 1;
                break;
            }
        }
        out.ids.resize(keep);
        softmax(l, out.ids, out.probs);
    }
    if (p.min_p > 0.0f) {  // drop tokens below min_p times the top probability
        const float floor = p.min_p * out.probs[0];
        size_t keep = 1;
        while (keep < out.ids.size() && out.probs[keep] >= floor) ++keep;
        out.ids.resize(keep);
    }
    softmax(l, out.ids, out.probs, p.temperature);
}

void Sampler::distribution_top(const float * logits, const int32_t * ids, int64_t k, Distribution & out) {
    out.ids.clear();
    out.probs.clear();
    if (params_.greedy()) {  // the first maximum: ties already go to the lowest id
        out.ids.push_back(ids[0]);
        out.probs.push_back(1.0f);
        return;
    }
    // the candidates are distribution()'s partially sorted top_k, in its order
    const int64_t n = std::min<int64_t>(params_.top_k, k);
    out.ids.resize(n);
    std::iota(out.ids.begin(), out.ids.end(), 0);
    shape(logits, out);
    for (int32_t & i : out.ids) i = ids[i];
}

int32_t Sampler::sample_top(const float * logits, const int32_t * ids, int64_t k) {
    distribution_top(logits, ids, k, dist_);
    return draw(dist_);
}

int32_t Sampler::draw(const Distribution & d) {
    if (d.ids.size() == 1) return d.ids[0];
    double u = uniform(), cum = 0.0;
    for (size_t i = 0; i < d.ids.size(); ++i) {
        cum += d.probs[i];
        if (u < cum) return d.ids[i];
    }
    // u landed in the rounding gap above the summed mass: the last candidate that has any (a
    // grammar's -inf logits leave candidates of probability 0, which must never be drawn)
    for (size_t i = d.ids.size(); i-- > 0;) {
        if (d.probs[i] > 0.0f) return d.ids[i];
    }
    return d.ids.back();
}

double Sampler::uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }

int32_t Sampler::sample(const float * logits, int64_t n_vocab, const std::vector<int32_t> & history) {
    distribution(logits, n_vocab, history, dist_);
    return draw(dist_);
}

}  // namespace deltaspec
