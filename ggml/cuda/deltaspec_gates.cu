// The DeltaNet gates of a decode step in one launch instead of three: beta = sigmoid(beta) and
// g = softplus(alpha + dt_bias) * a, which ggml-cuda runs as a sigmoid, an add and a fused
// softplus-mul, three tiny kernels per DeltaNet layer (144 per step of the 27B).
//
// The graph builds the four ops in place on the products' outputs (graph_qwen35.cpp) and offers
// them to deltaspec_cuda_fold_gates, which marks them when beta and alpha are rows of one stacked
// product (DELTASPEC_STACK_PROJECTIONS): the ADD then computes both gates (it depends on that
// product, so both are done), and the SIGMOID, SOFTPLUS and MUL are skipped (ggml-cuda.cu's
// entries for them are renamed to the ones here, inject.cmake). In place, every op's output is
// its input's memory, so skipping them leaves nothing unwritten and no buffer the graph
// allocator could have handed to another tensor.
#include "binbcast.cuh"
#include "common.cuh"
#include "gemv_common.cuh"
#include "unary.cuh"

#include <atomic>
#include <cstdint>
#include <cstring>

bool deltaspec_cuda_kernels_on();  // deltaspec_matmul.cu

namespace {

std::atomic<int64_t> g_launches{0};  // launches of ours (host side: a replayed CUDA graph adds none)

constexpr char kGatesName[] = "deltaspec.gates";           // the ADD, which computes both gates
constexpr char kGateDoneName[] = "deltaspec.gate_done";    // SIGMOID, SOFTPLUS, MUL: done by that ADD
// where the ADD keeps the beta and a tensors: the last 16 bytes of its op_params (ggml's ADD reads none)
constexpr size_t kGatePointersOffset = GGML_MAX_OP_PARAMS - 2 * sizeof(ggml_tensor *);

bool gate_done(const ggml_tensor * t) {
    return deltaspec_cuda_kernels_on() && std::strcmp(t->name, kGateDoneName) == 0;
}

// The tensor whose memory t is, and t's byte offset in it. (The graph is built before it is
// allocated: data pointers are not known yet when the gates are offered.)
const ggml_tensor * memory_of(const ggml_tensor * t) { return t->view_src ? t->view_src : t; }
size_t offset_of(const ggml_tensor * t) { return t->view_src ? t->view_offs : 0; }

// n f32 values, contiguous, computed in place on src (ggml's in-place ops view their input)
bool in_place_vector(const ggml_tensor * t, const ggml_tensor * src, int64_t n) {
    return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && ggml_nelements(t) == n &&
           memory_of(t) == memory_of(src) && offset_of(t) == offset_of(src);
}

// whether n-value f32 vectors a and b share any byte
bool overlap(const ggml_tensor * a, const ggml_tensor * b, int64_t n) {
    const size_t bytes = (size_t)n * sizeof(float), oa = offset_of(a), ob = offset_of(b);
    return memory_of(a) == memory_of(b) && oa < ob + bytes && ob < oa + bytes;
}

bool plain_vector(const ggml_tensor * t, int64_t n) {
    return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && ggml_nelements(t) == n;
}

bool is_unary(const ggml_tensor * t, ggml_unary_op op) { return t->op == GGML_OP_UNARY && ggml_get_unary_op(t) == op; }

// The same expressions as ggml-cuda's sigmoid and softplus (unary.cu).
__global__ void deltanet_gates(float * beta, float * alpha, const float * dt_bias, const float * a, int n) {
    deltaspec_cuda::wait_for_inputs();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    beta[i] = 1.0f / (1.0f + expf(-beta[i]));
    const float x = alpha[i] + dt_bias[i];
    alpha[i] = ((x > 20.0f) ? x : logf(1.0f + expf(x))) * a[i];
}

}  // namespace

// Marks beta_sigmoid = SIGMOID(beta) and g = MUL(SOFTPLUS(ADD(alpha, dt_bias)), a), all in place
// on n-value f32 vectors, for one launch (see the top); returns whether it did.
extern "C" __attribute__((visibility("default"))) bool deltaspec_cuda_fold_gates(ggml_tensor * beta_sigmoid,
                                                                              ggml_tensor * g) {
    if (!deltaspec_cuda_kernels_on() || g->op != GGML_OP_MUL || !is_unary(beta_sigmoid, GGML_UNARY_OP_SIGMOID)) {
        return false;
    }
    ggml_tensor * softplus = g->src[0];
    if (!is_unary(softplus, GGML_UNARY_OP_SOFTPLUS) || softplus->src[0]->op != GGML_OP_ADD) return false;
    ggml_tensor * add = softplus->src[0];
    const int64_t n = ggml_nelements(beta_sigmoid);
    if (!in_place_vector(beta_sigmoid, beta_sigmoid->src[0], n) || !in_place_vector(add, add->src[0], n) ||
        !in_place_vector(softplus, add, n) || !in_place_vector(g, softplus, n) || !plain_vector(add->src[1], n) ||
        !plain_vector(g->src[1], n) || overlap(add, beta_sigmoid, n)) {
        return false;
    }
    // beta and alpha rows of one stacked product: then the ADD depends on the product that wrote
    // beta, whatever order ggml-cuda runs the graph's nodes in
    if (memory_of(beta_sigmoid) != memory_of(add)) return false;
    const ggml_tensor * pointers[2] = {beta_sigmoid, g->src[1]};
    std::memcpy((char *)add->op_params + kGatePointersOffset, pointers, sizeof(pointers));
    ggml_set_name(add, kGatesName);
    for (ggml_tensor * t : {beta_sigmoid, softplus, g}) ggml_set_name(t, kGateDoneName);
    return true;
}

// deltaspec_op_add (deltaspec_matmul.cu) asks this first: true when `add` was the marked ADD and
// both gates are computed.
bool deltaspec_run_gates(ggml_backend_cuda_context & ctx, ggml_tensor * add) {
    if (!deltaspec_cuda_kernels_on() || std::strcmp(add->name, kGatesName) != 0) return false;
    const ggml_tensor * pointers[2];
    std::memcpy(pointers, (const char *)add->op_params + kGatePointersOffset, sizeof(pointers));
    const int n = (int)ggml_nelements(add);
    deltaspec_cuda::launch(deltanet_gates, (unsigned)((n + 127) / 128), 128, 0, ctx.stream(),
                           (float *)pointers[0]->data, (float *)add->data, (const float *)add->src[1]->data,
                           (const float *)pointers[1]->data, n);
    CUDA_CHECK(cudaGetLastError());
    ++g_launches;
    return true;
}

extern "C" __attribute__((visibility("default"))) int64_t deltaspec_cuda_gate_launches() { return g_launches; }

// ggml-cuda.cu calls these in place of its own (inject.cmake renames them).
void deltaspec_op_sigmoid(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (!gate_done(dst)) ggml_cuda_op_sigmoid(ctx, dst);
}

void deltaspec_op_softplus(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (!gate_done(dst)) ggml_cuda_op_softplus(ctx, dst);
}

void deltaspec_op_mul(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (!gate_done(dst)) ggml_cuda_op_mul(ctx, dst);
}

void deltaspec_op_unary_mul(ggml_backend_cuda_context & ctx, ggml_tensor * unary_node, ggml_tensor * mul_node) {
    if (!gate_done(unary_node)) ggml_cuda_op_unary_mul(ctx, unary_node, mul_node);
}
