// Saving and restoring one sequence's state (llama-cpp-python's save_state / load_state): the KV
// rows it has written and its recurrent state, as bytes by tensor name. The recurrent state is the
// whole history of a Gated DeltaNet layer, so nothing short of it (and of the KV rows) resumes a
// sequence; the KV cache past n_past holds nothing and is not saved.
#include <stdexcept>

#include "engine.h"

namespace deltaspec {

namespace {

// Bytes of a KV tensor's first n rows (rows are contiguous, n_ctx of them).
size_t kv_prefix_bytes(const ggml_tensor * t, int64_t n) { return (size_t)n * t->nb[1]; }

std::string get_bytes(ggml_tensor * t, size_t n) {
    std::string out(n, '\0');
    if (n) ggml_backend_tensor_get(t, out.data(), 0, n);
    return out;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> Engine::save_sequence() {
    settle_verify();
    SequenceState & st = seq();
    std::vector<std::pair<std::string, std::string>> out;
    for (size_t il = 0; il < st.conv.size(); ++il) {
        const std::string i = std::to_string(il);
        if (st.conv[il]) {
            out.emplace_back("conv." + i, get_bytes(st.conv[il], ggml_nbytes(st.conv[il])));
            out.emplace_back("ssm." + i, get_bytes(st.ssm[il], ggml_nbytes(st.ssm[il])));
        } else {
            out.emplace_back("k." + i, get_bytes(st.k[il], kv_prefix_bytes(st.k[il], st.n_past)));
            out.emplace_back("v." + i, get_bytes(st.v[il], kv_prefix_bytes(st.v[il], st.n_past)));
        }
    }
    return out;
}

void Engine::load_sequence(int64_t n_past, const std::vector<std::pair<std::string, std::string>> & tensors) {
    settle_verify();
    SequenceState & st = seq();
    if (n_past < 0 || n_past > st.n_ctx) {
        throw std::invalid_argument("the saved state holds " + std::to_string(n_past) +
                                    " tokens; this model's context holds " + std::to_string(st.n_ctx) + " (n_ctx)");
    }
    // every tensor is checked before any is written: a bad state leaves the sequence as it was
    std::vector<std::pair<ggml_tensor *, const std::string *>> writes;
    for (size_t il = 0; il < st.conv.size(); ++il) {
        const std::string i = std::to_string(il);
        const bool rec = st.conv[il] != nullptr;
        const std::pair<std::string, ggml_tensor *> wanted[2] = {
            {(rec ? "conv." : "k.") + i, rec ? st.conv[il] : st.k[il]},
            {(rec ? "ssm." : "v.") + i, rec ? st.ssm[il] : st.v[il]}};
        for (const auto & [name, t] : wanted) {
            const std::string * bytes = nullptr;
            for (const auto & [n, b] : tensors) {
                if (n == name) bytes = &b;
            }
            if (!bytes) throw std::invalid_argument("the saved state has no tensor '" + name + "'");
            const size_t need = rec ? ggml_nbytes(t) : kv_prefix_bytes(t, n_past);
            if (bytes->size() != need) {
                throw std::invalid_argument("saved tensor '" + name + "' has " + std::to_string(bytes->size()) +
                                            " bytes, this model's needs " + std::to_string(need) + " (" +
                                            ggml_type_name(t->type) + ")");
            }
            writes.emplace_back(t, bytes);
        }
    }
    if (writes.size() != tensors.size()) {
        throw std::invalid_argument("the saved state has " + std::to_string(tensors.size()) + " tensors, this model " +
                                    std::to_string(writes.size()));
    }
    for (const auto & [t, bytes] : writes) {
        if (!bytes->empty()) ggml_backend_tensor_set(t, bytes->data(), 0, bytes->size());
    }
    st.n_past = n_past;
}

}  // namespace deltaspec
