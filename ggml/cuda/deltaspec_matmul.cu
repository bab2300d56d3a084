// deltaspec's kernels inside ggml-cuda: ggml-cuda.cu is compiled with ggml_cuda_mul_mat_vec_q and
// ggml_cuda_mul_mat_q renamed to the two dispatchers below (see inject.cmake), so every quantized
// mat-vec and small-batch product ggml-cuda launches comes here first. What our kernels serve
// they compute; everything else goes on to ggml's own function unchanged. Off until the engine
// switches it on, so a llama.cpp built against the same ggml runs ggml's kernels (the benchmark's
// peer).
//
// Served: one column (a decode step) of Q4_K (any number of rows; also ggml's fused up/gate SwiGLU)
// and of Q6_K (256 rows or more), both also with ggml's fused residual add, and 2..32 columns
// (verifying a draft chain) of Q4_K. ggml asks its mat-vec for up to 8 columns and its tile
// kernels (mmq) for more; both routes reach the same kernels here.
#include "common.cuh"
#include "mmvq.cuh"
#include "q4k_gemv.cuh"
#include "q4k_mma.cuh"
#include "q6k_gemv.cuh"

#include <cstdint>

// ggml's tile-kernel entry (mmq.cuh); declared here rather than including that heavy header
void ggml_cuda_mul_mat_q(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                         const ggml_tensor * ids, ggml_tensor * dst);

static bool g_deltaspec_kernels = false;

extern "C" __attribute__((visibility("default"))) void deltaspec_cuda_set_kernels(bool on) {
    g_deltaspec_kernels = on;
}

namespace {

constexpr int64_t kMaxColumns = 32;

// A plain 2-D matrix of whole 256-weight blocks, rows stored back to back, 16-byte aligned.
// (`like`: the same type and shape as that one.)
bool plain_blocks(const ggml_tensor * w, const ggml_tensor * like = nullptr) {
    return w->ne[0] % 256 == 0 && w->ne[2] == 1 && w->ne[3] == 1 && w->nb[1] == ggml_row_size(w->type, w->ne[0]) &&
           (uintptr_t)w->data % 16 == 0 &&
           (like == nullptr || (w->type == like->type && w->ne[0] == like->ne[0] && w->ne[1] == like->ne[1]));
}

// src1 / dst: f32 columns with contiguous, 16-byte aligned values, one batch
bool plain_columns(const ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 && t->ne[2] == 1 && t->ne[3] == 1 && t->nb[0] == sizeof(float) &&
           t->nb[1] % 16 == 0 && (uintptr_t)t->data % 16 == 0;
}

// The fusions ggml asks of its mat-vec that ours also do: up/gate with SwiGLU (one Q4_K
// column, no biases or scales), or a following residual add as an f32 bias of one column.
bool swiglu_fusion(const ggml_cuda_mm_fusion_args_host * f, const ggml_tensor * src0) {
    return f->gate != nullptr && f->glu_op == GGML_GLU_OP_SWIGLU && !f->x_bias && !f->gate_bias && !f->x_scale &&
           !f->gate_scale && src0->type == GGML_TYPE_Q4_K && plain_blocks(f->gate, src0);
}

bool bias_fusion(const ggml_cuda_mm_fusion_args_host * f, const ggml_tensor * dst) {
    const ggml_tensor * b = f->x_bias;
    return b != nullptr && f->gate == nullptr && !f->gate_bias && !f->x_scale && !f->gate_scale &&
           b->type == GGML_TYPE_F32 && ggml_is_contiguous(b) && b->ne[0] == dst->ne[0] && ggml_nrows(b) == 1;
}

// Which of our kernels computes dst = src0 x src1 (with ggml's fusion, if any), or none.
enum class Kernel { none, q4k_gemv, q6k_gemv, q4k_mma };

Kernel pick(const ggml_tensor * src0, const ggml_tensor * src1, const ggml_tensor * ids, const ggml_tensor * dst,
            const ggml_cuda_mm_fusion_args_host * fusion) {
    if (!g_deltaspec_kernels || ids != nullptr || !plain_blocks(src0)) return Kernel::none;
    if (!plain_columns(src1) || !plain_columns(dst) || src1->ne[0] != src0->ne[0]) return Kernel::none;
    const int64_t n = src1->ne[1];
    if (n == 1) {
        if (fusion != nullptr && !swiglu_fusion(fusion, src0) && !bias_fusion(fusion, dst)) return Kernel::none;
        if (src0->type == GGML_TYPE_Q4_K) return Kernel::q4k_gemv;  // few rows: its split-K form
        // Q6_K rows of whole 1024-weight groups start 8-byte aligned, as the kernel's loads need;
        // matrices under 256 rows stay with ggml (8 rows a block would leave most SMs idle)
        if (src0->type == GGML_TYPE_Q6_K && src0->ne[0] % 1024 == 0 && src0->ne[1] >= 256) return Kernel::q6k_gemv;
        return Kernel::none;
    }
    if (fusion != nullptr) return Kernel::none;  // ggml fuses one column only
    return src0->type == GGML_TYPE_Q4_K && n <= kMaxColumns ? Kernel::q4k_mma : Kernel::none;
}

void run(Kernel k, ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
         ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion) {
    const float * x = (const float *)src1->data;
    float * y = (float *)dst->data;
    const int64_t rows = src0->ne[1], n_k = src0->ne[0];
    const void * gate = fusion && fusion->gate ? fusion->gate->data : nullptr;
    const float * bias = fusion && fusion->x_bias ? (const float *)fusion->x_bias->data : nullptr;
    switch (k) {
        case Kernel::q4k_gemv:
            deltaspec_cuda::launch_q4k_gemv(src0->data, gate, x, y, rows, n_k, src0->nb[1], ctx.stream(), true, bias);
            break;
        case Kernel::q6k_gemv:
            deltaspec_cuda::launch_q6k_gemv(src0->data, x, y, rows, n_k, src0->nb[1], ctx.stream(), true, bias);
            break;
        case Kernel::q4k_mma: {
            const int n = (int)src1->ne[1];
            ggml_cuda_pool_alloc<char> scratch(ctx.pool(), deltaspec_cuda::q4k_mma_scratch_bytes(n_k, n));
            deltaspec_cuda::launch_q4k_mma(src0->data, x, src1->nb[1] / sizeof(float), y, dst->nb[1] / sizeof(float),
                                           rows, n_k, n, src0->nb[1], scratch.get(), ctx.stream());
            break;
        }
        case Kernel::none:
            break;
    }
    CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void deltaspec_mul_mat_vec_q(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                             const ggml_tensor * ids, ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion) {
    const Kernel k = pick(src0, src1, ids, dst, fusion);
    if (k != Kernel::none) return run(k, ctx, src0, src1, dst, fusion);
    ggml_cuda_mul_mat_vec_q(ctx, src0, src1, ids, dst, fusion);
}

void deltaspec_mul_mat_q(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                         const ggml_tensor * ids, ggml_tensor * dst) {
    const Kernel k = pick(src0, src1, ids, dst, nullptr);
    if (k != Kernel::none) return run(k, ctx, src0, src1, dst, nullptr);
    ggml_cuda_mul_mat_q(ctx, src0, src1, ids, dst);
}
