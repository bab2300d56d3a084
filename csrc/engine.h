// One qwen35 model: weights, backends, the state of n_seq_max sequence slots and the step that
// runs the graph. The one-sequence calls (eval, verify, keep) act on the slot chosen
// with use_slot (0 unless changed); decode() runs rows of several slots in one graph.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "graph_qwen35.h"
#include "hparams.h"
#include "layer_split.h"
#include "rows.h"
#include "state.h"
#include "weights.h"

namespace deltaspec {

// What a step returns: no logits, the last row's, every row's, or the argmax (on the device, so
// that 4 bytes cross over instead of a vocabulary of floats) of the last row or of every row; or
// (hidden) every row's final hidden state, the output norm's result the head would multiply; or
// (top, top_all) the last row's or every row's top candidates (top_rows.h: its top_k() largest
// logits with their ids and its log-sum-exp, reduced on the device).
enum class LogitsWanted { none, last, all, argmax, argmax_all, hidden, top, top_all };

// The ggml device `device` names: "cpu", "cuda" (= "cuda:0"; "gpu" too) or "cuda:N", the N-th GPU.
// invalid_argument for another name; runtime_error naming the index and the GPU count when absent.
ggml_backend_dev_t backend_device(const std::string & device);

struct EngineOptions {
    int64_t n_ctx = 4096;
    int64_t n_ubatch = 512;       // largest micro-batch one graph processes
    int n_threads = 1;
    std::string device = "cpu";   // "cpu", "cuda" or "cuda:N" (backend_device)
    // A layer split (layer_split.h) instead of `device`: the devices, each once, and their shares of
    // the layers (empty: by free memory, as llama.cpp). Empty devices: `device` holds everything.
    std::vector<std::string> devices;
    std::vector<float> tensor_split;
    ggml_type type_k = GGML_TYPE_F16;  // KV cache types (Python maps llama.cpp's names to these)
    ggml_type type_v = GGML_TYPE_F16;
    int kv_format_k = 0;          // deltaspec_kv_format (ggml/deltaspec_tq.h): 0 type_k as is, 1 type_k holding
    int kv_format_v = 0;          // rotated rows, 3 / 4 tq3 / tq4 (type_k unused); the same for V
    int64_t n_slots = 0;          // the longest verify batch (0: no speculation)
    int64_t n_seq_max = 1;        // sequence slots
    // A row's result does not depend on the batch computing it. The CPU backend runs ggml-cpu's
    // reference paths (ggml_backend_cpu_set_use_ref): by default ggml-cpu multiplies K-quant
    // batches of 8+ rows in its tiled kernel, attends with a tiled kernel from 64 query rows on and
    // splits a one-row attention over the threads from 512 KV cells on; each sums in another order
    // than the one-row path, so a verify batch and a one-token step round differently. A CUDA
    // backend is registered with our kernels' invariant routes (ggml/cuda/deltaspec_invariant.h).
    bool batch_invariant = false;
    LoadProgress progress;        // optional: hears (done_bytes, total_bytes) while weights upload
};

class Engine {
  public:
    Engine(const std::string & path, const HParams & hp, const EngineOptions & opts);
    ~Engine();
    Engine(const Engine &) = delete;
    Engine & operator=(const Engine &) = delete;

