#include "engine.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "cuda_kernels.h"
#include "env.h"
#include "ggml-alloc.h"
#include "ggml-cpu.h"
#include "graph_qwen35.h"

namespace deltaspec {

ggml_backend_dev_t backend_device(const std::string & device) {
    if (device == "cpu") {
        ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        if (!dev) throw std::runtime_error("device 'cpu' is not available in this build of deltaspec");
        return dev;
    }
    // "cuda:N" counts only GPUs, in ggml's registry order (CUDA0, CUDA1, ...): the CPU's place in the
    // registry says nothing about which card a user means
    size_t index = 0;
    if (device.rfind("cuda:", 0) == 0) {
        const std::string digits = device.substr(5);
        if (digits.empty() || digits.size() > 6 || digits.find_first_not_of("0123456789") != std::string::npos) {
            throw std::invalid_argument("device: expected 'cpu', 'cuda' or 'cuda:N' (N >= 0), got '" + device + "'");
        }
        index = std::stoul(digits);
    } else if (device != "cuda" && device != "gpu") {
        throw std::invalid_argument("device must be 'cpu', 'cuda' or 'cuda:N', got '" + device + "'");
    }
    std::vector<ggml_backend_dev_t> gpus;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        if (ggml_backend_dev_type(ggml_backend_dev_get(i)) == GGML_BACKEND_DEVICE_TYPE_GPU) {
            gpus.push_back(ggml_backend_dev_get(i));
        }
    }
    if (gpus.empty()) throw std::runtime_error("device '" + device + "' is not available in this build of deltaspec");
    if (index >= gpus.size()) {
        throw std::runtime_error("device '" + device + "': GPU index " + std::to_string(index) + " is out of range: " +
                                 "this machine and build have " + std::to_string(gpus.size()) + " GPU device(s), " +
                                 "cuda:0 .. cuda:" + std::to_string(gpus.size() - 1));
    }
    return gpus[index];
}

namespace {

ggml_backend_t init_backend(const std::string & device) {
    ggml_backend_t backend = ggml_backend_dev_init(backend_device(device), nullptr);
    if (!backend) throw std::runtime_error("cannot initialise device '" + device + "'");
    return backend;
}

}  // namespace

Engine::Engine(const std::string & path, const HParams & hp, const EngineOptions & opts) : hp_(hp), opts_(opts) {
    if ((int64_t)hp.recurrent.size() != hp.n_layer) throw std::invalid_argument("recurrent flags != n_layer");
    if (opts.n_ubatch < 1) throw std::invalid_argument("n_ubatch must be >= 1");
    if (opts.n_seq_max < 1) throw std::invalid_argument("n_seq_max must be >= 1");
    for (auto [t, which] : {std::pair{opts.type_k, "type_k"}, std::pair{opts.type_v, "type_v"}}) {
        if (hp.head_dim % ggml_blck_size(t) != 0) {
            throw std::invalid_argument(std::string(which) + ": the block size of " + ggml_type_name(t) +
                                        " does not divide the head dim " + std::to_string(hp.head_dim));
        }
    }
    opts_.progress = nullptr;  // only the load uses it; keep no reference to the caller's callback
    try {
        open_backends();
        // a tree's side branches as a second walk of the recurrence beside its deepest path
        // (deltaspec_rows.h), which on a GPU runs at once with it: off unless DELTASPEC_ROWS_SPLIT=1.
        // Measured (H100, synthetic 27B, with the recurrence nodes' walk bound; bench/README.md) it
        // does not pay: 1 + 22 rows 14.73 ms split, 14.41 ms whole, and its room for 2 R positions
        // costs 0.1-0.2 ms even on chains, which never split.
        split_walks_ = env_flag("DELTASPEC_ROWS_SPLIT");
        const LayerSplit * split = split_.active() ? &split_ : nullptr;
        load_weights(weights_, path, hp_, backend_, env_on("DELTASPEC_STACK_PROJECTIONS"), opts.progress, split);
        allocate_state(pool_, hp_, opts.n_ctx, opts.n_seq_max, opts.type_k, opts.type_v, opts.n_slots, backend_,
                       opts.kv_format_k, opts.kv_format_v, split);
        slot_taps_.resize(opts.n_seq_max);
        init_step_graphs();
    } catch (...) {
        close_backends();
        throw;
    }
}

