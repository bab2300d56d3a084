#include "dflash_model.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <stdexcept>

#include "ggml-alloc.h"
#include "gguf.h"
#include "graph_dflash.h"
#include "graph_qwen35.h"  // set_input

namespace deltaspec {

namespace {

std::string blk(int il, const char * name) { return "blk." + std::to_string(il) + "." + name + ".weight"; }

// The drafter's tensors, declared in `ctx` with the file's types and shapes and filled from the
// file once allocated. The shapes were checked against the hyper-parameters in Python; what is
// checked here is only what a changed file could break.
class DFlashFile {
  public:
    DFlashFile(const std::string & path, ggml_context * ctx) : path_(path), ctx_(ctx) {
        gguf_init_params params = {/*no_alloc =*/true, /*ctx =*/&meta_};
        gguf_ = gguf_init_from_file(path.c_str(), params);
        if (!gguf_) throw std::runtime_error(path + ": not a readable GGUF file");
    }
    ~DFlashFile() {
        if (meta_) ggml_free(meta_);
        if (gguf_) gguf_free(gguf_);
    }

    ggml_tensor * bind(const std::string & name, std::initializer_list<int64_t> shape) {
        const ggml_tensor * src = ggml_get_tensor(meta_, name.c_str());
        if (!src) throw std::runtime_error(path_ + ": tensor '" + name + "' is missing");
        int i = 0;
        for (int64_t ne : shape) {
            if (src->ne[i++] != ne) throw std::runtime_error(path_ + ": tensor '" + name + "' has an unexpected shape");
        }
        ggml_tensor * t = ggml_dup_tensor(ctx_, src);
        ggml_set_name(t, name.c_str());
        bound_.emplace_back(t, gguf_find_tensor(gguf_, name.c_str()));
        return t;
    }

    void upload() {
        std::ifstream f(path_, std::ios::binary);
        std::vector<char> buf;
        const size_t data_offset = gguf_get_data_offset(gguf_);
        for (auto [t, id] : bound_) {
            buf.resize(ggml_nbytes(t));
            f.seekg((std::streamoff)(data_offset + gguf_get_tensor_offset(gguf_, id)));
            f.read(buf.data(), (std::streamsize)buf.size());
            if (!f) throw std::runtime_error(path_ + ": tensor '" + ggml_get_name(t) + "' extends past the end of the file");
            ggml_backend_tensor_set(t, buf.data(), 0, buf.size());
        }
    }

    int64_t n_tensors() const { return gguf_get_n_tensors(gguf_); }