    // Appends tokens to the sequence in micro-batches. `logits` receives n_vocab floats per
    // returned row: every row for LogitsWanted::all, the last row for ::last, nothing for ::none.
    void eval(const int32_t * tokens, int64_t n_tokens, LogitsWanted wanted, float * logits);
    // Appends tokens and returns the argmax of the last row's logits (greedy decoding).
    // `allowed` (here and in eval_top, decode and prefill_rows; nullptr: none): the tokens each
    // returned row may take, allowed_words() words a row (a TokenConstraint bitmask: bit t % 32 of
    // word t / 32), applied on the device before the argmax or the top candidates, as the host
    // applies a grammar's mask to a whole row (forbidden logits -inf: ggml/deltaspec_top.h), so that
    // a masked row needs neither its logits on the host nor a host pass over the vocabulary.
    int32_t eval_argmax(const int32_t * tokens, int64_t n_tokens, const uint32_t * allowed = nullptr);
    // Appends tokens; `top` receives the last row's top candidates (top_row_words() int32s, top_rows.h).
    void eval_top(const int32_t * tokens, int64_t n_tokens, int32_t * top, const uint32_t * allowed = nullptr);
    int64_t allowed_words() const { return (hp_.n_vocab + 31) / 32; }
    // Whether callers may hand grammar masks to the device (`allowed` above; on; off: a masked row
    // crosses over whole and is masked on the host, which tests and benches compare against).
    bool device_masks_enabled() const { return device_masks_enabled_; }
    void enable_device_masks(bool on) { device_masks_enabled_ = on; }
    // How many candidates a top row holds (min(64, n_vocab)), and its size in int32 words.
    int64_t top_k() const;
    int64_t top_row_words() const { return 2 * top_k() + 1; }
    // Whether callers may ask for top rows instead of whole logits rows (on; tests turn it off to
    // compare both ways).
    bool top_rows_enabled() const { return top_rows_enabled_; }
    void enable_top_rows(bool on) { top_rows_enabled_ = on; }
    void reset();                 // start a new, empty sequence (in the current slot)
    // Appends tokens; `hidden` receives n_embd floats per token: the final hidden state after the
    // output norm (what embeddings pool).
    void eval_hidden(const int32_t * tokens, int64_t n_tokens, float * hidden);

    // The current slot's sequence as bytes, by tensor name ("k.3", "v.3": its first n_past KV
    // rows; "conv.0", "ssm.0": the recurrent state), and back into a slot of an engine of the
    // same model: a saved conversation resumes without re-reading its tokens (sequence_io.cpp).
    std::vector<std::pair<std::string, std::string>> save_sequence();
    void load_sequence(int64_t n_past, const std::vector<std::pair<std::string, std::string>> & tensors);

    // The slot the one-sequence calls act on (a pending verify batch of the old one is kept whole).
    void use_slot(int64_t slot);
    int64_t current_slot() const { return cur_; }
    int64_t n_seq_max() const { return pool_.n_seq; }
    int64_t slot_n_past(int64_t slot) const { return pool_.slots.at(slot).n_past; }
    // slot `to` <- slot `from`: its KV rows, recurrent state and length (a scheduler compacting
    // its sequences into the lowest slots); `from` keeps its copy.
    void move_slot(int64_t from, int64_t to);

    // One row per sequence, each continuing its slot's committed state (parent -1, position =
    // the slot's length), in consecutive slots rows.slot[0], rows.slot[0] + 1, ...: one graph for
    // all of them, each slot then one token longer. `out` receives, for the rows that want
    // logits and in row order, n_vocab floats each (LogitsWanted::all), the argmax
    // (LogitsWanted::argmax_all, on the device) or top_row_words() int32s (LogitsWanted::top_all).
    void decode(const RowBatch & rows, LogitsWanted wanted, void * out, const uint32_t * allowed = nullptr);
    // What decode() has run (tests assert that batches of several sequences happened).
    struct DecodeStats {
        int64_t calls = 0, rows = 0, max_rows = 0;
        int64_t top_rows = 0;  // rows returned as top candidates (decode or eval_top), not as whole logits
        int64_t masked_rows = 0;  // result rows whose `allowed` mask forbade some token (applied on the device)
    };
    const DecodeStats & decode_stats() const { return decode_stats_; }
    // What the step graphs cost (step_graphs.cpp): graphs built and allocated vs steps that ran a
    // kept one (tests assert that alternating shapes stop rebuilding; benches show the host time).
    struct GraphStats {
        int64_t builds = 0;       // graphs built and allocated
        int64_t reuses = 0;       // steps that ran a kept graph: no build, no allocation
        int64_t switches = 0;     // of those, steps whose graph was not the previous step's
        int64_t evictions = 0;    // kept graphs freed to stay within the cache's limits
        int64_t kept = 0, kept_bytes = 0;  // graphs held now (the last step's included), their compute buffers
        int64_t max_graphs = 0, max_kept_bytes = 0;  // its limits (DELTASPEC_GRAPH_CACHE, _MIB)
        double build_seconds = 0, alloc_seconds = 0;  // host time building graphs, allocating them
    };
    GraphStats graph_stats() const;