void Engine::open_backends() {
    if (!opts_.devices.empty()) {
        backend_cpu_ = ggml_backend_cpu_init();
        ggml_backend_cpu_set_n_threads(backend_cpu_, std::max(1, opts_.n_threads));
        ggml_backend_cpu_set_use_ref(backend_cpu_, opts_.batch_invariant);  // the layers split onto the CPU
        // blocks: the trunk's and the MTP layers after it, as the GGUF's block_count counts them
        split_ = make_layer_split(opts_.devices, opts_.tensor_split, hp_.n_layer + hp_.n_layer_nextn, backend_cpu_);
        backend_ = split_.backends[0];
        for (size_t i = 0; i < split_.backends.size(); ++i) {
            backend_name_ += (i ? "," : "") + std::string(ggml_backend_name(split_.backends[i]));
        }
        // our kernels serve the nodes ggml-cuda runs, as on one GPU (folding stays off: it would skip
        // an op whose readers may sit on another device)
        if (split_.backends.size() > 1) enable_cuda_kernels();
        register_batch_invariant();
        return;
    }
    backend_ = init_backend(opts_.device);
    backend_name_ = ggml_backend_name(backend_);
    if (opts_.device == "cpu") {
        backend_cpu_ = backend_;
    } else {
        backend_cpu_ = ggml_backend_cpu_init();
        fold_inputs_ = enable_cuda_kernels() && env_on("DELTASPEC_FOLD_INPUTS");
    }
    ggml_backend_cpu_set_n_threads(backend_cpu_, std::max(1, opts_.n_threads));
    ggml_backend_cpu_set_use_ref(backend_cpu_, opts_.batch_invariant);
    register_batch_invariant();
}

void Engine::register_batch_invariant() {
    if (!opts_.batch_invariant) return;
    std::vector<ggml_backend_t> devices;
    if (split_.active()) {
        devices = split_.backends;
    } else {
        devices = {backend_};
    }
    for (ggml_backend_t b : devices) {
        if (ggml_backend_is_cpu(b)) continue;  // ggml_backend_cpu_set_use_ref above
        if (!cuda_set_batch_invariant(b, true)) {
            throw std::invalid_argument(std::string("batch_invariant: the ") + ggml_backend_name(b) +
                                        " backend has no batch-invariant mode (a CUDA build of deltaspec with its "
                                        "kernels in ggml-cuda has one)");
        }
        invariant_backends_.push_back(b);
    }
    // a folded norm or SwiGLU would round as part of its product's input, ggml's op as itself: the
    // same for every width only if never folded
    fold_inputs_ = false;
}

void Engine::close_backends() {
    for (ggml_backend_t b : invariant_backends_) cuda_set_batch_invariant(b, false);
    invariant_backends_.clear();
    if (split_.active()) {
        free_layer_split(split_);  // the devices' backends but the CPU's
    } else if (backend_ && backend_ != backend_cpu_) {
        ggml_backend_free(backend_);
    }
    if (backend_cpu_) ggml_backend_free(backend_cpu_);
    backend_ = backend_cpu_ = nullptr;
}

Engine::~Engine() {
    drop_step_graph();
    if (keep_alloc_) ggml_gallocr_free(keep_alloc_);
    // weights_ and pool_ free their buffers in their destructors, which run after this body;
    // the backends must outlive those buffers, so release the buffers first.
    if (keep_sched_) ggml_backend_sched_free(keep_sched_);
    if (weights_.buffer) {
        ggml_backend_buffer_free(weights_.buffer);
        weights_.buffer = nullptr;
    }
    for (ggml_backend_buffer_t b : weights_.split_buffers) {
        if (b) ggml_backend_buffer_free(b);
    }
    weights_.split_buffers.clear();
    pool_.release();
    close_backends();
}

size_t Engine::step_weight_bytes() const {
    // the MTP head's own weights are not read by a target step
    size_t all = weights_.buffer ? ggml_backend_buffer_get_size(weights_.buffer) : 0;
    for (ggml_backend_buffer_t b : weights_.split_buffers) all += b ? ggml_backend_buffer_get_size(b) : 0;
    all -= weights_.mtp.bytes;
    return weights_.output == weights_.token_embd ? all : all - ggml_nbytes(weights_.token_embd);
}

void Engine::reset() {
    seq().clear();
    clear_tapped();
    verify_T_ = 0;
    rows_pending_.active = false;
}

void Engine::use_slot(int64_t slot) {
    if (slot < 0 || slot >= pool_.n_seq) {
        throw std::out_of_range("sequence slot " + std::to_string(slot) + " outside [0, " + std::to_string(pool_.n_seq) + ")");
    }
    if (slot == cur_) return;
    settle_verify();
    cur_ = slot;
}

void Engine::move_slot(int64_t from, int64_t to) {
    settle_verify();
    pool_.copy_slot(from, to);
    if (from != to) slot_taps_.at(to) = slot_taps_.at(from);
}

