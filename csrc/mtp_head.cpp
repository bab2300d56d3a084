#include "mtp_head.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "ggml-alloc.h"

namespace deltaspec {

namespace {

// The target's KV cache type for K (which = "k") or V (every attention layer has the same).
ggml_type target_kv_type(const Engine & target, const char * which) {
    for (const StateTensorInfo & t : target.state_info()) {
        if (t.kind == which) return t.type;
    }
    return GGML_TYPE_F16;  // no attention layer in the trunk
}

}  // namespace

MtpHead::MtpHead(const Engine & target, int64_t n_ctx, int64_t n_ubatch)
    : target_(target), hp_(target.hparams()), n_ubatch_(n_ubatch) {
    if (!target.weights().mtp.present()) {
        throw std::invalid_argument("this model file has no MTP layer (qwen35.nextn_predict_layers is 0): "
                                    "convert it with its MTP weights to draft with MTP");
    }
    if (target.layer_split().active()) {  // its graphs and cache are made for one device
        throw std::invalid_argument("spec_type 'mtp' is not supported with devices= (a layer split); load the model on one device");
    }
    if (n_ctx < 1 || n_ubatch < 1) throw std::invalid_argument("MtpHead: n_ctx and n_ubatch must be >= 1");
    // FA reads the first n_kv rows, a multiple of kv_pad (SequenceState::n_kv_for)
    n_ctx_ = (n_ctx + SequenceState::kv_pad - 1) / SequenceState::kv_pad * SequenceState::kv_pad;
    const int64_t kv_width = hp_.n_head_kv * hp_.head_dim;
    ggml_init_params params = {2 * ggml_tensor_overhead(), nullptr, /*no_alloc =*/true};
    cache_ctx_ = ggml_init(params);
    k_ = ggml_new_tensor_2d(cache_ctx_, target_kv_type(target, "k"), kv_width, n_ctx_);
    v_ = ggml_new_tensor_2d(cache_ctx_, target_kv_type(target, "v"), kv_width, n_ctx_);
    ggml_set_name(k_, "mtp.k");
    ggml_set_name(v_, "mtp.v");
    cache_buf_ = ggml_backend_alloc_ctx_tensors(cache_ctx_, target.backend());
    if (!cache_buf_) {
        ggml_free(cache_ctx_);
        throw std::runtime_error("cannot allocate the MTP head's KV cache");
    }
    ggml_backend_buffer_clear(cache_buf_, 0);  // rows never written must not be NaN (the mask zeroes their weight)

    graph_size_ = 1024;
    ggml_backend_t backends[2] = {target.backend(), target.cpu_backend()};
    const int n_backends = target.backend() == target.cpu_backend() ? 1 : 2;
    for (Graph & g : g_) {
        g.meta.resize(ggml_tensor_overhead() * graph_size_ + ggml_graph_overhead_custom(graph_size_, false));
        g.sched = ggml_backend_sched_new(backends, nullptr, n_backends, graph_size_, false, false);
    }
    if (!g_[0].sched || !g_[1].sched) {
        for (Graph & g : g_) {
            if (g.sched) ggml_backend_sched_free(g.sched);
        }
        ggml_backend_buffer_free(cache_buf_);
        ggml_free(cache_ctx_);
        throw std::runtime_error("cannot create the MTP head's schedulers");
    }
}

MtpHead::~MtpHead() {
    for (int i = 0; i < 2; ++i) {
        drop_graph(i);
        ggml_backend_sched_free(g_[i].sched);
    }
    ggml_backend_buffer_free(cache_buf_);
    ggml_free(cache_ctx_);
}

void MtpHead::drop_graph(int which) {
    Graph & g = g_[which];
    if (g.ctx) ggml_free(g.ctx);
    g.ctx = nullptr;
    g.gf = nullptr;
    g.n_tokens = g.n_kv = -1;
}

size_t MtpHead::step_weight_bytes() const {
    const MtpWeights & w = target_.weights().mtp;
    size_t bytes = w.bytes;                                                      // the head's own tensors
    if (w.head == target_.weights().output) bytes += ggml_nbytes(w.head);        // the shared LM head
    if (w.embed != target_.weights().token_embd) bytes -= ggml_nbytes(w.embed);  // a step reads one row of it
    return bytes + ggml_row_size(w.embed->type, w.embed->ne[0]);
}

void MtpHead::set_n_past(int64_t n) {
    if (n < 0 || n > n_past_) throw std::invalid_argument("MtpHead::set_n_past: only rows already written can be forgotten");
    n_past_ = n;
}

void MtpHead::eval(const int32_t * tokens, const float * hidden, int64_t T, LogitsWanted wanted, void * out,
                   float * hidden_out) {
    if (T < 1) throw std::invalid_argument("MtpHead::eval needs at least one row");
    if (wanted == LogitsWanted::argmax_all) throw std::invalid_argument("MtpHead::eval: argmax of the last row only");
    if (n_past_ + T > n_ctx_) {
        throw std::length_error("the MTP head's context of " + std::to_string(n_ctx_) + " rows is full");
    }
    for (int64_t t = 0; t < T; ++t) {
        if (tokens[t] < 0 || tokens[t] >= hp_.n_vocab) {
            throw std::out_of_range("token id " + std::to_string(tokens[t]) + " is outside the vocabulary");
        }
    }
    const int64_t E = hp_.n_embd;
    for (int64_t done = 0; done < T;) {
        const int64_t n = std::min(n_ubatch_, T - done);
        const bool last = done + n == T;
        const bool all = wanted == LogitsWanted::all;
        void * dst = all ? (void *)((float *)out + done * hp_.n_vocab) : out;
        float * h_dst = hidden_out == nullptr ? nullptr : all ? hidden_out + done * E : hidden_out;
        eval_ubatch(tokens + done, hidden + done * E, n, all ? wanted : last ? wanted : LogitsWanted::none,
                    dst, all || last ? h_dst : nullptr);
        done += n;
    }
}

void MtpHead::eval_ubatch(const int32_t * tokens, const float * hidden, int64_t T, LogitsWanted wanted, void * out,
                          float * hidden_out) {
    const int64_t p0 = n_past_, E = hp_.n_embd;
    const int64_t padded = (p0 + T + SequenceState::kv_pad - 1) / SequenceState::kv_pad * SequenceState::kv_pad;
    const int64_t n_kv = std::min(n_ctx_, padded);
    const int which = T == 1 ? 0 : 1;
    Graph & g = g_[which];
    if (!(g.ctx && g.n_tokens == T && g.n_kv == n_kv && g.wanted == wanted)) {
        drop_graph(which);
        ggml_init_params params = {g.meta.size(), g.meta.data(), /*no_alloc =*/true};
        g.ctx = ggml_init(params);
        g.gf = ggml_new_graph_custom(g.ctx, graph_size_, false);
        g.in = make_step_inputs(g.ctx, T, n_kv);
        g.hidden_in = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, E, T);
        ggml_set_input(g.hidden_in);
        const int64_t n_rows = wanted == LogitsWanted::all ? T : wanted == LogitsWanted::none ? 0 : 1;
        g.out = build_mtp(g.ctx, g.gf, hp_, target_.weights().mtp, k_, v_, n_ctx_, g.in, g.hidden_in, n_rows);
        g.result = g.out.logits;
        if (wanted == LogitsWanted::argmax) {
            g.result = ggml_argmax(g.ctx, g.out.logits);
            ggml_set_output(g.result);
            ggml_build_forward_expand(g.gf, g.result);
        }
        ggml_backend_sched_reset(g.sched);
        if (!ggml_backend_sched_alloc_graph(g.sched, g.gf)) {
            drop_graph(which);
            throw std::runtime_error("cannot allocate the MTP head's graph");
        }
        g.n_tokens = T;
        g.n_kv = n_kv;
        g.wanted = wanted;
    }

