// The rows ops on CUDA (ggml/deltaspec_rows.h): the parent-indexed Gated DeltaNet recurrence and
// the causal conv over a batch of rows, run by ggml-cuda's renamed entries for our nodes
// (deltaspec_op_gated_delta_net in deltaspec_deltanet.cu calls deltaspec_rows_cuda_gated_delta_net;
// deltaspec_op_ssm_conv and deltaspec_op_gated_delta_net_fused_cache are below; inject.cmake).
//
// The recurrence. A thread block owns 16 columns of one head's state for one WALK (the rows of one
// slot, in order: deltaspec_rows_plan), so rows of different slots run in parallel, and a walk's rows
// run one after another in registers as the verify kernel runs a chain (deltaspec_deltanet.cu:
// 4 columns a warp, a chunk of 16 rows' inputs staged in shared memory while the chunk before
// computes, the same token step from deltanet_columns.cuh, so a chain gives that kernel's bits and
// costs what it costs). What a tree adds is at its branch points only: a row whose child is not the
// next row of the walk is written to the result's saved states (SAVED >= 0, as each warp's 4
// columns, by the lanes that hold them), and a row that does not continue the row before it reloads
// its parent's saved state (START >= 0) before its step; the lanes that stored a value are the ones
// that load it, so no barrier is needed. Depth-first row order keeps that to one store per branch
// point and one load per further child. The plan's per-position entries are read a window of 256
// positions at a time into shared memory (one dependent-load stall per window), and each chunk's
// entries travel with its staged inputs.
// A slot's branches run in sequence within a walk; the plan may split one slot's tree into two walks
// (its deepest path, and the other rows with their ancestors), which run in parallel blocks.
// Not done (yet): a reloaded state's loads are not issued ahead of the row that needs them (one
// global round trip per branch).
//
// The conv. One thread per (channel, row): its window is gathered along its ancestors (parent
// links read from the rows tensor, the same for a whole thread block) and from its slot's committed
// window, summed in ggml's order (ggml's ssm-conv.cu: oldest input first, then the bias, then SiLU
// when fused). The write-backs are a second launch, so that every row has read the pool before one
// is rewritten.
#include "common.cuh"
#include "deltanet_columns.cuh"
#include "deltaspec_rows.h"
#include "gated_delta_net.cuh"
#include "gemv_common.cuh"
#include "ssm-conv.cuh"
#include "unary.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

