#include "tree_walk.h"
#include "env.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace deltaspec {

TreeRuleBug tree_rule_bug() {
    return static_cast<TreeRuleBug>(planted_choice("DELTASPEC_TEST_WRONG_TREE_RULE",
                                                   {"fresh_next", "no_residual", "no_q_update"}));
}

namespace {

// A distribution held densely over the vocabulary with the list of ids it may be non-zero at, so
// that residual updates cost the support's size, not the vocabulary's.
struct DenseDist {
    std::vector<double> prob;
    std::vector<int32_t> support;

    void set(const Distribution & d, int64_t n_vocab) {
        clear();
        prob.resize(n_vocab, 0.0);
        support.reserve(d.ids.size());
        double sum = 0.0;
        for (float x : d.probs) sum += x;
        for (size_t i = 0; i < d.ids.size(); ++i) {
            if (d.probs[i] <= 0.0f) continue;
            prob[d.ids[i]] += d.probs[i] / sum;
            support.push_back(d.ids[i]);
        }
    }
    void clear() {
        for (int32_t id : support) prob[id] = 0.0;
        support.clear();
    }
    void normalize() {
        double sum = 0.0;
        for (int32_t id : support) sum += prob[id];
        if (sum <= 0.0) return;
        for (int32_t id : support) prob[id] /= sum;
    }
    Distribution sparse() const {
        Distribution d;
        d.ids.reserve(support.size());
        d.probs.reserve(support.size());
        for (int32_t id : support) {
            if (prob[id] > 0.0) {
                d.ids.push_back(id);
                d.probs.push_back((float)prob[id]);
            }
        }
        return d;
    }
};

// The target's p as the walk shrinks it: probabilities stored in the order of p's candidates
// (most probable first). It computes what a DenseDist would, in the same order, so the draws are
// the same bit for bit; only the memory walk differs. A residual's normalization is left pending
// (p[i] = max(0, prob[i] - minus[i]) / pending, computed where read) and done in the same pass as
// the next residual's sum, so a run of rejected siblings costs one pass over the candidates each
// instead of two scattered ones (248320 ids: ~0.25 instead of ~1 ms).
//
// set() makes one pass over the candidates: the sum that normalizes p, and the places of the few
// ids ever looked up at a node (its children's tokens and their q's support), found through a bit
// per vocabulary id; a place for every id would cost two scattered writes per candidate (filling,
// then clearing). Until the first residual p[i] is read as given[i] / norm where needed, and the
// first residual's pass writes prob[]: a node whose first child is accepted never fills it.
// Candidates of probability 0 keep their slot with p 0: their terms add +0.0 to every sum and they
// are never drawn, as when they were left out.
struct TargetDist {
    const int32_t * ids = nullptr;  // p's candidates in p's order (the Distribution given to set())
    const float * given = nullptr;  // their probabilities as given (not normalized)
    size_t n = 0;
    double norm = 0.0;              // the sum of given[], in order
    bool filled = false;            // prob[] holds p's values (else p[i] = given[i] / norm)
    std::vector<double> prob;       // see `pending`
    std::vector<uint64_t> wanted;   // bit per vocabulary id: the ids set() finds places for
    std::vector<std::pair<int32_t, int32_t>> places;  // (id, i with ids[i] == id) of the wanted ids found
    // what residuals take from prob[i] (0 but at q's ids): minus[cur] the pending one's, minus[1 -
    // cur] the next one's, both listed in marked[] to be zeroed again
    std::vector<double> minus[2];
    std::vector<int32_t> marked[2];
    std::vector<int32_t> stops;  // take_marked's scratch
    int cur = 0;
    double pending = 0.0;  // > 0: p[i] = max(0, prob[i] - minus[cur][i]) / pending; else p[i] = prob[i]