    // Speculative verification: append a batch of at most n_slots tokens and return logits for
    // every row, leaving what the recurrent state after each token needs (VerifyStates); then
    // `keep(n)` keeps only the batch's first n tokens (KV rows past them are dead; the mask hides
    // them). Anything else that reads or extends the sequence first keeps the whole batch.
    void eval_verify(const int32_t * tokens, int64_t n_tokens, float * logits);
    // greedy; `allowed` (every row's, nullptr: none) as eval_argmax's
    void eval_verify_argmax(const int32_t * tokens, int64_t n_tokens, int32_t * argmax, const uint32_t * allowed = nullptr);
    // every row's top row
    void eval_verify_top(const int32_t * tokens, int64_t n_tokens, int32_t * top, const uint32_t * allowed = nullptr);
    void keep(int64_t n_keep);
    // Tree verification (verify_tree.cpp), on the current slot. `rows` are the slot's rows (slot =
    // current_slot()): parent -1 continues the slot's committed state, parent p (< the row's index)
    // continues row p; position = the slot's length + the row's depth (siblings share a position).
    // Every row attends to the slot's committed KV rows and to its own ancestors in the batch only;
    // the DeltaNet layers run the parent-indexed rows ops. `out` receives every row's logits
    // (LogitsWanted::all, n_vocab floats each), argmax (::argmax_all) or top row (::top_all; `allowed`,
    // every row's, as decode's). Nothing is committed:
    // keep_path(path) then keeps one root-to-leaf path (path[0] a row of parent -1, path[i]'s
    // parent path[i-1]): the KV rows of its nodes moved to consecutive positions, the recurrent
    // state (DeltaNet state and conv window) after its leaf committed by replaying the path's
    // recurrences through the rows ops from the verify pass's inputs (the target is not re-run):
    // keep_paths' commit (commit_paths.cpp) on this one slot, with the path's taps.
    // Anything else that reads or extends the sequence first drops the tree (keeps none of it).
    void verify_tree(const RowBatch & rows, LogitsWanted wanted, void * out, const uint32_t * allowed = nullptr);
    void keep_path(const int32_t * path, int64_t n);
    // What tree verification has run (tests assert that trees with branches went through the rows ops).
    struct TreeStats {
        int64_t verify_calls = 0, rows = 0, max_rows = 0;
        int64_t branched_calls = 0;  // verify batches in which a row, or the committed sequence, has 2+ children
        int64_t rows_op_nodes = 0;   // rows-op nodes (deltaspec_rows.h) in the graphs those calls ran
        int64_t split_walks = 0;     // verify batches whose plan walked the tree as two walks (deltaspec_rows.h)
        int64_t keep_calls = 0, kept_rows = 0, kv_rows_moved = 0;
        int64_t keep_graph_builds = 0;  // keep_path calls that built their commit graph (the others reused it)
        int64_t kernel_commits = 0;     // keep_path calls whose states our CUDA kernels committed
    };
    const TreeStats & tree_stats() const { return tree_stats_; }

    // A debugging view of the step graphs (bench/invariance_probe.py --nodes): with capture on, every
    // contiguous F32 node of each step graph the engine computes is copied to the host as it is
    // computed (the scheduler then runs the graph node by node, without CUDA graphs: slow), and
    // captured_nodes() holds those of the last graph computed, in graph order.
    struct CapturedNode {
        std::string op;      // ggml_op_desc
        std::string source;  // its first source's name if a named leaf (a weight's GGUF name), else its op
        int64_t ne[4];
        std::vector<float> data;
    };
    void set_node_capture(bool on) { capture_nodes_ = on; }
    const std::vector<CapturedNode> & captured_nodes() const { return captured_; }

