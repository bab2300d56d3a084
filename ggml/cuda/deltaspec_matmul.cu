// deltaspec's kernels inside ggml-cuda: ggml-cuda.cu is compiled with ggml_cuda_mul_mat_vec_q and
// ggml_cuda_mul_mat_q renamed to the two dispatchers below (see inject.cmake), so every quantized
// mat-vec and small-batch product ggml-cuda launches comes here first. What our kernels serve
// they compute; everything else goes on to ggml's own function unchanged. Off until the engine
// switches it on, so a llama.cpp built against the same ggml runs ggml's kernels (the benchmark's
// peer).
//
// Served: one column (a decode step) of Q4_K (any number of rows; also ggml's fused up/gate SwiGLU)
// and of Q6_K (256 rows or more), both also with ggml's fused residual add, and 2..32 columns
// (verifying a draft chain) of Q4_K and of Q6_K (rows of whole 1024-weight groups) on tensor
// cores. ggml asks its mat-vec for up to 8 columns and its tile kernels (mmq) for more; both
// routes reach the same kernels here.
//
// Folded inputs: the engine may mark an RMS_NORM + MUL pair, or (2..32 columns) a SWIGLU, with
// deltaspec_cuda_fold_input when every product reading it is one our kernels serve (one column,
// or 2..32 on tensor cores). ggml-cuda then skips it (its fused rms_norm and its swiglu entries
// are renamed to deltaspec_rms_norm_fused and deltaspec_op_swiglu), and each of those products
// reads the op's inputs and applies it while it prepares x: ~130 launches fewer per 27B decode
// step, ~240 per verify batch. A product that is not ours after all (say, unaligned data) first
// writes the op's output as ggml would have.
//
// Pairs: the engine may mark two products of one input that follow each other in the graph (a
// layer's input projections of two types: Q4_K_M's Q6_K DeltaNet qkv beside its Q4_K gate/beta/
// alpha stack, attention's Q6_K v beside the q/k stack). The first then quantizes x once for both
// (in both kernels' layouts: one launch) and computes the second too, which ggml-cuda's call for
// it then skips: 32 launches fewer in a 27B verify batch (24 DeltaNet and 8 attention layers),
// 0.04 ms of a 13.7 ms tree verify on an H100 (bench/results/latest/tree_ab.md).
//
// Fused residual adds: the engine may also mark an ADD of a 2..32-column product and a residual
// (ggml fuses adds into one-column products only). The product then writes the sum into the
// ADD's output and ggml-cuda skips the ADD (its add entry is renamed to deltaspec_op_add); a
// product that is not ours after all runs ggml's kernel and then the ADD.
#include "binbcast.cuh"
#include "common.cuh"
#include "deltaspec_invariant.h"
#include "mmvf.cuh"
#include "mmvq.cuh"
#include "norm.cuh"
#include "q4k_gemv.cuh"
#include "q4k_mma.cuh"
#include "q6k_gemv.cuh"
#include "q6k_mma.cuh"
#include "unary.cuh"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

// ggml's tile-kernel entry (mmq.cuh); declared here rather than including that heavy header
void ggml_cuda_mul_mat_q(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                         const ggml_tensor * ids, ggml_tensor * dst);

static bool g_deltaspec_kernels = false;

extern "C" __attribute__((visibility("default"))) void deltaspec_cuda_set_kernels(bool on) {
    g_deltaspec_kernels = on;
}

bool deltaspec_cuda_kernels_on() { return g_deltaspec_kernels; }  // for our other ops (deltaspec_concat.cu)

// Pairs of products computed from one quantization of x (run_pair) so far in this process: the GPU
// tests check that pairs ran
static std::atomic<int64_t> g_pair_products{0};

extern "C" __attribute__((visibility("default"))) int64_t deltaspec_cuda_pair_count() {
    return g_pair_products.load();
}

// Our kernels' early launch (gemv_common.cuh launch): on with the kernels unless DELTASPEC_CUDA_PDL=0
extern "C" __attribute__((visibility("default"))) void deltaspec_cuda_set_early_launch(bool on) {
    deltaspec_cuda::early_launch() = on;
}

// 16-row tiles per thread block of the tensor-core kernels (mma_x.cuh with_row_tiles): 0 lets
// them choose by the matrix's rows; 1, 2 or 4 forces it (tests, A/B runs)
static int g_mma_row_tiles = 0;

extern "C" __attribute__((visibility("default"))) void deltaspec_cuda_set_mma_row_tiles(int row_tiles) {
    g_mma_row_tiles = row_tiles;
}

// Thread blocks per cluster sharing a row tile's k in the tensor-core kernels (mma_x.cuh; sm_90+,
// else 1): 0 lets them choose (q6k_mma_k_split; 1 for Q4_K); 1..4 forces it (tests, A/B runs)
static int g_mma_k_split = 0;