    // `lookups`: the ids at() and mark() will be asked about (the others read as absent). `d` must
    // outlive this use (up to clear()).
    void set(const Distribution & d, int64_t n_vocab, const std::vector<int32_t> & lookups) {
        clear();
        n = d.ids.size();
        ids = d.ids.data();
        given = d.probs.data();
        wanted.resize((size_t)(n_vocab + 63) / 64, 0);
        for (int32_t id : lookups) wanted[(uint32_t)id >> 6] |= 1ull << (id & 63);
        const uint64_t * bits = wanted.data();
        double sum = 0.0;
        for (size_t i = 0; i < n; ++i) {  // the lookups ride on the sum's dependency chain
            sum += given[i];
            const uint32_t id = (uint32_t)ids[i];
            if ((bits[id >> 6] >> (id & 63)) & 1) places.emplace_back((int32_t)id, (int32_t)i);
        }
        norm = sum;
        for (int32_t id : lookups) wanted[(uint32_t)id >> 6] = 0;
        for (auto & m : minus) {
            if (m.size() < n) m.resize(n, 0.0);  // all 0 where not marked
        }
    }
    void unmark(int k) {
        for (int32_t i : marked[k]) minus[k][i] = 0.0;
        marked[k].clear();
    }
    void clear() {
        places.clear();
        unmark(0);
        unmark(1);
        pending = 0.0;
        filled = false;
        n = 0;
    }
    int32_t place(int32_t id) const {
        for (const auto & [pid, i] : places) {
            if (pid == id) return i;
        }
        return -1;
    }
    double initial(size_t i) const { return given[i] <= 0.0f ? 0.0 : given[i] / norm; }  // a NaN stays, as it did
    double value(size_t i) const {
        if (!filled) return initial(i);
        return pending > 0.0 ? std::max(0.0, prob[i] - minus[cur][i]) / pending : prob[i];
    }
    double at(int32_t id) const {
        const int32_t i = place(id);
        return i < 0 ? 0.0 : value(i);
    }
    // the next residual takes q (a token's probability under q) at that token
    void mark(int32_t id, double q) {
        const int32_t i = place(id);
        if (i < 0 || q == 0.0 || given[i] <= 0.0f) return;
        minus[1 - cur][i] = q;
        marked[1 - cur].push_back(i);
    }
    // p <- norm(max(0, p - q)) with q the marked values; the sum runs in candidate order, as it
    // always has; the division stays pending. Between marked places minus[] is 0, where the terms
    // are max(0, p - 0) == max(0, p) exactly: those runs skip reading minus[] (248320 ids: two
    // fewer 2 MB streams per rejected child).
    void take_marked() {
        const int next = 1 - cur;
        const double * m = minus[next].data();
        // the marked places of both residuals, in order, each once
        stops.assign(marked[0].begin(), marked[0].end());
        stops.insert(stops.end(), marked[1].begin(), marked[1].end());
        std::sort(stops.begin(), stops.end());
        stops.erase(std::unique(stops.begin(), stops.end()), stops.end());
        stops.push_back((int32_t)n);
        double sum = 0.0;
        size_t i = 0;
        if (!filled) {  // the first residual: p's values written as its sum reads them
            prob.resize(n);  // not cleared between uses: every entry is written here
            double * pr = prob.data();
            for (int32_t stop : stops) {
                for (; i < (size_t)stop; ++i) {
                    const double v = initial(i);
                    pr[i] = v;
                    sum += std::max(0.0, v);
                }
                if (i == n) break;
                const double v = initial(i);
                pr[i] = v;
                sum += std::max(0.0, v - m[i]);
                ++i;
            }
            filled = true;
        } else if (pending > 0.0) {  // the pending division, then this residual's sum, in one pass
            double * pr = prob.data();
            const double * old = minus[cur].data();
            const double div = pending;  // a local: the stores through pr could alias the member
            for (int32_t stop : stops) {
                for (; i < (size_t)stop; ++i) {
                    const double v = std::max(0.0, pr[i]) / div;
                    pr[i] = v;
                    sum += std::max(0.0, v);
                }
                if (i == n) break;
                const double v = std::max(0.0, pr[i] - old[i]) / div;
                pr[i] = v;
                sum += std::max(0.0, v - m[i]);
                ++i;
            }
        } else {
            const double * pr = prob.data();
            for (int32_t stop : stops) {
                for (; i < (size_t)stop; ++i) sum += std::max(0.0, pr[i]);
                if (i == n) break;
                sum += std::max(0.0, pr[i] - m[i]);
                ++i;
            }
        }
        unmark(cur);
        cur = next;
        // sum <= 0: p <= q everywhere, i.e. p == q, where rejection is a rounding artefact; p stays
        pending = sum > 0.0 ? sum : 0.0;
        if (pending == 0.0) unmark(cur);
    }
    // The candidates with p > 0 as a Distribution (what draw() draws from without building it).
    Distribution sparse() const {
        Distribution d;
        for (size_t i = 0; i < n; ++i) {
            const double v = value(i);
            if (v > 0.0) {
                d.ids.push_back(ids[i]);
                d.probs.push_back((float)v);
            }
        }
        return d;
    }
    // sampler.draw(sparse()), token for token: the same uniforms, sums and fallback, read in place
    int32_t draw(Sampler & sampler) const {
        size_t first = n, positives = 0;
        for (size_t i = 0; i < n && positives < 2; ++i) {  // a single candidate is returned undrawn
            if (value(i) > 0.0) {
                if (positives++ == 0) first = i;
            }
        }
        if (positives == 1) return ids[first];
        const double u = sampler.uniform();
        double cum = 0.0;
        size_t last = n;  // the last candidate with p > 0
        for (size_t i = 0; i < n; ++i) {
            const double v = value(i);
            if (v > 0.0) {
                cum += (float)v;
                if (u < cum) return ids[i];
                last = i;
            }
        }
        for (size_t i = n; i-- > 0;) {  // u above the summed mass: as Sampler::draw
            const double v = value(i);
            if (v > 0.0 && (float)v > 0.0f) return ids[i];
        }
        if (last == n) throw std::logic_error("the tree walk's residual has no candidate");
        return ids[last];
    }
};

int32_t child_with_token(const DraftTree & tree, const std::vector<int32_t> & children, int32_t token) {
    for (int32_t c : children) {
        if (tree.token[c] == token) return c;
    }
    return -1;
}

// The rejection rule at one node: the accepted child, or -1 with `p` left as the residual the
// next token comes from.
int32_t try_children(const DraftTree & tree, const std::vector<int32_t> & children, int32_t node, TargetDist & p,
                     DenseDist & q, int64_t n_vocab, Sampler & sampler, TreeRuleBug bug) {
    const int32_t qi = tree.children_q(node);
    const bool drawn = qi >= 0;
    if (drawn) q.set(tree.dists[qi], n_vocab);
    for (int32_t c : children) {
        const int32_t tok = tree.token[c];
        const double pc = p.at(tok);
        const double qc = drawn ? q.prob[tok] : 1.0;
        if (qc <= 0.0) {
            throw std::invalid_argument("draft tree node " + std::to_string(c) + ": token " + std::to_string(tok) +
                                        " has probability 0 under the q it was drawn from (or repeats a sibling "
                                        "drawn without replacement)");
        }
        if (pc > 0.0 && (pc >= qc || sampler.uniform() < pc / qc)) {
            q.clear();
            return c;
        }
        if (bug != TreeRuleBug::no_residual) {  // p <- norm(max(0, p - q)); p only shrinks
            if (drawn) {
                for (int32_t id : q.support) p.mark(id, q.prob[id]);
            } else {
                p.mark(tok, 1.0);
            }
            p.take_marked();
        }
        if (drawn && tree.draw == ChildDraw::without_replacement && bug != TreeRuleBug::no_q_update) {
            q.prob[tok] = 0.0;
            q.normalize();
        }
    }
    q.clear();
    return -1;
}

}  // namespace

