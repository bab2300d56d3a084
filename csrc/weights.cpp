#include "weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>

#include "ggml-alloc.h"
#include "gguf.h"

namespace deltaspec {

ModelWeights::~ModelWeights() {
    if (buffer) ggml_backend_buffer_free(buffer);
    for (ggml_backend_buffer_t b : split_buffers) ggml_backend_buffer_free(b);
    if (ctx) ggml_free(ctx);
}

namespace {

// Read-only mapping of the whole file; tensor bytes are copied from it into the backend buffer.
struct MappedFile {
    void * data = MAP_FAILED;
    size_t size = 0;

    explicit MappedFile(const std::string & path) {
        int fd = open(path.c_str(), O_RDONLY);
        if (fd < 0) throw std::runtime_error(path + ": cannot open");
        struct stat sb {};
        if (fstat(fd, &sb) == 0) {
            size = static_cast<size_t>(sb.st_size);
            data = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
        }
        close(fd);
        if (data == MAP_FAILED) throw std::runtime_error(path + ": cannot mmap");
    }
    ~MappedFile() {
        if (data != MAP_FAILED) munmap(data, size);
    }
};

struct GgufFile {
    gguf_context * gguf = nullptr;
    ggml_context * meta = nullptr;

    explicit GgufFile(const std::string & path) {
        gguf_init_params params = {/*no_alloc =*/true, /*ctx =*/&meta};
        gguf = gguf_init_from_file(path.c_str(), params);
        if (!gguf) throw std::runtime_error(path + ": not a readable GGUF file");
    }
    ~GgufFile() {
        if (meta) ggml_free(meta);
        if (gguf) gguf_free(gguf);
    }
};

// One weight {ne0, ne1} of a group that multiplies the same input; `out` receives its tensor.
struct SharedInputWeight {
    ggml_tensor ** out;
    std::string name;
    int64_t ne0, ne1;
};

class Binder {
  public:
    Binder(const std::string & path, const GgufFile & file, ggml_context * ctx)
        : path_(path), file_(file), ctx_(ctx) {}

    // Declares a weight of the given shape in ctx; its bytes are copied after allocation.
    ggml_tensor * bind(const std::string & name, const std::vector<int64_t> & shape) {
        const ggml_tensor * src = check(name, shape);
        ggml_tensor * t = ggml_dup_tensor(ctx_, src);
        ggml_set_name(t, name.c_str());
        bound_.push_back({t, gguf_find_tensor(file_.gguf, name.c_str())});
        return t;
    }

    // Declares weights that multiply the same input. With `stack`, those of one type and row
    // length become row ranges of one tensor (weights.h); the rest are bound alone.
    void bind_shared_input(const std::vector<SharedInputWeight> & weights, const std::string & stack_name, bool stack) {
        std::vector<bool> done(weights.size(), false);
        for (size_t i = 0; i < weights.size(); ++i) {
            if (done[i]) continue;
            const ggml_tensor * first = check(weights[i].name, {weights[i].ne0, weights[i].ne1});
            std::vector<size_t> group;
            for (size_t j = i; j < weights.size(); ++j) {
                const ggml_tensor * t = j == i ? first : check(weights[j].name, {weights[j].ne0, weights[j].ne1});
                if (!done[j] && t->type == first->type && t->ne[0] == first->ne[0]) group.push_back(j);
            }
            if (!stack || group.size() < 2) {
                *weights[i].out = bind(weights[i].name, {weights[i].ne0, weights[i].ne1});
                done[i] = true;
                continue;
            }
            int64_t rows = 0;
            for (size_t j : group) rows += weights[j].ne1;
            ggml_tensor * whole = ggml_new_tensor_2d(ctx_, first->type, first->ne[0], rows);
            ggml_format_name(whole, "%s.%d", stack_name.c_str(), (int)i);
            int64_t row = 0;
            for (size_t j : group) {
                const int64_t n = weights[j].ne1;
                ggml_tensor * part = ggml_view_2d(ctx_, whole, whole->ne[0], n, whole->nb[1], row * whole->nb[1]);
                ggml_set_name(part, weights[j].name.c_str());
                bound_.push_back({part, gguf_find_tensor(file_.gguf, weights[j].name.c_str())});
                *weights[j].out = part;
                done[j] = true;
                row += n;
            }
        }
    }

    bool has(const std::string & name) const { return ggml_get_tensor(file_.meta, name.c_str()) != nullptr; }
    // ne[dim] of the file's tensor `name` (throws naming it when it is missing)
    int64_t ne(const std::string & name, int dim) const {
        const ggml_tensor * t = ggml_get_tensor(file_.meta, name.c_str());
        if (!t) throw std::runtime_error(path_ + ": tensor '" + name + "' is missing");
        return t->ne[dim];
    }

