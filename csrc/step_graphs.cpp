// The step graphs an Engine keeps, one per batch shape, and why they are kept this way.
//
// Speculation changes the step's shape every round: one sequence alternates a one-row step with
// verify batches whose length follows the drafts; a scheduler of several sequences alternates a
// plain pass of N rows with a verify pass of N x Tq rows. With only the last graph kept, every
// change of shape rebuilt the graph (build_qwen35, thousands of nodes) and re-ran the scheduler's
// split and allocation, on the host, every round. And since every graph was built into the same
// descriptor buffer, graphs of one kind had the same first-node address, which is ggml-cuda's key
// for its CUDA graphs (ggml_cuda_graph_get_key): it saw the key again with other node properties
// at each change, reset its warm-up and replayed no CUDA graph while the shapes alternated.
//
// So the graph of each shape is kept, each with
//  - a ggml context of its own: its descriptors stay valid while other graphs are built, and its
//    own node addresses give ggml-cuda a key of its own, so each kept graph keeps its captured
//    CUDA graph and replays it (ggml-cuda skips even the property check while the split's uid is
//    unchanged, i.e. while we do not re-allocate);
//  - a ggml_backend_sched of its own, allocated once for that graph. A scheduler holds the split
//    of ONE graph (its splits, graph copy, input copies) and its gallocr places that graph's
//    tensors in its buffer: computing graph A on a scheduler last allocated for graph B runs B's
//    splits. Sharing one scheduler would mean re-running the split and allocation at every switch
//    (about half of the host time of a rebuild: GraphStats::alloc_seconds vs build_seconds) and
//    would let the allocator move tensors (another CUDA capture). With a scheduler of its own a
//    kept graph's tensors stay where they are: a switch only sets the inputs. (mtp_head.cpp does
//    the same for its two graphs.)
//
// The price is memory: each kept graph keeps its compute buffer. The cache is bounded in graphs
// (DELTASPEC_GRAPH_CACHE, default 8) and in the bytes of the graphs kept besides the last step's
// (DELTASPEC_GRAPH_CACHE_MIB, default a 16th of the device's memory: a 27B's verify graph holds
// its DeltaNet states, hundreds of MB by our estimate, so a 24 GB card keeps a few, an H200 all).
// Which go first: a plain LRU lets one-off graphs push out the ones the rounds alternate between
// (a scheduler prefilling each new sequence's prompt alone in its slot builds a graph that names
// the slot and runs once; 4 of them flushed half of a cache of 8 at every admission). So, as in
// the 2Q policy, a graph run once waits on probation (kProbation graphs, the oldest evicted first)
// and only a graph run again enters the protected part, least recently run first out (graphs of a
// shorter KV length, n_kv growing by kv_pad, are never run again and age out there); and the keys
// of graphs evicted on probation are remembered (max_graphs_ of them), so that a shape that comes
// back after more others than probation holds (4 slots' one-row steps in turn) is built once
// more, straight into the protected part, instead of at every turn. A new graph takes over
// the scheduler, and so the buffers, of the graph it evicts (no device allocation once the cache
// is full): with DELTASPEC_GRAPH_CACHE=1 a step does what it did before the cache, one graph on
// one scheduler.
//
// Row counts are keyed exactly here, not padded up to buckets: a verify batch padded with dummy
// rows would run other kernels (ggml-cuda picks mat-vec or tiled products by the row count), so
// its rows could differ in the last bits from the unpadded batch's and greedy tokens could change.
// (verify_rows pads its slots' rows to a power of two itself: copies it already had to add.)
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_kernels.h"
#include "env.h"
#include "deltaspec_rows.h"
#include "deltaspec_top.h"
#include "engine.h"

