// The Gated DeltaNet recurrence of a verify batch (ggml_gated_delta_net over T > 1 tokens), and
// the replay that rolls the live state forward by the first n of those tokens when the engine
// keeps them (deltaspec_cuda_deltanet_replay, Engine::keep), or by the rows of accepted tree paths
// (deltaspec_cuda_deltanet_replay_paths, Engine::commit_paths): the verify op itself does not
// write a state per token.
//
// ggml's kernel (gated_delta_net.cu) gives each warp one column of one head's state (a 128 x 128
// matrix per head, 4 values a lane in registers) and walks the tokens: per token it loads q and k
// (4 values a lane), v[col], g and beta from global memory, then two warp reductions of 5
// shuffles (S^T k, then S^T q after the update). That kernel's form, with the next token's
// inputs loaded during this token's math, took 27 us per layer on a 16-token verify of the 27B
// (H200, Nsight Compute; it also wrote every token's state then), bound by latency and
// instruction issue, not by memory.
//
// Here a warp owns 4 columns, and the 4 warps of a thread block (16 columns of one head) first
// stage a chunk of tokens' inputs in shared memory with coalesced loads all in flight at once
// (fetch_chunk, store_chunk); the token loop then reads q and k once for 4 columns from there,
// and reduces the 4 columns' sums together (reduce_scatter: 6 shuffles for 4 sums instead of 20; each lane ends
// with the total of one column, which the lanes share back with 3 more where every lane needs
// it). The additions are the ones ggml's warp_reduce_sum makes (lane l adds lane l ^ 16, then ^ 8,
// ^ 4, ^ 2, ^ 1; a + b is b + a in floats), and every other expression is ggml's: the results are
// ggml's bits. (4 columns a warp with each token's inputs loaded from global memory during the
// token before: 20 us per layer, a third of the SMs' issue rate used.)
//
// Served: f32, scalar gate (not KDA), S_v = 128, T > 1, what ggml-cuda routes to its plain entry
// (ggml_cuda_op_gated_delta_net: the op's result is read as it is, no fused cache copy). The
// rest goes to ggml's kernel.
#include "common.cuh"
#include "deltanet_columns.cuh"
#include "deltaspec_deltanet.h"
#include "deltaspec_rows.h"
#include "gated_delta_net.cuh"
#include "gemv_common.cuh"
#include "side_stream.cuh"

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

bool g_on = false;
std::atomic<int64_t> g_launches{0};  // launches of ours (host side: a replayed CUDA graph adds none)

constexpr int kStateDim = 128;                    // S_v
constexpr int kRowsPerLane = kStateDim / 32;      // a column's 128 values over 32 lanes
using deltaspec_cuda::kColumnsPerWarp;
using deltaspec_cuda::reduce_scatter;
using deltaspec_cuda::reduced_column;
using deltaspec_cuda::share_columns;
constexpr int kWarpsPerBlock = 4;
constexpr int kColumnsPerBlock = kColumnsPerWarp * kWarpsPerBlock;

// Where one sequence's inputs of one head are: strides in floats (g and beta share theirs, as in
// ggml's op).
struct Inputs {
    const float * q;
    const float * k;
    const float * v;
    const float * g;
    const float * beta;
    int64_t qk_token, v_token, gate_token;
};

// A chunk of tokens' inputs in shared memory, loaded by the whole thread block (whose warps share
// one head); the token loop then reads them from here instead of waiting on a global load per
// token (the loop's other latencies are a few hundred cycles a token: with a global load per token, a
// 16-token verify took ~20 us per layer at a third of the SMs' issue rate). Each thread first loads its
// share of a chunk into registers, every load in flight at once (fetch_chunk), and only then
// stores it (store_chunk): a loop that stored each value as it arrived waited on one load
// round trip per token. The next chunk's loads are issued before this chunk's tokens, and the
// first chunk's before the state's.
constexpr int kChunkTokens = 16;
constexpr int kBlockThreads = 32 * kWarpsPerBlock;

struct Staged {
    float q[kChunkTokens][kStateDim], k[kChunkTokens][kStateDim];
    float v[kChunkTokens][kColumnsPerBlock];  // the block's columns
    float g[kChunkTokens], beta[kChunkTokens];
};

