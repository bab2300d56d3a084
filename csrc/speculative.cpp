#include "speculative.h"
#include "env.h"

#include <algorithm>
#include <vector>

namespace deltaspec {

namespace {

float prob_of(const Distribution & d, int32_t token) {
    for (size_t i = 0; i < d.ids.size(); ++i) {
        if (d.ids[i] == token) return d.probs[i];
    }
    return 0.0f;
}

// norm(max(0, p - q)): where a rejected draft token's mass goes (Leviathan et al., Chen et al.).
// q is looked up densely by id: a drafter sampling without top-k hands over a whole-vocabulary q,
// and scanning it once per candidate of p was quadratic in the vocabulary.
Distribution residual(const Distribution & p, const Distribution * q, int32_t drafted) {
    thread_local std::vector<float> q_at;     // q's probability by id (prob_of's: the first entry)
    thread_local std::vector<uint8_t> in_q;   // whether q lists the id
    if (q) {
        for (size_t i = 0; i < q->ids.size(); ++i) {
            const int32_t id = q->ids[i];
            if (id < 0) continue;  // matches no candidate of p
            if ((size_t)id >= q_at.size()) {
                q_at.resize((size_t)id + 1, 0.0f);
                in_q.resize((size_t)id + 1, 0);
            }
            if (!in_q[id]) {
                in_q[id] = 1;
                q_at[id] = q->probs[i];
            }
        }
    }
    Distribution r;
    r.ids.reserve(p.ids.size());  // up to the whole vocabulary: no regrowth on the way
    r.probs.reserve(p.ids.size());
    double sum = 0.0;
    for (size_t i = 0; i < p.ids.size(); ++i) {
        const int32_t id = p.ids[i];
        const float qi = q ? ((size_t)id < q_at.size() && in_q[id] ? q_at[id] : 0.0f) : (id == drafted ? 1.0f : 0.0f);
        const float m = std::max(0.0f, p.probs[i] - qi);
        if (m > 0.0f) {
            r.ids.push_back(id);
            r.probs.push_back(m);
            sum += m;
        }
    }
    if (q) {
        for (int32_t id : q->ids) {
            if (id >= 0) in_q[id] = 0;
        }
    }
    if (r.ids.empty()) return p;  // p <= q everywhere only when p == q: rejection cannot happen then
    for (float & x : r.probs) x = (float)(x / sum);
    return r;
}

}  // namespace

PlantedBug planted_bug() {
    return static_cast<PlantedBug>(planted_choice("DELTASPEC_TEST_WRONG_SPEC_RULE", {"residual", "accept"}));
}

int64_t accept_draft(const float * rows, int64_t n_vocab, const Draft & draft, Sampler & sampler,
                     std::vector<int32_t> & history, int32_t & next, PlantedBug bug) {
    const RowDistribution p_of = [&](int64_t i, const std::vector<int32_t> & h, Distribution & p) {
        sampler.distribution(rows + i * n_vocab, n_vocab, h, p);
    };
    return accept_draft(p_of, draft, sampler, history, next, bug);
}

int64_t accept_draft(const RowDistribution & p_of, const Draft & draft, Sampler & sampler,
                     std::vector<int32_t> & history, int32_t & next, PlantedBug bug) {
    Distribution p;
    const int64_t k = (int64_t)draft.tokens.size();
    for (int64_t i = 0; i < k; ++i) {
        p_of(i, history, p);
        const int32_t d = draft.tokens[i];
        const Distribution * q = draft.dists.empty() ? nullptr : &draft.dists[i];
        const float pd = prob_of(p, d);
        const float qd = q ? prob_of(*q, d) : 1.0f;
        // greedy targets have one-hot p: this is exact match; otherwise accept with min(1, p/q)
        const double ratio = bug == PlantedBug::accept_ignores_q ? (double)pd : (double)pd / qd;
        const bool accepted = pd > 0.0f && (ratio >= 1.0 || sampler.uniform() < ratio);
        if (!accepted) {
            next = sampler.draw(bug == PlantedBug::residual_is_p ? p : residual(p, q, d));
            return i;
        }
        history.push_back(d);
    }
    p_of(k, history, p);  // all accepted: the bonus token
    next = sampler.draw(p);
    return k;
}

int64_t accept_argmax(const int32_t * argmax, const Draft & draft, std::vector<int32_t> & history, int32_t & next) {
    int64_t i = 0;
    while (i < (int64_t)draft.tokens.size() && draft.tokens[i] == argmax[i]) history.push_back(draft.tokens[i++]);
    next = argmax[i];  // the correction, or the bonus token after a fully accepted draft
    return i;
}

}  // namespace deltaspec