extern "C" __attribute__((visibility("default"))) void deltaspec_cuda_set_mma_k_split(int k_split) {
    g_mma_k_split = k_split;
}

// The widest product (columns) our tensor-core kernels take, in launches of at most 32 columns
// (kLaunchColumns) of balanced widths; wider ones go to ggml (its mmq). 32 (one launch) unless set:
// the batch-invariant mode's cost (bench/results/latest/cuda_batch_invariance.md: prefill of 512
// columns as 16 launches at 0.83x ggml's mmq) says launches of 32 may beat mmq at the widths
// between (trees of 33+ rows, many sequences' drafts), which bench/tree_verify_cost.py's
// --mma-max-columns measures before any default moves.
static int64_t g_mma_max_columns = 32;

extern "C" __attribute__((visibility("default"))) void deltaspec_cuda_set_mma_max_columns(int n) {
    g_mma_max_columns = n > 0 ? n : 32;
}

namespace {

constexpr int64_t kLaunchColumns = 32;  // the tensor-core kernels' widest launch (mma_x.cuh: 4 tiles of 8)

// Column ranges of at most kLaunchColumns for a product of n columns, of balanced widths (33 ->
// 17 + 16: the same padded tiles, not 32 + 1).
template <typename Piece>
void for_column_pieces(int64_t n, Piece && piece) {
    const int64_t pieces = (n + kLaunchColumns - 1) / kLaunchColumns;
    for (int64_t i = 0, c0 = 0; i < pieces; ++i) {
        const int64_t m = (n - c0) / (pieces - i);
        piece(c0, m);
        c0 += m;
    }
}

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

// Whether our one-column kernels take this weight matrix (whatever x and the fusion turn out to be).
bool serves_one_column(const ggml_tensor * w) {
    if (!plain_blocks(w)) return false;
    if (w->type == GGML_TYPE_Q4_K) return true;  // few rows: its split-K form
    // Q6_K rows of whole 1024-weight groups start 8-byte aligned, as the kernel's loads need;
    // matrices under 256 rows stay with ggml (8 rows a block would leave most SMs idle)
    return w->type == GGML_TYPE_Q6_K && w->ne[0] % 1024 == 0 && w->ne[1] >= 256;
}

// Whether our tensor-core kernels take this weight matrix for 2..32 columns.
bool serves_columns(const ggml_tensor * w) {
    if (!plain_blocks(w)) return false;
    return w->type == GGML_TYPE_Q4_K || (w->type == GGML_TYPE_Q6_K && w->ne[0] % 1024 == 0);  // 8-byte rows
}

constexpr char kFoldedNormName[] = "deltaspec.folded_rms_norm";
constexpr char kFoldedGluName[] = "deltaspec.folded_swiglu";
constexpr char kFusedAddName[] = "deltaspec.fused_add";    // the ADD
constexpr char kAddIntoName[] = "deltaspec.add_into_next";  // its product, which keeps a pointer to it
// where that pointer sits in the product's op_params: the last 8 bytes (ggml's MUL_MAT reads the
// first two int32: precision and a hint)
constexpr size_t kAddPointerOffset = GGML_MAX_OP_PARAMS - sizeof(ggml_tensor *);
constexpr char kPairFirstName[] = "deltaspec.pair_first";    // keeps a pointer to the second
constexpr char kPairSecondName[] = "deltaspec.pair_second";  // computed by the first, when it could
constexpr size_t kPairPointerOffset = kAddPointerOffset - sizeof(ggml_tensor *);  // in the first's op_params
// in the second's: 1 from the first's computing it to ggml-cuda's call for it, which clears it (so
// the node is as it was when ggml-cuda next compares it with its CUDA graph's)
constexpr size_t kPairDoneOffset = kPairPointerOffset - sizeof(int32_t);

// A MUL(RMS_NORM(x), w) or a SWIGLU marked by deltaspec_cuda_fold_input, i.e. not computed by ggml-cuda.
bool folded_norm(const ggml_tensor * t) {
    return g_deltaspec_kernels && t->op == GGML_OP_MUL && std::strcmp(t->name, kFoldedNormName) == 0;
}

bool folded_glu(const ggml_tensor * t) {
    return g_deltaspec_kernels && t->op == GGML_OP_GLU && std::strcmp(t->name, kFoldedGluName) == 0;
}

bool fused_add(const ggml_tensor * t) {
    return g_deltaspec_kernels && t->op == GGML_OP_ADD && std::strcmp(t->name, kFusedAddName) == 0;
}

// Marks a product with `name` and the tensor it hands its work on to, kept at `offset` of its op_params.
void mark_product(ggml_tensor * product, const char * name, size_t offset, const ggml_tensor * to) {
    ggml_set_name(product, name);
    std::memcpy((char *)product->op_params + offset, &to, sizeof(to));
}

// The tensor a product marked `name` keeps at `offset` (mark_product), or nullptr.
ggml_tensor * marked_tensor(const ggml_tensor * product, const char * name, size_t offset) {
    if (!g_deltaspec_kernels || product->op != GGML_OP_MUL_MAT || std::strcmp(product->name, name) != 0) {
        return nullptr;
    }
    ggml_tensor * to = nullptr;
    std::memcpy(&to, (const char *)product->op_params + offset, sizeof(to));
    return to;
}

// The marked ADD a product's result goes to, or nullptr.
ggml_tensor * add_of(const ggml_tensor * product) { return marked_tensor(product, kAddIntoName, kAddPointerOffset); }

// The second product of the pair `product` begins, or nullptr.
ggml_tensor * pair_second_of(const ggml_tensor * product) {
    return marked_tensor(product, kPairFirstName, kPairPointerOffset);
}

void set_pair_done(ggml_tensor * second, int32_t done) {
    std::memcpy((char *)second->op_params + kPairDoneOffset, &done, sizeof(done));
}

// Whether the first product of its pair computed `product` (ggml-cuda's call for it then has
// nothing to do): once per computation, the mark cleared here. A product ggml fuses with the op
// after it (none of a pair's, which are 2..32 columns) runs as ggml asks all the same.
bool computed_with_first(ggml_tensor * product, const ggml_cuda_mm_fusion_args_host * fusion) {
    if (!g_deltaspec_kernels || std::strcmp(product->name, kPairSecondName) != 0) return false;
    int32_t done = 0;
    std::memcpy(&done, (const char *)product->op_params + kPairDoneOffset, sizeof(done));
    set_pair_done(product, 0);
    return done == 1 && fusion == nullptr;
}

// The ADD's other operand, if it is a residual our kernels can add as they store: f32 columns
// of the ADD's shape.
bool residual_of(const ggml_tensor * add, const ggml_tensor * product, deltaspec_cuda::YResidual & residual) {
    const ggml_tensor * other = add->src[0] == product ? add->src[1] : add->src[0];
    if (!plain_columns(other) || !plain_columns(add) || !ggml_are_same_shape(other, add)) return false;
    residual.res = (const float *)other->data;
    residual.ld = other->nb[1] / sizeof(float);
    return true;
}

// ggml's SWIGLU of two f32 halves, silu(src0) * src1, not swapped
bool plain_swiglu(const ggml_tensor * t) {
    return t->op == GGML_OP_GLU && ggml_get_glu_op(t) == GGML_GLU_OP_SWIGLU && t->src[1] != nullptr &&
           ggml_get_op_params_i32(t, 1) == 0 && t->src[0]->type == GGML_TYPE_F32 && t->src[1]->type == GGML_TYPE_F32;
}

// What a folded norm's consumer reads instead: the norm's input (x, its columns ldx floats apart)
// and weights, if our kernels can.
bool fold_inputs(const ggml_tensor * norm_mul, const float *& x, int64_t & ldx, deltaspec_cuda::XNorm & norm) {
    const ggml_tensor * rms = norm_mul->src[0];
    const ggml_tensor * w = norm_mul->src[1];
    if (!plain_columns(rms->src[0]) || w->type != GGML_TYPE_F32 || !ggml_is_contiguous(w) ||
        w->ne[0] != rms->ne[0] || ggml_nrows(w) != 1 || (uintptr_t)w->data % 16 != 0) {
        return false;
    }
    x = (const float *)rms->src[0]->data;
    ldx = rms->src[0]->nb[1] / sizeof(float);
    norm.w = (const float *)w->data;
    std::memcpy(&norm.eps, rms->op_params, sizeof(float));
    return true;
}

// The same for a folded SwiGLU: its gate half as x, its up half as glu.
bool fold_inputs(const ggml_tensor * swiglu, const float *& x, int64_t & ldx, deltaspec_cuda::XGlu & glu) {
    const ggml_tensor * gate = swiglu->src[0];
    const ggml_tensor * up = swiglu->src[1];
    if (!plain_columns(gate) || !plain_columns(up)) return false;
    x = (const float *)gate->data;
    ldx = gate->nb[1] / sizeof(float);
    glu.up = (const float *)up->data;
    glu.ld_up = up->nb[1] / sizeof(float);
    return true;
}

// Plain Q4_K products of 4096 rows or more take the kernel's PAIRED form (q4k_gemv.cuh); DELTASPEC_Q4K_PAIRED=0
// keeps the one-row form (A/B runs). First for wide matrices (ffn down, ssm_out, attention
// output); H200 (kernels_bench, one column) showed it faster for the input projections too:
// 10240 x 5120 16.8 -> 15.7 us, 12288 x 5120 19.1 -> 16.7, 6144 x 5120 12.5 -> 10.4.
bool q4k_paired(int64_t n_rows) {
    static const bool enabled = deltaspec_cuda::env_switch_on("DELTASPEC_Q4K_PAIRED");
    return enabled && n_rows >= deltaspec_cuda::kQ4KPairedMinRows;
}

// Which of our kernels computes dst = src0 x src1 (with ggml's fusion, if any), or none.
enum class Kernel { none, q4k_gemv, q6k_gemv, q4k_mma, q6k_mma };

Kernel pick(const ggml_tensor * src0, const ggml_tensor * src1, const ggml_tensor * ids, const ggml_tensor * dst,
            const ggml_cuda_mm_fusion_args_host * fusion) {
    if (!g_deltaspec_kernels || ids != nullptr || !plain_blocks(src0)) return Kernel::none;
    if (!plain_columns(src1) || !plain_columns(dst) || src1->ne[0] != src0->ne[0]) return Kernel::none;
    const int64_t n = src1->ne[1];
    if (n == 1) {
        if (fusion != nullptr && !swiglu_fusion(fusion, src0) && !bias_fusion(fusion, dst)) return Kernel::none;
        if (!serves_one_column(src0)) return Kernel::none;
        return src0->type == GGML_TYPE_Q4_K ? Kernel::q4k_gemv : Kernel::q6k_gemv;
    }
    // ggml fuses one column only
    if (fusion != nullptr || n > g_mma_max_columns || !serves_columns(src0)) return Kernel::none;
    return src0->type == GGML_TYPE_Q4_K ? Kernel::q4k_mma : Kernel::q6k_mma;
}

// Writes a folded op's output after all, for a product that does not apply it itself.
void compute_folded(ggml_backend_cuda_context & ctx, const ggml_tensor * folded) {
    ggml_tensor * t = const_cast<ggml_tensor *>(folded);
    if (t->op == GGML_OP_GLU) {
        ggml_cuda_op_swiglu(ctx, t);
    } else {
        ggml_cuda_op_rms_norm_fused(ctx, t->src[0], t);
    }
}

// Planted bug for tests/test_gpu_batch_invariant.py (DELTASPEC_TEST_INVARIANT_BUG=row_tiles, read per
// call): a batch-invariant context's products keep the row tiles and k-split their matrix's rows
// choose, as before the fixed order below.
bool planted_row_tiles() {
    const char * bug = std::getenv("DELTASPEC_TEST_INVARIANT_BUG");
    return bug != nullptr && std::strcmp(bug, "row_tiles") == 0;
}

// Whether the tensor-core kernels must add each row's blocks in one order whatever the matrix:
// on a batch-invariant context. R row tiles per thread block split k over 8 / R warps, and a
// k-split over a cluster's blocks, and both follow the matrix's row count (mma_row_tiles,
// q6k_mma_k_split), so one row's sums came out in another order in a stacked product (a batch
// projects its input through the ffn gate/up stack, 2 x 17408 rows on the 27B: R = 2) than in
// the product of its half alone (a one-token step's separate gate and up: R = 1). One tile and
// no split fix the order: warp w adds blocks w, w + 8, ..., then the warps are added in order.
bool fixed_sum_order(const ggml_backend_cuda_context & ctx) {
    return deltaspec_cuda_invariant(ctx) && !planted_row_tiles();
}

// The row tiles and k-split the tensor-core kernels take on ctx (0: their own choice): one tile and
// no split on a batch-invariant context (fixed_sum_order), else the forced ones, if any.
void mma_tiling(const ggml_backend_cuda_context & ctx, int & row_tiles, int & k_split) {
    const bool fixed = fixed_sum_order(ctx);
    row_tiles = fixed ? 1 : g_mma_row_tiles;
    k_split = fixed ? 1 : g_mma_k_split;
}

// x: src1's values (columns ldx floats apart), or the input of a folded norm or SwiGLU, which
// `norm` or `glu` then describe (a SwiGLU only for the tensor-core kernels); dst: where y goes,
// plus `residual` (tensor-core kernels only)
void run(Kernel k, ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
         ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion, const float * x, int64_t ldx,
         deltaspec_cuda::XNorm norm = {}, deltaspec_cuda::XGlu glu = {}, deltaspec_cuda::YResidual residual = {}) {
    float * y = (float *)dst->data;
    const int64_t rows = src0->ne[1], n_k = src0->ne[0];
    const void * gate = fusion && fusion->gate ? fusion->gate->data : nullptr;
    const float * bias = fusion && fusion->x_bias ? (const float *)fusion->x_bias->data : nullptr;
    switch (k) {
        case Kernel::q4k_gemv:
            deltaspec_cuda::launch_q4k_gemv(src0->data, gate, x, y, rows, n_k, src0->nb[1], ctx.stream(), true, bias,
                                            norm, q4k_paired(rows));
            break;
        case Kernel::q6k_gemv:
            deltaspec_cuda::launch_q6k_gemv(src0->data, x, y, rows, n_k, src0->nb[1], ctx.stream(),
                                            deltaspec_cuda::q6k_resident_grid(rows, n_k), bias, norm);
            break;
        case Kernel::q4k_mma:
        case Kernel::q6k_mma: {
            const int64_t n = src1->ne[1], ldy = dst->nb[1] / sizeof(float);
            int row_tiles, k_split;
            mma_tiling(ctx, row_tiles, k_split);
            ggml_cuda_pool_alloc<char> scratch(ctx.pool(), deltaspec_cuda::mma_x_bytes(n_k, (int)std::min(n, kLaunchColumns)));
            const auto launch = k == Kernel::q4k_mma ? deltaspec_cuda::launch_q4k_mma : deltaspec_cuda::launch_q6k_mma;
            // each column's sums are its own whatever the launch's width: pieces change no value
            for_column_pieces(n, [&](int64_t c0, int64_t m) {
                deltaspec_cuda::XGlu g = glu;
                if (g.up != nullptr) g.up += c0 * g.ld_up;
                deltaspec_cuda::YResidual r = residual;
                if (r.res != nullptr) r.res += c0 * r.ld;
                launch(src0->data, x + c0 * ldx, ldx, y + c0 * ldy, ldy, rows, n_k, (int)m, src0->nb[1], scratch.get(),
                       ctx.stream(), norm, g, r, row_tiles, k_split);
            });
            break;
        }
        case Kernel::none:
            break;
    }
    CUDA_CHECK(cudaGetLastError());
}

// One tensor-core product from x as quantize_x256 wrote it in kernel k's layout.
void mma_product(Kernel k, const deltaspec_cuda::MmaX & xq, const ggml_tensor * src0, ggml_tensor * dst, int n,
                 cudaStream_t stream, int row_tiles, int k_split) {
    const int64_t rows = src0->ne[1], n_k = src0->ne[0], ldy = dst->nb[1] / sizeof(float);
    const auto launch =
        k == Kernel::q4k_mma ? deltaspec_cuda::launch_q4k_mma_product : deltaspec_cuda::launch_q6k_mma_product;
    launch(src0->data, xq, (float *)dst->data, ldy, rows, n_k, n, src0->nb[1], stream, deltaspec_cuda::YResidual{},
           row_tiles, k_split);
}

// Planted bug for tests/test_gpu.py::test_pairs_change_no_bits (DELTASPEC_TEST_PAIR_BUG=layout, read
// per call): a pair's second product reads x in the first's layout.
bool planted_pair_layout() {
    const char * bug = std::getenv("DELTASPEC_TEST_PAIR_BUG");
    return bug != nullptr && std::strcmp(bug, "layout") == 0;
}

// A pair's two products (tensor-core kernels k and k2, one launch of columns each) from one
// quantization of x: in k's layout, and also in k2's where that differs. Each product gets the
// bytes its own quantization would give, so the pair changes no value.
void run_pair(Kernel k, Kernel k2, ggml_backend_cuda_context & ctx, const ggml_tensor * src0, ggml_tensor * dst,
              const ggml_tensor * src0_2, ggml_tensor * dst_2, const float * x, int64_t ldx,
              deltaspec_cuda::XNorm norm, deltaspec_cuda::XGlu glu) {
    const int n = (int)dst->ne[1];
    const int64_t n_k = src0->ne[0];
    int row_tiles, k_split;
    mma_tiling(ctx, row_tiles, k_split);
    const size_t bytes = deltaspec_cuda::mma_x_bytes(n_k, n);  // a multiple of 16
    ggml_cuda_pool_alloc<char> scratch(ctx.pool(), k == k2 ? bytes : 2 * bytes);
    char * other = k == k2 ? nullptr : scratch.get() + bytes;
    const deltaspec_cuda::MmaX xq =
        k == Kernel::q4k_mma
            ? deltaspec_cuda::launch_quantize_x256<deltaspec_cuda::XFormat::q4k>(x, ldx, n_k, n, scratch.get(),
                                                                                ctx.stream(), norm, glu, other)
            : deltaspec_cuda::launch_quantize_x256<deltaspec_cuda::XFormat::q6k>(x, ldx, n_k, n, scratch.get(),
                                                                                ctx.stream(), norm, glu, other);
    mma_product(k, xq, src0, dst, n, ctx.stream(), row_tiles, k_split);
    const bool own_layout = other != nullptr && !planted_pair_layout();
    mma_product(k2, own_layout ? deltaspec_cuda::mma_x_layout(other, n_k, n) : xq, src0_2, dst_2, n, ctx.stream(),
                row_tiles, k_split);
    CUDA_CHECK(cudaGetLastError());
    g_pair_products.fetch_add(1, std::memory_order_relaxed);
}

// The second product of dst's pair, if our tensor-core kernels compute it with dst's (kernel k)
// in one launch of columns from the same x: nullptr otherwise (it then runs on its own).
ggml_tensor * pair_partner(Kernel k, const ggml_tensor * src1, ggml_tensor * dst, Kernel & k2) {
    ggml_tensor * second = pair_second_of(dst);
    if (second == nullptr || second->src[1] != src1 || src1->ne[1] > kLaunchColumns) return nullptr;
    if (k != Kernel::q4k_mma && k != Kernel::q6k_mma) return nullptr;
    k2 = pick(second->src[0], src1, nullptr, second, nullptr);
    return k2 == Kernel::q4k_mma || k2 == Kernel::q6k_mma ? second : nullptr;
}

// Runs kernel k on src1 (none: returns false), applying src1's folded norm or SwiGLU if it is
// one, and the marked ADD (`add`, or nullptr) that takes its result. A folded op our kernel
// cannot apply is computed first, as ggml would have; an ADD it cannot take is run after it.
bool run_ours(Kernel k, ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
              ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion, ggml_tensor * add) {
    const bool mma = k == Kernel::q4k_mma || k == Kernel::q6k_mma;
    const float * x = (const float *)src1->data;
    int64_t ldx = src1->nb[1] / sizeof(float);
    deltaspec_cuda::XNorm norm;
    deltaspec_cuda::XGlu glu;
    bool applied = true;  // src1's folded op, if any, is applied by kernel k (fold_inputs set x, ldx)
    if (folded_norm(src1)) {
        const bool fits = !mma || src0->ne[0] <= deltaspec_cuda::kMmaNormMaxK;
        applied = k != Kernel::none && fits && fold_inputs(src1, x, ldx, norm);
    } else if (folded_glu(src1)) {
        applied = mma && fold_inputs(src1, x, ldx, glu);
    }
    if (!applied) compute_folded(ctx, src1);  // x stays src1, now written
    if (k == Kernel::none) return false;
    deltaspec_cuda::YResidual residual;
    ggml_tensor * out = dst;
    if (add != nullptr && mma && residual_of(add, dst, residual)) out = add;  // the product writes the sum
    Kernel k2 = Kernel::none;
    ggml_tensor * second = add == nullptr ? pair_partner(k, src1, dst, k2) : nullptr;
    if (second != nullptr) {
        run_pair(k, k2, ctx, src0, dst, second->src[0], second, x, ldx, norm, glu);
        set_pair_done(second, 1);
        return true;
    }
    run(k, ctx, src0, src1, out, fusion, x, ldx, norm, glu, residual);
    if (add != nullptr && out == dst) ggml_cuda_op_add(ctx, add);
    return true;
}

// Marks a residual ADD of a 2..32-column product our tensor-core kernels serve (weights[0]).
bool fuse_add(ggml_tensor * add, const ggml_tensor * const * weights, int n_weights) {
    ggml_tensor * product = add->src[0]->op == GGML_OP_MUL_MAT ? add->src[0] : add->src[1];
    const int64_t n = add->ne[1];
    if (!g_deltaspec_kernels || n_weights != 1 || product->op != GGML_OP_MUL_MAT || product->src[0] != weights[0] ||
        n < 2 || n > g_mma_max_columns || !serves_columns(weights[0]) || add->type != GGML_TYPE_F32 ||
        !ggml_are_same_shape(add->src[0], add->src[1])) {
        return false;
    }
    ggml_set_name(add, kFusedAddName);
    mark_product(product, kAddIntoName, kAddPointerOffset, add);
    return true;
}

// ---- batch-invariant products (deltaspec_invariant.h) -------------------------------------------

// Columns [c0, c0 + n) of t (dimension 1), as a tensor ggml's functions and ours take.
ggml_tensor column_view(const ggml_tensor * t, int64_t c0, int64_t n) {
    ggml_tensor v = *t;
    v.ne[1] = n;
    v.data = (char *)t->data + c0 * t->nb[1];
    return v;
}

// dst = src0 x src1 with every column computed as it would be alone: on our tensor-core kernels
// (any width, in launches of up to 32 columns; each column's sums are its own) where
// they serve the matrix, else one column at a time through ggml's mat-vec. False: neither takes it.
bool invariant_product(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                       ggml_tensor * dst) {
    const int64_t n = src1->ne[1];
    if (serves_columns(src0) && plain_columns(src1) && plain_columns(dst) && src1->ne[0] == src0->ne[0]) {
        const Kernel k = src0->type == GGML_TYPE_Q4_K ? Kernel::q4k_mma : Kernel::q6k_mma;
        run(k, ctx, src0, src1, dst, nullptr, (const float *)src1->data, src1->nb[1] / sizeof(float));
        deltaspec_invariant_count(kInvariantMmaProducts);
        return true;
    }
    const bool quantized = ggml_is_quantized(src0->type);
    const bool plain_float = src0->type == GGML_TYPE_F32 || src0->type == GGML_TYPE_F16 || src0->type == GGML_TYPE_BF16;
    if (!(quantized || plain_float) || src1->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32) return false;
    if (plain_float) {
        const int cc = ggml_cuda_info().devices[ctx.device].cc;
        if (!ggml_cuda_should_use_mmvf(src0->type, cc, src0->ne, src0->nb, 1)) return false;
    }
    for (int64_t c = 0; c < n; ++c) {
        const ggml_tensor x = column_view(src1, c, 1);
        ggml_tensor y = column_view(dst, c, 1);
        if (quantized) {
            ggml_cuda_mul_mat_vec_q(ctx, src0, &x, nullptr, &y, nullptr);
        } else {
            ggml_cuda_mul_mat_vec_f(ctx, src0, &x, nullptr, &y, nullptr);
        }
    }
    deltaspec_invariant_count(kInvariantColumnProducts);
    return true;
}

// A product ggml hands over (fused or not) on a batch-invariant context. What ggml fuses into a
// one-column product (ffn up / gate with their SwiGLU; a following ADD) runs as its separate
// nodes would: the products into their own nodes, then ggml's SwiGLU or add kernel, so that one
// column ends with the bits many columns get. False: not a case this route takes.
bool invariant_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                       const ggml_tensor * ids, ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion) {
    if (ids != nullptr) return false;
    if (fusion == nullptr) return invariant_product(ctx, src0, src1, dst);
    if (fusion->x_scale != nullptr || fusion->gate_scale != nullptr || fusion->gate_bias != nullptr) return false;
    if (fusion->gate != nullptr) {
        if (fusion->x_bias != nullptr || dst->op != GGML_OP_GLU || ggml_get_glu_op(dst) != GGML_GLU_OP_SWIGLU) {
            return false;
        }
        for (ggml_tensor * product : {dst->src[0], dst->src[1]}) {
            if (product == nullptr || product->op != GGML_OP_MUL_MAT ||
                !invariant_product(ctx, product->src[0], product->src[1], product)) {
                return false;  // ggml's fused kernel then writes dst itself
            }
        }
        ggml_cuda_op_swiglu(ctx, dst);
        return true;
    }
    if (fusion->x_bias == nullptr || dst->op != GGML_OP_ADD) return false;
    ggml_tensor * product = dst->src[0] != fusion->x_bias ? dst->src[0] : dst->src[1];
    if (product->op != GGML_OP_MUL_MAT || product->src[0] != src0 || product->src[1] != src1 ||
        !invariant_product(ctx, src0, src1, product)) {
        return false;
    }
    ggml_cuda_op_add(ctx, dst);
    return true;
}