    // Copies every bound tensor's bytes; `progress` (optional) hears (done, total) in bytes, throttled
    // to a call per 1% of the total plus the first and the last.
    void upload(const LoadProgress & progress) {
        MappedFile map(path_);
        const size_t data_offset = gguf_get_data_offset(file_.gguf);
        size_t total = 0;
        for (const auto & b : bound_) total += ggml_nbytes(b.tensor);
        size_t done = 0, reported_pct = 0;
        if (progress) progress(0, total);
        for (const auto & [t, id] : bound_) {
            const size_t offset = data_offset + gguf_get_tensor_offset(file_.gguf, id);
            const size_t nbytes = ggml_nbytes(t);
            if (offset + nbytes > map.size) {
                throw std::runtime_error(path_ + ": tensor '" + ggml_get_name(t) + "' extends past the end of the file");
            }
            ggml_backend_tensor_set(t, static_cast<const char *>(map.data) + offset, 0, nbytes);
            done += nbytes;
            // one call per whole percent crossed (1..99); 100% is the final call below
            const size_t pct = total ? done * 100 / total : 100;
            if (progress && pct > reported_pct && pct < 100) {
                progress(done, total);
                reported_pct = pct;
            }
        }
        if (progress) progress(total, total);
    }

  private:
    // The file's tensor `name`, which must have exactly `shape`.
    const ggml_tensor * check(const std::string & name, const std::vector<int64_t> & shape) const {
        const ggml_tensor * src = ggml_get_tensor(file_.meta, name.c_str());
        if (!src) throw std::runtime_error(path_ + ": tensor '" + name + "' is missing");
        size_t i = 0;
        for (int64_t ne : shape) {
            if (src->ne[i] != ne) throw std::runtime_error(path_ + ": tensor '" + name + "' has an unexpected shape");
            ++i;
        }
        for (; i < GGML_MAX_DIMS; ++i) {
            if (src->ne[i] != 1) throw std::runtime_error(path_ + ": tensor '" + name + "' has too many dimensions");
        }
        return src;
    }

    struct Bound {
        ggml_tensor * tensor;
        int64_t id;
    };
    const std::string & path_;
    const GgufFile & file_;
    ggml_context * ctx_;
    std::vector<Bound> bound_;
};

std::string blk(int il, const char * name) { return "blk." + std::to_string(il) + "." + name; }

// The first MTP layer (Qwen3.5 has one): block n_layer, bound unstacked (the head is small and
// runs apart from the trunk).
void bind_mtp(Binder & b, ModelWeights & w, const HParams & hp) {
    const int il = (int)hp.n_layer;
    const int64_t E = hp.n_embd, V = hp.n_vocab, D = hp.head_dim, H = hp.n_head, Hkv = hp.n_head_kv;
    MtpWeights & m = w.mtp;
    LayerWeights & l = m.block;
    std::vector<ggml_tensor *> own;
    auto bind = [&](const char * name, const std::vector<int64_t> & shape) {
        own.push_back(b.bind(blk(il, name), shape));
        return own.back();
    };
    l.attn_norm = bind("attn_norm.weight", {E});
    l.post_norm = bind("post_attention_norm.weight", {E});
    l.wq = bind("attn_q.weight", {E, 2 * H * D});
    l.wk = bind("attn_k.weight", {E, Hkv * D});
    l.wv = bind("attn_v.weight", {E, Hkv * D});
    l.wo = bind("attn_output.weight", {H * D, E});
    l.q_norm = bind("attn_q_norm.weight", {D});
    l.k_norm = bind("attn_k_norm.weight", {D});
    l.ffn_up = b.bind(blk(il, "ffn_up.weight"), {E, b.ne(blk(il, "ffn_up.weight"), 1)});
    own.push_back(l.ffn_up);
    l.ffn_gate = bind("ffn_gate.weight", {E, l.ffn_up->ne[1]});
    l.ffn_down = bind("ffn_down.weight", {l.ffn_up->ne[1], E});
    m.eh_proj = bind("nextn.eh_proj.weight", {2 * E, E});
    m.enorm = bind("nextn.enorm.weight", {E});
    m.hnorm = bind("nextn.hnorm.weight", {E});
    m.embed = b.has(blk(il, "nextn.embed_tokens.weight")) ? bind("nextn.embed_tokens.weight", {E, V}) : w.token_embd;
    m.head_norm = b.has(blk(il, "nextn.shared_head_norm.weight")) ? bind("nextn.shared_head_norm.weight", {E}) : w.output_norm;
    m.head = b.has(blk(il, "nextn.shared_head_head.weight")) ? bind("nextn.shared_head_head.weight", {E, V}) : w.output;
    m.bytes = 0;
    for (ggml_tensor * t : own) m.bytes += ggml_nbytes(t);
}

}  // namespace

std::vector<std::string> weight_buffer_types(const ModelWeights & w) {
    std::vector<std::string> names;
    for (ggml_tensor * t = ggml_get_first_tensor(w.ctx); t; t = ggml_get_next_tensor(w.ctx, t)) {
        const std::string name = t->buffer ? ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)) : "none";
        if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
    return names;
}