namespace deltaspec {

namespace {

// DELTASPEC_TEST_GRAPH_BUG (test only) plants a bug so that tests/test_graph_cache.py can show it
// notices: "never_reuse" rebuilds the graph at every step (a cache that never hits), "slot_key"
// leaves the slot out of a one-sequence graph's key (a graph that reads and writes slot 0's state
// serves a step of slot 1 of the same shape). Read once per process; unset or empty in every real
// use, anything else throws std::invalid_argument.
enum class GraphBug { none, never_reuse, slot_key };

GraphBug graph_bug() {
    static const GraphBug bug = [] {
        return static_cast<GraphBug>(planted_choice("DELTASPEC_TEST_GRAPH_BUG", {"never_reuse", "slot_key"}));
    }();
    return bug;
}

size_t env_count(const char * name, size_t fallback, size_t min) {
    const char * env = std::getenv(name);
    if (env == nullptr || *env == '\0') return fallback;
    char * end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    if (*end != '\0' || v < (long long)min) {
        throw std::invalid_argument(std::string(name) + " must be an integer >= " + std::to_string(min) + ", got '" + env + "'");
    }
    return (size_t)v;
}

// Graphs run once that the cache keeps on probation (see the top of this file): a scheduler's
// admission prefills 1-4 sequences, mostly one graph each.
constexpr size_t kProbation = 2;

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void Engine::init_step_graphs() {
    // Nodes and leaves (weights, state) both count. A layer costs under 96 of them; the rest
    // covers embeddings, head and inputs. (Too few aborts inside ggml's scheduler.)
    graph_size_ = (size_t)(96 * hp_.n_layer + 512);
    max_graphs_ = env_count("DELTASPEC_GRAPH_CACHE", 8, 1);
    size_t free = 0, total = 0;
    ggml_backend_dev_memory(ggml_backend_get_device(backend_), &free, &total);
    max_kept_bytes_ = env_count("DELTASPEC_GRAPH_CACHE_MIB", (total / 16) >> 20, 0) << 20;
}

Engine::GraphStats Engine::graph_stats() const {
    GraphStats s = graph_stats_;
    s.kept = (step_.ctx ? 1 : 0) + (int64_t)kept_graphs_.size();
    s.kept_bytes = (int64_t)step_.bytes;
    for (const StepGraph & g : kept_graphs_) s.kept_bytes += (int64_t)g.bytes;
    s.max_graphs = (int64_t)max_graphs_;
    s.max_kept_bytes = (int64_t)max_kept_bytes_;
    return s;
}

Engine::StepGraph & Engine::step_graph(int64_t T, int64_t n_kv, LogitsWanted wanted, bool keep_states,
                                       int64_t n_seqs, int64_t first_slot, bool tree, bool masked) {
    const GraphBug bug = graph_bug();
    const int64_t slot = n_seqs > 0 ? -1 : cur_;  // a one-sequence graph names its slot's tensors
    const bool reduced = wanted == LogitsWanted::argmax || wanted == LogitsWanted::argmax_all ||
                         wanted == LogitsWanted::top || wanted == LogitsWanted::top_all;
    if (masked && !reduced) {
        throw std::logic_error("a mask of allowed tokens applies to argmax or top results on the device; whole "
                               "logits rows are masked on the host");
    }
    const StepKey key = {T, n_kv, wanted, keep_states, tree, n_seqs, first_slot, slot, masked};
    auto fits = [&](const StepGraph & g) {
        if (!g.ctx) return false;
        if (bug != GraphBug::slot_key || g.key.slot < 0 || slot < 0) return g.key == key;
        StepKey other_slot = g.key;
        other_slot.slot = slot;
        return other_slot == key;
    };
    if (bug != GraphBug::never_reuse) {
        if (fits(step_)) {
            step_.probation = false;
            graph_stats_.reuses += 1;
            return step_;
        }
        for (size_t i = 0; i < kept_graphs_.size(); ++i) {
            if (!fits(kept_graphs_[i])) continue;
            StepGraph g = std::move(kept_graphs_[i]);
            kept_graphs_.erase(kept_graphs_.begin() + (ptrdiff_t)i);
            if (step_.ctx) kept_graphs_.push_back(std::move(step_));  // now the most recently run
            step_ = std::move(g);
            step_.probation = false;
            taps_.out = step_.tap_out;
            graph_stats_.reuses += 1;
            graph_stats_.switches += 1;
            evict_kept_graphs(max_graphs_ - 1, false);  // step_ may have left probation: the protected part's limit
            return step_;
        }
    }

    if (step_.ctx) kept_graphs_.push_back(std::move(step_));
    step_ = StepGraph{};
    // room for the new one; it takes over the scheduler (and the buffers) of the last graph evicted
    step_.sched = evict_kept_graphs(max_graphs_ - 1, /*take_sched =*/true);
    step_.key = key;
    // a shape evicted on probation and back: run again, so protected from the start
    const auto seen = std::find(evicted_keys_.begin(), evicted_keys_.end(), key);
    step_.probation = seen == evicted_keys_.end();
    if (!step_.probation) evicted_keys_.erase(seen);
    build_step_graph(step_);
    evict_kept_graphs(max_graphs_ - 1, false);  // and within the byte limit, now that its size is known
    return step_;
}

void Engine::build_step_graph(StepGraph & g) {
    const auto t0 = std::chrono::steady_clock::now();
    const StepKey & k = g.key;
    const int64_t T = k.n_tokens, n_seqs = k.n_seqs;
    const LogitsWanted wanted = k.wanted;
    try {
        ggml_init_params params = {ggml_tensor_overhead() * graph_size_ + ggml_graph_overhead_custom(graph_size_, false),
                                   nullptr, /*no_alloc =*/true};
        g.ctx = ggml_init(params);
        if (!g.ctx) throw std::runtime_error("cannot create the step graph's context");
        g.gf = ggml_new_graph_custom(g.ctx, graph_size_, false);
        g.in = n_seqs > 0 ? make_batch_inputs(g.ctx, n_seqs, T / n_seqs, k.n_kv, k.first_slot)
               : k.tree   ? make_tree_inputs(g.ctx, T, k.n_kv, rows_positions(T))
                          : make_step_inputs(g.ctx, T, k.n_kv, k.keep_states);
        if (n_seqs > 0 && k.tree) add_rows_input(g.ctx, g.in, rows_positions(T));  // verify_rows: rows of several slots
        // rows of several slots without verify states: a prefill of chains (prefill_rows.cpp), each
        // slot's last row writing its state back, every slot's last row's result
        const bool prefill = n_seqs > 0 && k.tree && !k.keep_states;
        if (prefill) {
            g.in.keep_states = false;
            g.in.n_saved = 0;
        }
        const bool hidden = wanted == LogitsWanted::hidden;
        const bool every_row = wanted == LogitsWanted::all || wanted == LogitsWanted::argmax_all ||
                               wanted == LogitsWanted::top_all || hidden;
        const int64_t n_rows = wanted == LogitsWanted::none ? 0 : prefill ? n_seqs : every_row ? T : 1;
        const bool taps = !taps_.layers.empty();
        // hidden states: no folding, so that the head's input stays the output norm's own result
        g.out = build_qwen35(g.ctx, g.gf, hp_, weights_, pool_, n_seqs > 0 ? pool_.slots[k.first_slot] : pool_.slots[k.slot],
                             g.in, n_rows, fold_inputs_ && !hidden ? FoldInput(cuda_fold_input) : FoldInput(), &g.verify,
                             taps ? &taps_ : nullptr);
        g.tap_out = taps ? taps_.out : std::vector<ggml_tensor *>();
        taps_.out = g.tap_out;
        if (hidden) {  // the head's input {n_embd, T}; the head itself still runs (embeddings are rare)
            g.out = g.out->src[1];
            ggml_set_output(g.out);
        }
        if (k.masked) {
            g.allowed = ggml_new_tensor_2d(g.ctx, GGML_TYPE_I32, allowed_words(), n_rows);
            ggml_set_name(g.allowed, "allowed_tokens");
            ggml_set_input(g.allowed);
        }
        const bool argmax = wanted == LogitsWanted::argmax || wanted == LogitsWanted::argmax_all;
        if (argmax || wanted == LogitsWanted::top || wanted == LogitsWanted::top_all) {  // per row
            // a masked argmax is the masked top node's one candidate (ggml's argmax takes no mask)
            const int n_top = argmax ? 1 : (int)top_k();
            g.out = k.masked ? deltaspec_top_rows_allowed(g.ctx, g.out, n_top, g.allowed)
                    : argmax ? ggml_argmax(g.ctx, g.out)
                             : deltaspec_top_rows(g.ctx, g.out, n_top);
            ggml_set_output(g.out);
            ggml_build_forward_expand(g.gf, g.out);
        }
        g.out_row_bytes = g.out ? ggml_nbytes(g.out) / std::max<int64_t>(1, n_rows) : 0;
        for (int i = 0; i < ggml_graph_n_nodes(g.gf); ++i) {
            g.n_rows_op_nodes += deltaspec_is_rows_node(ggml_graph_node(g.gf, i)) ? 1 : 0;
        }
        const auto t1 = std::chrono::steady_clock::now();
        graph_stats_.build_seconds += std::chrono::duration<double>(t1 - t0).count();

        std::vector<ggml_backend_t> backends = sched_backends();  // a layer split's devices, or the one and the CPU
        const int n_backends = (int)backends.size();
        if (g.sched) {
            ggml_backend_sched_reset(g.sched);  // an evicted graph's, its buffers reused (grown if need be)
        } else {
            g.sched = ggml_backend_sched_new(backends.data(), nullptr, n_backends, graph_size_, false, false);
            if (!g.sched) throw std::runtime_error("cannot create the ggml scheduler");
        }
        if (!ggml_backend_sched_alloc_graph(g.sched, g.gf)) throw std::runtime_error("cannot allocate the compute graph");
        for (int b = 0; b < n_backends; ++b) g.bytes += ggml_backend_sched_get_buffer_size(g.sched, backends[b]);
        graph_stats_.alloc_seconds += seconds_since(t1);
        graph_stats_.builds += 1;
    } catch (...) {
        free_step_graph(g);
        throw;
    }
}

ggml_backend_sched_t Engine::evict_kept_graphs(size_t max_kept, bool take_sched) {
    // Probation only where there is room besides it (a cache of a few graphs is one plain LRU).
    const size_t probation = max_kept >= 2 * kProbation ? kProbation : 0, protect = max_kept - probation;
    size_t bytes = 0, n_probation = 0;
    for (const StepGraph & g : kept_graphs_) {
        bytes += g.bytes;
        n_probation += g.probation;
    }
    ggml_backend_sched_t taken = nullptr;
    for (;;) {
        const size_t n_protected = kept_graphs_.size() - n_probation;
        const bool evict_probation = probation > 0 && n_probation > probation;
        const bool evict_protected = probation > 0 && n_protected > protect;
        if (!evict_probation && !evict_protected && kept_graphs_.size() <= max_kept && bytes <= max_kept_bytes_) break;
        // the least recently run graph of the part over its limit, else of all
        auto victim = kept_graphs_.begin();
        if (evict_probation || evict_protected) {
            while (victim->probation != evict_probation) ++victim;
        }
        StepGraph & g = *victim;
        bytes -= g.bytes;
        n_probation -= g.probation;
        if (g.probation) {
            evicted_keys_.push_back(g.key);
            if (evicted_keys_.size() > max_graphs_) evicted_keys_.erase(evicted_keys_.begin());
        }
        if (take_sched) {
            if (taken) ggml_backend_sched_free(taken);
            taken = std::exchange(g.sched, nullptr);
        }
        free_step_graph(g);
        kept_graphs_.erase(victim);
        graph_stats_.evictions += 1;
    }
    return taken;
}

void Engine::free_step_graph(StepGraph & g) {
    if (g.sched) ggml_backend_sched_free(g.sched);  // and the compute buffers it allocated
    if (g.ctx) ggml_free(g.ctx);
    g = StepGraph{};
}

void Engine::drop_step_graph() {
    free_step_graph(step_);
    for (StepGraph & g : kept_graphs_) free_step_graph(g);
    kept_graphs_.clear();
    evicted_keys_.clear();
    taps_.out.clear();
}

// The scheduler's eval callback while the engine captures nodes (Engine::set_node_capture): asked
// first whether a node is wanted, then called again once it is computed.
static bool capture_node(ggml_tensor * t, bool ask, void * user) {
    if (ask) return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t);
    auto * nodes = static_cast<std::vector<Engine::CapturedNode> *>(user);
    const ggml_tensor * src = t->src[0];
    // a leaf's name (a weight's GGUF name); ggml names views after their node's index, which
    // differs from graph to graph, so other sources go by their op
    const bool leaf = src != nullptr && src->op == GGML_OP_NONE && src->name[0] != '\0';
    Engine::CapturedNode c{ggml_op_desc(t), src == nullptr ? "" : leaf ? src->name : ggml_op_desc(src),
                           {t->ne[0], t->ne[1], t->ne[2], t->ne[3]}, std::vector<float>(ggml_nelements(t))};
    ggml_backend_tensor_get(t, c.data.data(), 0, ggml_nbytes(t));
    nodes->push_back(std::move(c));
    return true;
}

void Engine::compute(StepGraph & g) {
    captured_.clear();
    ggml_backend_sched_set_eval_callback(g.sched, capture_nodes_ ? capture_node : nullptr,
                                         capture_nodes_ ? &captured_ : nullptr);
    if (ggml_backend_sched_graph_compute(g.sched, g.gf) != GGML_STATUS_SUCCESS) {
        drop_step_graph();
        throw std::runtime_error("graph computation failed");
    }
}

void Engine::set_allowed_input(StepGraph & g, const uint32_t * allowed, bool count) {
    if (!g.allowed) return;
    if (!allowed) throw std::logic_error("a masked step graph ran without its mask");
    set_input(g.allowed, allowed, ggml_nbytes(g.allowed));
    if (count) count_masked_rows(allowed, g.allowed->ne[1]);
}

void Engine::count_masked_rows(const uint32_t * allowed, int64_t n_rows) {
    // the rows whose mask forbids some token (the others of a pass carry masks allowing every one)
    const int64_t n_words = allowed_words(), n_vocab = hp_.n_vocab;
    const uint32_t last_word = n_vocab % 32 == 0 ? ~0u : (1u << (n_vocab % 32)) - 1u;
    for (int64_t r = 0; r < n_rows; ++r) {
        const uint32_t * row = allowed + r * n_words;
        bool forbids = (row[n_words - 1] & last_word) != last_word;
        for (int64_t w = 0; w + 1 < n_words && !forbids; ++w) forbids = row[w] != ~0u;
        decode_stats_.masked_rows += forbids;
    }
}

void Engine::get_result_rows(const StepGraph & g, int64_t first, int64_t n, void * out) {
    const bool argmax = g.key.wanted == LogitsWanted::argmax || g.key.wanted == LogitsWanted::argmax_all;
    if (!(argmax && g.key.masked)) {
        ggml_backend_tensor_get(g.out, out, first * g.out_row_bytes, n * g.out_row_bytes);
        return;
    }
    // the masked top node of one candidate: [logit, id, log-sum-exp] a row
    std::vector<int32_t> words(3 * n);
    ggml_backend_tensor_get(g.out, words.data(), first * g.out_row_bytes, n * g.out_row_bytes);
    auto * ids = static_cast<int32_t *>(out);
    for (int64_t i = 0; i < n; ++i) ids[i] = words[3 * i + 1];
}

}  // namespace deltaspec