// One thread's share of a chunk: row `tid` of every token's q and k, two of the chunk's v values
// (i = tid, tid + 128 of token i / 16, column i % 16), and token tid's g and beta.
struct ChunkShare {
    float q[kChunkTokens], k[kChunkTokens];
    float v[2];
    float g, beta;
};
static_assert(kBlockThreads == kStateDim && kChunkTokens * kColumnsPerBlock == 2 * kBlockThreads,
              "ChunkShare's split of a chunk");

// GATHER: token t's inputs are those of row rows[t] (a path's rows, in shared memory).
template <bool GATHER>
__device__ __forceinline__ void fetch_chunk(ChunkShare & c, const Inputs & x, int64_t t0, int n, int first_block_col,
                                            const int32_t * rows) {
    const int tid = threadIdx.y * 32 + threadIdx.x;
    auto token = [&](int64_t t) -> int64_t { return GATHER ? (int64_t)rows[t] : t; };
#pragma unroll
    for (int j = 0; j < kChunkTokens; ++j) {
        if (j < n) {
            c.q[j] = x.q[token(t0 + j) * x.qk_token + tid];
            c.k[j] = x.k[token(t0 + j) * x.qk_token + tid];
        }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int i = tid + kBlockThreads * j;
        if (i < n * kColumnsPerBlock) {
            c.v[j] = x.v[token(t0 + i / kColumnsPerBlock) * x.v_token + first_block_col + i % kColumnsPerBlock];
        }
    }
    if (tid < n) {
        c.g = x.g[token(t0 + tid) * x.gate_token];
        c.beta = x.beta[token(t0 + tid) * x.gate_token];
    }
}

__device__ __forceinline__ void store_chunk(Staged & st, const ChunkShare & c, int n) {
    const int tid = threadIdx.y * 32 + threadIdx.x;
#pragma unroll
    for (int j = 0; j < kChunkTokens; ++j) {
        if (j < n) {
            st.q[j][tid] = c.q[j];
            st.k[j][tid] = c.k[j];
        }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int i = tid + kBlockThreads * j;
        if (i < n * kColumnsPerBlock) st.v[i / kColumnsPerBlock][i % kColumnsPerBlock] = c.v[j];
    }
    if (tid < n) {
        st.g[tid] = c.g;
        st.beta[tid] = c.beta;
    }
}

// this warp's 4 columns of a state stored transposed (a column's 128 values contiguous)
__device__ __forceinline__ void load_columns(float (&s)[kColumnsPerWarp][kRowsPerLane], const float * state,
                                             int first_col, int lane) {
#pragma unroll
    for (int c = 0; c < kColumnsPerWarp; c++) {
#pragma unroll
        for (int r = 0; r < kRowsPerLane; r++) s[c][r] = state[(first_col + c) * kStateDim + r * 32 + lane];
    }
}

