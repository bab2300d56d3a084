// Speculation, for one sequence (generate()) or several at once: one scheduler step drafts for every running sequence
// that speculates (prompt lookup chains or trees, the draft model's chains: batch_draft.h, or
// DFlash chains or DDTree trees: one block pass per sequence in its own drafter slot),
// verifies every running sequence's rows in ONE target pass (Engine::verify_rows: a drafting
// sequence's chain [pending token, drafts...] or tree [pending token, nodes...], any other sequence's
// pending token alone), then per sequence applies the accept rule (speculative.h: accept_argmax /
// accept_draft, or walk_tree's; the sequence's own Sampler, so its random draws come in the same
// order whatever else runs) and keeps the accepted path of each slot (Engine::keep_paths). The
// drafting schedule (room, adaptive draft length, pause and backoff) is per sequence and depends on
// its tokens only: each sequence gives the tokens it gives alone (generate()), greedy or sampled. A
// sequence with a grammar drafts the tokens the grammar forces (grammar_drafter.h), else its
// drafter's proposal cut or pruned by the grammar, and its verify rows are masked with the grammar's
// state along each row's path.
// One difference: a pass holds at most n_ubatch rows, so with N sequences a draft is at most
// n_ubatch / N - 1 tokens long (a sampled sequence whose draft that cuts takes other random draws
// than alone; it is no less exact).
#include <algorithm>
#include <chrono>
#include <cmath>

#include "grammar_drafter.h"
#include "logprobs.h"
#include "scheduler.h"
#include "tree_walk.h"

