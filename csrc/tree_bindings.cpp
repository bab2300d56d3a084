// Test-only bindings of draft trees and tree walks (tests/test_draft_tree.py, tests/test_tree_walk.py).
// A tree crosses as a dict {token, parent, depth, child_q, root_child_q, dists: [(ids, probs)],
// draw: "without_replacement" | "iid", cost}.
#include "tree_bindings.h"

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "batch_draft.h"
#include "draft_tree.h"
#include "drafters.h"
#include "speculative.h"
#include "tree_walk.h"

namespace py = pybind11;

namespace deltaspec {

namespace {

using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using SparseDist = std::pair<std::vector<int32_t>, std::vector<float>>;

Distribution to_dist(const SparseDist & d) {
    if (d.first.size() != d.second.size()) throw std::invalid_argument("a distribution needs as many probs as ids");
    return Distribution{d.first, d.second};
}

py::dict tree_dict(const DraftTree & t) {
    py::dict out;
    out["token"] = t.token;
    out["parent"] = t.parent;
    out["depth"] = t.depth;
    out["child_q"] = t.child_q;
    out["root_child_q"] = t.root_child_q;
    py::list dists;
    for (const Distribution & d : t.dists) dists.append(py::make_tuple(d.ids, d.probs));
    out["dists"] = dists;
    out["draw"] = t.draw == ChildDraw::iid ? "iid" : "without_replacement";
    out["cost"] = t.cost;
    return out;
}

DraftTree tree_from(const py::dict & d) {
    DraftTree t;
    t.token = d["token"].cast<std::vector<int32_t>>();
    t.parent = d["parent"].cast<std::vector<int32_t>>();
    t.depth = d.contains("depth") ? d["depth"].cast<std::vector<int32_t>>() : std::vector<int32_t>{};
    if (t.depth.empty()) {
        for (int32_t p : t.parent) t.depth.push_back(p < 0 || p >= (int32_t)t.depth.size() ? 1 : t.depth[p] + 1);
    }
    t.child_q = d.contains("child_q") ? d["child_q"].cast<std::vector<int32_t>>()
                                      : std::vector<int32_t>(t.token.size(), -1);
    t.root_child_q = d.contains("root_child_q") ? d["root_child_q"].cast<int32_t>() : -1;
    if (d.contains("dists")) {
        for (const auto & q : d["dists"].cast<std::vector<SparseDist>>()) t.dists.push_back(to_dist(q));
    }
    const std::string draw = d.contains("draw") ? d["draw"].cast<std::string>() : "without_replacement";
    if (draw != "iid" && draw != "without_replacement") {
        throw std::invalid_argument("tree draw must be 'iid' or 'without_replacement', not '" + draw + "'");
    }
    t.draw = draw == "iid" ? ChildDraw::iid : ChildDraw::without_replacement;
    return t;
}

TreeRule rule_from(const std::string & s) {
    if (s == "match") return TreeRule::match;
    if (s == "rejection") return TreeRule::rejection;
    throw std::invalid_argument("tree rule must be 'match' or 'rejection', not '" + s + "'");
}

BestFirstOptions options(int64_t budget, int64_t max_depth, int64_t max_children, py::object sample_seed,
                         std::mt19937_64 & rng, bool seed_chain = true) {
    BestFirstOptions o;
    o.seed_chain = seed_chain;
    o.budget = budget;
    o.max_depth = max_depth;
    o.max_children = max_children;
    if (!sample_seed.is_none()) {
        rng.seed(sample_seed.cast<uint64_t>());
        o.uniform = [&rng] { return std::uniform_real_distribution<double>(0.0, 1.0)(rng); };
    }
    return o;
}

py::dict walk_result(const TreeWalk & w) {
    py::dict out;
    out["path"] = w.path;
    out["next"] = w.next;
    return out;
}

// Rows of logits indexed by token prefix: all prefixes of length 0, 1, 2, ... of an n_vocab
// alphabet, in order of length, then lexicographically.
int64_t prefix_row(const std::vector<int32_t> & prefix, int64_t n_vocab) {
    int64_t offset = 0, width = 1, index = 0;
    for (size_t k = 0; k < prefix.size(); ++k) {
        offset += width;
        width *= n_vocab;
    }
    for (int32_t t : prefix) index = index * n_vocab + t;
    return offset + index;
}

}  // namespace

void bind_trees(py::module_ & m) {
    m.def(
        "tree_best_first",
        [](const std::function<SparseDist(std::vector<int32_t>)> & dist, int64_t budget, int64_t max_depth,
           int64_t max_children, py::object sample_seed, bool seed_chain) {
            std::mt19937_64 rng;
            std::vector<std::vector<int32_t>> asked;
            const DraftTree t = build_best_first(
                [&](const DraftTree & tree, int32_t node, Distribution & out) {
                    asked.push_back(tree.path_tokens(node));
                    out = to_dist(dist(asked.back()));
                },
                options(budget, max_depth, max_children, sample_seed, rng, seed_chain));
            py::dict out = tree_dict(t);
            out["asked"] = asked;  // the paths whose distribution the builder asked for, in order
            return out;
        },
        py::arg("dist"), py::arg("budget"), py::arg("max_depth"), py::arg("max_children") = 0,
        py::arg("sample_seed") = py::none(), py::arg("seed_chain") = true,
        "Test only: build_best_first with dist(path) -> (ids, probs); sample_seed set draws children "
        "without replacement; seed_chain false: pure best-first.");

    m.def(
        "tree_from_marginals",
        [](const std::vector<SparseDist> & marginals, int64_t budget, int64_t max_depth, int64_t max_children,
           py::object sample_seed, bool seed_chain) {
            std::vector<Distribution> ms;
            for (const auto & d : marginals) ms.push_back(to_dist(d));
            std::mt19937_64 rng;
            return tree_dict(build_from_marginals(ms, options(budget, max_depth, max_children, sample_seed, rng, seed_chain)));
        },
        py::arg("marginals"), py::arg("budget"), py::arg("max_depth"), py::arg("max_children") = 0,
        py::arg("sample_seed") = py::none(), py::arg("seed_chain") = true, "Test only: build_from_marginals.");

    m.def(
        "ngram_tree",
        [](const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth, int64_t max_ngram,
           int64_t min_ngram) {
            NgramDrafter d(max_ngram, min_ngram);
            py::dict out = tree_dict(d.propose_tree(committed, budget, max_depth));
            out["chain"] = d.propose(committed, max_depth).tokens;  // what the chain drafter proposes
            return out;
        },
        py::arg("committed"), py::arg("budget"), py::arg("max_depth"), py::arg("max_ngram") = 3,
        py::arg("min_ngram") = 1, "Test only: NgramDrafter::propose_tree (and its chain propose, as 'chain').");

    m.def(
        "model_drafter_trees",
        [](const std::string & path, const HParams & hp, const std::vector<std::vector<int32_t>> & rounds,
           int64_t budget, int64_t max_depth, const SamplingParams & sampling, int64_t n_ctx) {
            if (rounds.empty()) throw std::invalid_argument("rounds: at least the prompt");
            EngineOptions o;
            o.n_ctx = n_ctx;
            for (size_t k = 1; k < rounds.size(); ++k) {
                if (rounds[k].size() <= rounds[k - 1].size()) throw std::invalid_argument("rounds: each commits more tokens");
            }
            if (rounds[0].size() < 2) throw std::invalid_argument("rounds[0]: a prompt and its first generated token");
            std::vector<DraftTree> trees;
            {
                py::gil_scoped_release release;
                Engine draft(path, hp, o);
                BatchModelDrafter drafter(draft, 1.0);
                DraftSlotState state(sampling);
                // as the scheduler: the draft reads the prompt, the first round catches up on the first token
                drafter.begin(0, state, std::vector<int32_t>(rounds[0].begin(), rounds[0].end() - 1));
                for (const auto & committed : rounds) {
                    std::vector<DraftJob> jobs(1);
                    jobs[0].slot = 0;
                    jobs[0].state = &state;
                    jobs[0].committed = &committed;
                    jobs[0].n_max = max_depth;
                    jobs[0].tree_budget = budget;
                    drafter.propose(jobs);
                    trees.push_back(std::move(jobs[0].tree));
                }
            }
            py::list out;
            for (const DraftTree & t : trees) out.append(tree_dict(t));
            return out;
        },
        py::arg("path"), py::arg("hparams"), py::arg("rounds"), py::arg("budget"), py::arg("max_depth"),
        py::arg("sampling"), py::arg("n_ctx"),
        "Test only: a draft Engine on `path` (CPU) and the scheduler's draft-model drafter (BatchModelDrafter, "
        "step cost 1, slot 0) that reads rounds[0] but its last token (the prompt) and proposes a tree after "
        "each committed text in `rounds`.");

    m.def(
        "walk_tree",
        [](const py::dict & tree, F32 rows, const SamplingParams & sampling, std::vector<int32_t> history,
           const std::string & rule) {
            const DraftTree t = tree_from(tree);
            if (rows.ndim() != 2 || rows.shape(0) != t.size() + 1) {
                throw std::invalid_argument("rows must be (1 + nodes, n_vocab) logits, row 0 the root's");
            }
            Sampler sampler(sampling);
            py::dict out = walk_result(walk_tree(t, rows.data(), rows.shape(1), sampler, history, rule_from(rule),
                                                 tree_rule_bug()));
            out["history"] = history;
            out["radix_sorts"] = sampler.sort_counts().radix;  // how the walk ordered its rows (sampler.h)
            out["comparison_sorts"] = sampler.sort_counts().comparison;
            out["in_order_rows"] = sampler.sort_counts().in_order;
            return out;
        },
        py::arg("tree"), py::arg("rows"), py::arg("sampling"), py::arg("history"), py::arg("rule"),
        "Test only: walk_tree once (the planted DELTASPEC_TEST_WRONG_TREE_RULE applies).");

    m.def(
        "accept_chain",
        [](F32 rows, const std::vector<int32_t> & tokens, const std::vector<SparseDist> & dists,
           const SamplingParams & sampling, std::vector<int32_t> history) {
            if (rows.ndim() != 2 || rows.shape(0) != (py::ssize_t)tokens.size() + 1) {
                throw std::invalid_argument("rows must be (1 + tokens, n_vocab) logits");
            }
            Draft d;
            d.tokens = tokens;
            for (const auto & q : dists) d.dists.push_back(to_dist(q));
            Sampler sampler(sampling);
            int32_t next = -1;
            const int64_t n = accept_draft(rows.data(), rows.shape(1), d, sampler, history, next);
            py::dict out;
            out["n_accepted"] = n;
            out["next"] = next;
            out["history"] = history;
            out["radix_sorts"] = sampler.sort_counts().radix;
            out["comparison_sorts"] = sampler.sort_counts().comparison;
            out["in_order_rows"] = sampler.sort_counts().in_order;
            return out;
        },
        py::arg("rows"), py::arg("tokens"), py::arg("dists"), py::arg("sampling"), py::arg("history"),
        "Test only: the chain accept rule (speculative.h accept_draft), to compare with a chain's tree walk.");

    m.def(
        "walk_tree_argmax",
        [](const py::dict & tree, std::vector<int32_t> argmax) {
            const DraftTree t = tree_from(tree);
            if ((int64_t)argmax.size() != t.size() + 1) throw std::invalid_argument("argmax needs 1 + nodes ids");
            std::vector<int32_t> history;
            return walk_result(walk_tree_argmax(t, argmax.data(), history));
        },
        py::arg("tree"), py::arg("argmax"), "Test only: walk_tree_argmax.");

    m.def(
        "tree_walk_trials",
        [](F32 target, F32 draft, int64_t n_vocab, std::vector<int32_t> prompt, const SamplingParams & sampling,
           const std::string & tree_kind, int64_t budget, int64_t max_depth, const std::string & rule,
           int64_t n_trials, uint64_t seed) {
            // one round per trial: a tree drafted afresh (the draft's randomness is part of what the
            // rejection rule is exact over), the target's rows looked up by prefix, one walk
            if (tree_kind != "chosen" && tree_kind != "sampled") {
                throw std::invalid_argument("tree_kind must be 'chosen' or 'sampled'");
            }
            const TreeRule r = rule_from(rule);
            const TreeRuleBug bug = tree_rule_bug();
            const int64_t n_rows = prefix_row(std::vector<int32_t>(max_depth + 1, 0), n_vocab);
            if (target.ndim() != 2 || draft.ndim() != 2 || target.shape(1) != n_vocab || draft.shape(1) != n_vocab ||
                target.shape(0) < n_rows || draft.shape(0) < n_rows) {
                throw std::invalid_argument("target and draft need a row of n_vocab logits per prefix up to max_depth");
            }
            Sampler walker(sampling);
            SamplingParams ds = sampling;
            ds.seed = seed ^ 0x5DEECE66Dull;
            Sampler drafter(ds);
            std::mt19937_64 rng(seed);
            BestFirstOptions o;
            o.budget = budget;
            o.max_depth = max_depth;
            if (tree_kind == "sampled") o.uniform = [&rng] { return std::uniform_real_distribution<double>(0.0, 1.0)(rng); };
            std::vector<int32_t> history;
            auto dist = [&](const DraftTree & t, int32_t node, Distribution & out) {
                const std::vector<int32_t> path = t.path_tokens(node);
                history = prompt;
                history.insert(history.end(), path.begin(), path.end());
                drafter.distribution(draft.data() + prefix_row(path, n_vocab) * n_vocab, n_vocab, history, out);
            };
            py::array_t<int32_t> emitted({n_trials, max_depth + 1});
            py::array_t<int32_t> left_chain(n_trials), n_nodes(n_trials);
            auto e = emitted.mutable_unchecked<2>();
            auto lc = left_chain.mutable_unchecked<1>();
            auto nn = n_nodes.mutable_unchecked<1>();
            std::vector<float> rows;
            {
                py::gil_scoped_release release;
                for (int64_t i = 0; i < n_trials; ++i) {
                    const DraftTree t = build_best_first(dist, o);
                    rows.resize((t.size() + 1) * n_vocab);
                    for (int32_t node = -1; node < (int32_t)t.size(); ++node) {
                        const float * src = target.data() + prefix_row(t.path_tokens(node), n_vocab) * n_vocab;
                        std::copy(src, src + n_vocab, rows.begin() + (node + 1) * n_vocab);
                    }
                    history = prompt;
                    const TreeWalk w = walk_tree(t, rows.data(), n_vocab, walker, history, r, bug);
                    int64_t j = 0;
                    lc(i) = 0;
                    for (int32_t node : w.path) {
                        e(i, j++) = t.token[node];
                        if (node >= t.chain_length()) lc(i) = 1;
                    }
                    e(i, j++) = w.next;
                    for (; j <= max_depth; ++j) e(i, j) = -1;
                    nn(i) = (int32_t)t.size();
                }
            }
            py::dict out;
            out["emitted"] = emitted;      // accepted path tokens, then the next token, then -1
            out["left_chain"] = left_chain;  // 1 where the accepted path left the top-1 chain
            out["n_nodes"] = n_nodes;
            return out;
        },
        py::arg("target"), py::arg("draft"), py::arg("n_vocab"), py::arg("prompt"), py::arg("sampling"),
        py::arg("tree_kind"), py::arg("budget"), py::arg("max_depth"), py::arg("rule"), py::arg("n_trials"),
        py::arg("seed"),
        "Test only: n_trials speculative rounds over fixed logits per token prefix (rows in the order of "
        "length, then lexicographic): a best-first tree from the draft's rows ('chosen': most probable "
        "children; 'sampled': drawn without replacement), walked with the target's rows.");
}

}  // namespace deltaspec