// The recurrence of one warp's 4 columns (first_col..first_col+3 of one head's state, loaded
// from `state` into s: this lane's rows r * 32 + lane in registers; first_col - first_block_col
// of the block's staged columns) over n_tokens tokens, staged kChunkTokens at a time by the
// whole block (every warp of it must call this). OUTPUT: also o[col] = (S^T q) * scale after
// each token (token t's at o + t * o_token), and the state after the last K tokens (slot 0 =
// after the last token, slot i = i tokens back; slot_stride floats apart). GATHER: token t is
// row rows[t] of the inputs.
template <bool OUTPUT, bool GATHER = false>
__device__ __forceinline__ void walk_tokens(float (&s)[kColumnsPerWarp][kRowsPerLane], const float * state,
                                            const Inputs & x, int64_t n_tokens, int first_block_col, int first_col,
                                            int lane, float * o, int64_t o_token, float scale, float * slots,
                                            int64_t slot_stride, int K, const int32_t * rows = nullptr) {
    __shared__ Staged st;
    const int my_col = first_col + reduced_column(lane), my_staged = my_col - first_block_col;
    ChunkShare next;
    fetch_chunk<GATHER>(next, x, 0, (int)min((int64_t)kChunkTokens, n_tokens), first_block_col, rows);
    load_columns(s, state, first_col, lane);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += kChunkTokens) {
        const int n = (int)min((int64_t)kChunkTokens, n_tokens - t0);
        __syncthreads();  // the chunk before is read
        store_chunk(st, next, n);
        __syncthreads();
        if (t0 + kChunkTokens < n_tokens) {  // in flight during this chunk's tokens
            fetch_chunk<GATHER>(next, x, t0 + kChunkTokens,
                                (int)min((int64_t)kChunkTokens, n_tokens - t0 - kChunkTokens), first_block_col, rows);
        }
        for (int i = 0; i < n; i++) {
            // every expression below is ggml's, in its order: the same bits (deltanet_columns.cuh's
            // token_step, which the rows op uses, is this step; kept inline here, where the
            // compiler gave the function form 123 registers instead of 96)
            const float decay = expf(st.g[i]);
            float k[kRowsPerLane];
#pragma unroll
            for (int r = 0; r < kRowsPerLane; r++) k[r] = st.k[i][r * 32 + lane];
            float sk_part[kColumnsPerWarp];  // (S^T k)[col], this lane's share
#pragma unroll
            for (int c = 0; c < kColumnsPerWarp; c++) {
                sk_part[c] = 0.0f;
#pragma unroll
                for (int r = 0; r < kRowsPerLane; r++) sk_part[c] += s[c][r] * k[r];
            }
            const float sk = reduce_scatter(sk_part, lane);
            float delta[kColumnsPerWarp];
            share_columns((st.v[i][my_staged] - decay * sk) * st.beta[i], lane, delta);
#pragma unroll
            for (int c = 0; c < kColumnsPerWarp; c++) {
#pragma unroll
                for (int r = 0; r < kRowsPerLane; r++) s[c][r] = decay * s[c][r] + k[r] * delta[c];
            }
            if constexpr (OUTPUT) {
                float out_part[kColumnsPerWarp];  // (S^T q)[col] after the update
#pragma unroll
                for (int c = 0; c < kColumnsPerWarp; c++) {
                    out_part[c] = 0.0f;
#pragma unroll
                    for (int r = 0; r < kRowsPerLane; r++) out_part[c] += s[c][r] * st.q[i][r * 32 + lane];
                }
                const int64_t t = t0 + i;
                const float o_col = reduce_scatter(out_part, lane);
                if ((lane & 7) == 0) o[t * o_token + my_col] = o_col * scale;
                const int64_t slot = n_tokens - 1 - t;
                if (slot < K) {
#pragma unroll
                    for (int c = 0; c < kColumnsPerWarp; c++) {
#pragma unroll
                        for (int r = 0; r < kRowsPerLane; r++) {
                            slots[slot * slot_stride + (first_col + c) * kStateDim + r * 32 + lane] = s[c][r];
                        }
                    }
                }
            }
        }
    }
}

// The op: grid (H, n_seqs, S_v / 16), block (32, 4): warp y of block z owns columns 16 z + 4 y ..
// + 3 of head x's state. Strides in floats; q/k heads tile the v heads (head % n_qk_heads).
__global__ void __launch_bounds__(kBlockThreads)
deltanet_verify(const float * q, const float * k, const float * v, const float * g, const float * beta,
                const float * state_in, float * out, float * slots, int64_t H, int64_t n_tokens, int64_t q_head,
                int64_t q_token, int64_t q_seq, int64_t v_head, int64_t v_token, int64_t v_seq, int64_t gate_head,
                int64_t gate_token, int64_t gate_seq, int64_t n_qk_heads, int64_t seqs_per_qk, float scale,
                int64_t slot_stride, int K) {
    deltaspec_cuda::wait_for_inputs();
    const int64_t head = blockIdx.x, seq = blockIdx.y;
    const int lane = threadIdx.x, first_block_col = blockIdx.z * kColumnsPerBlock;
    const int first_col = first_block_col + threadIdx.y * kColumnsPerWarp;
    const int64_t qk = (seq / seqs_per_qk) * q_seq + (head % n_qk_heads) * q_head;
    const int64_t gate = seq * gate_seq + head * gate_head;
    const Inputs x{q + qk, k + qk, v + seq * v_seq + head * v_head, g + gate, beta + gate,
                   q_token, v_token, gate_token};
    constexpr int64_t kStateSize = kStateDim * kStateDim;
    float s[kColumnsPerWarp][kRowsPerLane];
    walk_tokens<true>(s, state_in + (seq * H + head) * kStateSize, x, n_tokens, first_block_col, first_col, lane,
                      out + (seq * n_tokens * H + head) * kStateDim, kStateDim * H, scale,
                      slots + (seq * H + head) * kStateSize, slot_stride, K);
}