void Engine::eval(const int32_t * tokens, int64_t n_tokens, LogitsWanted wanted, float * logits) {
    if (wanted == LogitsWanted::argmax || wanted == LogitsWanted::argmax_all || wanted == LogitsWanted::top ||
        wanted == LogitsWanted::top_all) {
        throw std::invalid_argument("use eval_argmax / eval_verify_argmax / eval_top for argmax tokens or top rows");
    }
    eval_all(tokens, n_tokens, wanted, logits);
}

void Engine::eval_hidden(const int32_t * tokens, int64_t n_tokens, float * hidden) {
    eval_all(tokens, n_tokens, LogitsWanted::hidden, hidden);
}

int32_t Engine::eval_argmax(const int32_t * tokens, int64_t n_tokens, const uint32_t * allowed) {
    int32_t token = -1;
    eval_all(tokens, n_tokens, LogitsWanted::argmax, &token, allowed);
    return token;
}

int64_t Engine::top_k() const {
    // enough for top_logprobs <= 20 (OpenAI's limit) and the top-k of common sampler settings (40)
    return std::min<int64_t>(64, hp_.n_vocab);
}

void Engine::eval_top(const int32_t * tokens, int64_t n_tokens, int32_t * top, const uint32_t * allowed) {
    eval_all(tokens, n_tokens, LogitsWanted::top, top, allowed);
    decode_stats_.top_rows += 1;
}

