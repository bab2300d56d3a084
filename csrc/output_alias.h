// Tensors of a small follow-up graph (keep()'s replays) over a step graph's outputs: the step
// graph's allocator keeps its outputs untouched until the next step graph runs.
#pragma once

#include <stdexcept>

#include "ggml-backend.h"
#include "ggml.h"

namespace deltaspec {

// A tensor of ctx over t's data, without t's op and sources (a graph over t must not pull in the
// graph that computed it). t's values must be contiguous.
inline ggml_tensor * detached(ggml_context * ctx, const ggml_tensor * t) {
    ggml_tensor * d = ggml_new_tensor(ctx, t->type, GGML_MAX_DIMS, t->ne);
    if (!ggml_is_contiguous(t) || ggml_backend_tensor_alloc(t->buffer, d, t->data) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("cannot alias a verify graph output");
    }
    return d;
}

// t (an output, or a view of one) as the same view in ctx, over a detached base.
inline ggml_tensor * output_alias(ggml_context * ctx, const ggml_tensor * t) {
    if (t->view_src == nullptr) return detached(ctx, t);
    ggml_tensor * base = detached(ctx, t->view_src);
    return ggml_view_4d(ctx, base, t->ne[0], t->ne[1], t->ne[2], t->ne[3], t->nb[1], t->nb[2], t->nb[3], t->view_offs);
}

}  // namespace deltaspec