namespace deltaspec {

namespace {

using Clock = std::chrono::steady_clock;

// a sequence that drafted a chain this step (or nothing): the planted swap_keep bug acts on chains
bool s_is_chain(const Sequence & s) { return s.tree.empty(); }

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

namespace {

// The steps after a proposal: what the sequence's grammar forbids is not verified
// (TokenConstraint::cut_draft / prune_tree), then the floor: a chain shorter than n_min, or a tree of
// fewer nodes than min(n_min, budget), is not verified (a best-first tree fills its budget but may
// stay shallow)
void settle_draft(Sequence & s, int64_t budget) {
    if (TokenConstraint * grammar = s.req.constraint) {
        if (budget > 0) {
            grammar->prune_tree(s.tree);
        } else {
            grammar->cut_draft(s.draft);
        }
    }
    if ((int64_t)s.draft.tokens.size() < s.spec.n_min) s.draft = Draft{};
    if (!s.tree.empty() && s.tree.size() < std::min(s.spec.n_min, budget)) s.tree = DraftTree{};
}

// A constrained request's first rule (take_forced): where the grammar leaves one way on, the tokens it forces are the draft
// (at most n_max; with a tree budget, a chain of at most min(budget, n_max) nodes), and the drafter
// is not asked. False when the grammar forces nothing.
bool draft_forced(Sequence & s, int64_t budget, int64_t n_max) {
    if (!deltaspec::draft_forced(*s.req.constraint, budget, n_max, s.draft, s.tree)) return false;
    settle_draft(s, budget);
    return true;
}

bool drafted(const Sequence & s) { return !s.draft.tokens.empty() || !s.tree.empty(); }

}  // namespace

int64_t Scheduler::draft_all() {
    const int64_t n_ctx = engine_.n_ctx();
    // the pass holds every running sequence's rows, each slot padded to the longest: Tq <= n_ubatch / N
    // a prompt still being prefilled (split over steps, the top slot) neither drafts nor decodes
    const int64_t N = n_decoding();
    const int64_t cap = engine_.n_ubatch() / std::max<int64_t>(1, N) - 1;
    int64_t n_drafting = 0;
    // the drafters whose work for several sequences runs together, after this loop
    std::vector<DraftJob> jobs;  // the draft model's
    std::vector<Sequence *> job_seq;
    std::vector<DFlashModel::BlockJob> blocks;  // DFlash: every sequence's block in one pass
    std::vector<BlockPlan> block_plans;
    std::vector<MtpHead::RowsJob> head_jobs;  // MTP chains: every sequence's head steps in one graph
    std::vector<Sequence *> head_seqs;
    for (int64_t i = 0; i < N; ++i) {
        Sequence & s = *running_[i];
        s.draft = Draft{};
        s.tree = DraftTree{};
        if (!s.speculates()) continue;
        s.stats.n_steps++;
        // the batch [pending, drafts...] must fit the context, and drafts
        // past max_tokens would be thrown away (the target adds one token itself)
        const int64_t left = s.req.max_tokens - (int64_t)s.res.tokens.size();
        const int64_t room = std::min({n_ctx - engine_.slot_n_past(s.slot) - 1, s.spec.n_max, left - 1, cap});
        // every node takes a KV row and a row of the pass: the tree fits the context and the pass
        const int64_t budget = s.spec.tree_budget > 0
                                   ? std::min({s.spec.tree_budget, n_ctx - engine_.slot_n_past(s.slot) - 1, cap}) : 0;
        s.forced_in_pause = false;
        if (s.pause > 0) {
            --s.pause;
            // a pause stops the drafter, not the grammar's forced tokens (free to propose, always accepted)
            if (s.req.constraint && room >= 1 && s.req.constraint->bug != GrammarBug::pause_blocks_forced &&
                draft_forced(s, budget, room)) {
                s.forced_in_pause = true;
                n_drafting += drafted(s);
            }
            continue;
        }
        if (room < std::max<int64_t>(s.spec.n_min, 1)) continue;
        if (s.req.constraint && draft_forced(s, budget, std::min(s.n_draft, room))) {
            n_drafting += drafted(s);
            continue;
        }
        if (s.draft_state) {
            DraftJob job;
            job.slot = s.slot;
            job.state = s.draft_state.get();
            job.committed = &s.history;
            job.n_max = std::min(s.n_draft, room);  // a tree's depth too (a draft model's depth is not free)
            job.tree_budget = budget;
            job.constraint = drafting_constraint(s.req.constraint);
            jobs.push_back(std::move(job));
            job_seq.push_back(&s);
            continue;
        }
        const auto td = Clock::now();
        const std::vector<int32_t> * text = &s.history;
        if (!s.spec.reference.empty()) {
            s.lookup.assign(s.spec.reference.begin(), s.spec.reference.end());
            s.lookup.insert(s.lookup.end(), s.history.begin(), s.history.end());
            text = &s.lookup;
        }
        // (a grammar's forced tokens come first, so a constrained sequence's depth is not free)
        const bool free_depth = s.drafter->tree_depth_is_free() && !s.req.constraint;
        const int64_t depth = budget > 0 && free_depth ? room : std::min(s.n_draft, room);
        // the MTP head and DFlash draft within the grammar, as a draft model's DraftJob
        if (s.mtp) s.mtp->constrain(drafting_constraint(s.req.constraint));
        if (s.dflash) s.dflash->constrain(drafting_constraint(s.req.constraint));
        if (s.dflash) {
            // as DFlashDrafter::propose_tree / propose, its block run with the others' below
            const int64_t block_depth = std::min(depth, dflash_->hparams().block_size - 1);
            DFlashModel::BlockJob job;
            if ((budget == 0 || block_depth >= 1) && s.dflash->plan(*text, budget, job)) {
                blocks.push_back(job);
                block_plans.push_back({&s, budget, budget > 0 ? block_depth : depth});
            }
        } else if (s.mtp && budget == 0) {
            // as MtpDrafter::propose, a head step at a time with the other sequences' below
            MtpHead::RowsJob job;
            if (s.mtp->begin_chain(*text, depth, job)) {
                head_jobs.push_back(std::move(job));
                head_seqs.push_back(&s);
            }
        } else if (budget > 0) {
            s.tree = s.drafter->propose_tree(*text, budget, depth);
        } else {
            s.draft = s.drafter->propose(*text, depth);
        }
        settle_draft(s, budget);
        s.stats.draft_seconds += seconds_since(td);
        n_drafting += drafted(s);
    }
    n_drafting += draft_mtp_chains(head_jobs, head_seqs) + draft_dflash_blocks(blocks, block_plans);
    if (!jobs.empty()) {
        const auto td = Clock::now();
        model_drafter_->propose(jobs);
        const double seconds = seconds_since(td);
        for (size_t k = 0; k < jobs.size(); ++k) {
            Sequence & s = *job_seq[k];
            s.draft = std::move(jobs[k].draft);
            s.tree = std::move(jobs[k].tree);
            settle_draft(s, jobs[k].tree_budget);
            s.stats.draft_seconds += seconds;  // the passes were shared
            n_drafting += drafted(s);
        }
    }
    return n_drafting;
}

int64_t Scheduler::draft_mtp_chains(std::vector<MtpHead::RowsJob> & jobs, std::vector<Sequence *> & seqs) {
    if (jobs.empty()) return 0;
    const auto td = Clock::now();
    const std::vector<Sequence *> all = seqs;
    int64_t n_drafting = 0;
    while (!jobs.empty()) {  // one graph per draft position, over the chains still growing
        MtpHead::eval_groups(jobs);
        std::vector<MtpHead::RowsJob> next;
        std::vector<Sequence *> next_seqs;
        for (size_t k = 0; k < jobs.size(); ++k) {
            Sequence & s = *seqs[k];
            MtpHead::RowsJob job;
            if (s.mtp->next_chain(job)) {
                next.push_back(std::move(job));
                next_seqs.push_back(&s);
                continue;
            }
            s.draft = s.mtp->take_chain();
            settle_draft(s, 0);
            n_drafting += drafted(s);
        }
        jobs = std::move(next);
        seqs = std::move(next_seqs);
    }
    const double seconds = seconds_since(td);
    for (Sequence * s : all) s->stats.draft_seconds += seconds;  // the graphs were shared
    return n_drafting;
}

int64_t Scheduler::draft_dflash_blocks(const std::vector<DFlashModel::BlockJob> & blocks,
                                       const std::vector<BlockPlan> & plans) {
    if (blocks.empty()) return 0;
    const auto td = Clock::now();
    dflash_->blocks(blocks);
    int64_t n_drafting = 0;
    for (const BlockPlan & b : plans) {
        Sequence & s = *b.seq;
        if (b.budget > 0) {
            s.tree = s.dflash->tree(b.budget, b.depth);
        } else {
            s.draft = s.dflash->chain(b.depth);
        }
        settle_draft(s, b.budget);
        n_drafting += drafted(s);
    }
    const double seconds = seconds_since(td);
    for (const BlockPlan & b : plans) b.seq->stats.draft_seconds += seconds;  // the pass was shared
    return n_drafting;
}

const uint32_t * Scheduler::verify_masks(const std::vector<int64_t> & first_row, const std::vector<uint8_t> & device_mask) {
    if (std::none_of(device_mask.begin(), device_mask.end(), [](uint8_t m) { return m != 0; })) return nullptr;
    const int64_t n_words = engine_.allowed_words(), n_vocab = engine_.hparams().n_vocab;
    allowed_.assign(first_row.back() * n_words, ~0u);
    for (size_t i = 0; i + 1 < first_row.size(); ++i) {
        if (!device_mask[i]) continue;
        const Sequence & s = *running_[i];
        uint32_t * rows = allowed_.data() + first_row[i] * n_words;
        if (!s.tree.empty()) {
            s.req.constraint->fill_tree_allowed(s.tree, rows, n_vocab);
        } else if (s.draft.tokens.empty()) {
            s.req.constraint->fill_allowed(rows, n_vocab);
        } else {
            s.req.constraint->fill_verify_allowed(s.draft, rows, n_vocab);
        }
    }
    return allowed_.data();
}

bool Scheduler::decode_speculative(std::vector<StepEvent> & events) {
    if (n_decoding() == 0) return false;
    const int64_t n_drafting = draft_all();
    if (n_drafting == 0) return false;  // a plain decode step (decode_running) for everyone

    const int64_t n_vocab = engine_.hparams().n_vocab;
    const int64_t N = n_decoding();
    rows_.clear();
    std::vector<int64_t> first_row(N + 1);
    // where every sequence's sampler and logprobs are decided by its rows' top candidates, those
    // cross over instead of whole rows (top_rows.h), as a one-sequence verify takes them; a
    // constraint that allows every token along the drafts (a reasoning budget far from its end, a
    // lazy grammar whose trigger is not drafted) leaves them as free as none; a grammar that masks
    // them sends its masks to the device with them (device_mask), unless log-probabilities want
    // the raw rows whole
    std::vector<uint8_t> masked(N), device_mask(N);
    bool all_argmax = true, all_top = true;
    for (int64_t i = 0; i < N; ++i) {
        const Sequence & s = *running_[i];
        first_row[i] = rows_.size();
        const int32_t p0 = (int32_t)engine_.slot_n_past(s.slot);
        rows_.add(s.pending, p0, (int32_t)s.slot);
        for (size_t d = 0; d < s.draft.tokens.size(); ++d) {
            rows_.add(s.draft.tokens[d], p0 + 1 + (int32_t)d, (int32_t)s.slot, (int32_t)(first_row[i] + d));
        }
        for (int64_t n = 0; n < s.tree.size(); ++n) {  // node n: row 1 + n of the slot, its parent's row after the root
            rows_.add(s.tree.token[n], p0 + s.tree.depth[n], (int32_t)s.slot, (int32_t)(first_row[i] + 1 + s.tree.parent[n]));
        }
        const RowNeeds needs = row_needs(s.req, s.tree.empty() ? s.draft.tokens : s.tree.token,
                                         engine_.top_rows_enabled(), engine_.top_k(), engine_.device_masks_enabled());
        masked[i] = needs.masked;
        device_mask[i] = needs.device_mask;
        all_argmax = all_argmax && needs.argmax;
        all_top = all_top && needs.top;
    }
    first_row[N] = rows_.size();
    const int64_t R = rows_.size();
    all_top = all_top && !all_argmax;
    const int64_t W = engine_.top_row_words();
    const auto tv = Clock::now();
    const uint32_t * allowed = all_argmax || all_top ? verify_masks(first_row, device_mask) : nullptr;
    if (all_argmax) {
        argmax_.resize(R);
        engine_.verify_rows(rows_, LogitsWanted::argmax_all, argmax_.data(), allowed);
    } else if (all_top) {
        top_.resize(R * W);
        engine_.verify_rows(rows_, LogitsWanted::top_all, top_.data(), allowed);
    } else {
        logits_.resize(R * n_vocab);
        engine_.verify_rows(rows_, LogitsWanted::all, logits_.data());
    }
    const double verify_seconds = seconds_since(tv);
    const auto top_of = [&](int64_t r) { return top_row(top_.data() + r * W, engine_.top_k()); };

    // accept per sequence: n_acc drafts, then `next` (the correction or the bonus token). A tree's
    // walk turns into the chain it accepted (draft.tokens) and its rows (kept).
    const PlantedBug bug = planted_bug();
    std::vector<int64_t> n_acc(N, 0);
    std::vector<int32_t> next(N, -1), row_argmax;
    std::vector<std::vector<int32_t>> kept(N);  // rows of each slot kept after its root, relative to it
    // the rows (relative to the slot's first) that predicted each token a drafting sequence commits:
    // the root's, then each accepted node's (the last predicted `next`); logprobs.h reads them
    std::vector<std::vector<int32_t>> parent_rows(N);
    std::vector<std::vector<float>> unmasked(N);  // a drafting sequence's rows before its grammar's mask
    for (int64_t i = 0; i < N; ++i) {
        Sequence & s = *running_[i];
        const int64_t r0 = first_row[i];
        float * logits = all_argmax || all_top ? nullptr : logits_.data() + r0 * n_vocab;
        if (s.draft.tokens.empty() && s.tree.empty()) {  // a plain step, or no speculation
            next[i] = all_argmax ? argmax_[r0]
                      : all_top  ? choose_from_top(s.req, s.sampler, top_of(r0), s.res)
                                 : choose(s, logits, n_vocab, masked[i]);
            continue;
        }
        const size_t before = s.history.size();  // the accept rules append the accepted drafts; commit() does
        const int64_t T = first_row[i + 1] - r0;
        if (TokenConstraint * grammar = masked[i] && !device_mask[i] ? s.req.constraint : nullptr) {
            // each row masked with the grammar's state after its path, as a sequence alone masks
            // them; logprobs are those of the raw rows
            if (s.req.n_logprobs >= 0) unmasked[i].assign(logits, logits + T * n_vocab);
            if (!s.tree.empty()) {
                grammar->mask_tree_rows(s.tree, logits, n_vocab);
            } else {
                grammar->mask_verify_rows(s.draft, logits, n_vocab);
            }
        }
        if (s.req.sampling.argmax_only()) {
            row_argmax.resize(T);
            for (int64_t t = 0; t < T; ++t) {
                row_argmax[t] = all_argmax ? argmax_[r0 + t]
                                : all_top  ? top_of(r0 + t).id[0]  // the first maximum, as first_argmax's
                                           : first_argmax(logits + t * n_vocab, n_vocab);
            }
        }
        // the target's distribution at row r of the slot, from its top candidates (as
        // a one-sequence step's top rows; Sampler::distribution_top equals distribution there)
        const RowDistribution top_p = [&](int64_t r, const std::vector<int32_t> &, Distribution & p) {
            const TopRow top = top_of(r0 + r);
            s.sampler.distribution_top(top.logit, top.id, top.k, p);
        };
        if (!s.tree.empty()) {
            const TreeWalk walk = s.req.sampling.argmax_only() ? walk_tree_argmax(s.tree, row_argmax.data(), s.history)
                                  : all_top ? walk_tree(s.tree, top_p, n_vocab, s.sampler, s.history, TreeRule::rejection,
                                                        tree_rule_bug())
                                            : walk_tree(s.tree, logits, n_vocab, s.sampler, s.history, TreeRule::rejection,
                                                        tree_rule_bug());
            for (int32_t node : walk.path) {
                s.draft.tokens.push_back(s.tree.token[node]);
                kept[i].push_back(node + 1);
            }
            s.draft.cost = s.tree.cost;
            n_acc[i] = (int64_t)walk.path.size();
            next[i] = walk.next;
        } else {
            n_acc[i] = s.req.sampling.argmax_only() ? accept_argmax(row_argmax.data(), s.draft, s.history, next[i])
                       : all_top ? accept_draft(top_p, s.draft, s.sampler, s.history, next[i], bug)
                                 : accept_draft(logits, n_vocab, s.draft, s.sampler, s.history, next[i], bug);
            for (int64_t d = 1; d <= n_acc[i]; ++d) kept[i].push_back((int32_t)d);
        }
        parent_rows[i] = {0};
        parent_rows[i].insert(parent_rows[i].end(), kept[i].begin(), kept[i].end());
        s.history.resize(before);
    }

    // keep each slot's pending token and accepted drafts
    const auto tr = Clock::now();
    std::vector<std::vector<int32_t>> paths(N);
    for (int64_t i = 0; i < N; ++i) {
        int64_t keep = n_acc[i];
        if (rows_bug() == RowsBug::swap_keep && s_is_chain(*running_[i])) {  // the next drafting slot's count, cut to this chain
            for (int64_t j = 1; j < N; ++j) {
                const int64_t o = (i + j) % N;
                if (!running_[o]->draft.tokens.empty() || !running_[o]->tree.empty()) {
                    keep = std::min<int64_t>(n_acc[o], first_row[i + 1] - first_row[i] - 1);
                    break;
                }
            }
            kept[i].clear();
            for (int64_t d = 1; d <= keep; ++d) kept[i].push_back((int32_t)d);
        }
        paths[i].push_back((int32_t)first_row[i]);
        for (int32_t r : kept[i]) paths[i].push_back((int32_t)(first_row[i] + r));
    }
    engine_.keep_paths(paths);
    const double keep_seconds = seconds_since(tr);

    // emit, then adapt each drafting sequence's schedule: grow after a fully accepted draft, shrink to
    // what was accepted otherwise; a round that accepts nothing, or whose draft cost more target steps
    // than it saved (the drafter's own estimate, the verify counted as one step), pauses drafting long
    // enough that the loss stays under kLossBudget of the plain steps taken meanwhile, and at least
    // `backoff` steps, which doubles while rounds keep losing. So a useless or too slow drafter costs
    // about plain decoding; the schedule depends on tokens only, never on timing.
    int64_t n_accepting = 0, n_rejecting = 0;
    const int64_t row_shift = logprob_bug() == LogprobBug::next_row ? 1 : 0;  // the planted bug: own row
    for (int64_t i = 0; i < N; ++i) {
        Sequence & s = *running_[i];
        StepEvent & ev = event_of(events, s);
        const Draft & draft = s.draft;
        // the log-probabilities of a committed token (choose() recorded those of an undrafted step)
        const auto record = [&](int64_t d, int32_t token) {
            if (parent_rows[i].empty() || s.req.n_logprobs < 0) return;
            const int64_t r = parent_rows[i][d];
            if (all_top) {
                record_top_logprobs(s.req, top_of(first_row[i] + r), token, s.res);
                return;
            }
            const float * rows = unmasked[i].empty() ? logits_.data() + first_row[i] * n_vocab : unmasked[i].data();
            record_logprobs(s.req, rows + r * n_vocab, n_vocab, token, s.res);
        };
        bool running = true;
        for (int64_t d = 0; d < n_acc[i] && running; ++d) {
            record(d + row_shift, draft.tokens[d]);
            running = commit(s, draft.tokens[d], ev, /*check_ctx =*/false);
        }
        if (running) {
            record(n_acc[i], next[i]);
            commit(s, next[i], ev);
        }
        if (draft.tokens.empty() && s.tree.empty()) continue;

        // the most a round could have accepted: the chain, or the tree's depth
        const int64_t n_full = s.tree.empty() ? (int64_t)draft.tokens.size() : s.tree.max_depth();
        const int64_t n_verified = s.tree.empty() ? n_full : s.tree.size();
        n_accepting += n_acc[i] > 0;
        n_rejecting += n_acc[i] < n_full;
        s.stats.verify_seconds += verify_seconds;
        s.stats.rollback_seconds += keep_seconds;
        s.stats.n_drafted += n_verified;
        s.stats.n_tree_nodes += s.tree.size();
        s.stats.n_accepted += n_acc[i];
        s.stats.accepted_lengths.push_back((int32_t)n_acc[i]);
        if (s.finished) ev.spec = stats_of(s);  // finish() copied them before this round's counts
        if (s.forced_in_pause) continue;  // the drafter's schedule is its own
        constexpr double kLossBudget = 0.05;
        const int64_t n_floor = std::max<int64_t>(s.spec.n_min, 1);
        s.n_draft = n_acc[i] == n_full ? std::min(s.spec.n_max, s.n_draft * 2) : std::max(n_floor, n_acc[i] + 1);
        const double loss = draft.cost - (double)n_acc[i];
        if (s.spec.n_min == 0 && (n_acc[i] == 0 || loss > 0)) {
            s.pause = std::max<int64_t>(s.backoff, (int64_t)std::ceil(loss / kLossBudget));
            s.backoff = std::min<int64_t>(s.backoff * 2, 256);
        } else {
            s.backoff = 1;
        }
    }
    spec_stats_.verify_passes += 1;
    spec_stats_.multi_draft_passes += n_drafting >= 2;
    spec_stats_.mixed_passes += n_drafting >= 2 && n_accepting >= 1 && n_rejecting >= 1;
    spec_stats_.max_drafting = std::max(spec_stats_.max_drafting, n_drafting);
    return true;
}

}  // namespace deltaspec
