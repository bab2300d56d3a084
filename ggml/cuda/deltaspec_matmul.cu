// deltaspec's kernels inside ggml-cuda: ggml-cuda.cu is compiled with ggml_cuda_mul_mat_vec_q
// renamed to deltaspec_mul_mat_vec_q (see inject.cmake), so every quantized mat-vec ggml-cuda
// launches comes here first. What our kernels serve they compute; everything else goes on to
// ggml's own function unchanged. Off until the engine switches it on, so a llama.cpp built
// against the same ggml runs ggml's kernels (the benchmark's peer).
#include "common.cuh"
#include "mmvq.cuh"
#include "q4k_gemv.cuh"

#include <cstdint>

static bool g_deltaspec_kernels = false;

extern "C" __attribute__((visibility("default"))) void deltaspec_cuda_set_kernels(bool on) {
    g_deltaspec_kernels = on;
}

namespace {

bool q4k_matrix(const ggml_tensor * w, const ggml_tensor * like) {
    return w->type == GGML_TYPE_Q4_K && w->ne[0] % 256 == 0 && w->ne[2] == 1 && w->ne[3] == 1 &&
           w->nb[1] == ggml_row_size(GGML_TYPE_Q4_K, w->ne[0]) && (uintptr_t)w->data % 16 == 0 &&
           (like == nullptr || (w->ne[0] == like->ne[0] && w->ne[1] == like->ne[1]));
}

// One f32 column times a plain Q4_K matrix (or up and gate with a fused SwiGLU, no biases or
// scales); matrices under 256 rows stay with ggml (its grid spreads them over more SMs).
bool ours(const ggml_tensor * src0, const ggml_tensor * src1, const ggml_tensor * ids, const ggml_tensor * dst,
          const ggml_cuda_mm_fusion_args_host * fusion) {
    if (!g_deltaspec_kernels || ids != nullptr) return false;
    if (!q4k_matrix(src0, nullptr) || src0->ne[1] < 256) return false;
    if (src1->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32) return false;
    if (src1->ne[0] != src0->ne[0] || src1->ne[1] != 1 || src1->ne[2] != 1 || src1->ne[3] != 1) return false;
    if (!ggml_is_contiguous(src1) || !ggml_is_contiguous(dst) || (uintptr_t)src1->data % 16 != 0) return false;
    if (fusion != nullptr) {
        if (fusion->x_bias || fusion->gate_bias || fusion->x_scale || fusion->gate_scale) return false;
        if (fusion->gate == nullptr || fusion->glu_op != GGML_GLU_OP_SWIGLU) return false;
        if (!q4k_matrix(fusion->gate, src0)) return false;
    }
    return true;
}

}  // namespace

void deltaspec_mul_mat_vec_q(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                             const ggml_tensor * ids, ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion) {
    if (ours(src0, src1, ids, dst, fusion)) {
        deltaspec_cuda::launch_q4k_gemv(src0->data, fusion ? fusion->gate->data : nullptr, (const float *)src1->data,
                                        (float *)dst->data, src0->ne[1], src0->ne[0], src0->nb[1], ctx.stream());
        CUDA_CHECK(cudaGetLastError());
        return;
    }
    ggml_cuda_mul_mat_vec_q(ctx, src0, src1, ids, dst, fusion);
}