TreeWalk walk_tree(const DraftTree & tree, const float * rows, int64_t n_vocab, Sampler & sampler,
                   std::vector<int32_t> & history, TreeRule rule, TreeRuleBug bug) {
    const RowDistribution p_of = [&](int64_t r, const std::vector<int32_t> & h, Distribution & p) {
        sampler.distribution(rows + r * n_vocab, n_vocab, h, p);
    };
    return walk_tree(tree, p_of, n_vocab, sampler, history, rule, bug);
}

TreeWalk walk_tree(const DraftTree & tree, const RowDistribution & p_of, int64_t n_vocab, Sampler & sampler,
                   std::vector<int32_t> & history, TreeRule rule, TreeRuleBug bug) {
    tree.check(n_vocab);
    TreeWalk w;
    Distribution target;
    // vocabulary-sized, so kept between walks; set() starts by clearing what the last use left
    thread_local TargetDist p;
    thread_local DenseDist q;
    std::vector<int32_t> lookups;
    for (int32_t node = -1;;) {
        p_of(node + 1, history, target);
        const std::vector<int32_t> children = tree.children(node);
        int32_t next_node = -1;
        if (rule == TreeRule::match) {
            const int32_t y = sampler.draw(target);
            next_node = child_with_token(tree, children, y);
            if (next_node < 0) {
                w.next = bug == TreeRuleBug::fresh_next ? sampler.draw(target) : y;
                return w;
            }
        } else {
            // the ids try_children reads p at: the children's tokens and their q's support
            lookups.clear();
            for (int32_t c : children) lookups.push_back(tree.token[c]);
            const int32_t qi = tree.children_q(node);
            if (qi >= 0 && !children.empty()) {
                for (int32_t id : tree.dists[qi].ids) {
                    if (id >= 0 && id < n_vocab) lookups.push_back(id);
                }
            }
            p.set(target, n_vocab, lookups);
            next_node = children.empty() ? -1 : try_children(tree, children, node, p, q, n_vocab, sampler, bug);
            if (next_node < 0) {
                w.next = sampler.reference() == Sampler::Reference::gathering ? sampler.draw(p.sparse()) : p.draw(sampler);
                p.clear();
                return w;
            }
            p.clear();
        }
        w.path.push_back(next_node);
        history.push_back(tree.token[next_node]);
        node = next_node;
    }
}

TreeWalk walk_tree_argmax(const DraftTree & tree, const int32_t * argmax, std::vector<int32_t> & history) {
    TreeWalk w;
    for (int32_t node = -1;;) {
        const int32_t next_node = child_with_token(tree, tree.children(node), argmax[node + 1]);
        if (next_node < 0) {
            w.next = argmax[node + 1];
            return w;
        }
        w.path.push_back(next_node);
        history.push_back(tree.token[next_node]);
        node = next_node;
    }
}

}  // namespace deltaspec