// On a batch-invariant context: true if the invariant route computed the product; a product it
// cannot take is counted (kInvariantMisses) and left to ggml.
bool ran_invariant(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                   const ggml_tensor * ids, ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion) {
    if (!deltaspec_cuda_invariant(ctx)) return false;
    if (invariant_mul_mat(ctx, src0, src1, ids, dst, fusion)) return true;
    deltaspec_invariant_count(kInvariantMisses);
    return false;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) bool deltaspec_cuda_fold_input(ggml_tensor * input,
                                                                                 const ggml_tensor * const * weights,
                                                                                 int n_weights) {
    const int64_t n = input->ne[1];
    if (input->op == GGML_OP_ADD) return fuse_add(input, weights, n_weights);
    const bool norm = input->op == GGML_OP_MUL && input->src[0]->op == GGML_OP_RMS_NORM;
    if (!g_deltaspec_kernels || !(norm || plain_swiglu(input)) || n < 1 || n > g_mma_max_columns || n_weights < 1) {
        return false;
    }
    if (!norm && n == 1) return false;  // the mat-vecs take no SwiGLU of their own (ggml fuses ffn up/gate)
    if (norm && n > 1 && input->ne[0] > deltaspec_cuda::kMmaNormMaxK) return false;
    for (int i = 0; i < n_weights; ++i) {
        const bool served = n == 1 ? serves_one_column(weights[i]) : serves_columns(weights[i]);
        if (!served || weights[i]->ne[0] != input->ne[0]) {
            return false;
        }
    }
    ggml_set_name(input, norm ? kFoldedNormName : kFoldedGluName);
    return true;
}