    // Verification of rows of several slots in one pass (verify_rows.cpp): speculation for many
    // sequences. `rows` are grouped by slot, slots consecutive from rows.slot[0], every slot's rows a
    // chain or tree of its own (parent -1: the slot's committed state; else an earlier row of the
    // same slot), position = the slot's length + depth. `out` receives every row's logits
    // (LogitsWanted::all), argmax (::argmax_all) or top candidates (::top_all, top_row_words() each:
    // top_rows.h), in row order (only the rows whose wants_logits
    // is set, when some are not). Nothing is committed: keep_paths then keeps one root-to-leaf path
    // per slot (row indices of `rows`, in slot order; empty: the slot keeps nothing), as keep_path
    // does for one slot. Anything else that reads or extends a sequence first
    // drops the batch (keeps none of it).
    // `allowed`: each row's allowed tokens (in row order, allowed_words() words a row) as decode's.
    void verify_rows(const RowBatch & rows, LogitsWanted wanted, void * out, const uint32_t * allowed = nullptr);
    void keep_paths(const std::vector<std::vector<int32_t>> & paths);
    // What verify_rows has run (tests assert that passes over several slots happened).
    struct RowsStats {
        int64_t calls = 0, multi_slot_calls = 0;  // passes; passes holding rows of 2+ slots
        int64_t rows = 0, padded_rows = 0;        // the callers' rows; copies added to even out the slots
        int64_t max_slots = 0, keep_calls = 0, kept_rows = 0;
        int64_t branched_calls = 0, kv_rows_moved = 0;  // passes with a branching slot; KV rows compacted
        int64_t keep_graph_builds = 0;  // keep_paths calls that built their commit graph (the others reused it)
        int64_t kernel_commits = 0;     // keep_paths calls whose states our CUDA kernels committed
    };
    const RowsStats & rows_stats() const { return rows_stats_; }

    // Prompt chunks of several sequences in one pass (prefill_rows.cpp): `rows` hold slots
    // rows.slot[0], +1, ... consecutive, each a chain (parent -1, then the previous row) of the same
    // number of rows at positions slot length + 0, 1, ...; each slot is then that much longer, its
    // state as if the chunk had been eval()'d in it alone. `out` receives each slot's last row's
    // logits (LogitsWanted::all), argmax (::argmax_all) or top row (::top_all), in slot order, or
    // nothing (::none).
    void prefill_rows(const RowBatch & rows, LogitsWanted wanted, void * out, const uint32_t * allowed = nullptr);
    // What prefill_rows has run (tests assert that passes over several slots happened).
    struct PrefillStats {
        int64_t passes = 0, multi_slot_passes = 0, rows = 0, max_slots = 0;
    };
    const PrefillStats & prefill_stats() const { return prefill_stats_; }

    // Allow chain verify batches (eval_verify) of at least n tokens.
    void ensure_slots(int64_t n);

    // Hidden states returned for the rows of every step, kept per slot: Taps' layer ids
    // (graph_qwen35.h; n_layer = the final normed hidden). tapped(slot) holds them for the slot's
    // committed positions tapped_pos(slot) .. + n_tapped_rows(slot) - 1, each row's taps side by
    // side (layers.size() * n_embd floats a row): rows accumulate over steps until the reader calls
    // clear_tapped(slot). The one-sequence steps (eval, eval_verify, verify_tree) tap the current
    // slot: keep(n) drops a verify batch's rows past its first n, and a tree verify adds rows only
    // at keep_path(path), the path's rows in path order (none when the tree is dropped). The steps
    // of several slots tap each of theirs: decode() and prefill_rows() every row, verify_rows() the
    // rows of each slot's path at keep_paths(). Positions that ran on untapped (taps set later)
    // restart a slot's rows; reset() clears the current slot's, set_taps() every slot's, and
    // move_slot() moves them with the slot. Empty layers: no taps (the default).
    void set_taps(const std::vector<int> & layers);
    const std::vector<int> & taps() const { return taps_.layers; }
    const std::vector<float> & tapped() const { return tapped(cur_); }
    int64_t tapped_pos() const { return tapped_pos(cur_); }
    int64_t n_tapped_rows() const { return n_tapped_rows(cur_); }
    void clear_tapped() { clear_tapped(cur_); }  // the rows read: the next ones start at n_past()
    const std::vector<float> & tapped(int64_t slot) const { return slot_taps_.at(slot).rows; }
    int64_t tapped_pos(int64_t slot) const { return slot_taps_.at(slot).pos; }
    int64_t n_tapped_rows(int64_t slot) const;
    void clear_tapped(int64_t slot);

    // What another graph over this model's weights needs (the MTP head, mtp_head.h).
    const ModelWeights & weights() const { return weights_; }
    ggml_backend_t backend() const { return backend_; }
    ggml_backend_t cpu_backend() const { return backend_cpu_; }

