// The Gated DeltaNet recurrence of a verify batch (ggml_gated_delta_net over T tokens keeping the
// state after each of them: K = T snapshots), as ggml-cuda computes it, with the next token's
// inputs loaded while this token is computed.
//
// ggml's kernel (gated_delta_net.cu) gives each warp one column of one head's state (a
// 128 x 128 matrix per head, 4 values a lane in registers) and walks the tokens: per token it
// loads q, k (4 values a lane), v[col], g and beta, then two warp reductions (S^T k, then S^T q
// after the update). The loads start only when the token does, so every token waits on them
// (the batch's inputs were just written: L2 hits, but hundreds of cycles each), and a 17-token
// verify spent ~1.1 ms of its 1.4 ms in DeltaNet ops on that chain rather than on the 2.6 GB of
// states it writes (bench/README, the replay experiment). Here the loads of token t + 1 are issued
// before token t's math; the math itself is ggml's, expression for expression, so the results
// are the same sums in the same order.
//
// Served: f32, scalar gate (not KDA), S_v = 128, what ggml-cuda routes to its plain entry
// (ggml_cuda_op_gated_delta_net: the op's result is read as it is, no fused cache copy). The
// rest goes to ggml's kernel.
#include "common.cuh"
#include "gated_delta_net.cuh"
#include "gemv_common.cuh"

#include <atomic>
#include <cstdint>