// The replay: grid (H, layers, S_v / 16), block (32, 4); each layer's state rolled forward in place
// over the first shape.n_tokens tokens or (PATH) over the rows of a path.
constexpr int kReplayLayersPerLaunch = 64;  // by value in the kernel's parameters (64 x 48 bytes)

struct ReplayLayers {
    deltaspec_deltanet_layer layer[kReplayLayersPerLaunch];
};

template <bool PATH>
__global__ void __launch_bounds__(kBlockThreads)
deltanet_replay(const ReplayLayers layers, const deltaspec_deltanet_replay shape, const deltaspec_deltanet_path path) {
    __shared__ int32_t rows[PATH ? DELTASPEC_DELTANET_PATH_MAX : 1];
    int64_t n_tokens = shape.n_tokens;
    if constexpr (PATH) {
        for (int i = threadIdx.y * 32 + threadIdx.x; i < path.n_rows; i += kBlockThreads) rows[i] = path.rows[i];
        __syncthreads();
        n_tokens = path.n_rows;
    }
    const deltaspec_deltanet_layer & l = layers.layer[blockIdx.y];
    const int64_t head = blockIdx.x;
    const int lane = threadIdx.x, first_block_col = blockIdx.z * kColumnsPerBlock;
    const int first_col = first_block_col + threadIdx.y * kColumnsPerWarp;
    const int64_t qk = (head % shape.n_qk_heads) * shape.qk_head, gate = head * shape.gate_head;
    const Inputs x{l.q + qk, l.k + qk, l.v + head * shape.v_head, l.g + gate, l.beta + gate,
                   shape.qk_token, shape.v_token, shape.gate_token};
    float * state = l.state + head * kStateDim * kStateDim;
    float s[kColumnsPerWarp][kRowsPerLane];
    walk_tokens<false, PATH>(s, state, x, n_tokens, first_block_col, first_col, lane, nullptr, 0, 0.0f, nullptr, 0, 0,
                             rows);
#pragma unroll
    for (int c = 0; c < kColumnsPerWarp; c++) {
#pragma unroll
        for (int r = 0; r < kRowsPerLane; r++) state[(first_col + c) * kStateDim + r * 32 + lane] = s[c][r];
    }
}

// Launches the replay of each path (PATH) or of the first shape.n_tokens tokens (one "path", paths
// null) over its n_layers layers, on our stream, and waits; the convention of
// deltaspec_cuda_deltanet_replay's result.
template <bool PATH>
int replay(const deltaspec_deltanet_replay & shape, const deltaspec_deltanet_path * paths, int n_paths,
           const deltaspec_deltanet_layer * layers, int n_layers) {
    if (!g_on || shape.state_dim != kStateDim || shape.n_qk_heads < 1) return 0;
    if (!PATH && shape.n_tokens < 1) return 0;
    for (int p = 0; PATH && p < n_paths; ++p) {
        if (paths[p].n_rows < 0 || paths[p].n_rows > DELTASPEC_DELTANET_PATH_MAX) return 0;
    }
    if (n_layers <= 0 || n_paths <= 0) return 1;
    const int device = device_of(layers[0].state);
    if (device < 0) return 0;
    // the caller has synchronized the backend that wrote the inputs
    return run_on_side_stream(device, [&](cudaStream_t stream) {
        const deltaspec_deltanet_path none = {};
        for (int p = 0; p < n_paths; ++p) {
            const deltaspec_deltanet_path & path = PATH ? paths[p] : none;
            if (PATH && path.n_rows == 0) continue;
            const deltaspec_deltanet_layer * mine = layers + (int64_t)p * n_layers;
            for (int first = 0; first < n_layers; first += kReplayLayersPerLaunch) {
                const int n = std::min(kReplayLayersPerLaunch, n_layers - first);
                ReplayLayers batch;
                std::copy(mine + first, mine + first + n, batch.layer);
                const dim3 grid((unsigned)shape.n_v_heads, (unsigned)n, kStateDim / kColumnsPerBlock);
                deltanet_replay<PATH><<<grid, dim3(32, kWarpsPerBlock), 0, stream>>>(batch, shape, path);
                ++g_launches;
                if (cudaGetLastError() != cudaSuccess) return false;
            }
        }
        return true;
    }) ? 1 : -1;
}

