// Draft trees: the candidates one speculative round verifies, more than one continuation per node.
// A chain is the special case where every node has one child. The target verifies the rows
// [root, node 0, node 1, ...] in one pass (root = the last committed token); tree_walk.h decides
// which path it accepts.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "sampler.h"

namespace deltaspec {

// How the children of a node that records a q were drawn from it. The multi-draft rejection rule
// (tree_walk.h) is exact only for the way the children really were drawn, so the tree says which.
enum class ChildDraw : uint8_t {
    without_replacement,  // child i from q with children 0..i-1 removed (q renormalized)
    iid,                  // every child an independent draw from q (SpecInfer's setting)
};

// Nodes are stored so that a parent precedes its children. Most drafters put the top-1 chain first
// (nodes 0 .. chain_length()-1 each the child of the one before, node 0 a child of the root); a
// pure best-first tree (BestFirstOptions::seed_chain false) stores nodes in score order instead.
struct DraftTree {
    std::vector<int32_t> token;   // the drafted token of each node
    std::vector<int32_t> parent;  // its parent node; -1: a child of the root (the last committed token)
    std::vector<int32_t> depth;   // 1 for the root's children, parent's depth + 1 below
    // The draft distribution q each node's children were drawn from, as an index into `dists`, or
    // -1 when they were chosen deterministically (top-k of a ranking, n-gram lookup): the walk then
    // treats each child as one-hot, which is the only exact reading of a choice that was not a draw.
    std::vector<int32_t> child_q;
    int32_t root_child_q = -1;    // the same for the root's children
    std::vector<Distribution> dists;  // shared: nodes of one depth may share a marginal (DFlash)
    ChildDraw draw = ChildDraw::without_replacement;
    // what drafting it cost, in target decode steps (an estimate independent of timing, as Draft::cost)
    double cost = 0.0;

    int64_t size() const { return (int64_t)token.size(); }
    bool empty() const { return token.empty(); }
    // Appends a node (its parent must exist already); returns its index.
    int32_t add(int32_t tok, int32_t par, int32_t q = -1);
    int32_t children_q(int32_t node) const { return node < 0 ? root_child_q : child_q[node]; }
    // The children of `node` (-1: the root) in the order they were drafted.
    std::vector<int32_t> children(int32_t node) const;
    // Tokens from the root's child down to `node` (empty for -1).
    std::vector<int32_t> path_tokens(int32_t node) const;
    int64_t chain_length() const;  // length of the leading chain 0 -> 1 -> 2 ...
    int32_t max_depth() const;
    // Throws std::invalid_argument naming the node and field when the tree breaks the rules above
    // (parents first, depths, token ids < n_vocab, q indices). Costs O(size), not O(vocabulary):
    // the rejection walk checks q(child) > 0 where it reads it.
    void check(int64_t n_vocab) const;
};

// A chain as a tree: node i the child of node i-1; `dists[i]`, when given, the q token i was drawn from.
DraftTree chain_tree(const std::vector<int32_t> & tokens, const std::vector<Distribution> & dists = {});

// The draft's next-token distribution after `node`'s path (-1: after the committed tokens). Ids in
// any order with their probabilities; leaving `out` empty means "do not expand this node".
using NodeDistribution = std::function<void(const DraftTree & tree, int32_t node, Distribution & out)>;

struct BestFirstOptions {
    int64_t budget = 16;        // most nodes (the root not counted): the verify batch is budget + 1
    int64_t max_depth = 16;     // deepest node
    int64_t max_children = 0;   // most children per node (<= 0: no limit but the budget)
    // Set: children are drawn from each node's q without replacement (Gumbel top-k with these
    // uniforms) and q is recorded, so that rejection sampling can be exact. Unset: children are the
    // most probable tokens, chosen deterministically, and no q is recorded.
    std::function<double()> uniform;
    // The top-1 chain first, whatever its scores (Luce's default); false: pure best-first from the
    // root's rank-0 candidate, the DDTree paper's rule (liranringel/ddtree, our torch reference
    // bench/testbed/ddtree.py), which can leave the chain's deep nodes out for likelier branches.
    bool seed_chain = true;
};

// DDTree's best-first expansion, with the top-1 chain seeded first (as Luce) when seed_chain: the
// chain of rank-0 children down to min(max_depth, budget); then, until the budget is spent, the
// candidate with the highest path score, where a candidate is (node, rank r) and its score is the
// node's score plus log of q's r-th largest probability (ties: the candidate offered first).
// Popping a candidate adds the node and offers its next-rank sibling, then its own rank-0 child.
// Scores use q's sorted probabilities, never the drawn token's, so that whether a drawn child exists never depends on which token it is (what keeps
// rejection sampling exact on sampled trees). `dist` is called once per node that may get
// children, in the order nodes are added.
DraftTree build_best_first(const NodeDistribution & dist, const BestFirstOptions & opts);

// DDTree from per-depth marginals (a block drafter such as DFlash): the children of every node of
// depth d come from marginals[d] (marginals[0]: the root's children). max_depth = marginals.size().
DraftTree build_from_marginals(const std::vector<Distribution> & marginals, const BestFirstOptions & opts);

}  // namespace deltaspec