namespace {

bool g_on = false;
std::atomic<int64_t> g_launches{0};  // launches of ours (host side: a replayed CUDA graph adds none)

constexpr int kStateDim = 128;                    // S_v
constexpr int kRowsPerLane = kStateDim / 32;      // the column's 128 values over 32 lanes
constexpr int kColumnsPerBlock = 4;               // one warp per column, as ggml's launch

// One token's inputs as one lane needs them.
struct TokenInputs {
    float q[kRowsPerLane], k[kRowsPerLane];
    float v, g, beta;
};

__device__ __forceinline__ void load_token(TokenInputs & in, const float * q_t, const float * k_t, const float * v_t,
                                           const float * g_t, const float * beta_t, int col, int lane) {
#pragma unroll
    for (int r = 0; r < kRowsPerLane; r++) {
        const int i = r * 32 + lane;
        in.k[r] = k_t[i];
        in.q[r] = q_t[i];
    }
    in.v = v_t[col];
    in.g = *g_t;
    in.beta = *beta_t;
}

// grid (H, n_seqs, S_v / 4), block (32, 4): warp y of block z owns column 4z + y of head x's state
// (stored transposed: the column's values are contiguous). Strides in floats; g and beta share
// theirs (as in ggml's op).
__global__ void __launch_bounds__(32 * kColumnsPerBlock, 2)
deltanet_snapshots(const float * q, const float * k, const float * v, const float * g, const float * beta,
                   const float * state_in, float * out, float * snapshots, int64_t H, int64_t n_tokens,
                   int64_t q_head, int64_t q_token, int64_t q_seq, int64_t v_head, int64_t v_token, int64_t v_seq,
                   int64_t gate_head, int64_t gate_token, int64_t gate_seq, int64_t n_qk_heads, int64_t seqs_per_qk,
                   float scale, int64_t snapshot_stride, int K) {
    deltaspec_cuda::wait_for_inputs();
    const int64_t head = blockIdx.x, seq = blockIdx.y;
    const int lane = threadIdx.x;
    const int col = blockIdx.z * blockDim.y + threadIdx.y;
    const int64_t qk_head = head % n_qk_heads, qk_seq = seq / seqs_per_qk;  // q/k heads tile the v heads

    constexpr int64_t kStateSize = kStateDim * kStateDim;
    snapshots += (seq * H + head) * kStateSize + col * kStateDim;
    state_in += (seq * H + head) * kStateSize + col * kStateDim;
    float * o = out + (seq * n_tokens * H + head) * kStateDim;

    float s[kRowsPerLane];  // this lane's values of the column (state stored transposed)
#pragma unroll
    for (int r = 0; r < kRowsPerLane; r++) s[r] = state_in[r * 32 + lane];

    auto load = [&](TokenInputs & in, int64_t t) {
        const int64_t gate = seq * gate_seq + t * gate_token + head * gate_head;
        const int64_t qk = qk_seq * q_seq + t * q_token + qk_head * q_head;
        load_token(in, q + qk, k + qk, v + seq * v_seq + t * v_token + head * v_head, g + gate, beta + gate, col, lane);
    };
    TokenInputs cur;
    load(cur, 0);
    for (int64_t t = 0; t < n_tokens; t++) {
        TokenInputs next;
        if (t + 1 < n_tokens) load(next, t + 1);  // in flight during this token's math

        // the order of every sum below is ggml's: the same bits
        const float decay = expf(cur.g);
        float sk_part = 0.0f;  // (S^T k)[col], this lane's share
#pragma unroll
        for (int r = 0; r < kRowsPerLane; r++) sk_part += s[r] * cur.k[r];
        const float sk = warp_reduce_sum<32>(sk_part);
        const float delta = (cur.v - decay * sk) * cur.beta;
        float out_part = 0.0f;  // (S^T q)[col] after the update
#pragma unroll
        for (int r = 0; r < kRowsPerLane; r++) {
            s[r] = decay * s[r] + cur.k[r] * delta;
            out_part += s[r] * cur.q[r];
        }
        const float o_col = warp_reduce_sum<32>(out_part);
        if (lane == 0) o[col] = o_col * scale;
        o += kStateDim * H;

        // snapshot slot 0 = the state after the last token, slot i = i tokens back
        const int64_t slot = n_tokens - 1 - t;
        if (slot < K) {
#pragma unroll
            for (int r = 0; r < kRowsPerLane; r++) snapshots[slot * snapshot_stride + r * 32 + lane] = s[r];
        }
        if (t + 1 < n_tokens) cur = next;
    }
}

bool serves(const ggml_tensor * dst) {
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * g = dst->src[3];
    const int K = ggml_get_op_params_i32(dst, 0);
    for (int i = 0; i < 6; ++i) {
        if (dst->src[i]->type != GGML_TYPE_F32) return false;
    }
    return g_on && K > 1 && v->ne[0] == kStateDim && dst->src[0]->ne[0] == kStateDim && g->ne[0] == 1 &&
           dst->src[0]->ne[1] == dst->src[1]->ne[1] &&
           ggml_are_same_stride(dst->src[0], dst->src[1]) && ggml_is_contiguous_rows(dst->src[0]) &&
           ggml_is_contiguous_rows(v) && ggml_is_contiguous(g) && ggml_is_contiguous(dst->src[4]) &&
           ggml_is_contiguous(dst->src[5]) && v->ne[3] % dst->src[0]->ne[3] == 0;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void deltaspec_cuda_set_deltanet(bool on) { g_on = on; }

extern "C" __attribute__((visibility("default"))) int64_t deltaspec_cuda_deltanet_launches() { return g_launches; }

// ggml-cuda.cu calls this in place of ggml_cuda_op_gated_delta_net (inject.cmake renames it).
void deltaspec_op_gated_delta_net(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (!serves(dst)) {
        ggml_cuda_op_gated_delta_net(ctx, dst);
        return;
    }
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * beta = dst->src[4];
    const int64_t H = v->ne[1], n_tokens = v->ne[2], n_seqs = v->ne[3];
    const int64_t f = sizeof(float);
    float * out = (float *)dst->data;
    float * snapshots = out + kStateDim * H * n_tokens * n_seqs;  // the snapshots follow the outputs
    const dim3 grid((unsigned)H, (unsigned)n_seqs, kStateDim / kColumnsPerBlock), block(32, kColumnsPerBlock, 1);
    deltaspec_cuda::launch(deltanet_snapshots, grid, block, 0, ctx.stream(), (const float *)q->data,
                           (const float *)dst->src[1]->data, (const float *)v->data, (const float *)dst->src[3]->data,
                           (const float *)beta->data, (const float *)dst->src[5]->data, out, snapshots, H, n_tokens,
                           q->nb[1] / f, q->nb[2] / f, q->nb[3] / f, v->nb[1] / f, v->nb[2] / f, v->nb[3] / f,
                           beta->nb[1] / f, beta->nb[2] / f, beta->nb[3] / f, q->ne[1], n_seqs / q->ne[3],
                           1.0f / sqrtf((float)kStateDim), kStateDim * kStateDim * H * n_seqs,
                           (int)ggml_get_op_params_i32(dst, 0));
    CUDA_CHECK(cudaGetLastError());
    ++g_launches;
}
