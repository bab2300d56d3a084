#include "draft_tree.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>

namespace deltaspec {

int32_t DraftTree::add(int32_t tok, int32_t par, int32_t q) {
    if (par < -1 || par >= (int32_t)size()) {
        throw std::invalid_argument("DraftTree::add: parent " + std::to_string(par) + " does not exist yet");
    }
    token.push_back(tok);
    parent.push_back(par);
    depth.push_back(par < 0 ? 1 : depth[par] + 1);
    child_q.push_back(q);
    return (int32_t)size() - 1;
}

std::vector<int32_t> DraftTree::children(int32_t node) const {
    std::vector<int32_t> out;
    for (int32_t i = node + 1; i < (int32_t)size(); ++i) {  // children come after their parent
        if (parent[i] == node) out.push_back(i);
    }
    return out;
}

std::vector<int32_t> DraftTree::path_tokens(int32_t node) const {
    std::vector<int32_t> out;
    for (int32_t n = node; n >= 0; n = parent[n]) out.push_back(token[n]);
    std::reverse(out.begin(), out.end());
    return out;
}

int64_t DraftTree::chain_length() const {
    int64_t n = 0;
    while (n < size() && parent[n] == n - 1) ++n;
    return n;
}

int32_t DraftTree::max_depth() const { return depth.empty() ? 0 : *std::max_element(depth.begin(), depth.end()); }

void DraftTree::check(int64_t n_vocab) const {
    const size_t n = token.size();
    if (parent.size() != n || depth.size() != n || child_q.size() != n) {
        throw std::invalid_argument("draft tree: token, parent, depth and child_q must have one entry per node");
    }
    auto bad_q = [this](int32_t q) { return q < -1 || q >= (int32_t)dists.size(); };
    if (bad_q(root_child_q)) throw std::invalid_argument("draft tree: root_child_q is not an index into dists");
    for (size_t i = 0; i < n; ++i) {
        const std::string node = "draft tree node " + std::to_string(i);
        if (parent[i] < -1 || parent[i] >= (int32_t)i) {
            throw std::invalid_argument(node + ": parent " + std::to_string(parent[i]) +
                                        " must be -1 (the root) or an earlier node");
        }
        if (depth[i] != (parent[i] < 0 ? 1 : depth[parent[i]] + 1)) {
            throw std::invalid_argument(node + ": depth " + std::to_string(depth[i]) + " is not its parent's + 1");
        }
        if (token[i] < 0 || token[i] >= n_vocab) {
            throw std::invalid_argument(node + ": token " + std::to_string(token[i]) + " outside the vocabulary [0, " +
                                        std::to_string(n_vocab) + ")");
        }
        if (bad_q(child_q[i])) throw std::invalid_argument(node + ": child_q is not an index into dists");
    }
}

DraftTree chain_tree(const std::vector<int32_t> & tokens, const std::vector<Distribution> & dists) {
    if (!dists.empty() && dists.size() != tokens.size()) {
        throw std::invalid_argument("chain_tree: dists must be empty or one per token");
    }
    DraftTree t;
    t.dists = dists;
    t.root_child_q = dists.empty() ? -1 : 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
        const bool has_child_q = !dists.empty() && i + 1 < tokens.size();
        t.add(tokens[i], (int32_t)i - 1, has_child_q ? (int32_t)i + 1 : -1);
    }
    return t;
}

namespace {

// A node's candidate children, best rank first: the token of each rank and log of q's rank-th
// largest probability (what the rank scores; the token only says who fills the rank).
struct Candidates {
    std::vector<int32_t> ids;
    std::vector<double> log_sorted;
};

Candidates rank_candidates(const Distribution & d, int64_t k_max, const std::function<double()> & uniform) {
    std::vector<int32_t> order;
    for (int32_t i = 0; i < (int32_t)d.ids.size(); ++i) {
        if (d.probs[i] > 0.0f) order.push_back(i);
    }
    const int64_t k = std::min<int64_t>(k_max, (int64_t)order.size());
    Candidates c;
    if (k <= 0) return c;
    auto by_prob = [&d](int32_t a, int32_t b) {
        return d.probs[a] > d.probs[b] || (d.probs[a] == d.probs[b] && d.ids[a] < d.ids[b]);
    };
    std::vector<int32_t> sorted = order;
    std::partial_sort(sorted.begin(), sorted.begin() + k, sorted.end(), by_prob);
    for (int64_t r = 0; r < k; ++r) c.log_sorted.push_back(std::log((double)d.probs[sorted[r]]));
    if (!uniform) {
        for (int64_t r = 0; r < k; ++r) c.ids.push_back(d.ids[sorted[r]]);
        return c;
    }
    // Gumbel top-k: the order of log q + Gumbel noise is a draw without replacement from q
    std::vector<double> key(d.ids.size());
    for (int32_t i : order) key[i] = std::log((double)d.probs[i]) - std::log(-std::log(uniform()));
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&key](int32_t a, int32_t b) { return key[a] > key[b]; });
    for (int64_t r = 0; r < k; ++r) c.ids.push_back(d.ids[order[r]]);
    return c;
}

}  // namespace