std::vector<std::vector<std::string>> weight_stacks(const ModelWeights & w) {
    std::vector<const ggml_tensor *> stacks;
    std::vector<std::vector<std::string>> parts;
    for (ggml_tensor * t = ggml_get_first_tensor(w.ctx); t; t = ggml_get_next_tensor(w.ctx, t)) {
        if (!t->view_src) continue;
        const size_t i = std::find(stacks.begin(), stacks.end(), t->view_src) - stacks.begin();
        if (i == stacks.size()) {
            stacks.push_back(t->view_src);
            parts.emplace_back();
        }
        parts[i].push_back(ggml_get_name(t));  // declared, and so listed, in row order
    }
    return parts;
}

void load_weights(ModelWeights & w, const std::string & path, const HParams & hp, ggml_backend_t backend,
                  bool stack_shared_inputs, const LoadProgress & progress, const LayerSplit * split) {
    GgufFile file(path);
    const int64_t n_tensors = gguf_get_n_tensors(file.gguf);
    // the file's tensors plus at most three stacks a layer
    ggml_init_params params = {ggml_tensor_overhead() * (size_t)(n_tensors + 3 * hp.n_layer + 8), nullptr,
                               /*no_alloc =*/true};
    w.ctx = ggml_init(params);
    Binder b(path, file, w.ctx);

    const int64_t E = hp.n_embd, V = hp.n_vocab, D = hp.head_dim, H = hp.n_head, Hkv = hp.n_head_kv;
    const int64_t S = hp.ssm_state_size, Hv = hp.ssm_n_v_heads, C = hp.conv_channels();

    w.token_embd = b.bind("token_embd.weight", {E, V});
    w.output_norm = b.bind("output_norm.weight", {E});
    w.output = b.has("output.weight") ? b.bind("output.weight", {E, V}) : w.token_embd;
    if (split && split->active() && w.output == w.token_embd && split->output != split->input) {
        w.output = b.bind("token_embd.weight", {E, V});
        ggml_set_name(w.output, "output.tied");
    }

    w.layers.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; ++il) {
        LayerWeights & l = w.layers[il];
        l.attn_norm = b.bind(blk(il, "attn_norm.weight"), {E});
        l.post_norm = b.bind(blk(il, "post_attention_norm.weight"), {E});
        const int64_t n_ff = ggml_get_tensor(file.meta, blk(il, "ffn_up.weight").c_str())
                                 ? ggml_get_tensor(file.meta, blk(il, "ffn_up.weight").c_str())->ne[1]
                                 : 0;
        b.bind_shared_input({{&l.ffn_gate, blk(il, "ffn_gate.weight"), E, n_ff},
                             {&l.ffn_up, blk(il, "ffn_up.weight"), E, n_ff}},
                            blk(il, "ffn_stack"), stack_shared_inputs);
        l.ffn_down = b.bind(blk(il, "ffn_down.weight"), {n_ff, E});
        if (hp.recurrent[il]) {
            b.bind_shared_input({{&l.wqkv, blk(il, "attn_qkv.weight"), E, C},
                                 {&l.wgate, blk(il, "attn_gate.weight"), E, Hv * S},
                                 {&l.wbeta, blk(il, "ssm_beta.weight"), E, Hv},
                                 {&l.walpha, blk(il, "ssm_alpha.weight"), E, Hv}},
                                blk(il, "input_stack"), stack_shared_inputs);
            l.dt_bias = b.bind(blk(il, "ssm_dt.bias"), {Hv});
            l.ssm_a = b.bind(blk(il, "ssm_a"), {Hv});
            l.conv1d = b.bind(blk(il, "ssm_conv1d.weight"), {hp.ssm_conv_kernel, C});
            l.ssm_norm = b.bind(blk(il, "ssm_norm.weight"), {S});
            l.ssm_out = b.bind(blk(il, "ssm_out.weight"), {Hv * S, E});
        } else {
            b.bind_shared_input({{&l.wq, blk(il, "attn_q.weight"), E, 2 * H * D},
                                 {&l.wk, blk(il, "attn_k.weight"), E, Hkv * D},
                                 {&l.wv, blk(il, "attn_v.weight"), E, Hkv * D}},
                                blk(il, "input_stack"), stack_shared_inputs);
            l.wo = b.bind(blk(il, "attn_output.weight"), {H * D, E});
            l.q_norm = b.bind(blk(il, "attn_q_norm.weight"), {D});
            l.k_norm = b.bind(blk(il, "attn_k_norm.weight"), {D});
        }
    }

    if (hp.n_layer_nextn > 0) bind_mtp(b, w, hp);

    if (split && split->active()) {
        w.split_buffers = alloc_placed(w.ctx, split->backends,
                                       [&](const ggml_tensor * t) { return split->weight_place(ggml_get_name(t)); },
                                       GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    } else {
        w.buffer = ggml_backend_alloc_ctx_tensors(w.ctx, backend);
        if (!w.buffer) throw std::runtime_error(path + ": cannot allocate the weight buffer (out of memory?)");
        ggml_backend_buffer_set_usage(w.buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    b.upload(progress);
}

}  // namespace deltaspec