void Engine::check_batch(const int32_t * tokens, int64_t n_tokens) const {
    if (n_tokens < 1) throw std::invalid_argument("eval needs at least one token");
    if (seq().n_past + n_tokens > seq().n_ctx) {
        throw std::length_error("sequence of " + std::to_string(seq().n_past + n_tokens) +
                                " tokens does not fit the context of " + std::to_string(seq().n_ctx));
    }
    for (int64_t i = 0; i < n_tokens; ++i) {
        if (tokens[i] < 0 || tokens[i] >= hp_.n_vocab) {
            throw std::out_of_range("token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                                    " is outside the vocabulary [0, " + std::to_string(hp_.n_vocab) + ")");
        }
    }
}

void Engine::set_taps(const std::vector<int> & layers) {
    for (int il : layers) {
        if (il < 0 || il > hp_.n_layer) {
            throw std::out_of_range("tap layer " + std::to_string(il) + " outside [0, n_layer = " + std::to_string(hp_.n_layer) + "]");
        }
    }
    settle_verify();
    drop_step_graph();
    taps_.layers = layers;
    for (int64_t s = 0; s < pool_.n_seq; ++s) clear_tapped(s);
}

int64_t Engine::n_tapped_rows(int64_t slot) const {
    const SlotTaps & st = slot_taps_.at(slot);
    return taps_.layers.empty() ? 0 : (int64_t)(st.rows.size() / (taps_.layers.size() * hp_.n_embd));
}

void Engine::clear_tapped(int64_t slot) {
    SlotTaps & st = slot_taps_.at(slot);
    st.rows.clear();
    st.pos = pool_.slots.at(slot).n_past;
}

void Engine::eval_all(const int32_t * tokens, int64_t n_tokens, LogitsWanted wanted, void * out,
                      const uint32_t * allowed) {
    check_batch(tokens, n_tokens);
    for (int64_t done = 0; done < n_tokens;) {
        const int64_t n = std::min(opts_.n_ubatch, n_tokens - done);
        const bool last_batch = done + n == n_tokens;
        const bool every_row = wanted == LogitsWanted::all || wanted == LogitsWanted::hidden;
        LogitsWanted w = every_row ? wanted : last_batch ? wanted : LogitsWanted::none;
        const int64_t row = wanted == LogitsWanted::hidden ? hp_.n_embd : hp_.n_vocab;
        void * dst = every_row ? static_cast<float *>(out) + done * row : out;
        eval_ubatch(tokens + done, n, w, dst, /*keep_states =*/false, last_batch ? allowed : nullptr);
        done += n;
    }
}

void Engine::eval_verify(const int32_t * tokens, int64_t T, float * logits) {
    verify(tokens, T, LogitsWanted::all, logits);
}

void Engine::eval_verify_argmax(const int32_t * tokens, int64_t T, int32_t * argmax, const uint32_t * allowed) {
    verify(tokens, T, LogitsWanted::argmax_all, argmax, allowed);
}

void Engine::eval_verify_top(const int32_t * tokens, int64_t T, int32_t * top, const uint32_t * allowed) {
    verify(tokens, T, LogitsWanted::top_all, top, allowed);
    decode_stats_.top_rows += T;
}

void Engine::verify(const int32_t * tokens, int64_t T, LogitsWanted wanted, void * out, const uint32_t * allowed) {
    if (T < 1 || T > seq().n_slots || T > opts_.n_ubatch) {
        throw std::invalid_argument("a verify batch holds 1 to " + std::to_string(std::min(seq().n_slots, opts_.n_ubatch)) +
                                    " tokens (n_slots, n_ubatch), got " + std::to_string(T));
    }
    check_batch(tokens, T);
    const int64_t p0 = seq().n_past;
    eval_ubatch(tokens, T, wanted, out, /*keep_states =*/true, allowed);
    verify_p0_ = p0;
    verify_T_ = T;
}

void Engine::keep(int64_t n_keep) {
    if (verify_T_ == 0 || n_keep < 1 || n_keep > verify_T_) {
        throw std::logic_error("keep(n) needs 1 <= n <= the tokens of the verify batch just evaluated");
    }
    advance_verify_state(n_keep);
    seq().n_past = verify_p0_ + n_keep;
    // the tapped rows of the dropped tokens go too
    SlotTaps & st = slot_taps_[cur_];
    st.rows.resize(std::min<size_t>(st.rows.size(), (seq().n_past - st.pos) * taps_.layers.size() * hp_.n_embd));
    verify_T_ = 0;
}

void Engine::settle_verify() {
    if (verify_T_ > 0) keep(verify_T_);
    rows_pending_.active = false;  // a tree or rows verify batch left the committed state as it was: drop it
}

void Engine::ensure_slots(int64_t n) {
    // a capacity only: a verify graph holds its per-token states itself (VerifyStates)
    for (SequenceState & st : pool_.slots) st.n_slots = std::max(st.n_slots, n);
}

void Engine::eval_ubatch(const int32_t * tokens, int64_t T, LogitsWanted wanted, void * out, bool keep_states,
                         const uint32_t * allowed) {
    settle_verify();  // before a new graph may take the memory of the last one's outputs
    const int64_t p0 = seq().n_past;
    const int64_t n_kv = seq().n_kv_for(p0 + T);
    StepGraph & g = step_graph(T, n_kv, wanted, keep_states, 0, 0, false, allowed != nullptr);

    set_input(g.in.tokens, tokens, T * sizeof(int32_t));
    set_chain_inputs(g.in, p0, T, n_kv);
    set_allowed_input(g, allowed);

    compute(g);
    seq().n_past = p0 + T;
    if (wanted != LogitsWanted::none) get_result_rows(g, 0, (int64_t)(ggml_nbytes(g.out) / g.out_row_bytes), out);
    append_taps(T);
}

void Engine::append_taps(int64_t T) { append_tap_runs({{cur_, seq().n_past - T, 0, T}}); }

size_t Engine::extend_taps(int64_t slot, int64_t pos, int64_t n) {
    SlotTaps & st = slot_taps_.at(slot);
    if (st.pos + n_tapped_rows(slot) != pos) {  // positions ran on without taps
        st.rows.clear();
        st.pos = pos;
    }
    const size_t first = st.rows.size();
    st.rows.resize(first + n * taps_.layers.size() * hp_.n_embd);
    return first;
}

void Engine::append_tap_runs(const std::vector<TapRun> & runs) {
    const int64_t E = hp_.n_embd, n_taps = (int64_t)taps_.layers.size();
    if (n_taps == 0 || runs.empty()) return;
    std::vector<size_t> first(runs.size());
    for (size_t k = 0; k < runs.size(); ++k) first[k] = extend_taps(runs[k].slot, runs[k].pos, runs[k].n);
    // one read per tap and span of adjacent graph rows (a decode's or prefill's rows are one span;
    // the accepted paths of a verify, one per slot), then each row to its slot, its taps side by side
    std::vector<float> buf;
    for (size_t k0 = 0; k0 < runs.size();) {
        size_t k1 = k0 + 1;
        while (k1 < runs.size() && runs[k1].row == runs[k1 - 1].row + runs[k1 - 1].n) ++k1;
        const int64_t row0 = runs[k0].row, n_rows = runs[k1 - 1].row + runs[k1 - 1].n - row0;
        buf.resize(n_rows * E);
        for (int64_t i = 0; i < n_taps; ++i) {
            ggml_backend_tensor_get(taps_.out[i], buf.data(), row0 * E * sizeof(float), buf.size() * sizeof(float));
            for (size_t k = k0; k < k1; ++k) {
                float * dst = slot_taps_[runs[k].slot].rows.data() + first[k];
                for (int64_t t = 0; t < runs[k].n; ++t) {
                    std::copy_n(buf.data() + (runs[k].row - row0 + t) * E, E, dst + (t * n_taps + i) * E);
                }
            }
        }
        k0 = k1;
    }
}

}  // namespace deltaspec