    const HParams & hparams() const { return hp_; }
    int64_t n_past() const { return pool_.slots[cur_].n_past; }
    int64_t n_ctx() const { return pool_.n_ctx; }
    int64_t n_ubatch() const { return opts_.n_ubatch; }
    const std::string & backend_name() const { return backend_name_; }
    // The layer split (inactive on one device) and what each of its devices holds (engine_split.cpp;
    // one entry, everything, on one device).
    const LayerSplit & layer_split() const { return split_; }
    std::vector<DeviceLayers> device_layers() const;
    const SequenceState & state() {  // the current slot's live state (a pending verify batch kept whole first)
        settle_verify();
        return seq();
    }
    // The state's tensors as allocated, every slot: KV cache types and bytes per attention layer,
    // recurrent state.
    std::vector<StateTensorInfo> state_info() const { return state_tensor_info(pool_); }
    std::vector<std::string> weight_buffer_types() const { return deltaspec::weight_buffer_types(weights_); }
    std::vector<std::vector<std::string>> weight_stacks() const { return deltaspec::weight_stacks(weights_); }
    // Weight bytes one decode step reads (every matrix; one embedding row): what a step costs
    // where decoding is bound by memory bandwidth.
    size_t step_weight_bytes() const;

  private:
    void verify(const int32_t * tokens, int64_t n_tokens, LogitsWanted wanted, void * out,
                const uint32_t * allowed = nullptr);
    void eval_all(const int32_t * tokens, int64_t n_tokens, LogitsWanted wanted, void * out,
                  const uint32_t * allowed = nullptr);
    void eval_ubatch(const int32_t * tokens, int64_t n_tokens, LogitsWanted wanted, void * out,
                     bool keep_states = false, const uint32_t * allowed = nullptr);
    // verify_rollback.cpp: the recurrent state after the first n tokens of the last verify batch,
    // from the one before it (conv windows copied, DeltaNet recurrences replayed; for all T
    // tokens the states after the batch copied), and the same for all of them when the batch is
    // followed by anything but keep()
    void advance_verify_state(int64_t n);
    bool copy_conv_windows_cuda(int64_t n);  // one CUDA launch; false: not done
    bool copy_last_states_cuda();            // n = T: the same
    bool replay_deltanet_cuda(int64_t n);    // n < T: the same
    void advance_verify_state_graph(int64_t n, bool conv, bool deltanet);  // a ggml graph, any backend
    void settle_verify();
    // commit_paths.cpp: keep_path's and keep_paths' commit of rows_pending_'s paths (paths[i]: slot
    // first_slot + i's rows in the padded batch, root first), the planted bugs their callers pass,
    // `tap_rows`' taps (one slot) gathered to `taps`.
    struct CommitBugs { bool no_compaction = false, parent_state = false, stale_graph = false; };
    struct Committed {
        int64_t kv_rows_moved = 0;
        bool graph_built = false;        // a commit graph was built (none ran, or the kept one was reused)
        bool states_by_kernels = false;  // the recurrent states went through commit_states_cuda
    };
    Committed commit_paths(const std::vector<std::vector<int32_t>> & paths, const CommitBugs & bugs,
                           const std::vector<int32_t> & tap_rows, float * taps);
    // commit_states_cuda.cpp: the DeltaNet states and conv windows after each slot's path (paths[i]:
    // slot first_slot + i's rows, empty: nothing) by our CUDA kernels, two launches for all layers;
    // false when nothing was done (not one GPU, kernels off or absent, a path too long).
    bool commit_states_cuda(const std::vector<std::vector<int32_t>> & paths);
    void append_taps(int64_t n_rows);  // the one-sequence step's tapped rows -> the current slot's
    // n graph rows from `row` of the step just run are slot `slot`'s positions pos .. pos + n - 1
    struct TapRun {
        int64_t slot, pos, row, n;
    };
    void append_tap_runs(const std::vector<TapRun> & runs);  // a slot's runs in position order
    // room for n more rows of `slot` starting at position `pos` (a gap: the old rows go first);
    // returns the offset in its rows where they go
    size_t extend_taps(int64_t slot, int64_t pos, int64_t n);