DraftTree build_best_first(const NodeDistribution & dist, const BestFirstOptions & opts) {
    DraftTree tree;
    const int64_t budget = std::max<int64_t>(opts.budget, 0), max_depth = std::max<int64_t>(opts.max_depth, 0);
    const int64_t k_max = opts.max_children > 0 ? std::min(opts.max_children, budget) : budget;
    const bool sampled = (bool)opts.uniform;
    std::vector<Candidates> cands(1);  // index node + 1
    std::vector<double> score;         // path score of each node
    Distribution d;

    // the candidates of `node` (-1: root), asking the drafter for its distribution
    auto expand = [&](int32_t node) {
        d.ids.clear();
        d.probs.clear();
        dist(tree, node, d);
        cands[node + 1] = rank_candidates(d, k_max, opts.uniform);
        if (sampled && !cands[node + 1].ids.empty()) {
            tree.dists.push_back(d);
            (node < 0 ? tree.root_child_q : tree.child_q[node]) = (int32_t)tree.dists.size() - 1;
        }
    };
    auto add = [&](int32_t par, int64_t rank) {
        const int32_t n = tree.add(cands[par + 1].ids[rank], par);
        cands.emplace_back();
        score.push_back((par < 0 ? 0.0 : score[par]) + cands[par + 1].log_sorted[rank]);
        if (tree.depth[n] < max_depth && tree.size() < budget) expand(n);
        return n;
    };
    // frontier: (score, -sequence, parent, rank); the sequence breaks ties in insertion order
    using Item = std::tuple<double, int64_t, int32_t, int64_t>;
    std::priority_queue<Item> frontier;
    int64_t seq = 0;
    auto offer = [&](int32_t par, int64_t rank) {
        const Candidates & c = cands[par + 1];
        if (rank < (int64_t)c.ids.size()) {
            frontier.emplace((par < 0 ? 0.0 : score[par]) + c.log_sorted[rank], -(seq++), par, rank);
        }
    };

    if (budget == 0 || max_depth == 0) return tree;
    expand(-1);
    if (opts.seed_chain) {
        // the top-1 chain first: the likeliest path must be verified whatever the scores elsewhere
        for (int32_t node = -1; tree.size() < std::min(budget, max_depth) && !cands[node + 1].ids.empty();) {
            offer(node, 1);
            node = add(node, 0);
        }
        if (!tree.empty()) offer((int32_t)tree.size() - 1, 0);  // the chain's end may grow further
    } else {
        offer(-1, 0);
    }
    while (tree.size() < budget && !frontier.empty()) {
        const auto [s, neg_seq, par, rank] = frontier.top();
        frontier.pop();
        offer(par, rank + 1);
        const int32_t n = add(par, rank);
        offer(n, 0);
    }
    return tree;
}

DraftTree build_from_marginals(const std::vector<Distribution> & marginals, const BestFirstOptions & opts) {
    BestFirstOptions o = opts;
    o.max_depth = std::min<int64_t>(opts.max_depth, (int64_t)marginals.size());
    DraftTree tree = build_best_first(
        [&marginals](const DraftTree & t, int32_t node, Distribution & out) {
            out = marginals[node < 0 ? 0 : t.depth[node]];
        },
        o);
    // one shared copy per depth instead of one per expanded node
    auto depth_q = [&tree](int32_t node) { return node < 0 ? 0 : tree.depth[node]; };
    if (tree.root_child_q >= 0) tree.root_child_q = 0;
    for (int32_t n = 0; n < (int32_t)tree.size(); ++n) {
        if (tree.child_q[n] >= 0) tree.child_q[n] = depth_q(n);
    }
    if (!tree.dists.empty()) tree.dists = marginals;
    return tree;
}

}  // namespace deltaspec
