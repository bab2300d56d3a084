// Many requests on one engine, in the shape of nano-vllm's engine loop: a Sequence per request, a
// step that admits waiting requests into free slots (prefill: the prompt chunks of the step's
// sequences together, Engine::prefill_rows) and then decodes every running sequence in one batch of
// rows, sampling and committing per sequence. Sequences finish
// independently (their own max_tokens, stop tokens and strings, sampler and seed); each gives the
// tokens generate() gives it alone.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "dflash_drafter.h"
#include "mtp_drafter.h"
#include "engine.h"
#include "generate.h"
#include "sampler.h"
#include "speculative.h"
#include "batch_draft.h"
#include "top_rows.h"
#include "slot_history.h"

namespace deltaspec {

// A request's speculation in the scheduler (scheduler_spec.cpp): prompt lookup drafts of up to
// n_max tokens (n_max 0: none; NgramDrafter), none shorter than n_min verified.
// `reference` (optional): a text the lookup searches before the sequence's own (prompt lookup
// over a document the target never reads, as llama.cpp's static lookup cache; the benches use it
// for stated acceptance rates on random-weight models).
// tree_budget > 0: n-gram draft trees of up to that many nodes (NgramDrafter::propose_tree), walked
// with TreeRule::rejection.
struct SeqSpec {
    int64_t n_max = 0;
    int64_t n_min = 0;
    int64_t ngram_max = 3;
    std::vector<int32_t> reference;
    int64_t tree_budget = 0;
    // drafts with the scheduler's draft model (Scheduler::set_draft_model) instead of prompt lookup,
    // (batch_draft.h: chains or trees)
    bool draft_model = false;
    // drafts with the scheduler's DFlash drafter (Scheduler::set_dflash, DFlashDrafter): a block
    // pass per round, chains or DDTree trees (tree_budget)
    bool dflash = false;
    // drafts with the target's own MTP head (MtpDrafter: chains or trees), a head and KV cache of
    // its own per sequence
    bool mtp = false;
};

// The first maximum, as ggml's argmax picks it: a greedy sequence in a batch that also samples
// gets the token the device's argmax would have given it.
int32_t first_argmax(const float * row, int64_t n);

struct Sequence {
    explicit Sequence(int64_t id, GenerateRequest request, const PieceTable & pieces);

    int64_t id;
    GenerateRequest req;
    Sampler sampler;
    GenerateResult res;
    std::vector<int32_t> history;  // prompt + every committed token (the penalties read it)
    TokenCallback on_token;        // none: the scheduler's caller reads tokens from step()
    Emitter out;
    int64_t slot = -1;             // while running
    int32_t pending = -1;          // the token emitted last, not yet in the slot's state
    int64_t n_fed = 0;             // prompt tokens in the slot's state (a prompt split by the prefill budget: < its size)
    LogprobEntries prompt_entries; // prompt_logprobs: those of the prompt fed so far (res.prompt once complete)
    bool finished = false;
    bool cancel_requested = false;
    std::chrono::steady_clock::time_point decode_start;

    // speculation (spec.n_max > 0): the drafter and its schedule (scheduler_spec.cpp)
    SeqSpec spec;
    std::unique_ptr<Drafter> drafter;
    DFlashDrafter * dflash = nullptr;  // `drafter` when it is the scheduler's DFlash drafter's
    MtpDrafter * mtp = nullptr;        // `drafter` when it drafts with the MTP head
    bool reads_taps() const { return dflash != nullptr || mtp != nullptr; }
    int64_t n_draft = 0, pause = 0, backoff = 1;
    bool forced_in_pause = false;  // this step's draft is the grammar's forced tokens, the drafter paused
    Draft draft;        // this step's (chains)
    DraftTree tree;     // this step's (tree_budget > 0)
    std::vector<int32_t> lookup;  // spec.reference + history, the text the drafter searches
    std::unique_ptr<DraftSlotState> draft_state;  // spec.draft_model: its draft slot's state
    SpecStats stats;
    bool speculates() const { return spec.n_max > 0; }
};

// What one step did to one sequence.
struct StepEvent {
    int64_t id = -1;
    std::vector<int32_t> tokens;   // the tokens this step committed (the first comes from the prefill)
    // a request with n_logprobs >= 0: those tokens' log-probabilities, and n_logprobs top ones each
    std::vector<float> logprobs;
    std::vector<int32_t> top_ids;
    std::vector<float> top_logprobs;
    // a request with prompt_logprobs, in the step that completes its prompt: the prompt's entries
    std::optional<LogprobEntries> prompt;
    bool finished = false;
    GenerateResult result;         // when finished
    bool speculative = false;      // the request speculated: `spec` holds its stats (when finished)
    SpecStats spec;
};

// What the scheduler's speculation did across sequences (tests assert that passes over several
// drafting sequences happened).
struct BatchSpecStats {
    int64_t verify_passes = 0;      // target passes that verified drafts (Engine::verify_rows)
    int64_t multi_draft_passes = 0; // ... with drafts of 2+ sequences
    int64_t mixed_passes = 0;       // ... of which one sequence accepted drafts and another rejected some
    int64_t max_drafting = 0;       // the most sequences that drafted in one pass
};

class Scheduler {
  public:
    // keep_histories: finished sequences' states stay in idle slots, and a request whose prompt
    // begins with one of them resumes there (slot_history.h); for a scheduler that outlives its
    // requests (a server's). Without it every admitted request starts from an empty slot.
    Scheduler(Engine & engine, const PieceTable & pieces, bool keep_histories = false)
        : engine_(engine), pieces_(pieces), max_sequences_(engine.n_seq_max()) {
        if (keep_histories) {
            histories_ = std::make_unique<SlotHistories>(engine);
            histories_->set_on_move([this](int64_t from, int64_t to) {
                if (dflash_) dflash_->move_slot(from, to);  // a kept history's drafter context goes with it
            });
        }
    }
    ~Scheduler();
    Scheduler(const Scheduler &) = delete;
    Scheduler & operator=(const Scheduler &) = delete;