    set_input(g.in.tokens, tokens, T * sizeof(int32_t));
    set_input(g.hidden_in, hidden, T * E * sizeof(float));
    set_chain_inputs(g.in, p0, T, n_kv);

    if (ggml_backend_sched_graph_compute(g.sched, g.gf) != GGML_STATUS_SUCCESS) {
        drop_graph(which);
        throw std::runtime_error("the MTP head's graph computation failed");
    }
    n_past_ = p0 + T;
    if (wanted != LogitsWanted::none) ggml_backend_tensor_get(g.result, out, 0, ggml_nbytes(g.result));
    if (hidden_out != nullptr) {
        const bool all = wanted == LogitsWanted::all;
        const size_t row = E * sizeof(float);
        ggml_backend_tensor_get(g.out.hidden, hidden_out, all ? 0 : (T - 1) * row, all ? T * row : row);
    }
}

namespace {

MtpHead::GroupStats g_group_stats;

}  // namespace

MtpHead::GroupStats MtpHead::group_stats() { return g_group_stats; }

void MtpHead::eval_groups(std::vector<RowsJob> & jobs) {
    if (jobs.empty()) return;
    if (jobs.size() == 1) {  // one head: its own graphs, kept from step to step (a group's are built per call)
        RowsJob & job = jobs[0];
        if (job.head == nullptr) throw std::invalid_argument("MtpHead::eval_groups: every job needs a head of the same target");
        job.head->eval(job.tokens.data(), job.hidden.data(), (int64_t)job.tokens.size(), job.wanted, job.out, job.hidden_out);
        return;
    }
    const MtpHead & first = *jobs[0].head;
    const HParams & hp = first.hp_;
    const int64_t E = hp.n_embd, N = (int64_t)jobs.size();
    int64_t T = 0;
    for (int64_t j = 0; j < N; ++j) {
        const RowsJob & job = jobs[j];
        const int64_t n = (int64_t)job.tokens.size();
        if (job.head == nullptr || &job.head->target_ != &first.target_) {
            throw std::invalid_argument("MtpHead::eval_groups: every job needs a head of the same target");
        }
        for (int64_t i = 0; i < j; ++i) {
            if (jobs[i].head == job.head) throw std::invalid_argument("MtpHead::eval_groups: two jobs of one head");
        }
        if (n < 1 || (int64_t)job.hidden.size() != n * E) {
            throw std::invalid_argument("MtpHead::eval_groups: a job needs rows, with n_embd hidden values each");
        }
        if (job.wanted != LogitsWanted::none && job.wanted != LogitsWanted::last && job.wanted != LogitsWanted::argmax) {
            throw std::invalid_argument("MtpHead::eval_groups: a job's last row's logits or argmax, or nothing");
        }
        if (job.head->n_past_ + n > job.head->n_ctx_) {
            throw std::length_error("the MTP head's context of " + std::to_string(job.head->n_ctx_) + " rows is full");
        }
        for (int32_t t : job.tokens) {
            if (t < 0 || t >= hp.n_vocab) throw std::out_of_range("token id " + std::to_string(t) + " is outside the vocabulary");
        }
        T += n;
    }
    // per head: its inputs, attention and cache writes; the rest once
    const size_t graph_size = 256 + (size_t)N * 96;
    std::vector<uint8_t> meta(ggml_tensor_overhead() * graph_size + ggml_graph_overhead_custom(graph_size, false));
    ggml_context * ctx = ggml_init({meta.size(), meta.data(), /*no_alloc =*/true});
    ggml_backend_sched_t sched = nullptr;
    try {
        ggml_cgraph * gf = ggml_new_graph_custom(ctx, graph_size, false);
        ggml_tensor * tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
        ggml_tensor * hidden = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, E, T);
        ggml_tensor * logit_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, N);  // each job's last row
        for (ggml_tensor * t : {tokens, hidden, logit_rows}) ggml_set_input(t);
        std::vector<MtpHeadCache> caches;
        std::vector<StepInputs> in;
        std::vector<int64_t> n_kv(N);
        for (int64_t j = 0; j < N; ++j) {
            const MtpHead & h = *jobs[j].head;
            const int64_t n = (int64_t)jobs[j].tokens.size();
            const int64_t padded = (h.n_past_ + n + SequenceState::kv_pad - 1) / SequenceState::kv_pad * SequenceState::kv_pad;
            n_kv[j] = std::min(h.n_ctx_, padded);
            caches.push_back({h.k_, h.v_, h.n_ctx_});
            in.push_back(make_step_inputs(ctx, n, n_kv[j]));
        }
        const MtpGraphOutputs out = build_mtp_groups(ctx, gf, hp, first.target_.weights().mtp, caches, in, tokens, hidden,
                                                     logit_rows);
        ggml_tensor * argmax = ggml_argmax(ctx, out.logits);  // {N}
        ggml_set_output(argmax);
        ggml_build_forward_expand(gf, argmax);

        ggml_backend_t backends[2] = {first.target_.backend(), first.target_.cpu_backend()};
        const int n_backends = backends[0] == backends[1] ? 1 : 2;
        sched = ggml_backend_sched_new(backends, nullptr, n_backends, graph_size, false, false);
        if (!sched || !ggml_backend_sched_alloc_graph(sched, gf)) throw std::runtime_error("cannot allocate the MTP heads' graph");

        std::vector<int32_t> all_tokens, last(N);
        std::vector<float> all_hidden;
        for (int64_t j = 0; j < N; ++j) {
            all_tokens.insert(all_tokens.end(), jobs[j].tokens.begin(), jobs[j].tokens.end());
            all_hidden.insert(all_hidden.end(), jobs[j].hidden.begin(), jobs[j].hidden.end());
            last[j] = (int32_t)all_tokens.size() - 1;
            set_chain_inputs(in[j], jobs[j].head->n_past_, (int64_t)jobs[j].tokens.size(), n_kv[j]);
        }
        set_input(tokens, all_tokens.data(), all_tokens.size() * sizeof(int32_t));
        set_input(hidden, all_hidden.data(), all_hidden.size() * sizeof(float));
        set_input(logit_rows, last.data(), last.size() * sizeof(int32_t));
        if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("the MTP heads' graph computation failed");
        }
        const size_t row = E * sizeof(float), logits_row = hp.n_vocab * sizeof(float);
        for (int64_t j = 0; j < N; ++j) {
            RowsJob & job = jobs[j];
            job.head->n_past_ += (int64_t)job.tokens.size();
            if (job.wanted == LogitsWanted::last) ggml_backend_tensor_get(out.logits, job.out, j * logits_row, logits_row);
            if (job.wanted == LogitsWanted::argmax) ggml_backend_tensor_get(argmax, job.out, j * sizeof(int32_t), sizeof(int32_t));
            if (job.hidden_out) ggml_backend_tensor_get(out.hidden, job.hidden_out, last[j] * row, row);
        }
    } catch (...) {
        if (sched) ggml_backend_sched_free(sched);
        ggml_free(ctx);
        throw;
    }
    ggml_backend_sched_free(sched);
    ggml_free(ctx);
    g_group_stats.calls += 1;
    g_group_stats.max_heads = std::max(g_group_stats.max_heads, N);
}

}  // namespace deltaspec
