#include "sampler.h"
#include "env.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "logit_order.h"

namespace deltaspec {

namespace {

Sampler::Reference reference_planted() {
    return static_cast<Sampler::Reference>(planted_choice("DELTASPEC_TEST_SAMPLER_SORT", {"comparison", "reference"}));
}

}  // namespace

Sampler::Sampler(const SamplingParams & params)
    : params_(params), rng_(params.seed), reference_(reference_planted()) {}

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
// `sorted`, when given, holds logits[ids[i]] at i: read in order, it spares a gather per candidate,
// and a run of equal logits (ties are common in quantized or biased rows) reuses one exp and one
// division. The arithmetic per candidate is the gathering loop's, so the probabilities are too.
void softmax(const float * logits, const float * sorted, const std::vector<int32_t> & ids, std::vector<float> & probs,
             float temperature = 1.0f) {
    const size_t n = ids.size();
    probs.resize(n);
    float * pr = probs.data();
    double sum = 0.0;
    if (sorted) {
        const float max_l = sorted[0];
        uint32_t prev_bits = 0;
        float prev_e = 0.0f;
        for (size_t i = 0; i < n; ++i) {
            uint32_t bits;
            std::memcpy(&bits, &sorted[i], sizeof(bits));
            if (i == 0 || bits != prev_bits) {
                prev_e = std::exp((sorted[i] - max_l) / temperature);
                prev_bits = bits;
            }
            pr[i] = prev_e;
            sum += prev_e;
        }
        float prev_x = 0.0f, prev_p = 0.0f;
        for (size_t i = 0; i < n; ++i) {
            const float x = pr[i];
            if (i == 0 || x != prev_x) {
                prev_p = (float)(x / sum);
                prev_x = x;
            }
            pr[i] = prev_p;
        }
        return;
    }
    const float max_l = logits[ids[0]];
    for (size_t i = 0; i < n; ++i) {
        pr[i] = std::exp((logits[ids[i]] - max_l) / temperature);
        sum += pr[i];
    }
    for (size_t i = 0; i < n; ++i) pr[i] = (float)(pr[i] / sum);
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

    if (p.greedy()) {
        // first maximum: ties go to the lowest id, as llama.cpp's greedy sampler
        out.ids.clear();
        out.probs.clear();
        out.ids.push_back((int32_t)(std::max_element(l, l + n_vocab) - l));
        out.probs.push_back(1.0f);
        return;
    }
    int64_t k = p.top_k > 0 ? std::min<int64_t>(p.top_k, n_vocab) : n_vocab;
    // out's vectors are not cleared first: every entry is overwritten below, and resizing a cleared
    // vector would zero 248320 entries of each for nothing
    const float * sorted = nullptr;  // l[out.ids[i]] at i, where the order came with it
    if (k > kRadixFrom && reference_ != Reference::comparison_sort) {
        // the comparison's order (logit_order.h), in linear time
        if (reference_ == Reference::none) {
            order_by_logit(l, n_vocab, out.ids, &sorted_);
            sorted = sorted_.data();
            sorts_.in_order++;
        } else {
            order_by_logit(l, n_vocab, out.ids);
        }
        sorts_.radix++;
    } else {
        const auto by_logit = [l](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
        out.ids.resize(n_vocab);
        std::iota(out.ids.begin(), out.ids.end(), 0);
        std::partial_sort(out.ids.begin(), out.ids.begin() + k, out.ids.end(), by_logit);
        if (k > kRadixFrom) sorts_.comparison++;
    }
    out.ids.resize(k);

    shape(l, sorted, out);
}

void Sampler::shape(const float * l, const float * sorted, Distribution & out) const {
    const SamplingParams & p = params_;
    // the temperature-1 probabilities only serve the top-p and min-p cuts; without them the
    // final softmax below recomputes every probability from the logits anyway
    if (p.top_p < 1.0f || p.min_p > 0.0f) softmax(l, sorted, out.ids, out.probs);
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
        softmax(l, sorted, out.ids, out.probs);
    }
    if (p.min_p > 0.0f) {  // drop tokens below min_p times the top probability
        const float floor = p.min_p * out.probs[0];
        size_t keep = 1;
        while (keep < out.ids.size() && out.probs[keep] >= floor) ++keep;
        out.ids.resize(keep);
    }
    softmax(l, sorted, out.ids, out.probs, p.temperature);
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
    shape(logits, logits, out);  // candidate i's logit is logits[i]: already in order
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
