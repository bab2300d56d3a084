#include "scheduler.h"
#include "logprobs.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace deltaspec {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

int32_t first_argmax(const float * row, int64_t n) {
    return (int32_t)(std::max_element(row, row + n) - row);
}

Sequence::Sequence(int64_t id_, GenerateRequest request, const PieceTable & pieces)
    : id(id_), req(std::move(request)), sampler(req.sampling), history(req.prompt), out(pieces, req, on_token, res) {}

int64_t Scheduler::add_request(const GenerateRequest & req, TokenCallback on_token, const SeqSpec & spec) {
    const int64_t n_vocab = engine_.hparams().n_vocab;
    if ((int64_t)pieces_.size() != n_vocab) throw std::invalid_argument("piece table does not match the vocabulary");
    if (req.prompt.empty()) throw std::invalid_argument("the prompt is empty");
    if ((int64_t)req.prompt.size() >= engine_.n_ctx()) {
        throw std::invalid_argument("the prompt has " + std::to_string(req.prompt.size()) +
                                    " tokens but the context holds " + std::to_string(engine_.n_ctx()) + " (n_ctx)");
    }
    for (size_t i = 0; i < req.prompt.size(); ++i) {
        if (req.prompt[i] < 0 || req.prompt[i] >= n_vocab) {
            throw std::out_of_range("token id " + std::to_string(req.prompt[i]) + " at index " + std::to_string(i) +
                                    " is outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
        }
    }
    if (req.max_tokens < (req.prompt_logprobs || req.hidden_states ? 0 : 1)) {
        throw std::invalid_argument("max_tokens must be >= 1 (0 only with prompt_logprobs: the prompt scored alone)");
    }
    if (req.hidden_states && (req.max_tokens != 0 || req.prompt_logprobs || req.n_cached != 0 || spec.n_max > 0)) {
        throw std::invalid_argument("hidden_states evaluates the prompt alone: max_tokens 0, no prompt_logprobs, "
                                    "no n_cached, no speculation");
    }
    if (req.prompt_logprobs && (req.n_logprobs < 0 || req.n_cached != 0)) {
        throw std::invalid_argument(req.n_logprobs < 0 ? "prompt_logprobs needs n_logprobs >= 0 (how many top tokens each entry lists)"
                                                       : "prompt_logprobs evaluates the whole prompt: n_cached must be 0");
    }
    if (req.n_cached != 0 && (req.n_cached < 0 || req.n_cached >= (int64_t)req.prompt.size() || !idle() ||
                              engine_.slot_n_past(0) != req.n_cached)) {
        throw std::invalid_argument("n_cached = " + std::to_string(req.n_cached) + " prompt tokens in the state, but "
                                    "the state holds " + std::to_string(engine_.slot_n_past(0)) +
                                    " and the prompt " + std::to_string(req.prompt.size()) +
                                    " (a resumed prompt runs alone and has at least one new token)");
    }
    if (spec.n_max < 0 || spec.n_min < 0 || (spec.n_max > 0 && spec.n_min > spec.n_max) || spec.ngram_max < 1 ||
        spec.tree_budget < 0) {
        throw std::invalid_argument("speculation needs 0 <= draft_n_min <= draft_n_max, ngram_max >= 1, tree_budget >= 0");
    }
    for (size_t i = 0; i < spec.reference.size(); ++i) {
        if (spec.reference[i] < 0 || spec.reference[i] >= n_vocab) {
            throw std::out_of_range("speculation: reference token id " + std::to_string(spec.reference[i]) + " at index " +
                                    std::to_string(i) + " is outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
        }
    }
    if (spec.draft_model && !model_drafter_) {
        throw std::invalid_argument("speculation with a draft model: the scheduler has none (set_draft_model)");
    }
    if (spec.dflash && (!dflash_ || spec.draft_model || spec.mtp)) {
        throw std::invalid_argument(dflash_ ? "a request drafts with one of a draft model, DFlash or the MTP head"
                                            : "speculation with DFlash: the scheduler has no DFlash drafter (set_dflash)");
    }
    if (spec.mtp && (spec.draft_model || dflash_)) {
        throw std::invalid_argument(spec.draft_model ? "a request drafts with one of a draft model, DFlash or the MTP head"
                                                     : "MTP and DFlash requests do not share a scheduler (the target taps "
                                                       "the layers of one of them)");
    }
    waiting_.push_back(std::make_unique<Sequence>(next_id_, req, pieces_));
    waiting_.back()->on_token = std::move(on_token);
    if (spec.n_max > 0) {
        try {
            Sequence & s = *waiting_.back();
            s.spec = spec;
            // the drafter samples with the request's settings and a seed of its own: its draws must
            // not mirror the target's
            SamplingParams ds = req.sampling;
            ds.seed = req.sampling.seed ^ 0x9E3779B97F4A7C15ull;
            if (spec.draft_model) {
                s.draft_state = std::make_unique<DraftSlotState>(ds);
            } else if (spec.dflash) {
                auto d = std::make_unique<DFlashDrafter>(*dflash_, engine_, dflash_cost_, ds, /*slot =*/0);  // slot: at admission
                s.dflash = d.get();
                s.drafter = std::move(d);
            } else if (spec.mtp) {
                auto d = std::make_unique<MtpDrafter>(engine_, ds, /*slot =*/0);  // throws without an MTP layer
                s.mtp = d.get();
                s.drafter = std::move(d);
                mtp_ = true;
            } else {
                s.drafter = std::make_unique<NgramDrafter>(spec.ngram_max);
            }
            s.n_draft = std::max<int64_t>(spec.n_min, std::min<int64_t>(spec.n_max, 4));
        } catch (...) {  // a drafter that cannot be made (no MTP layer): the request is not queued
            waiting_.pop_back();
            throw;
        }
    }
    return next_id_++;
}

void Scheduler::cancel(int64_t id) {
    for (auto & s : running_) {
        if (s->id == id) s->cancel_requested = true;
    }
    for (auto & s : waiting_) {
        if (s->id == id) s->cancel_requested = true;
    }
}

StepEvent & Scheduler::event_of(std::vector<StepEvent> & events, const Sequence & s) {
    for (StepEvent & ev : events) {
        if (ev.id == s.id) return ev;
    }
    events.emplace_back();
    events.back().id = s.id;
    return events.back();
}

void Scheduler::finish(Sequence & s, FinishReason why, StepEvent & ev) {
    s.finished = true;
    s.res.finish = why;
    if (s.slot >= 0) s.res.decode_seconds = seconds_since(s.decode_start);
    ev.finished = true;
    ev.result = s.res;
    ev.speculative = s.speculates();
    ev.spec = stats_of(s);
}

SpecStats Scheduler::stats_of(const Sequence & s) {
    SpecStats out = s.stats;
    out.sampler_radix_sorts = s.sampler.sort_counts().radix;
    out.sampler_comparison_sorts = s.sampler.sort_counts().comparison;
    if (s.mtp) out.n_mtp_steps = s.mtp->n_head_steps();
    return out;
}

bool Scheduler::commit(Sequence & s, int32_t token, StepEvent & ev, bool check_ctx) {
    s.history.push_back(token);
    ev.tokens.push_back(token);
    if (s.req.n_logprobs >= 0) {  // recorded for this token just before (logprobs.h)
        if (s.res.logprobs.size() != s.res.tokens.size() + 1) {
            throw std::logic_error("request " + std::to_string(s.id) + ": a token was committed without its logprobs");
        }
        const size_t k = s.res.top_ids.size() / s.res.logprobs.size();
        ev.logprobs.push_back(s.res.logprobs.back());
        ev.top_ids.insert(ev.top_ids.end(), s.res.top_ids.end() - k, s.res.top_ids.end());
        ev.top_logprobs.insert(ev.top_logprobs.end(), s.res.top_logprobs.end() - k, s.res.top_logprobs.end());
    }
    if (!s.out.emit(token)) {  // the Emitter set res.finish
        finish(s, s.res.finish, ev);
        return false;
    }
    if (check_ctx && engine_.slot_n_past(s.slot) >= engine_.n_ctx()) {
        finish(s, FinishReason::length, ev);
        return false;
    }
    s.pending = token;
    return true;
}

void Scheduler::begin_draft(Sequence & s) {
    if (s.dflash) {  // the drafter's slot reads the target's taps of the prompt (or of its part not kept)
        s.dflash->set_slot(s.slot);
        s.dflash->begin(s.req.prompt);
    }
    if (s.mtp) {  // the head reads the prompt with the target's hidden states of it
        s.mtp->set_slot(s.slot);
        s.mtp->begin(s.req.prompt);
    }
    if (!model_drafter_) return;
    // the draft slot reads the whole prompt (or is emptied for a sequence without it)
    if (s.draft_state) {
        model_drafter_->begin(s.slot, *s.draft_state, s.req.prompt);
    } else {
        model_drafter_->clear_slot(s.slot);
    }
}

bool Scheduler::split_on_top() const {
    return !running_.empty() && running_.back()->n_fed < (int64_t)running_.back()->req.prompt.size();
}

int64_t Scheduler::feed(Sequence & s, int64_t budget, std::vector<StepEvent> & events) {
    const auto t0 = Clock::now();
    engine_.use_slot(s.slot);
    const int32_t * chunk = s.req.prompt.data() + s.n_fed;
    const int64_t left = (int64_t)s.req.prompt.size() - s.n_fed;
    const int64_t n = std::min(left, budget);
    int32_t token = -1;
    if (s.req.hidden_states) {
        // n_embd floats a row, few enough to take each piece whole: Engine::eval cuts it as a
        // plain prefill does
        const int64_t n_embd = engine_.hparams().n_embd, at = (int64_t)s.res.hidden.size();
        s.res.hidden.resize(at + n * n_embd);
        engine_.eval_hidden(chunk, n, s.res.hidden.data() + at);
    } else if (s.req.prompt_logprobs) {
        token = feed_scored(s, n);
    } else if (n < left) {
        engine_.eval(chunk, n, LogitsWanted::none, nullptr);
    } else if (const RowNeeds needs = row_needs(s.req, {}, engine_.top_rows_enabled(), engine_.top_k(),
                                                engine_.device_masks_enabled());
               needs.argmax) {
        token = engine_.eval_argmax(chunk, n, device_masks({&s}, {needs.device_mask}));
    } else if (needs.top) {
        top_.resize(engine_.top_row_words());
        engine_.eval_top(chunk, n, top_.data(), device_masks({&s}, {needs.device_mask}));
        token = choose_from_top(s.req, s.sampler, top_row(top_.data(), engine_.top_k()), s.res);
    } else {
        const int64_t n_vocab = engine_.hparams().n_vocab;
        logits_.resize(n_vocab);
        engine_.eval(chunk, n, LogitsWanted::last, logits_.data());
        token = choose(s, logits_.data(), n_vocab, needs.masked);
    }
    if (n == left) begin_draft(s);
    s.n_fed += n;
    s.res.n_prefilled += n;
    s.res.prefill_seconds += seconds_since(t0);
    if (n == left) {
        s.decode_start = Clock::now();
        StepEvent & ev = event_of(events, s);
        if (s.req.prompt_logprobs) ev.prompt = s.res.prompt = std::move(s.prompt_entries);
        if (s.req.max_tokens == 0) {
            finish(s, FinishReason::length, ev);  // the prompt scored (or its hidden states read) alone
        } else {
            commit(s, token, ev);
        }
    }
    return n;
}

int32_t Scheduler::feed_scored(Sequence & s, int64_t n) {
    // Pieces of at most kScoredRows rows: every row's logits are a graph output and then on the
    // host, n_vocab floats each (a 248K vocabulary: 1 MB a row), so a piece of n_ubatch rows would
    // ask for 0.5 GB on both sides per scored request. Prompts up to kScoredRows tokens are cut
    // where a plain prefill cuts them.
    constexpr int64_t kScoredRows = 128;
    const int64_t n_vocab = engine_.hparams().n_vocab, size = (int64_t)s.req.prompt.size();
    const int64_t piece = std::min(engine_.n_ubatch(), kScoredRows);
    const bool bug = logprob_bug() == LogprobBug::prompt_own_row;
    std::vector<float> rows;
    int32_t token = -1;
    for (int64_t done = 0; done < n;) {
        const int64_t m = std::min(piece, n - done);
        rows.resize(m * n_vocab);
        engine_.eval(s.req.prompt.data() + s.n_fed + done, m, LogitsWanted::all, rows.data());
        for (int64_t r = 0; r < m; ++r) {
            float * row = rows.data() + r * n_vocab;
            const int64_t next = s.n_fed + done + r + 1;  // the prompt token this row predicts
            if (next < size) {
                record_prompt_logprobs(s.req, row, n_vocab, s.req.prompt[bug ? next - 1 : next], s.prompt_entries);
            } else if (s.req.max_tokens > 0) {
                token = choose(s, row, n_vocab, masks_rows_along(s.req, {}));
            }
        }
        done += m;
    }
    return token;
}

void Scheduler::admit(std::vector<StepEvent> & events) {
    // prompt tokens this step may still prefill, handed out first come first served: the split
    // prompt on top first, then each request admitted takes what it needs; the last one may not
    // get all (it is split, stays on top, and no other request is admitted until it is complete)
    int64_t budget = prefill_budget_ > 0 ? prefill_budget_ : std::numeric_limits<int64_t>::max();
    std::vector<PromptChunk> chunks;  // consecutive slots, evaluated together below
    const auto take_chunk = [&](Sequence & seq) {
        const int64_t n = std::min((int64_t)seq.req.prompt.size() - seq.n_fed, budget);
        chunks.push_back({&seq, n});
        budget -= n;
    };
    if (split_on_top()) take_chunk(*running_.back());
    while (budget > 0 && !waiting_.empty() && (int64_t)running_.size() < max_sequences_) {
        std::unique_ptr<Sequence> s = std::move(waiting_.front());
        waiting_.pop_front();
        if (s->cancel_requested) {
            finish(*s, FinishReason::cancelled, event_of(events, *s));
            continue;
        }
        s->slot = (int64_t)running_.size();
        // the slot holds the prompt's first `cached` tokens: a kept history moved in, or what the
        // caller said (checked by add_request)
        s->n_fed = histories_ ? histories_->take(s->slot, s->req.prompt) : s->req.n_cached;
        engine_.use_slot(s->slot);
        if (s->reads_taps()) ensure_taps();
        // read it all again, tapped: a DFlash context that was not kept with the history, or an MTP
        // head, which is the sequence's own and starts empty; or a prompt whose every row is read
        if (s->n_fed > 0 && (s->mtp || s->req.prompt_logprobs || s->req.hidden_states ||
                             (s->dflash && !dflash_context_covers(s->slot)))) {
            s->n_fed = 0;
        }
        if (s->n_fed == 0 && batch_bug() != BatchBug::no_reset) engine_.reset();
        Sequence & seq = *s;
        running_.push_back(std::move(s));
        take_chunk(seq);
    }
    feed_together(chunks, events);
}

void Scheduler::feed_together(const std::vector<PromptChunk> & chunks, std::vector<StepEvent> & events) {
    // Rounds over the chunks still unfed: a run of 2+ consecutive ones goes through one
    // Engine::prefill_rows pass per round, every sequence fed the same number of tokens (the
    // shortest chunk's, at most n_ubatch in all); a run of one takes the one-sequence path (feed),
    // whose micro-batches and graph are what generate() runs.
    std::vector<int64_t> left;
    for (const PromptChunk & c : chunks) left.push_back(c.n);
    const int64_t K = (int64_t)chunks.size();
    for (bool fed = true; fed;) {
        fed = false;
        for (int64_t a = 0; a < K;) {
            if (left[a] == 0) {
                ++a;
                continue;
            }
            // a prompt whose rows are all read (scored, or their hidden states) goes alone (feed)
            const auto scored = [&](int64_t i) {
                return chunks[i].seq->req.prompt_logprobs || chunks[i].seq->req.hidden_states;
            };
            int64_t b = a + 1;
            while (!scored(a) && b < K && left[b] > 0 && !scored(b) && b - a < engine_.n_ubatch()) ++b;
            fed = true;
            if (b - a == 1 || disable_prefill_rows_) {
                for (int64_t i = a; i < b; ++i) left[i] -= feed(*chunks[i].seq, left[i], events);
            } else {
                int64_t n = engine_.n_ubatch() / (b - a);
                for (int64_t i = a; i < b; ++i) n = std::min(n, left[i]);
                std::vector<Sequence *> seqs;
                for (int64_t i = a; i < b; ++i) seqs.push_back(chunks[i].seq);
                feed_rows(seqs, n, events);
                for (int64_t i = a; i < b; ++i) left[i] -= n;
            }
            a = b;
        }
    }
}

void Scheduler::feed_rows(const std::vector<Sequence *> & seqs, int64_t n, std::vector<StepEvent> & events) {
    const auto t0 = Clock::now();
    const int64_t N = (int64_t)seqs.size(), n_vocab = engine_.hparams().n_vocab;
    rows_.clear();
    bool any_done = false, all_argmax = true, all_top = true;
    std::vector<uint8_t> masked(N), device_mask(N);  // per sequence whose prompt is complete: its first row masked
    for (int64_t i = 0; i < N; ++i) {
        const Sequence * s = seqs[i];
        const int32_t p0 = (int32_t)engine_.slot_n_past(s->slot);
        for (int64_t j = 0; j < n; ++j) {
            const int32_t parent = j == 0 ? -1 : (int32_t)rows_.size() - 1;
            rows_.add(s->req.prompt[s->n_fed + j], p0 + (int32_t)j, (int32_t)s->slot, parent, j == n - 1);
        }
        if (s->n_fed + n < (int64_t)s->req.prompt.size()) continue;  // its prompt goes on in a later round
        any_done = true;
        const RowNeeds needs =
            row_needs(s->req, {}, engine_.top_rows_enabled(), engine_.top_k(), engine_.device_masks_enabled());
        masked[i] = needs.masked;
        device_mask[i] = needs.device_mask;
        all_argmax = all_argmax && needs.argmax;
        all_top = all_top && needs.top;
    }
    // one result row per sequence (its last row's), read only for the sequences whose prompt is complete
    const int64_t W = engine_.top_row_words();
    if (!any_done) {
        engine_.prefill_rows(rows_, LogitsWanted::none, nullptr);
    } else if (all_argmax) {
        argmax_.resize(N);
        engine_.prefill_rows(rows_, LogitsWanted::argmax_all, argmax_.data(), device_masks(seqs, device_mask));
    } else if (all_top) {
        top_.resize(N * W);
        engine_.prefill_rows(rows_, LogitsWanted::top_all, top_.data(), device_masks(seqs, device_mask));
    } else {
        logits_.resize(N * n_vocab);
        engine_.prefill_rows(rows_, LogitsWanted::all, logits_.data());
    }
    const double seconds = seconds_since(t0);  // the pass was shared
    for (int64_t i = 0; i < N; ++i) {
        Sequence & s = *seqs[i];
        s.n_fed += n;
        s.res.n_prefilled += n;
        s.res.prefill_seconds += seconds;
        if (s.n_fed < (int64_t)s.req.prompt.size()) continue;
        const int32_t token = all_argmax ? argmax_[i]
                              : all_top  ? choose_from_top(s.req, s.sampler, top_row(top_.data() + i * W, engine_.top_k()), s.res)
                                         : choose(s, logits_.data() + i * n_vocab, n_vocab, masked[i]);
        begin_draft(s);
        s.decode_start = Clock::now();
        commit(s, token, event_of(events, s));
    }
}

int32_t Scheduler::choose(Sequence & s, float * row, int64_t n_vocab, bool masked) {
    // logprobs are those of the raw logits (as llama-cpp-python's), so a grammar's mask applies to a copy
    const bool keep_raw = masked && s.req.n_logprobs >= 0;
    if (keep_raw) raw_.assign(row, row + n_vocab);
    if (masked) s.req.constraint->mask_row(row, n_vocab);
    const int32_t token = s.req.sampling.argmax_only() ? first_argmax(row, n_vocab)
                                                       : s.sampler.sample(row, n_vocab, s.history);
    record_logprobs(s.req, keep_raw ? raw_.data() : row, n_vocab, token, s.res);
    return token;
}

const uint32_t * Scheduler::device_masks(const std::vector<Sequence *> & seqs, const std::vector<uint8_t> & device_mask) {
    if (std::none_of(device_mask.begin(), device_mask.end(), [](uint8_t m) { return m != 0; })) return nullptr;
    const int64_t n_words = engine_.allowed_words(), n_vocab = engine_.hparams().n_vocab;
    allowed_.assign(seqs.size() * n_words, ~0u);
    for (size_t i = 0; i < seqs.size(); ++i) {
        if (device_mask[i]) seqs[i]->req.constraint->fill_allowed(allowed_.data() + i * n_words, n_vocab);
    }
    return allowed_.data();
}

void Scheduler::decode_running(std::vector<StepEvent> & events) {
    // a split prompt (the top slot) decodes once it is complete; the others are consecutive slots
    const int64_t N = n_decoding();
    if (N == 0) return;
    const int64_t n_vocab = engine_.hparams().n_vocab;
    bool all_argmax = true, all_top = true;
    rows_.clear();
    std::vector<uint8_t> masked(N), device_mask(N);
    std::vector<Sequence *> seqs(N);
    for (int64_t i = 0; i < N; ++i) {
        const auto & s = running_[i];
        seqs[i] = s.get();
        rows_.add(s->pending, (int32_t)engine_.slot_n_past(s->slot), (int32_t)s->slot);
        // a constraint that allows every token at this row (a reasoning budget not yet spent) leaves
        // it as free as none; one the device can apply leaves it reduced there
        const RowNeeds needs =
            row_needs(s->req, {}, engine_.top_rows_enabled(), engine_.top_k(), engine_.device_masks_enabled());
        masked[i] = needs.masked;
        device_mask[i] = needs.device_mask;
        all_argmax = all_argmax && needs.argmax;
        all_top = all_top && needs.top;
    }
    // greedy everywhere: only the argmax ids cross over; where every sequence's sampler and logprobs
    // are decided by its row's top candidates, those (top_rows.h); otherwise every row's logits. A
    // grammar's mask goes with its row where the device can apply it. One sequence takes the
    // one-sequence step, whose graph writes its state in place (ggml-cuda's fused forms) and which is
    // what generate() runs.
    all_top = all_top && !all_argmax;
    const int64_t W = engine_.top_row_words();
    if (all_top) top_.resize(N * W);
    const uint32_t * allowed = all_argmax || all_top ? device_masks(seqs, device_mask) : nullptr;
    if (N == 1) {
        engine_.use_slot(0);
        if (all_argmax) {
            argmax_.assign(1, engine_.eval_argmax(&rows_.token[0], 1, allowed));
        } else if (all_top) {
            engine_.eval_top(&rows_.token[0], 1, top_.data(), allowed);
        } else {
            logits_.resize(n_vocab);
            engine_.eval(&rows_.token[0], 1, LogitsWanted::last, logits_.data());
        }
    } else if (all_argmax) {
        argmax_.resize(N);
        engine_.decode(rows_, LogitsWanted::argmax_all, argmax_.data(), allowed);
    } else if (all_top) {
        engine_.decode(rows_, LogitsWanted::top_all, top_.data(), allowed);
    } else {
        logits_.resize(N * n_vocab);
        engine_.decode(rows_, LogitsWanted::all, logits_.data());
    }
    for (int64_t i = 0; i < N; ++i) {
        Sequence & s = *running_[i];
        const int32_t token = all_argmax ? argmax_[i]
                              : all_top  ? choose_from_top(s.req, s.sampler, top_row(top_.data() + i * W, engine_.top_k()), s.res)
                                         : choose(s, logits_.data() + i * n_vocab, n_vocab, masked[i]);
        commit(s, token, event_of(events, s));
    }
}

void Scheduler::release_finished() {
    // from the top, so that the sequence moved into a freed slot (the last one) is never one
    // still to be released
    for (int64_t i = (int64_t)running_.size() - 1; i >= 0; --i) {
        if (!running_[i]->finished) continue;
        const int64_t last = (int64_t)running_.size() - 1;
        if (histories_) {  // its state holds every committed token but the last, never evaluated
            const Sequence & s = *running_[i];  // (none committed: the prompt as far as it was fed)
            const auto end = s.res.tokens.empty() ? s.history.begin() + s.n_fed : s.history.end() - 1;
            histories_->finished(i, last, std::vector<int32_t>(s.history.begin(), end));
        }
        const auto move_to = [&](int64_t from, int64_t to) {
            if (batch_bug() != BatchBug::no_move) engine_.move_slot(from, to);
            if (model_drafter_) model_drafter_->engine().move_slot(from, to);
            if (dflash_) dflash_->move_slot(from, to);
            running_[to] = std::move(running_[from]);
            running_[to]->slot = to;
            if (running_[to]->dflash) running_[to]->dflash->set_slot(to);
            if (running_[to]->mtp) running_[to]->mtp->set_slot(to);
        };
        if (i != last) {
            // the highest decoding sequence fills the hole; a split prompt stays on top, one slot down
            const bool split = split_on_top() && i != last - 1;
            move_to(split ? last - 1 : last, i);
            if (split) move_to(last, last - 1);
        }
        running_.pop_back();
    }
}

void Scheduler::set_max_sequences(int64_t n) {
    if (!idle() || model_drafter_ || dflash_) throw std::logic_error("set_max_sequences: set it before drafters and requests");
    if (n < 1 || n > engine_.n_seq_max()) {
        throw std::invalid_argument("set_max_sequences: " + std::to_string(n) + " is outside [1, " +
                                    std::to_string(engine_.n_seq_max()) + "] (n_seq_max)");
    }
    max_sequences_ = n;
}

void Scheduler::set_draft_model(Engine & draft, double step_cost) {
    if (model_drafter_ && &model_drafter_->engine() == &draft) return;
    if (model_drafter_ || !idle()) throw std::logic_error("set_draft_model: the scheduler has a draft model or requests already");
    if (&draft == &engine_) throw std::invalid_argument("the draft model must be a separate engine");
    if (draft.hparams().n_vocab != engine_.hparams().n_vocab || draft.n_seq_max() < max_sequences_ ||
        draft.n_ctx() < engine_.n_ctx()) {
        throw std::invalid_argument("the draft model needs the target's vocabulary (" + std::to_string(engine_.hparams().n_vocab) +
                                    "), at least " + std::to_string(max_sequences_) + " sequence slots (n_seq_max) and n_ctx (" +
                                    std::to_string(engine_.n_ctx()) + "); it has " + std::to_string(draft.hparams().n_vocab) +
                                    ", " + std::to_string(draft.n_seq_max()) + " and " + std::to_string(draft.n_ctx()));
    }
    model_drafter_ = std::make_unique<BatchModelDrafter>(draft, step_cost);
}

Scheduler::~Scheduler() {
    if (!dflash_ && !mtp_) return;
    try {
        engine_.set_taps({});  // plain steps stop paying for the copies
    } catch (...) {
    }
}

void Scheduler::set_dflash(DFlashModel & model, double pass_cost) {
    if (dflash_ == &model) return;
    if (dflash_ || !idle()) throw std::logic_error("set_dflash: the scheduler has a DFlash drafter or requests already");
    if (mtp_) throw std::invalid_argument("MTP and DFlash requests do not share a scheduler (the target taps the layers of one of them)");
    if (&model.target() != &engine_) throw std::invalid_argument("the DFlash drafter belongs to another target");
    if (model.n_slots() < max_sequences_) {
        throw std::invalid_argument("the DFlash drafter has " + std::to_string(model.n_slots()) + " slots; drafting for " +
                                    std::to_string(max_sequences_) + " sequences (n_seq_max) needs one per sequence");
    }
    dflash_ = &model;
    dflash_cost_ = pass_cost;
    ensure_taps();
}

void Scheduler::ensure_taps() {
    // a one-sequence call between requests (a DFlash or MTP generate()) may have changed them
    const std::vector<int> want = dflash_ ? dflash_taps(dflash_->hparams())
                                  : mtp_  ? std::vector<int>{(int)engine_.hparams().n_layer}
                                          : std::vector<int>{};
    if (engine_.taps() != want) {
        engine_.set_taps(want);
        if (histories_) histories_->forget();  // what the idle slots hold has no taps now
    }
}

bool Scheduler::dflash_context_covers(int64_t slot) const {
    const int64_t from = engine_.tapped_pos(slot);
    return dflash_->n_cached_of(slot) >= from && from + engine_.n_tapped_rows(slot) == engine_.slot_n_past(slot);
}

std::vector<StepEvent> Scheduler::step() {
    std::vector<StepEvent> events;
    for (auto & s : running_) {
        if (s->cancel_requested && !s->finished) finish(*s, FinishReason::cancelled, event_of(events, *s));
    }
    release_finished();
    admit(events);
    release_finished();
    if (!decode_speculative(events)) decode_running(events);
    if (dflash_ || mtp_) {  // only DFlash and MTP sequences read their slot's taps: the others' would pile up
        for (const auto & s : running_) {
            if (!s->reads_taps()) engine_.clear_tapped(s->slot);
        }
    }
    release_finished();
    return events;
}

GenerateResult Scheduler::run_one(const GenerateRequest & req, const std::atomic<bool> & cancel,
                                  const TokenCallback & on_token, const SeqSpec & spec, SpecStats * stats) {
    const int64_t id = add_request(req, on_token, spec);
    GenerateResult res;
    while (!idle()) {
        if (cancel.load()) this->cancel(id);
        for (StepEvent & ev : step()) {
            if (!ev.finished) continue;
            res = std::move(ev.result);
            if (stats) *stats = std::move(ev.spec);
        }
    }
    return res;
}

std::vector<GenerateResult> Scheduler::run(const std::vector<GenerateRequest> & reqs, const std::atomic<bool> & cancel,
                                           const std::vector<SeqSpec> & specs, std::vector<SpecStats> * stats) {
    if (!specs.empty() && specs.size() != reqs.size()) throw std::invalid_argument("run: one SeqSpec per request, or none");
    std::vector<int64_t> ids;
    for (size_t i = 0; i < reqs.size(); ++i) ids.push_back(add_request(reqs[i], {}, specs.empty() ? SeqSpec{} : specs[i]));
    std::unordered_map<int64_t, GenerateResult> done;
    std::unordered_map<int64_t, SpecStats> done_stats;
    while (!idle()) {
        if (cancel.load()) {
            for (int64_t id : ids) this->cancel(id);
        }
        for (StepEvent & ev : step()) {
            if (ev.finished) {
                done[ev.id] = std::move(ev.result);
                done_stats[ev.id] = std::move(ev.spec);
            }
        }
    }
    std::vector<GenerateResult> out;
    for (int64_t id : ids) out.push_back(std::move(done.at(id)));
    if (stats) {
        stats->clear();
        for (int64_t id : ids) stats->push_back(std::move(done_stats.at(id)));
    }
    return out;
}

}  // namespace deltaspec