// Marks two products of one input (2..32 columns), `second` the graph's node right after `first`,
// as a pair when our tensor-core kernels serve both matrices: `first` then computes both from one
// quantization of x (run_pair). The engine has put them next to each other, so that nothing reads
// or reuses second's output memory in between.
extern "C" __attribute__((visibility("default"))) bool deltaspec_cuda_pair_products(ggml_tensor * first,
                                                                                   ggml_tensor * second) {
    if (!g_deltaspec_kernels || first == nullptr || second == nullptr || first == second) return false;
    if (first->op != GGML_OP_MUL_MAT || second->op != GGML_OP_MUL_MAT || first->src[1] != second->src[1]) return false;
    const int64_t n = first->ne[1];
    if (n < 2 || n > std::min<int64_t>(g_mma_max_columns, kLaunchColumns)) return false;
    for (const ggml_tensor * p : {first, second}) {
        // a marked product (a fused ADD's, another pair's) keeps its mark
        if (!serves_columns(p->src[0]) || std::strncmp(p->name, "deltaspec.", 10) == 0) return false;
    }
    mark_product(first, kPairFirstName, kPairPointerOffset, second);
    ggml_set_name(second, kPairSecondName);
    set_pair_done(second, 0);
    return true;
}

void deltaspec_rms_norm_fused(ggml_backend_cuda_context & ctx, ggml_tensor * dst, ggml_tensor * mul_tensor) {
    if (folded_norm(mul_tensor)) return;  // the products reading it apply the norm themselves
    ggml_cuda_op_rms_norm_fused(ctx, dst, mul_tensor);
}

