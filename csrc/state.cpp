#include "state.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "deltaspec_tq.h"
#include "ggml-alloc.h"

namespace deltaspec {

StatePool::~StatePool() { release(); }

void StatePool::release() {
    if (buffer) ggml_backend_buffer_free(buffer);
    for (ggml_backend_buffer_t b : split_buffers) ggml_backend_buffer_free(b);
    split_buffers.clear();
    if (alias_ctx) ggml_free(alias_ctx);
    if (ctx) ggml_free(ctx);
    buffer = nullptr;
    ctx = alias_ctx = nullptr;
    k.clear();
    v.clear();
    conv.clear();
    ssm.clear();
    slots.clear();
    n_seq = 0;
}

void StatePool::copy_slot(int64_t from, int64_t to) {
    if (from < 0 || from >= n_seq || to < 0 || to >= n_seq) throw std::out_of_range("copy_slot: no such slot");
    if (from == to) return;
    SequenceState & src = slots[from];
    SequenceState & dst = slots[to];
    for (size_t il = 0; il < src.k.size(); ++il) {
        using Tensors = std::vector<ggml_tensor *> SequenceState::*;
        for (Tensors kind : {&SequenceState::k, &SequenceState::v, &SequenceState::conv, &SequenceState::ssm}) {
            ggml_tensor * s = (src.*kind)[il];
            if (s) ggml_backend_tensor_copy(s, (dst.*kind)[il]);
        }
    }
    dst.n_past = src.n_past;
}

void SequenceState::clear() {
    // Only the live recurrent state carries over into a new sequence: KV rows past n_past are
    // masked and the saved state is written before it is read. (Zeroing the whole buffer, KV
    // cache included, cost a drafter that restarts often more than its drafting.)
    for (size_t il = 0; il < conv.size(); ++il) {
        if (!conv[il]) continue;
        ggml_backend_tensor_memset(conv[il], 0, 0, ggml_nbytes(conv[il]));
        ggml_backend_tensor_memset(ssm[il], 0, 0, ggml_nbytes(ssm[il]));
    }
    n_past = 0;
}

int64_t SequenceState::n_kv_for(int64_t n_tokens_total) const {
    const int64_t padded = (n_tokens_total + kv_pad - 1) / kv_pad * kv_pad;
    return std::min(n_ctx, std::max(kv_pad, padded));
}

namespace {

// DELTASPEC_TEST_FORCE_KV_F32=1 allocates every KV cache as F32 whatever type was asked for: a
// planted bug, so that the tests of the cache types (tests/test_kv_cache_types.py) can show that
// they notice a cache of the wrong type. Never set it otherwise.
bool force_kv_f32() {
    const char * env = std::getenv("DELTASPEC_TEST_FORCE_KV_F32");
    return env != nullptr && std::strcmp(env, "1") == 0;
}

// A tensor of shape `like` over `whole`'s bytes from `offset` on: a plain tensor (no view op),
// so graphs treat it as a state tensor of its own.
ggml_tensor * alias(ggml_context * ctx, ggml_tensor * whole, int64_t ne0, int64_t ne1, size_t offset,
                    const std::string & name) {
    ggml_tensor * t = ne1 > 0 ? ggml_new_tensor_2d(ctx, whole->type, ne0, ne1) : ggml_new_tensor_1d(ctx, whole->type, ne0);
    ggml_set_name(t, name.c_str());
    deltaspec_tq_copy_mark(t, whole);  // a tq cache's slot is tq too (a no-op for other tensors)
    if (offset + ggml_nbytes(t) > ggml_nbytes(whole) ||
        ggml_backend_tensor_alloc(whole->buffer, t, (char *)whole->data + offset) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("cannot place the state of a sequence slot");
    }
    return t;
}

}  // namespace

void allocate_state(StatePool & pool, const HParams & hp, int64_t n_ctx, int64_t n_seq, ggml_type type_k,
                    ggml_type type_v, int64_t n_slots, ggml_backend_t backend, int format_k, int format_v,
                    const LayerSplit * split) {
    if (n_seq < 1) throw std::invalid_argument("n_seq_max must be >= 1");
    pool.n_seq = n_seq;
    pool.n_ctx = (n_ctx + SequenceState::kv_pad - 1) / SequenceState::kv_pad * SequenceState::kv_pad;
    const int64_t L = hp.n_layer;
    ggml_init_params params = {ggml_tensor_overhead() * (6 * (size_t)L + 1), nullptr, /*no_alloc =*/true};
    pool.ctx = ggml_init(params);

    const int64_t kv_width = hp.n_head_kv * hp.head_dim;
    const int64_t conv_elems = (hp.ssm_conv_kernel - 1) * hp.conv_channels();
    const int64_t ssm_elems = hp.ssm_state_size * hp.ssm_state_size * hp.ssm_n_v_heads;
    if (force_kv_f32()) {
        type_k = type_v = GGML_TYPE_F32;
        format_k = format_v = DELTASPEC_KV_PLAIN;
    }
    for (auto [format, type] : {std::pair{format_k, type_k}, std::pair{format_v, type_v}}) {
        if (format != DELTASPEC_KV_PLAIN && format != DELTASPEC_KV_ROTATED && format != DELTASPEC_KV_TQ3 &&
            format != DELTASPEC_KV_TQ4) {
            throw std::invalid_argument("KV cache format must be 0, 1, 3 or 4, got " + std::to_string(format));
        }
        if (format != DELTASPEC_KV_PLAIN && !deltaspec_tq_head_dim_ok(hp.head_dim)) {
            throw std::invalid_argument("tq3/tq4 and rotated KV caches: the head dim must be 32, 64, 128 or 256, got " +
                                        std::to_string(hp.head_dim));
        }
        if (format == DELTASPEC_KV_ROTATED && !ggml_is_quantized(type)) {
            throw std::invalid_argument(std::string("a rotated KV cache needs a quantized type, got ") + ggml_type_name(type));
        }
    }
    auto new_cache = [&](ggml_type type, int format) {
        const int64_t rows = pool.n_ctx * n_seq;
        if (format == DELTASPEC_KV_ROTATED) return deltaspec_kv_new_rotated_cache(pool.ctx, type, hp.head_dim, hp.n_head_kv, rows);
        if (format != DELTASPEC_KV_PLAIN) return deltaspec_tq_new_cache(pool.ctx, format, hp.head_dim, hp.n_head_kv, rows);
        return ggml_new_tensor_2d(pool.ctx, type, kv_width, rows);
    };
    for (auto * t : {&pool.k, &pool.v, &pool.conv, &pool.ssm}) t->assign(L, nullptr);
    for (int il = 0; il < L; ++il) {
        const std::string suffix = std::to_string(il);
        if (hp.recurrent[il]) {
            pool.conv[il] = ggml_new_tensor_2d(pool.ctx, GGML_TYPE_F32, conv_elems, n_seq);
            pool.ssm[il] = ggml_new_tensor_2d(pool.ctx, GGML_TYPE_F32, ssm_elems, n_seq);
            ggml_set_name(pool.conv[il], ("conv_states_" + suffix).c_str());
            ggml_set_name(pool.ssm[il], ("ssm_states_" + suffix).c_str());
        } else {
            pool.k[il] = new_cache(type_k, format_k);
            pool.v[il] = new_cache(type_v, format_v);
            ggml_set_name(pool.k[il], ("caches_k_" + suffix).c_str());
            ggml_set_name(pool.v[il], ("caches_v_" + suffix).c_str());
        }
    }
    if (split && split->active()) {
        // every state tensor's name ends in _<layer>
        const bool bug = split_bug() == SplitBug::state_first;
        auto place = [&](const ggml_tensor * t) {
            const std::string name = ggml_get_name(t);
            return bug ? 0 : split->block.at(std::stoi(name.substr(name.rfind('_') + 1)));
        };
        try {
            pool.split_buffers = alloc_placed(pool.ctx, split->backends, place, GGML_BACKEND_BUFFER_USAGE_ANY);
        } catch (const std::runtime_error & e) {
            throw std::runtime_error(std::string("the KV/recurrent state (n_ctx or n_seq_max too large?): ") + e.what());
        }
        for (ggml_backend_buffer_t b : pool.split_buffers) {
            if (b) ggml_backend_buffer_clear(b, 0);  // null: a place without state (only the output layer, say)
        }
    } else {
        pool.buffer = ggml_backend_alloc_ctx_tensors(pool.ctx, backend);
        if (!pool.buffer) throw std::runtime_error("cannot allocate the KV/recurrent state (n_ctx or n_seq_max too large?)");
        // zero everything once: masked KV rows are still multiplied by 0, and garbage may be NaN
        ggml_backend_buffer_clear(pool.buffer, 0);
    }

    ggml_init_params alias_params = {ggml_tensor_overhead() * (4 * (size_t)L * n_seq + 1), nullptr, true};
    pool.alias_ctx = ggml_init(alias_params);
    pool.slots.resize(n_seq);
    for (int64_t s = 0; s < n_seq; ++s) {
        SequenceState & st = pool.slots[s];
        st.n_ctx = pool.n_ctx;
        st.n_past = 0;
        st.n_slots = n_slots;
        for (auto * t : {&st.k, &st.v, &st.conv, &st.ssm}) t->assign(L, nullptr);
        for (int il = 0; il < L; ++il) {
            const std::string suffix = std::to_string(il) + (n_seq > 1 ? "_s" + std::to_string(s) : "");
            if (hp.recurrent[il]) {
                st.conv[il] = alias(pool.alias_ctx, pool.conv[il], hp.ssm_conv_kernel - 1, hp.conv_channels(),
                                    s * pool.conv[il]->nb[1], "conv_state_" + suffix);
                st.ssm[il] = alias(pool.alias_ctx, pool.ssm[il], ssm_elems, 0, s * pool.ssm[il]->nb[1], "ssm_state_" + suffix);
            } else {
                st.k[il] = alias(pool.alias_ctx, pool.k[il], pool.k[il]->ne[0], pool.n_ctx,
                                 s * pool.n_ctx * pool.k[il]->nb[1], "cache_k_" + suffix);
                st.v[il] = alias(pool.alias_ctx, pool.v[il], pool.v[il]->ne[0], pool.n_ctx,
                                 s * pool.n_ctx * pool.v[il]->nb[1], "cache_v_" + suffix);
            }
        }
    }
}

std::vector<StateTensorInfo> state_tensor_info(const StatePool & pool) {
    std::vector<StateTensorInfo> out;
    for (size_t s = 0; s < pool.slots.size(); ++s) {
        const SequenceState & st = pool.slots[s];
        const std::pair<const char *, const std::vector<ggml_tensor *> *> kinds[] = {
            {"k", &st.k}, {"v", &st.v}, {"conv", &st.conv}, {"ssm", &st.ssm}};
        for (size_t il = 0; il < st.k.size(); ++il) {
            for (const auto & [kind, tensors] : kinds) {
                const ggml_tensor * t = il < tensors->size() ? (*tensors)[il] : nullptr;
                if (!t) continue;
                StateTensorInfo info;
                info.kind = kind;
                info.layer = (int)il;
                info.slot = (int)s;
                info.type = t->type;
                info.kv_format = deltaspec_kv_format(t);
                info.nbytes = ggml_nbytes(t);
                info.ne0 = t->ne[0];
                info.ne1 = t->ne[1];
                info.buffer = t->buffer ? ggml_backend_buffer_name(t->buffer) : "";
                out.push_back(std::move(info));
            }
        }
    }
    return out;
}

void copy_recurrent_state(const SequenceState & from, SequenceState & to) {
    for (size_t il = 0; il < from.conv.size(); ++il) {
        if (!from.conv[il]) continue;
        ggml_backend_tensor_copy(from.conv[il], to.conv[il]);
        ggml_backend_tensor_copy(from.ssm[il], to.ssm[il]);
    }
}

}  // namespace deltaspec