    // What a step graph's structure depends on: a kept graph serves the steps of its key.
    struct StepKey {
        int64_t n_tokens = -1, n_kv = -1;
        LogitsWanted wanted = LogitsWanted::none;
        bool keep_states = false;
        bool tree = false;  // a tree verify batch (StepInputs::rows)
        int64_t n_seqs = 0, first_slot = 0, slot = -1;  // rows of several slots, or the one slot
        bool masked = false;  // its argmax or top candidates read a mask of allowed tokens (StepGraph::allowed)
        bool operator==(const StepKey & o) const {
            return n_tokens == o.n_tokens && n_kv == o.n_kv && wanted == o.wanted && keep_states == o.keep_states &&
                   tree == o.tree && n_seqs == o.n_seqs && first_slot == o.first_slot && slot == o.slot &&
                   masked == o.masked;
        }
    };
    // A step's graph, built and allocated once for its shape and kept (step_graphs.cpp says why
    // and for how long): a later step of the same shape only sets its inputs and computes, and
    // the CUDA backend can replay it as a CUDA graph.
    struct StepGraph {
        StepKey key;
        ggml_context * ctx = nullptr;  // owns its tensor and node descriptors
        ggml_cgraph * gf = nullptr;
        ggml_backend_sched_t sched = nullptr;  // this graph's own scheduler, allocated for it alone
        size_t bytes = 0;                      // its compute buffers'
        std::vector<ggml_tensor *> tap_out;    // Taps::out of this graph (taps_.out while it runs)
        bool probation = true;                 // run once so far (step_graphs.cpp: eviction)
        StepInputs in;
        ggml_tensor * out = nullptr;
        size_t out_row_bytes = 0;  // one result row of out: logits, top candidates or argmax
        // key.masked: the allowed tokens of each result row (I32 {allowed_words(), rows}); an argmax is
        // then the masked top node of k = 1, whose candidate id is the row's argmax (out_row_bytes 3 words)
        ggml_tensor * allowed = nullptr;
        int64_t n_rows_op_nodes = 0;  // nodes of the rows ops (deltaspec_rows.h) in gf
        VerifyStates verify;  // keep_states: where each token's recurrent state is
    };
    // The graph of that shape, kept or built (step_graphs.cpp); it becomes step_.
    StepGraph & step_graph(int64_t n_tokens, int64_t n_kv, LogitsWanted wanted, bool keep_states,
                           int64_t n_seqs = 0, int64_t first_slot = 0, bool tree = false, bool masked = false);
    // Sets g's mask input from `allowed` (one row per result row), counting the rows it masks
    // (count_masked_rows) unless told not to (a caller whose graph rows repeat some of its rows).
    void set_allowed_input(StepGraph & g, const uint32_t * allowed, bool count = true);
    void count_masked_rows(const uint32_t * allowed, int64_t n_rows);
    // Result rows [first, first + n) of g's last compute into out, in the caller's form (an argmax:
    // one int32 a row, also where the masked top node computed it).
    void get_result_rows(const StepGraph & g, int64_t first, int64_t n, void * out);
    void compute(StepGraph & g);
    void build_step_graph(StepGraph & g);  // g's key set: its graph, allocated by a scheduler of its own
    void free_step_graph(StepGraph & g);
    // Frees kept graphs until within the limits (step_graphs.cpp: which go first); take_sched:
    // returns the last one's scheduler instead of freeing it (null if none was evicted).
    ggml_backend_sched_t evict_kept_graphs(size_t max_kept, bool take_sched);
    SequenceState & seq() { return pool_.slots[cur_]; }
    const SequenceState & seq() const { return pool_.slots[cur_]; }
    void check_batch(const int32_t * tokens, int64_t n_tokens) const;  // fits the context, ids in range
    void init_step_graphs();  // the graphs' size and the cache's limits (step_graphs.cpp)
    void drop_step_graph();   // every kept graph: the tensors they name are gone or changed
    // engine_split.cpp: the backends a scheduler runs graphs on (the device's and the CPU, or every
    // place of a split); a small graph over the state and a step's outputs run through a scheduler
    // of its own (a split's tensors live on several devices); the backends opened and closed.
    std::vector<ggml_backend_t> sched_backends() const;
    void compute_split_graph(ggml_cgraph * gf, size_t graph_size, const char * what);
    void open_backends();
    // opts_.batch_invariant on a GPU: its backends registered (ggml/cuda/deltaspec_invariant.h),
    // folding off; throws std::invalid_argument where a backend has no such mode
    void register_batch_invariant();
    void close_backends();