void deltaspec_op_swiglu(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (folded_glu(dst)) return;  // the products reading it apply the SwiGLU themselves
    ggml_cuda_op_swiglu(ctx, dst);
}

void deltaspec_op_add(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (fused_add(dst)) return;  // its product wrote the sum (or ran it, see run_ours)
    ggml_cuda_op_add(ctx, dst);
}

void deltaspec_mul_mat_vec_q(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                             const ggml_tensor * ids, ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion) {
    if (ran_invariant(ctx, src0, src1, ids, dst, fusion)) return;
    if (computed_with_first(dst, fusion)) return;  // its pair's first product wrote it
    ggml_tensor * add = add_of(dst);  // (a product ggml fuses itself has the fused op as dst: none)
    if (run_ours(pick(src0, src1, ids, dst, fusion), ctx, src0, src1, dst, fusion, add)) return;
    ggml_cuda_mul_mat_vec_q(ctx, src0, src1, ids, dst, fusion);
    if (add != nullptr) ggml_cuda_op_add(ctx, add);
}

void deltaspec_mul_mat_q(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                         const ggml_tensor * ids, ggml_tensor * dst) {
    if (ran_invariant(ctx, src0, src1, ids, dst, nullptr)) return;
    if (computed_with_first(dst, nullptr)) return;  // its pair's first product wrote it
    ggml_tensor * add = add_of(dst);
    if (run_ours(pick(src0, src1, ids, dst, nullptr), ctx, src0, src1, dst, nullptr, add)) return;
    ggml_cuda_mul_mat_q(ctx, src0, src1, ids, dst);
    if (add != nullptr) ggml_cuda_op_add(ctx, add);
}