  private:
    const std::string & path_;
    ggml_context * ctx_;
    gguf_context * gguf_ = nullptr;
    ggml_context * meta_ = nullptr;
    std::vector<std::pair<ggml_tensor *, int64_t>> bound_;
};

}  // namespace

DFlashModel::DFlashModel(const std::string & path, const DFlashHParams & hp, Engine & target, int64_t n_ctx,
                         int64_t n_slots)
    : hp_(hp), target_(target), n_ctx_(n_ctx) {
    const int64_t E = hp.n_embd, D = hp.head_dim, H = hp.n_head, Hkv = hp.n_head_kv;
    if (target.layer_split().active()) {  // its weights, cache and scheduler are made for one device
        throw std::invalid_argument("a DFlash drafter is not supported with devices= (a layer split); load the target on one device");
    }
    if (E != target.hparams().n_embd) throw std::invalid_argument("DFlash drafter and target differ in hidden size");
    if (hp.n_rot < 2 || hp.n_rot > D || H % Hkv != 0 || hp.block_size < 2 || n_ctx < hp.block_size) {
        throw std::invalid_argument("DFlash hyper-parameters out of range");
    }
    if (n_slots < 1) throw std::invalid_argument("a DFlash drafter needs at least one slot");
    slots_.resize(n_slots);
    try {
        const size_t n_w = 3 + 11 * (size_t)hp.n_layer;
        wctx_ = ggml_init({ggml_tensor_overhead() * (n_w + 8), nullptr, /*no_alloc =*/true});
        DFlashFile file(path, wctx_);
        fc_ = file.bind("fc.weight", {n_feat(), E});
        hidden_norm_ = file.bind("enc.output_norm.weight", {E});
        output_norm_ = file.bind("output_norm.weight", {E});
        for (int il = 0; il < hp.n_layer; ++il) {
            DFlashLayer l;
            l.attn_norm = file.bind(blk(il, "attn_norm"), {E});
            l.wq = file.bind(blk(il, "attn_q"), {E, H * D});
            l.wk = file.bind(blk(il, "attn_k"), {E, Hkv * D});
            l.wv = file.bind(blk(il, "attn_v"), {E, Hkv * D});
            l.wo = file.bind(blk(il, "attn_output"), {H * D, E});
            l.q_norm = file.bind(blk(il, "attn_q_norm"), {D});
            l.k_norm = file.bind(blk(il, "attn_k_norm"), {D});
            l.ffn_norm = file.bind(blk(il, "ffn_norm"), {E});
            l.ffn_gate = file.bind(blk(il, "ffn_gate"), {E, hp.n_ff});
            l.ffn_up = file.bind(blk(il, "ffn_up"), {E, hp.n_ff});
            l.ffn_down = file.bind(blk(il, "ffn_down"), {hp.n_ff, E});
            layers_.push_back(l);
        }
        wbuf_ = ggml_backend_alloc_ctx_tensors(wctx_, target.backend());
        if (!wbuf_) throw std::runtime_error(path + ": cannot allocate the DFlash weights (out of memory?)");
        ggml_backend_buffer_set_usage(wbuf_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        file.upload();

        allocate_slot(slots_[0]);

        // a pass of one block per slot at most: per block its attention, cache writes and outputs
        graph_size_ = 64 * (size_t)hp.n_layer + 256 + (size_t)n_slots * (24 * (size_t)hp.n_layer + 16);
        meta_.resize(ggml_tensor_overhead() * graph_size_ + ggml_graph_overhead_custom(graph_size_, false));
        ggml_backend_t backends[2] = {target.backend(), target.cpu_backend()};
        const int n_backends = target.backend() == target.cpu_backend() ? 1 : 2;
        sched_ = ggml_backend_sched_new(backends, nullptr, n_backends, graph_size_, false, false);
        if (!sched_) throw std::runtime_error("cannot create the ggml scheduler");
    } catch (...) {
        for (Slot & sl : slots_) {
            if (sl.buf) ggml_backend_buffer_free(sl.buf);
            if (sl.ctx) ggml_free(sl.ctx);
        }
        if (wbuf_) ggml_backend_buffer_free(wbuf_);
        if (wctx_) ggml_free(wctx_);
        throw;
    }
}

DFlashModel::~DFlashModel() {
    ggml_backend_sched_free(sched_);
    for (Slot & sl : slots_) {
        if (sl.buf) ggml_backend_buffer_free(sl.buf);
        if (sl.ctx) ggml_free(sl.ctx);
    }
    ggml_backend_buffer_free(wbuf_);
    ggml_free(wctx_);
}

size_t DFlashModel::weight_bytes() const { return ggml_backend_buffer_get_size(wbuf_); }

void DFlashModel::allocate_slot(Slot & slot) {
    if (slot.buf) return;
    // F32 cache: the context rows are few per round and the block is short; exactness first
    const int64_t kv = hp_.n_head_kv * hp_.head_dim;
    slot.ctx = ggml_init({ggml_tensor_overhead() * (2 * (size_t)hp_.n_layer + 2), nullptr, /*no_alloc =*/true});
    if (!slot.ctx) throw std::runtime_error("cannot create the DFlash cache's context");
    for (int il = 0; il < hp_.n_layer; ++il) {
        slot.k.push_back(ggml_new_tensor_2d(slot.ctx, GGML_TYPE_F32, kv, n_ctx_));
        slot.v.push_back(ggml_new_tensor_2d(slot.ctx, GGML_TYPE_F32, kv, n_ctx_));
    }
    slot.buf = ggml_backend_alloc_ctx_tensors(slot.ctx, target_.backend());
    if (!slot.buf) {
        ggml_free(slot.ctx);
        slot = Slot{};
        throw std::runtime_error("cannot allocate the DFlash cache (out of memory?)");
    }
    ggml_backend_buffer_clear(slot.buf, 0);
    slot.n_cached = 0;
}

void DFlashModel::use_slot(int64_t slot) {
    if (slot < 0 || slot >= n_slots()) {
        throw std::out_of_range("DFlash slot " + std::to_string(slot) + " outside [0, " + std::to_string(n_slots()) + ")");
    }
    allocate_slot(slots_[slot]);
    cur_ = slot;
}

int64_t DFlashModel::n_cached_of(int64_t slot) const {
    if (slot < 0 || slot >= n_slots()) {
        throw std::out_of_range("DFlash slot " + std::to_string(slot) + " outside [0, " + std::to_string(n_slots()) + ")");
    }
    return slots_[slot].n_cached;
}

void DFlashModel::move_slot(int64_t from, int64_t to) {
    if (from < 0 || from >= n_slots() || to < 0 || to >= n_slots()) {
        throw std::out_of_range("DFlash move_slot: slot outside [0, " + std::to_string(n_slots()) + ")");
    }
    if (from == to) return;
    Slot & src = slots_[from];
    Slot & dst = slots_[to];
    if (!src.buf) {  // never used: nothing to copy
        dst.n_cached = 0;
        return;
    }
    allocate_slot(dst);
    for (size_t il = 0; il < src.k.size(); ++il) {
        ggml_backend_tensor_copy(src.k[il], dst.k[il]);
        ggml_backend_tensor_copy(src.v[il], dst.v[il]);
    }
    dst.n_cached = src.n_cached;
}

void DFlashModel::run(ggml_cgraph * gf) {
    ggml_backend_sched_reset(sched_);
    if (!ggml_backend_sched_alloc_graph(sched_, gf)) throw std::runtime_error("cannot allocate the DFlash graph");
}

void DFlashModel::inject(const float * features, int64_t n, int64_t pos0) {
    if (n < 1) return;
    if (pos0 < 0 || pos0 > n_cached() || pos0 + n > n_ctx_) {
        throw std::out_of_range("DFlash inject: rows " + std::to_string(pos0) + ".." + std::to_string(pos0 + n) +
                                " do not continue the cache of " + std::to_string(n_cached()) + " rows within " +
                                std::to_string(n_ctx_));
    }
    ggml_context * ctx = ggml_init({meta_.size(), meta_.data(), /*no_alloc =*/true});
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, graph_size_, false);
    const DFlashGraphWeights w{hp_, fc_, hidden_norm_, output_norm_, layers_, target_.weights().token_embd,
                               target_.weights().output, slots_[cur_].k, slots_[cur_].v};
    DFlashInputs in;
    build_dflash_inject(ctx, gf, w, in, n);
    try {
        run(gf);
        std::vector<int32_t> pos(n);
        std::vector<int64_t> rows(n);
        for (int64_t i = 0; i < n; ++i) rows[i] = pos[i] = (int32_t)(pos0 + i);
        set_input(in.features, features, ggml_nbytes(in.features));
        set_input(in.pos, pos.data(), n * sizeof(int32_t));
        set_input(in.rows, rows.data(), n * sizeof(int64_t));
        if (ggml_backend_sched_graph_compute(sched_, gf) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("DFlash inject: graph computation failed");
        }
    } catch (...) {
        ggml_free(ctx);
        throw;
    }
    ggml_free(ctx);
    slots_[cur_].n_cached = pos0 + n;
}

void DFlashModel::blocks(const std::vector<BlockJob> & jobs) {
    const int64_t B = hp_.block_size, N = (int64_t)jobs.size();
    if (N == 0) return;
    std::vector<int64_t> n_kv(N);
    std::vector<DFlashSlotCache> caches;
    for (int64_t j = 0; j < N; ++j) {
        const BlockJob & b = jobs[j];
        if (b.slot < 0 || b.slot >= n_slots() || !slots_[b.slot].buf) {
            throw std::out_of_range("DFlash block: slot " + std::to_string(b.slot) + " holds no context");
        }
        for (int64_t i = 0; i < j; ++i) {
            if (jobs[i].slot == b.slot) throw std::invalid_argument("DFlash blocks: two blocks in slot " + std::to_string(b.slot));
        }
        n_kv[j] = slots_[b.slot].n_cached + B;
        if (n_kv[j] > n_ctx_) throw std::length_error("DFlash block past the drafter's context of " + std::to_string(n_ctx_));
        if (b.anchor < 0 || b.anchor >= n_vocab()) throw std::out_of_range("DFlash block: anchor token outside the vocabulary");
        if (b.top_k < 0 || b.top_k > n_vocab() || !(b.temperature > 0.0f)) {
            throw std::invalid_argument("DFlash block: top_k must be in [0, n_vocab] and the temperature > 0");
        }
        caches.push_back({slots_[b.slot].k, slots_[b.slot].v});
    }
    ggml_context * ctx = ggml_init({meta_.size(), meta_.data(), /*no_alloc =*/true});
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, graph_size_, false);
    const DFlashGraphWeights w{hp_, fc_, hidden_norm_, output_norm_, layers_, target_.weights().token_embd,
                               target_.weights().output, slots_[cur_].k, slots_[cur_].v};
    DFlashInputs in;
    std::vector<ggml_tensor *> masks;
    ggml_tensor * out = build_dflash_blocks(ctx, gf, w, caches, in, masks, B, n_kv);  // {V, (B-1) * N}
    struct Outs {
        ggml_tensor *logits = nullptr, *best = nullptr, *ids = nullptr, *probs = nullptr;
    };
    std::vector<Outs> outs(N);
    for (int64_t j = 0; j < N; ++j) {
        const BlockJob & b = jobs[j];
        Outs & o = outs[j];
        o.logits = ggml_view_2d(ctx, out, out->ne[0], B - 1, out->nb[1], j * (B - 1) * out->nb[1]);
        if (b.top1) {
            o.best = ggml_argmax(ctx, o.logits);
            ggml_set_output(o.best);
            ggml_build_forward_expand(gf, o.best);
        }
        // a tree's candidates: (B-1) x top_k ids and probabilities cross over instead of (B-1) x n_vocab
        // logits (15 x 248k floats, 15 MB, for the 27B's vocabulary)
        if (b.top_k > 0) {
            ggml_tensor * lj = ggml_cont(ctx, o.logits);
            ggml_tensor * probs = ggml_soft_max_ext(ctx, lj, nullptr, 1.0f / b.temperature, 0.0f);  // {V, B-1}
            o.ids = ggml_top_k(ctx, lj, (int)b.top_k);                                              // {k, B-1}
            // per slot: row ids[., s] of the slot's probabilities seen as V rows of one value
            o.probs = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, probs->ne[0], probs->ne[1]), o.ids);
            for (ggml_tensor * t : {o.ids, o.probs}) {
                ggml_set_output(t);
                ggml_build_forward_expand(gf, t);
            }
        }
    }
    try {
        run(gf);
        std::vector<int32_t> tokens(N * B, hp_.mask_token), pos(N * B);
        std::vector<int64_t> rows(N * B);
        for (int64_t j = 0; j < N; ++j) {
            const int64_t p0 = n_kv[j] - B;
            tokens[j * B] = jobs[j].anchor;
            for (int64_t i = 0; i < B; ++i) rows[j * B + i] = pos[j * B + i] = (int32_t)(p0 + i);
            if (masks[j]) {  // causal inside the block: slot i sees the context and slots 0..i
                std::vector<float> mask(n_kv[j] * B);
                for (int64_t i = 0; i < B; ++i) {
                    for (int64_t c = 0; c < n_kv[j]; ++c) mask[i * n_kv[j] + c] = c <= p0 + i ? 0.0f : -INFINITY;
                }
                set_input(masks[j], mask.data(), mask.size() * sizeof(float));
            }
        }
        set_input(in.tokens, tokens.data(), tokens.size() * sizeof(int32_t));
        set_input(in.pos, pos.data(), pos.size() * sizeof(int32_t));
        set_input(in.rows, rows.data(), rows.size() * sizeof(int64_t));
        if (ggml_backend_sched_graph_compute(sched_, gf) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("DFlash block: graph computation failed");
        }
        for (int64_t j = 0; j < N; ++j) {
            const BlockJob & b = jobs[j];
            const Outs & o = outs[j];
            if (b.logits) ggml_backend_tensor_get(out, b.logits, j * (B - 1) * out->nb[1], (B - 1) * out->nb[1]);
            if (b.top1) ggml_backend_tensor_get(o.best, b.top1, 0, ggml_nbytes(o.best));
            if (b.top_k > 0 && b.top_ids) ggml_backend_tensor_get(o.ids, b.top_ids, 0, ggml_nbytes(o.ids));
            if (b.top_k > 0 && b.top_probs) ggml_backend_tensor_get(o.probs, b.top_probs, 0, ggml_nbytes(o.probs));
        }
        block_stats_.passes += 1;
        block_stats_.blocks += N;
        block_stats_.max_blocks = std::max(block_stats_.max_blocks, N);
    } catch (...) {
        ggml_free(ctx);
        throw;
    }
    ggml_free(ctx);
}

}  // namespace deltaspec