    HParams hp_;
    EngineOptions opts_;
    ggml_backend_t backend_ = nullptr;      // holds weights and state
    ggml_backend_t backend_cpu_ = nullptr;  // the scheduler's mandatory CPU fallback
    LayerSplit split_;                      // active: backend_ is the first listed device's
    std::string backend_name_;
    std::vector<ggml_backend_t> invariant_backends_;  // registered batch-invariant, released on close
    bool fold_inputs_ = false;  // norms and SwiGLUs offered to our CUDA kernels (cuda_kernels.h)
    bool capture_nodes_ = false;           // set_node_capture
    std::vector<CapturedNode> captured_;   // the last step graph's nodes, while capture_nodes_
    bool split_walks_ = false;  // tree plans may split a slot's walk (deltaspec_rows.h; the constructor says when)
    // The rows tensor's room for walk positions of a batch of n_rows rows (deltaspec_rows_plan's n_positions).
    int64_t rows_positions(int64_t n_rows) const { return split_walks_ ? 2 * n_rows : n_rows; }
    // The rows ops' plan (deltaspec_rows_plan) of a batch's rows in n_positions positions, and in
    // *n_saved the saved states it needs. A rule the rows break throws with `who` in front: as
    // std::invalid_argument where the rows are the caller's (verify_tree, verify_rows), else as
    // std::logic_error (prefill and commit build their own rows).
    std::vector<int32_t> rows_plan(int64_t n_rows, const int32_t * parent, const int32_t * slot, const int32_t * flags,
                                   int64_t n_positions, const char * who, bool callers_rows,
                                   int64_t * n_saved = nullptr) const;
    ModelWeights weights_;
    StatePool pool_;
    int64_t cur_ = 0;  // the slot of the one-sequence calls
    DecodeStats decode_stats_;
    size_t graph_size_ = 0;                 // nodes and leaves a step graph may hold
    StepGraph step_;                        // the last step's graph (keep() reads its outputs)
    std::vector<StepGraph> kept_graphs_;    // other graphs kept for reuse, least recently run first
    std::vector<StepKey> evicted_keys_;     // of graphs evicted on probation, the oldest first
    size_t max_graphs_ = 8, max_kept_bytes_ = 0;  // the cache's limits (init_step_graphs)
    GraphStats graph_stats_;
    int64_t verify_p0_ = -1, verify_T_ = 0;  // the last verify batch, for keep()
    TreeStats tree_stats_;
    // verify_rows' batch until keep_paths, or verify_tree's (tree: one slot, unpadded) until
    // keep_path: padded rows (slot i's at i * tq ..), their parents, slots and indices within
    // their slot, each slot's length before it, the caller's rows' places
    struct RowsPending {
        bool active = false, tree = false;
        int64_t first_slot = 0, n_slots = 0, tq = 0;
        std::vector<int32_t> parent, slot, local, row_of;
        std::vector<int64_t> p0;
    };
    RowsPending rows_pending_;
    RowsStats rows_stats_;
    PrefillStats prefill_stats_;
    ggml_gallocr_t keep_alloc_ = nullptr;    // the commit graph's memory, reused
    ggml_backend_sched_t keep_sched_ = nullptr;  // the same under a layer split (its graph spans devices)
    // The last commit graph (commit_paths.cpp), kept for the next commit of the same shape (key).
    struct KeepGraph {
        ggml_context * ctx = nullptr;
        ggml_cgraph * gf = nullptr;
        ggml_tensor * input = nullptr, * taps = nullptr;  // the plan and the taps' rows; the gathered taps
        std::vector<int64_t> key;
        KeepGraph() = default;
        KeepGraph(const KeepGraph &) = delete;
        KeepGraph & operator=(const KeepGraph &) = delete;
        ~KeepGraph() { drop(); }
        void drop();
    };
    KeepGraph keep_graph_;
    Taps taps_;                  // the layers asked for; their graph outputs in the step graph
    struct SlotTaps {
        std::vector<float> rows;  // of positions pos .. (set_taps)
        int64_t pos = 0;
    };
    std::vector<SlotTaps> slot_taps_;  // per slot
    bool top_rows_enabled_ = true;
    bool device_masks_enabled_ = true;
};


}  // namespace deltaspec
