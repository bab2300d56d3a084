#include "state.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ggml-alloc.h"

namespace deltaspec {

SequenceState::~SequenceState() { release(); }

void SequenceState::release() {
    if (buffer) ggml_backend_buffer_free(buffer);
    if (ctx) ggml_free(ctx);
    buffer = nullptr;
    ctx = nullptr;
    k.clear();
    v.clear();
    conv.clear();
    ssm.clear();
    conv_saved.clear();
    ssm_saved.clear();
    n_slots = 0;
    n_past = 0;
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

}  // namespace

void allocate_state(SequenceState & st, const HParams & hp, int64_t n_ctx, ggml_type type_k, ggml_type type_v,
                    int64_t n_slots, ggml_backend_t backend) {
    st.n_slots = n_slots;
    st.n_ctx = (n_ctx + SequenceState::kv_pad - 1) / SequenceState::kv_pad * SequenceState::kv_pad;
    const size_t n_tensors = 4 * (size_t)hp.n_layer;
    ggml_init_params params = {ggml_tensor_overhead() * (n_tensors + 1), nullptr, /*no_alloc =*/true};
    st.ctx = ggml_init(params);

    const int64_t kv_width = hp.n_head_kv * hp.head_dim;
    if (force_kv_f32()) type_k = type_v = GGML_TYPE_F32;
    st.k.assign(hp.n_layer, nullptr);
    st.v.assign(hp.n_layer, nullptr);
    st.conv.assign(hp.n_layer, nullptr);
    st.ssm.assign(hp.n_layer, nullptr);
    st.conv_saved.assign(hp.n_layer, nullptr);
    st.ssm_saved.assign(hp.n_layer, nullptr);
    for (int il = 0; il < hp.n_layer; ++il) {
        const std::string suffix = std::to_string(il);
        if (hp.recurrent[il]) {
            st.conv[il] = ggml_new_tensor_2d(st.ctx, GGML_TYPE_F32, hp.ssm_conv_kernel - 1, hp.conv_channels());
            st.ssm[il] = ggml_new_tensor_1d(st.ctx, GGML_TYPE_F32,
                                            hp.ssm_state_size * hp.ssm_state_size * hp.ssm_n_v_heads);
            ggml_set_name(st.conv[il], ("conv_state_" + suffix).c_str());
            ggml_set_name(st.ssm[il], ("ssm_state_" + suffix).c_str());
            if (n_slots > 0) {
                st.conv_saved[il] = ggml_dup_tensor(st.ctx, st.conv[il]);
                st.ssm_saved[il] = ggml_dup_tensor(st.ctx, st.ssm[il]);
                ggml_set_name(st.conv_saved[il], ("conv_saved_" + suffix).c_str());
                ggml_set_name(st.ssm_saved[il], ("ssm_saved_" + suffix).c_str());
            }
        } else {
            st.k[il] = ggml_new_tensor_2d(st.ctx, type_k, kv_width, st.n_ctx);
            st.v[il] = ggml_new_tensor_2d(st.ctx, type_v, kv_width, st.n_ctx);
            ggml_set_name(st.k[il], ("cache_k_" + suffix).c_str());
            ggml_set_name(st.v[il], ("cache_v_" + suffix).c_str());
        }
    }
    st.buffer = ggml_backend_alloc_ctx_tensors(st.ctx, backend);
    if (!st.buffer) throw std::runtime_error("cannot allocate the KV/recurrent state (n_ctx too large?)");
    // zero everything once: masked KV rows are still multiplied by 0, and garbage may be NaN
    ggml_backend_buffer_clear(st.buffer, 0);
    st.n_past = 0;
}

std::vector<StateTensorInfo> state_tensor_info(const SequenceState & st) {
    std::vector<StateTensorInfo> out;
    const std::pair<const char *, const std::vector<ggml_tensor *> *> kinds[] = {
        {"k", &st.k}, {"v", &st.v}, {"conv", &st.conv}, {"ssm", &st.ssm},
        {"conv_saved", &st.conv_saved}, {"ssm_saved", &st.ssm_saved}};
    for (size_t il = 0; il < st.k.size(); ++il) {
        for (const auto & [kind, tensors] : kinds) {
            const ggml_tensor * t = il < tensors->size() ? (*tensors)[il] : nullptr;
            if (!t) continue;
            StateTensorInfo info;
            info.kind = kind;
            info.layer = (int)il;
            info.type = t->type;
            info.nbytes = ggml_nbytes(t);
            info.ne0 = t->ne[0];
            info.ne1 = t->ne[1];
            info.buffer = t->buffer ? ggml_backend_buffer_name(t->buffer) : "";
            out.push_back(std::move(info));
        }
    }
    return out;
}

}  // namespace deltaspec

namespace deltaspec {

void copy_recurrent_state(SequenceState & st, bool to_saved) {
    if (st.n_slots == 0) throw std::logic_error("no saved recurrent state: the state was allocated without slots");
    for (size_t il = 0; il < st.conv.size(); ++il) {
        if (!st.conv[il]) continue;
        if (to_saved) {
            ggml_backend_tensor_copy(st.conv[il], st.conv_saved[il]);
            ggml_backend_tensor_copy(st.ssm[il], st.ssm_saved[il]);
        } else {
            ggml_backend_tensor_copy(st.conv_saved[il], st.conv[il]);
            ggml_backend_tensor_copy(st.ssm_saved[il], st.ssm[il]);
        }
    }
}

}  // namespace deltaspec