bool serves(const ggml_tensor * dst) {
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * g = dst->src[3];
    for (int i = 0; i < 6; ++i) {
        if (dst->src[i]->type != GGML_TYPE_F32) return false;
    }
    return g_on && v->ne[2] > 1 && v->ne[0] == kStateDim && dst->src[0]->ne[0] == kStateDim && g->ne[0] == 1 &&
           dst->src[0]->ne[1] == dst->src[1]->ne[1] && ggml_are_same_stride(dst->src[0], dst->src[1]) &&
           ggml_is_contiguous_rows(dst->src[0]) && ggml_is_contiguous_rows(v) && ggml_is_contiguous(g) &&
           ggml_is_contiguous(dst->src[4]) && ggml_is_contiguous(dst->src[5]) && v->ne[3] % dst->src[0]->ne[3] == 0;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void deltaspec_cuda_set_deltanet(bool on) { g_on = on; }

extern "C" __attribute__((visibility("default"))) int64_t deltaspec_cuda_deltanet_launches() { return g_launches; }

extern "C" __attribute__((visibility("default"))) int deltaspec_cuda_deltanet_replay(
    const deltaspec_deltanet_replay * shape, const deltaspec_deltanet_layer * layers, int n_layers) {
    return replay<false>(*shape, nullptr, 1, layers, n_layers);
}

extern "C" __attribute__((visibility("default"))) int deltaspec_cuda_deltanet_replay_paths(
    const deltaspec_deltanet_replay * shape, const deltaspec_deltanet_path * paths, int n_paths,
    const deltaspec_deltanet_layer * layers, int n_layers) {
    return replay<true>(*shape, paths, n_paths, layers, n_layers);
}

void deltaspec_rows_cuda_gated_delta_net(ggml_backend_cuda_context & ctx, ggml_tensor * dst);  // deltaspec_rows.cu

// ggml-cuda.cu calls this in place of ggml_cuda_op_gated_delta_net (inject.cmake renames it).
void deltaspec_op_gated_delta_net(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (deltaspec_is_rows_node(dst)) {  // ours, whether our other kernels are on or not: ggml has no such op
        deltaspec_rows_cuda_gated_delta_net(ctx, dst);
        return;
    }
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
    float * slots = out + kStateDim * H * n_tokens * n_seqs;  // the states follow the outputs
    const dim3 grid((unsigned)H, (unsigned)n_seqs, kStateDim / kColumnsPerBlock), block(32, kWarpsPerBlock, 1);
    deltaspec_cuda::launch(deltanet_verify, grid, block, 0, ctx.stream(), (const float *)q->data,
                           (const float *)dst->src[1]->data, (const float *)v->data, (const float *)dst->src[3]->data,
                           (const float *)beta->data, (const float *)dst->src[5]->data, out, slots, H, n_tokens,
                           q->nb[1] / f, q->nb[2] / f, q->nb[3] / f, v->nb[1] / f, v->nb[2] / f, v->nb[3] / f,
                           beta->nb[1] / f, beta->nb[2] / f, beta->nb[3] / f, q->ne[1], n_seqs / q->ne[3],
                           1.0f / sqrtf((float)kStateDim), kStateDim * kStateDim * H * n_seqs,
                           (int)ggml_get_op_params_i32(dst, 0));
    CUDA_CHECK(cudaGetLastError());
    ++g_launches;
}
