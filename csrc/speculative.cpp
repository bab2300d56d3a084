#include "speculative.h"
#include "env.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "grammar_drafter.h"
#include "logprobs.h"
#include "top_rows.h"
#include "tree_round.h"

namespace deltaspec {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

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

GenerateResult generate_speculative(Engine & target, Drafter & drafter, const PieceTable & pieces,
                                    const GenerateRequest & req, const SpecOptions & spec,
                                    const std::atomic<bool> & cancel, const TokenCallback & on_token,
                                    SpecStats & stats) {
    const int64_t n_vocab = target.hparams().n_vocab;
    if (req.prompt.empty()) throw std::invalid_argument("the prompt is empty");
    if ((int64_t)pieces.size() != n_vocab) throw std::invalid_argument("piece table does not match the vocabulary");
    GenerateResult res;
    const PlantedBug bug = planted_bug();
    const TreeRuleBug tree_bug = spec.tree_budget > 0 ? tree_rule_bug() : TreeRuleBug::none;
    Sampler sampler(req.sampling);
    std::vector<int32_t> history = req.prompt;  // prompt + every committed token
    std::vector<float> rows;
    std::vector<int32_t> argmax;
    // How a pass's rows cross over, decided for each pass: greedy without penalties, the device
    // returns argmax ids, no logits cross over (a grammar masks logits; log-probabilities read
    // them); a sampler that the rows' top candidates decide, those instead of whole rows
    // (top_rows.h). A constraint that allows every token at the pass's rows (a reasoning budget far
    // from its end, a lazy grammar before its trigger: TokenConstraint::allows_every_token) leaves
    // them as free as none; one that masks them sends its masks to the device with the rows
    // (device_mask: their argmax or top candidates, as when unmasked), unless log-probabilities
    // want the raw rows whole.
    const bool want_logprobs = req.n_logprobs >= 0;
    bool masked = false, device_mask = false, device_argmax = false, top = false, keep_unmasked = false;
    VerifyRead read = VerifyRead::logits;
    std::vector<uint32_t> allowed;  // device_mask: the rows' allowed tokens
    const auto read_rows_along = [&](const std::vector<int32_t> & along) {
        const RowNeeds needs = row_needs(req, along, target.top_rows_enabled(), target.top_k(),
                                         target.device_masks_enabled());
        masked = needs.masked;
        device_mask = needs.device_mask;
        device_argmax = needs.argmax;
        top = !device_argmax && needs.top;
        read = device_argmax ? VerifyRead::argmax : top ? VerifyRead::top : VerifyRead::logits;
        keep_unmasked = want_logprobs && masked;  // log-probabilities are those of the raw logits
    };
    const int64_t W = target.top_row_words();
    std::vector<int32_t> top_words;
    std::vector<float> unmasked;  // the rows before a grammar masked them
    // the log-probabilities of `token`, predicted by row r of the last pass (logprobs.h)
    auto record_row = [&](int64_t r, int32_t token) {
        if (!want_logprobs) return;
        if (top) {
            record_top_logprobs(req, top_row(top_words.data() + r * W, target.top_k()), token, res);
        } else {
            record_logprobs(req, (keep_unmasked ? unmasked : rows).data() + r * n_vocab, n_vocab, token, res);
        }
    };
    const RowDistribution top_p = [&](int64_t i, const std::vector<int32_t> &, Distribution & p) {
        const TopRow r = top_row(top_words.data() + i * W, target.top_k());
        sampler.distribution_top(r.logit, r.id, r.k, p);
    };
    // the step's one row's allowed tokens, where the device masks it
    const auto step_allowed = [&]() -> const uint32_t * {
        if (!device_mask) return nullptr;
        allowed.resize(target.allowed_words());
        req.constraint->fill_allowed(allowed.data(), n_vocab);
        return allowed.data();
    };
    // a chain verify's rows' allowed tokens, where the device masks them
    const auto verify_allowed = [&](const Draft & draft) -> const uint32_t * {
        if (!device_mask) return nullptr;
        allowed.resize((draft.tokens.size() + 1) * target.allowed_words());
        req.constraint->fill_verify_allowed(draft, allowed.data(), n_vocab);
        return allowed.data();
    };
    // one target step on `tokens`, the next token sampled (or the argmax) after its last row
    auto step = [&](const int32_t * tokens, int64_t n) {
        if (device_argmax) return target.eval_argmax(tokens, n, step_allowed());
        if (top) {
            top_words.resize(W);
            target.eval_top(tokens, n, top_words.data(), step_allowed());
            const TopRow r = top_row(top_words.data(), target.top_k());
            const int32_t token = sampler.sample_top(r.logit, r.id, r.k);
            record_row(0, token);
            return token;
        }
        rows.resize(n_vocab);
        target.eval(tokens, n, LogitsWanted::last, rows.data());
        if (keep_unmasked) unmasked = rows;
        if (masked) req.constraint->mask_row(rows.data(), n_vocab);
        const int32_t token = sampler.sample(rows.data(), n_vocab, history);
        record_row(0, token);
        return token;
    };

    auto t0 = Clock::now();
    target.reset();
    read_rows_along({});
    int32_t next = step(req.prompt.data(), (int64_t)req.prompt.size());
    drafter.begin(req.prompt);
    res.prefill_seconds = seconds_since(t0);

    Emitter out(pieces, req, on_token, res);

    // Adaptive draft length: grow after a fully accepted draft, shrink to what was accepted
    // otherwise. A round that accepts nothing, or whose draft cost more target steps than it
    // saved (the drafter's own estimate, with the verify counted as one step), pauses drafting:
    // long enough that the loss stays under kLossBudget of the plain steps taken meanwhile, and
    // at least `backoff` steps, which doubles while rounds keep losing. So a useless or too slow
    // drafter costs about plain decoding; the schedule depends on tokens only, never on timing.
    constexpr double kLossBudget = 0.05;
    int64_t n_draft = std::max<int64_t>(spec.n_min, std::min<int64_t>(spec.n_max, 4));
    int64_t pause = 0, backoff = 1;
    t0 = Clock::now();
    history.push_back(next);
    bool running = out.emit(next);
    while (running) {
        if (cancel.load()) {
            res.finish = FinishReason::cancelled;
            break;
        }
        if (target.n_past() >= target.n_ctx()) {
            res.finish = FinishReason::length;
            break;
        }
        // room: the batch [next, drafts...] must fit the context and the verify capacity, and
        // drafts past max_tokens would be thrown away (the target adds one token itself)
        const int64_t left = req.max_tokens - (int64_t)res.tokens.size();
        const int64_t room = std::min({target.n_ctx() - target.n_past() - 1, spec.n_max, left - 1});
        Draft draft;
        DraftTree tree;
        // every node takes a KV row in the verify: the whole tree must fit the context
        const int64_t budget = spec.tree_budget > 0 ? std::min(spec.tree_budget, target.n_ctx() - target.n_past() - 1) : 0;
        bool forced_in_pause = false;  // this round verifies only what the grammar forces
        if (pause > 0) {
            --pause;
            // a pause stops the drafter, not the grammar: what it forces costs nothing to propose
            // and is always accepted (planted bug pause_blocks_forced: the pause stops it too)
            forced_in_pause = req.constraint && room >= 1 && req.constraint->bug != GrammarBug::pause_blocks_forced &&
                              draft_forced(*req.constraint, budget, room, draft, tree);
        } else if (room >= std::max<int64_t>(spec.n_min, 1)) {
            auto td = Clock::now();
            if (spec.tree_budget > 0) {
                tree = drafter.propose_tree(history, budget, drafter.tree_depth_is_free() ? room : std::min(n_draft, room));
                if (req.constraint) req.constraint->prune_tree(tree);  // what the grammar forbids is not verified
                // n_min counts verified nodes: a best-first tree fills its budget but may stay
                // shallow (DDTree's budget 8 under a 15-deep block), which is no reason to skip it
                if (tree.size() < std::min(spec.n_min, budget)) tree = DraftTree{};
            } else {
                draft = drafter.propose(history, std::min(n_draft, room));
                if (req.constraint) req.constraint->cut_draft(draft);  // what the grammar forbids is not verified
                if ((int64_t)draft.tokens.size() < spec.n_min) draft = Draft{};
            }
            stats.draft_seconds += seconds_since(td);
        }
        stats.n_steps++;

        read_rows_along(tree.empty() ? draft.tokens : tree.token);
        if (draft.tokens.empty() && tree.empty()) {  // a plain decode step: no per-token states to keep
            auto tv = Clock::now();
            next = step(&next, 1);
            stats.verify_seconds += seconds_since(tv);
            history.push_back(next);
            running = out.emit(next);
            continue;
        }

        // verify, accept, keep: the accepted drafts end up in draft.tokens[0 .. n_acc), and
        // parent_row[i] is the verify row that predicted the i-th committed token (the last: `next`)
        int64_t n_acc = 0, n_full = 0;  // n_full: the most a round could have accepted
        std::vector<int64_t> parent_row = {0};
        if (!tree.empty()) {
            auto tv = Clock::now();
            const TreeWalk walk = verify_and_walk_tree(target, tree, next, read, sampler, history, spec.tree_rule,
                                                       tree_bug, rows, top ? top_words : argmax,
                                                       masked ? req.constraint : nullptr,
                                                       keep_unmasked ? &unmasked : nullptr);
            stats.verify_seconds += seconds_since(tv);
            auto tr = Clock::now();
            keep_walk(target, tree, walk);  // `next` (the old one) and the accepted path stay
            stats.rollback_seconds += seconds_since(tr);
            stats.n_drafted += tree.size();
            stats.n_tree_nodes += tree.size();
            for (int32_t node : walk.path) {
                draft.tokens.push_back(tree.token[node]);
                parent_row.push_back(1 + node);
            }
            draft.cost = tree.cost;
            next = walk.next;
            n_acc = (int64_t)walk.path.size();
            n_full = tree.max_depth();
        } else {
            std::vector<int32_t> batch = {next};
            batch.insert(batch.end(), draft.tokens.begin(), draft.tokens.end());
            const int64_t T = (int64_t)batch.size();
            auto tv = Clock::now();
            if (device_argmax) {
                argmax.resize(T);
                target.eval_verify_argmax(batch.data(), T, argmax.data(), verify_allowed(draft));
            } else if (top) {
                top_words.resize(T * W);
                target.eval_verify_top(batch.data(), T, top_words.data(), verify_allowed(draft));
            } else {
                rows.resize(T * n_vocab);
                target.eval_verify(batch.data(), T, rows.data());
                if (keep_unmasked) unmasked = rows;
                if (masked) req.constraint->mask_verify_rows(draft, rows.data(), n_vocab);
            }
            stats.verify_seconds += seconds_since(tv);
            stats.n_drafted += (int64_t)draft.tokens.size();

            n_acc = device_argmax ? accept_argmax(argmax.data(), draft, history, next)
                    : top         ? accept_draft(top_p, draft, sampler, history, next, bug)
                                  : accept_draft(rows.data(), n_vocab, draft, sampler, history, next, bug);
            auto tr = Clock::now();
            target.keep(1 + n_acc);  // `next` (the old one) and the accepted drafts stay
            stats.rollback_seconds += seconds_since(tr);
            n_full = (int64_t)draft.tokens.size();
            for (int64_t i = 1; i <= n_acc; ++i) parent_row.push_back(i);
        }
        stats.n_accepted += n_acc;
        stats.accepted_lengths.push_back((int32_t)n_acc);

        // the planted bug reads each token's log-probabilities from its own row, not its parent's
        const int64_t row_shift = logprob_bug() == LogprobBug::next_row ? 1 : 0;
        for (int64_t i = 0; i < n_acc && running; ++i) {
            record_row(parent_row[i + row_shift], draft.tokens[i]);
            running = out.emit(draft.tokens[i]);
        }
        if (!running) break;
        record_row(parent_row[n_acc], next);
        history.push_back(next);
        running = out.emit(next);

        if (forced_in_pause) continue;  // the drafter's schedule (length, pause, backoff) is its own
        const int64_t n_floor = std::max<int64_t>(spec.n_min, 1);
        n_draft = n_acc == n_full ? std::min(spec.n_max, n_draft * 2) : std::max(n_floor, n_acc + 1);
        const double loss = draft.cost - (double)n_acc;  // target steps lost (< 0: saved)
        if (spec.n_min == 0 && (n_acc == 0 || loss > 0)) {
            pause = std::max<int64_t>(backoff, (int64_t)std::ceil(loss / kLossBudget));
            backoff = std::min<int64_t>(backoff * 2, 256);
        } else {
            backoff = 1;
        }
    }
    res.decode_seconds = seconds_since(t0);
    stats.sampler_radix_sorts += sampler.sort_counts().radix;
    stats.sampler_comparison_sorts += sampler.sort_counts().comparison;
    return res;
}

}  // namespace deltaspec