    // Queues a request (validated now); returns its id. `on_token` hears each of its tokens as it
    // is committed; returning false cancels it (streaming).
    // `spec` (n_max > 0): it speculates (SeqSpec's drafter), verified with the other sequences' rows
    // (each gives the tokens it gives alone).
    int64_t add_request(const GenerateRequest & req, TokenCallback on_token = {}, const SeqSpec & spec = {});
    // A waiting request finishes at once, a running one at the next step (finish "cancelled",
    // with the tokens it has); unknown or finished ids are ignored.
    void cancel(int64_t id);
    // Admit, prefill, decode one token for every running sequence; what happened to each.
    std::vector<StepEvent> step();
    bool idle() const { return waiting_.empty() && running_.empty(); }
    int64_t n_running() const { return (int64_t)running_.size(); }
    int64_t n_waiting() const { return (int64_t)waiting_.size(); }
    // Prompt tokens one step prefills at most (0: no limit): the running sequences decode in every
    // step instead of waiting for every new prompt (time to first token under load, and no stall
    // behind a long prompt). A prompt that does not fit is split: its sequence takes the top
    // running slot, is fed a budget's worth per step and decodes once its prompt is complete; no
    // other request is admitted until then. The step's chunks (the split prompt's, then the newly
    // admitted ones') are evaluated together: one Engine::prefill_rows pass over their consecutive
    // slots per round of equal-length pieces, not one prompt after another.
    void set_prefill_budget(int64_t n_tokens) { prefill_budget_ = n_tokens; }
    // Something else changed the slots (a one-sequence call): their kept histories are unknown now.
    void forget_histories() {
        if (histories_) histories_->forget();
    }

    // Runs the requests to the end; results in request order. `cancel` (checked each step)
    // cancels all of them.
    std::vector<GenerateResult> run(const std::vector<GenerateRequest> & reqs, const std::atomic<bool> & cancel,
                                    const std::vector<SeqSpec> & specs = {}, std::vector<SpecStats> * stats = nullptr);
    // Runs one request to the end (generate()'s loop, speculative or not): `cancel` (checked each
    // step) cancels it, `on_token` sees every committed token; `stats`: its speculation's counts.
    GenerateResult run_one(const GenerateRequest & req, const std::atomic<bool> & cancel, const TokenCallback & on_token,
                           const SeqSpec & spec = {}, SpecStats * stats = nullptr);
    const BatchSpecStats & spec_stats() const { return spec_stats_; }
    // The draft model of requests with SeqSpec::draft_model: an engine of the same vocabulary with
    // at least set_max_sequences' slots; a draft forward costs step_cost target decode steps
    // (batch_draft.h). Set once, before such requests.
    void set_draft_model(Engine & draft, double step_cost);
    bool has_draft_model() const { return model_drafter_ != nullptr; }
    const Engine * draft_engine() const { return model_drafter_ ? &model_drafter_->engine() : nullptr; }
    // The DFlash drafter of requests with SeqSpec::dflash: its model (on this engine, with at least
    // its slots), one block pass costing pass_cost target decode steps (as for DFlashDrafter). Sets
    // the engine's taps to the drafter's layers for as long as the scheduler lives: every step then
    // taps every slot's rows, and each DFlash sequence's context follows its slot (slot moves and
    // kept histories included). Set once, before such requests.
    void set_dflash(DFlashModel & model, double pass_cost);
    const DFlashModel * dflash_model() const { return dflash_; }

    // At most n sequences run at once (1 .. the engine's n_seq_max, its default), in slots 0 .. n - 1:
    // a draft model or DFlash drafter then needs n slots, not n_seq_max (generate(): one). Set before
    // requests.
    void set_max_sequences(int64_t n);

    // Off: each sequence's prompt chunk is evaluated alone, one after another, instead of several
    // in one Engine::prefill_rows pass (the benches' before/after).
    void set_prefill_rows(bool on) { disable_prefill_rows_ = !on; }

