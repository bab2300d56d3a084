// Draft-verify decoding's accept rules and counts. The scheduler (scheduler_spec.cpp) drafts, verifies
// every draft in one target pass and keeps the accepted rows only (Engine::keep_paths: recurrent
// states advanced along the accepted path, the target never re-run); the rules here decide what is
// accepted. Lossless: greedy output equals plain greedy output, and sampled output is distributed
// as plain sampling with the same settings.
#pragma once

#include "drafters.h"
#include "generate.h"
#include "tree_walk.h"

namespace deltaspec {

struct SpecStats {
    int64_t n_steps = 0;      // target forward passes after the prompt
    int64_t n_drafted = 0;
    int64_t n_accepted = 0;
    int64_t n_tree_nodes = 0;  // nodes of the draft trees verified (tree_budget > 0)
    std::vector<int32_t> accepted_lengths;  // per verified draft (chain or tree): drafts accepted
    double draft_seconds = 0.0;
    double verify_seconds = 0.0;
    double rollback_seconds = 0.0;
    // how the target's sampler ordered whole rows (sampler.h SortCounts); comparison sorts over
    // the vocabulary are the slow path no real sampler takes any more
    int64_t sampler_radix_sorts = 0;
    int64_t sampler_comparison_sorts = 0;
    int64_t n_mtp_steps = 0;  // graphs the MTP head ran (tests assert that it drafted)
};

// Test only: a wrong accept rule, planted so that the statistical tests of speculative sampling
// (tests/test_speculative_sampling.py) can show they reject it. Read from
// DELTASPEC_TEST_WRONG_SPEC_RULE at the start of every speculative generation: unset or empty (every
// real use) is the right rule; "residual" draws a rejected draft's replacement from p instead of
// norm(max(0, p - q)); "accept" accepts a draft with probability p(d) instead of min(1, p(d)/q(d)).
// Any other value is an error (std::invalid_argument).
enum class PlantedBug { none, residual_is_p, accept_ignores_q };
PlantedBug planted_bug();

// The accept rule for one verified draft. rows: target logits, one row per verified position
// (row i predicts the token after batch[i]); returns the accepted draft prefix length and sets
// `next` to the token the target contributes after it (correction or bonus).
int64_t accept_draft(const float * rows, int64_t n_vocab, const Draft & draft, Sampler & sampler,
                     std::vector<int32_t> & history, int32_t & next, PlantedBug bug = PlantedBug::none);
// The same rule with p read through `p_of` (sampler.h).
int64_t accept_draft(const RowDistribution & p_of, const Draft & draft, Sampler & sampler,
                     std::vector<int32_t> & history, int32_t & next, PlantedBug bug = PlantedBug::none);

// The same rule for greedy decoding without penalties, from the argmax of every row: the longest
// prefix of drafts that equal the target's argmax.
int64_t accept_argmax(const int32_t * argmax, const Draft & draft, std::vector<int32_t> & history, int32_t & next);

}  // namespace deltaspec