// ggml-cuda.cu's choice of its mat-vec for F32 / F16 / BF16 weights (renamed to this, inject.cmake).
// While a backend is batch-invariant it is asked for every width the matrix takes (the choice is
// made without the context, so for every backend of the process), and deltaspec_mul_mat_vec_f
// then computes a registered backend's columns one at a time and another's 8 at a time.
bool deltaspec_should_use_mmvf(enum ggml_type type, int cc, const int64_t * src0_ne, const size_t * src0_nb,
                               int64_t ne11) {
    return ggml_cuda_should_use_mmvf(type, cc, src0_ne, src0_nb, deltaspec_cuda_any_invariant() ? 1 : ne11);
}

void deltaspec_mul_mat_vec_f(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                             const ggml_tensor * ids, ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion) {
    if (ran_invariant(ctx, src0, src1, ids, dst, fusion)) return;
    if (ids == nullptr && fusion == nullptr && src1->ne[1] > MMVF_MAX_BATCH_SIZE) {
        for (int64_t c0 = 0; c0 < src1->ne[1]; c0 += MMVF_MAX_BATCH_SIZE) {
            const int64_t m = std::min<int64_t>(MMVF_MAX_BATCH_SIZE, src1->ne[1] - c0);
            const ggml_tensor x = column_view(src1, c0, m);
            ggml_tensor y = column_view(dst, c0, m);
            ggml_cuda_mul_mat_vec_f(ctx, src0, &x, nullptr, &y, nullptr);
        }
        return;
    }
    ggml_cuda_mul_mat_vec_f(ctx, src0, src1, ids, dst, fusion);
}