  private:
    struct PromptChunk {
        Sequence * seq;
        int64_t n;  // prompt tokens it is fed this step
    };
    // admits waiting requests into free slots and hands out the step's prefill budget
    void admit(std::vector<StepEvent> & events);
    // evaluates the step's prompt chunks (consecutive slots): several sequences at once where it can
    void feed_together(const std::vector<PromptChunk> & chunks, std::vector<StepEvent> & events);
    // n more prompt tokens of each of seqs (consecutive slots) in one pass; a sequence whose prompt
    // is then complete chooses and commits its first token
    void feed_rows(const std::vector<Sequence *> & seqs, int64_t n, std::vector<StepEvent> & events);
    void begin_draft(Sequence & s);  // s's prompt is complete: its draft slot (the draft model's) follows
    // a sequence resuming a kept history drafts with DFlash: whether the drafter's slot holds the
    // context of what the target's slot holds (else the prompt is read again)
    bool dflash_context_covers(int64_t slot) const;
    void ensure_taps();  // the engine taps what the DFlash drafter or the MTP head reads
    // evaluates up to `budget` more of s's prompt in its slot; once the prompt is complete, chooses
    // and commits its first token. Returns the prompt tokens evaluated.
    int64_t feed(Sequence & s, int64_t budget, std::vector<StepEvent> & events);
    // feed's n prompt tokens for a request with prompt_logprobs: every row's logits to the host, 128
    // rows (or n_ubatch, if fewer) at a time; returns the first token when they complete the prompt (else -1)
    int32_t feed_scored(Sequence & s, int64_t n);
    bool split_on_top() const;  // the top running sequence's prompt is not complete yet
    // the running sequences that decode this step: all but a split prompt on top
    int64_t n_decoding() const { return (int64_t)running_.size() - (split_on_top() ? 1 : 0); }
    void decode_running(std::vector<StepEvent> & events);
    // the token after a logits row: masked by the request's constraint where `masked` (as the step
    // decided it: row_needs), then argmax or sampled (and its logprobs recorded when asked for)
    int32_t choose(Sequence & s, float * row, int64_t n_vocab, bool masked);
    // Engine's `allowed` for a pass of one result row per sequence of `seqs`: the constraint's mask
    // where row_needs let the device apply it (device_mask[i]), every token elsewhere; nullptr
    // (no mask input) where no row has one
    const uint32_t * device_masks(const std::vector<Sequence *> & seqs, const std::vector<uint8_t> & device_mask);
    // the same for decode_speculative's verify rows (running sequence i's from first_row[i]): a drafting
    // sequence's rows masked as mask_verify_rows / mask_tree_rows mask them (fill_verify_allowed,
    // fill_tree_allowed)
    const uint32_t * verify_masks(const std::vector<int64_t> & first_row, const std::vector<uint8_t> & device_mask);
    // commits a sampled token; false when the sequence is done
    bool commit(Sequence & s, int32_t token, StepEvent & ev, bool check_ctx = true);
    // scheduler_spec.cpp: when a running sequence drafts this step, one verify pass over every
    // running sequence's rows, accept and keep per sequence; false (nothing done) when none drafts
    bool decode_speculative(std::vector<StepEvent> & events);
    int64_t draft_all();  // this step's drafts; how many sequences drafted
    // draft_all's batched drafters, each returning how many sequences drafted: MTP chains, a
    // graph per draft position over every drafting sequence's head; DFlash, one block pass
    struct BlockPlan {  // a DFlash sequence's block in the pass
        Sequence * seq;
        int64_t budget, depth;  // budget 0: a chain of `depth`
    };
    int64_t draft_mtp_chains(std::vector<MtpHead::RowsJob> & jobs, std::vector<Sequence *> & seqs);
    int64_t draft_dflash_blocks(const std::vector<DFlashModel::BlockJob> & blocks, const std::vector<BlockPlan> & plans);
    void finish(Sequence & s, FinishReason why, StepEvent & ev);
    static SpecStats stats_of(const Sequence & s);  // s.stats with its sampler's and MTP head's counts
    void release_finished();
    StepEvent & event_of(std::vector<StepEvent> & events, const Sequence & s);

    Engine & engine_;
    const PieceTable & pieces_;
    int64_t next_id_ = 0;
    std::deque<std::unique_ptr<Sequence>> waiting_;
    std::vector<std::unique_ptr<Sequence>> running_;  // running_[i] lives in slot i
    std::vector<float> logits_;
    std::vector<float> raw_;  // a row before its grammar mask (logprobs)
    std::vector<int32_t> argmax_;
    std::vector<int32_t> top_;  // top rows (top_rows.h), when they serve every sequence
    std::vector<uint32_t> allowed_;  // device_masks' rows
    RowBatch rows_;
    BatchSpecStats spec_stats_;
    std::unique_ptr<BatchModelDrafter> model_drafter_;
    DFlashModel * dflash_ = nullptr;
    double dflash_cost_ = 0.0;
    bool mtp_ = false;  // an MTP request came: the engine taps its final hidden state
    std::unique_ptr<SlotHistories> histories_;  // keep_histories only
    int64_t prefill_budget_ = 0;
    bool disable_prefill_rows_ = false;
    int64_t max_sequences_ = 0;  // set_max_sequences (the constructor: the engine's n_seq_max)
};

}  // namespace deltaspec