void deltaspec_rows_cuda_gated_delta_net(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

namespace {

using deltaspec_cuda::kColumnsPerWarp;
using deltaspec_cuda::reduced_column;

constexpr int kWarpsPerBlock = 4;
constexpr int kBlockThreads = 32 * kWarpsPerBlock;
constexpr int kColumnsPerBlock = kColumnsPerWarp * kWarpsPerBlock;
constexpr int kChunkRows = 16;
constexpr int kMetaWindow = 256;  // walk positions whose plan entries a block holds at once
static_assert(kMetaWindow % kChunkRows == 0, "a chunk lies in one window");
static_assert(kChunkRows * kColumnsPerBlock == 2 * kBlockThreads, "ChunkShare's split of v");

__device__ __forceinline__ int32_t entry(const int32_t * rows, int64_t i, int e) {
    return rows[i * DELTASPEC_ROWS_N_COLS + e];
}

// The test-only planted bugs (tests/test_gpu_rows_op.py): DELTASPEC_TEST_ROWS_BUG names one for the
// whole process (read once).
bool planted(const char * name) {
    static const char * const bug = std::getenv("DELTASPEC_TEST_ROWS_BUG");
    return bug != nullptr && std::strcmp(bug, name) == 0;
}

// What the recurrence reads and writes; strides in floats.
struct RowsArgs {
    const float * q;
    const float * k;
    const float * v;
    const float * g;
    const float * beta;
    float * pool;     // [S, S, H, n_slots]
    const int32_t * rows;
    float * y;        // [S, H, R]
    float * saved;    // [S, S, H, n_saved]
    int64_t H, n_qk_heads;
    int64_t q_head, q_row, v_head, v_row, gate_head, gate_row;  // q and k share theirs, g and beta theirs
    float scale;
    bool bug_continue;  // test-only planted bug: no branch reloads its parent's state (planted() below)
};

// One walk position's plan entries.
struct Meta {
    int row, start, saved, flags;
};

template <int S>
struct Staged {
    float q[kChunkRows][S], k[kChunkRows][S];
    float v[kChunkRows][kColumnsPerBlock];  // the block's columns
    float g[kChunkRows], beta[kChunkRows];
    Meta meta[kChunkRows];
};

// One thread's share of a chunk (as in deltaspec_deltanet.cu): element tid of every row's q and k
// (tid < S), two of the chunk's v values (i = tid, tid + 128: row i / 16, column i % 16), row tid's
// g and beta.
struct ChunkShare {
    float q[kChunkRows], k[kChunkRows];
    float v[2];
    float g, beta;
};

// Plan entries of positions begin .. begin + n - 1 of the rows tensor into meta (all threads).
__device__ __forceinline__ void load_meta(Meta * meta, const int32_t * rows, int64_t begin, int n) {
    const int tid = threadIdx.y * 32 + threadIdx.x;
    for (int i = tid; i < n; i += kBlockThreads) {
        const int row = entry(rows, begin + i, DELTASPEC_ROWS_ORDER);
        meta[i] = {row, entry(rows, begin + i, DELTASPEC_ROWS_START), entry(rows, row, DELTASPEC_ROWS_SAVED),
                   entry(rows, row, DELTASPEC_ROWS_FLAGS)};
    }
}

// Loads of the chunk at meta[m0 .. m0 + n - 1], all issued before any is used.
template <int S>
__device__ __forceinline__ void fetch_chunk(ChunkShare & c, const RowsArgs & a, const Meta * meta, int m0, int n,
                                            int64_t head, int first_block_col) {
    const int tid = threadIdx.y * 32 + threadIdx.x;
    const int64_t qk_head = head % a.n_qk_heads;  // q/k heads tile the value heads
#pragma unroll
    for (int j = 0; j < kChunkRows; ++j) {
        if (j < n && tid < S) {
            const int64_t at = meta[m0 + j].row * a.q_row + qk_head * a.q_head + tid;
            c.q[j] = a.q[at];
            c.k[j] = a.k[at];
        }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int i = tid + kBlockThreads * j;
        if (i < n * kColumnsPerBlock) {
            const int64_t row = meta[m0 + i / kColumnsPerBlock].row;
            c.v[j] = a.v[row * a.v_row + head * a.v_head + first_block_col + i % kColumnsPerBlock];
        }
    }
    if (tid < n) {
        const int64_t at = meta[m0 + tid].row * a.gate_row + head * a.gate_head;
        c.g = a.g[at];
        c.beta = a.beta[at];
    }
}

template <int S>
__device__ __forceinline__ void store_chunk(Staged<S> & st, const ChunkShare & c, const Meta * meta, int m0, int n) {
    const int tid = threadIdx.y * 32 + threadIdx.x;
#pragma unroll
    for (int j = 0; j < kChunkRows; ++j) {
        if (j < n && tid < S) {
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
        st.meta[tid] = meta[m0 + tid];
    }
}

// this warp's 4 columns (first_col ..) of a state stored transposed, to and from registers
template <int S>
__device__ __forceinline__ void load_columns(float (&s)[kColumnsPerWarp][S / 32], const float * state, int first_col,
                                             int lane) {
#pragma unroll
    for (int c = 0; c < kColumnsPerWarp; c++) {
#pragma unroll
        for (int r = 0; r < S / 32; r++) s[c][r] = state[(first_col + c) * S + r * 32 + lane];
    }
}

template <int S>
__device__ __forceinline__ void store_columns(const float (&s)[kColumnsPerWarp][S / 32], float * state, int first_col,
                                              int lane) {
#pragma unroll
    for (int c = 0; c < kColumnsPerWarp; c++) {
#pragma unroll
        for (int r = 0; r < S / 32; r++) state[(first_col + c) * S + r * 32 + lane] = s[c][r];
    }
}

// grid (H, walks: deltaspec_rows_walks_max, S / 16), block (32, 4): warp y of block z owns columns
// 16 z + 4 y .. + 3 of head x's state through walk y's rows. Blocks past the last walk return.
// DEFER: each row's output reduced during the next row's step (token_step_deferred), off the
// walk's row-after-row critical path; the same bits (DELTASPEC_ROWS_DEFER_OUTPUT=0: at once).
template <int S, bool DEFER>
__global__ void __launch_bounds__(kBlockThreads) rows_deltanet(const RowsArgs a) {
    deltaspec_cuda::wait_for_inputs();
    const int64_t head = blockIdx.x;
    const int walk = blockIdx.y;
    const int64_t end = entry(a.rows, walk, DELTASPEC_ROWS_WALK_END);
    if (end < 0) return;
    const int64_t begin = walk == 0 ? 0 : entry(a.rows, walk - 1, DELTASPEC_ROWS_WALK_END);
    const int n_pos = (int)(end - begin);
    const int lane = threadIdx.x, first_block_col = blockIdx.z * kColumnsPerBlock;
    const int first_col = first_block_col + threadIdx.y * kColumnsPerWarp;
    const int my_col = first_col + reduced_column(lane), my_staged = my_col - first_block_col;
    const int64_t state_size = (int64_t)S * S, all_heads = a.H * state_size;
    const int64_t slot = entry(a.rows, entry(a.rows, begin, DELTASPEC_ROWS_ORDER), DELTASPEC_ROWS_SLOT);
    float * pool = a.pool + slot * all_heads + head * state_size;
    float * saved = a.saved + head * state_size;  // saved state k at + k * all_heads

    __shared__ Meta meta[kMetaWindow];
    __shared__ Staged<S> st;
    load_meta(meta, a.rows, begin, min(kMetaWindow, n_pos));
    __syncthreads();
    ChunkShare next;
    fetch_chunk<S>(next, a, meta, 0, min(kChunkRows, n_pos), head, first_block_col);
    float s[kColumnsPerWarp][S / 32];
    load_columns<S>(s, pool, first_col, lane);  // a walk's first row is a root: it starts from the pool
    float pending[kColumnsPerWarp] = {}, pending_next[kColumnsPerWarp];  // DEFER: the last row's output shares
    int64_t pending_row = -1;
    for (int t0 = 0; t0 < n_pos; t0 += kChunkRows) {
        const int n = min(kChunkRows, n_pos - t0);
        __syncthreads();  // the chunk before is read
        store_chunk<S>(st, next, meta, t0 % kMetaWindow, n);
        __syncthreads();
        const int t1 = t0 + kChunkRows;
        if (t1 < n_pos) {  // in flight during this chunk's rows
            if (t1 % kMetaWindow == 0) {  // this chunk's entries are in st already
                load_meta(meta, a.rows, begin + t1, min(kMetaWindow, n_pos - t1));
                __syncthreads();
            }
            fetch_chunk<S>(next, a, meta, t1 % kMetaWindow, min(kChunkRows, n_pos - t1), head, first_block_col);
        }
        for (int i = 0; i < n; i++) {
            const Meta m = st.meta[i];
            if (t0 + i > 0) {  // where the row does not continue the one before it
                if (m.start == -2) load_columns<S>(s, pool, first_col, lane);
                if (m.start >= 0 && !a.bug_continue) load_columns<S>(s, saved + m.start * all_heads, first_col, lane);
            }
            if constexpr (DEFER) {
                const float o = deltaspec_cuda::token_step_deferred<S / 32>(
                    s, st.k[i], st.q[i], st.v[i][my_staged], st.g[i], st.beta[i], lane, pending, pending_next);
                if (pending_row >= 0 && (lane & 7) == 0) a.y[(pending_row * a.H + head) * S + my_col] = o * a.scale;
#pragma unroll
                for (int c = 0; c < deltaspec_cuda::kColumnsPerWarp; ++c) pending[c] = pending_next[c];
                pending_row = m.row;
            } else {
                const float o = deltaspec_cuda::token_step<S / 32, true>(s, st.k[i], st.q[i], st.v[i][my_staged],
                                                                          st.g[i], st.beta[i], lane);
                if ((lane & 7) == 0) a.y[((int64_t)m.row * a.H + head) * S + my_col] = o * a.scale;
            }
            if (m.saved >= 0) store_columns<S>(s, saved + m.saved * all_heads, first_col, lane);
            if (m.flags & DELTASPEC_ROW_WRITE_BACK) store_columns<S>(s, pool, first_col, lane);
        }
    }
    if (DEFER && pending_row >= 0) {
        const float o = deltaspec_cuda::reduce_scatter(pending, lane);
        if ((lane & 7) == 0) a.y[(pending_row * a.H + head) * S + my_col] = o * a.scale;
    }
}

// Whether the recurrence defers each row's output reduction (rows_deltanet's DEFER): on unless
// DELTASPEC_ROWS_DEFER_OUTPUT=0 (read once; A/B runs).
bool defer_output() {
    static const bool on = deltaspec_cuda::env_switch_on("DELTASPEC_ROWS_DEFER_OUTPUT");
    return on;
}

template <int S>
void launch_rows_deltanet(const RowsArgs & a, int64_t n_walks_max, cudaStream_t stream) {
    const dim3 grid((unsigned)a.H, (unsigned)n_walks_max, S / kColumnsPerBlock), block(32, kWarpsPerBlock, 1);
    if (defer_output()) {
        deltaspec_cuda::launch(rows_deltanet<S, true>, grid, block, 0, stream, a);
    } else {
        deltaspec_cuda::launch(rows_deltanet<S, false>, grid, block, 0, stream, a);
    }
}

// The conv of row blockIdx.y, channels blockIdx.x * 128 + threadIdx.x; KC > 0: the kernel size
// known at compile time (qwen35's 4), 0: kc.
template <int KC, bool SILU>
__global__ void __launch_bounds__(128) rows_conv(const float * pool, const float * x, const float * w,
                                                 const float * bias, const int32_t * rows, float * y, int64_t C,
                                                 int kc, int64_t x_row, int64_t y_row, bool bug_short_window) {
    deltaspec_cuda::wait_for_inputs();
    const int Kc = KC > 0 ? KC : kc, W = Kc - 1;
    const int64_t r = blockIdx.y, ch = (int64_t)blockIdx.x * 128 + threadIdx.x;
    const int64_t slot = entry(rows, r, DELTASPEC_ROWS_SLOT);
    if (slot < 0 || ch >= C) return;
    int anc[KC > 0 ? KC : DELTASPEC_ROWS_MAX_KC];  // the newest ancestors, oldest first: anc[W-m .. W-1]
    int m = 0;
    for (int a = entry(rows, r, DELTASPEC_ROWS_PARENT); a >= 0 && m < W; a = entry(rows, a, DELTASPEC_ROWS_PARENT)) {
        anc[W - 1 - m++] = a;
        if (bug_short_window) break;  // planted: only the parent, then the committed window
    }
    const float * w_ch = w + ch * Kc;
    float sumf = 0.0f;  // ggml's order: oldest input first
#pragma unroll
    for (int j = 0; j < (KC > 0 ? KC - 1 : DELTASPEC_ROWS_MAX_KC - 1); j++) {
        if (KC == 0 && j >= W) break;
        const float in = j >= W - m ? x[anc[j] * x_row + ch] : pool[(slot * C + ch) * W + j + m];
        sumf += in * w_ch[j];
    }
    sumf += x[r * x_row + ch] * w_ch[W];
    sumf += bias != nullptr ? bias[ch] : 0.0f;  // ggml adds 0 without a bias, which turns -0 into +0
    y[r * y_row + ch] = SILU ? ggml_cuda_op_silu_single(sumf) : sumf;
}

// The window after each WRITE_BACK row into its slot: the row's window shifted by one, then its input.
__global__ void __launch_bounds__(128) rows_conv_write_back(float * pool, const float * x, const int32_t * rows,
                                                            int64_t C, int Kc, int64_t x_row) {
    const int W = Kc - 1;
    const int64_t r = blockIdx.y, ch = (int64_t)blockIdx.x * 128 + threadIdx.x;
    const int64_t slot = entry(rows, r, DELTASPEC_ROWS_SLOT);
    if (slot < 0 || ch >= C || !(entry(rows, r, DELTASPEC_ROWS_FLAGS) & DELTASPEC_ROW_WRITE_BACK)) return;
    float window[DELTASPEC_ROWS_MAX_KC];  // window[0 .. W-1], then the input at W
    int m = 0;
    int anc[DELTASPEC_ROWS_MAX_KC];
    for (int a = entry(rows, r, DELTASPEC_ROWS_PARENT); a >= 0 && m < W; a = entry(rows, a, DELTASPEC_ROWS_PARENT)) {
        anc[W - 1 - m++] = a;
    }
    float * committed = pool + (slot * C + ch) * W;
    for (int j = 0; j < W; j++) window[j] = j >= W - m ? x[anc[j] * x_row + ch] : committed[j + m];
    window[W] = x[r * x_row + ch];
    for (int j = 0; j < W; j++) committed[j] = window[j + 1];
}

void rows_ssm_conv(ggml_backend_cuda_context & ctx, ggml_tensor * dst, ggml_tensor * bias_add_node,
                   ggml_tensor * silu_dst) {
    const ggml_tensor *pool = dst->src[0], *c = dst->src[1], *x = dst->src[2], *rows = dst->src[3];
    // ggml-cuda fuses a following SiLU (and a bias ADD before it) as for ggml's conv: the result then
    // goes to the SiLU's tensor
    const ggml_tensor * bias = bias_add_node == nullptr ? nullptr
                               : bias_add_node->src[0] == dst ? bias_add_node->src[1] : bias_add_node->src[0];
    GGML_ASSERT(bias_add_node == nullptr || silu_dst != nullptr);
    GGML_ASSERT(bias == nullptr || (bias->type == GGML_TYPE_F32 && ggml_is_contiguous(bias) &&
                                    ggml_nelements(bias) == c->ne[1]));
    const ggml_tensor * out = silu_dst != nullptr ? silu_dst : dst;
    const int64_t C = c->ne[1], R = x->ne[1];
    const int Kc = (int)c->ne[0];
    const int64_t f = sizeof(float);
    GGML_ASSERT(R <= 65535 && out->nb[0] == f);
    const dim3 grid((unsigned)((C + 127) / 128), (unsigned)R), block(128);
    const float * bias_d = bias != nullptr ? (const float *)bias->data : nullptr;
    auto launch = [&](auto kernel) {
        deltaspec_cuda::launch(kernel, grid, block, 0, ctx.stream(), (const float *)pool->data,
                               (const float *)x->data, (const float *)c->data, bias_d, (const int32_t *)rows->data,
                               (float *)out->data, C, Kc, (int64_t)(x->nb[1] / f), (int64_t)(out->nb[1] / f),
                               planted("cuda_short_window"));
    };
    const bool silu = silu_dst != nullptr;
    if (Kc == 4) {
        silu ? launch(rows_conv<4, true>) : launch(rows_conv<4, false>);
    } else {
        silu ? launch(rows_conv<0, true>) : launch(rows_conv<0, false>);
    }
    CUDA_CHECK(cudaGetLastError());
    rows_conv_write_back<<<grid, block, 0, ctx.stream()>>>((float *)pool->data, (const float *)x->data,
                                                          (const int32_t *)rows->data, C, Kc,
                                                          (int64_t)(x->nb[1] / f));
    CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void deltaspec_rows_cuda_gated_delta_net(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor *q = dst->src[0], *v = dst->src[2], *g = dst->src[3], *pool = dst->src[5];
    const int64_t S = v->ne[0], H = v->ne[1], R = v->ne[2];
    auto floats = [](size_t nb) { return (int64_t)(nb / sizeof(float)); };
    float * y = (float *)dst->data;
    RowsArgs a = {(const float *)q->data, (const float *)dst->src[1]->data, (const float *)v->data,
                  (const float *)g->data, (const float *)dst->src[4]->data, (float *)pool->data,
                  (const int32_t *)dst->src[6]->data, y, y + S * H * R, H, q->ne[1], floats(q->nb[1]),
                  floats(q->nb[2]), floats(v->nb[1]), floats(v->nb[2]), floats(g->nb[1]), floats(g->nb[2]),
                  1.0f / sqrtf((float)S), planted("cuda_continue")};
    GGML_ASSERT(ggml_are_same_stride(q, dst->src[1]) && ggml_are_same_stride(g, dst->src[4]));
    const int64_t n_walks_max = deltaspec_rows_walks_max(dst);  // a row of blocks per walk the plan may have
    GGML_ASSERT(n_walks_max <= 65535);
    switch (S) {
        case 32: launch_rows_deltanet<32>(a, n_walks_max, ctx.stream()); break;
        case 64: launch_rows_deltanet<64>(a, n_walks_max, ctx.stream()); break;
        case 128: launch_rows_deltanet<128>(a, n_walks_max, ctx.stream()); break;
        default:
            GGML_ABORT("deltaspec_rows_gated_delta_net on CUDA: state size %lld (32, 64 or 128 served)", (long long)S);
    }
    CUDA_CHECK(cudaGetLastError());
}

// ggml-cuda.cu calls this in place of ggml_cuda_op_ssm_conv (inject.cmake renames it).
void deltaspec_op_ssm_conv(ggml_backend_cuda_context & ctx, ggml_tensor * dst, ggml_tensor * bias_add_node,
                           ggml_tensor * silu_dst) {
    if (deltaspec_is_rows_node(dst)) {
        rows_ssm_conv(ctx, dst, bias_add_node, silu_dst);
    } else {
        ggml_cuda_op_ssm_conv(ctx, dst, bias_add_node, silu_dst);
    }
}

// ggml-cuda.cu calls this in place of ggml_cuda_op_gated_delta_net_fused_cache (inject.cmake
// renames it) when a CPY of the op's state tail into a cache view follows the node. For our node
// that tail is the saved states: the op runs, then the copy the skipped CPY would have made.
void deltaspec_op_gated_delta_net_fused_cache(ggml_backend_cuda_context & ctx, ggml_tensor * dst,
                                              ggml_cuda_gated_delta_net_fused_cache cache) {
    if (!deltaspec_is_rows_node(dst)) {
        ggml_cuda_op_gated_delta_net_fused_cache(ctx, dst, cache);
        return;
    }
    deltaspec_rows_cuda_gated_delta_net(ctx, dst);
    const ggml_tensor * v = dst->src[2];
    const int64_t S = v->ne[0], H = v->ne[1], R = v->ne[2], D = S * S * H;
    const int64_t n_written = std::min<int64_t>(R, ggml_get_op_params_i32(dst, 0));  // what ggml matched
    const float * tail = (const float *)dst->data + S * H * R;
    for (int64_t i = 0; i < n_written; ++i) {
        CUDA_CHECK(cudaMemcpyAsync(cache.data + i * cache.slot_stride, tail + i * D, D * sizeof(float),
                                   cudaMemcpyDeviceToDevice, ctx.stream()));
    }
}
