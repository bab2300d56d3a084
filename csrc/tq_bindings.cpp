// Test-only bindings of the tq KV cache types (ggml/deltaspec_tq.h): the host reference codec, and
// the two graph nodes (quantize-on-write, attention) run on the CPU or CUDA backend on numpy arrays
// (tests/test_turboquant.py, tests/test_gpu_turboquant.py, bench/kv_quality.py). Arrays are in numpy
// order, the reverse of ggml's.
#include "tq_bindings.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_kernels.h"
#include "deltaspec_tq.h"
#include "ggml_type_by_name.h"
#include "tq_warp_emulation.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace py = pybind11;

// Defined by ggml/cuda/deltaspec_tq.cu inside ggml-cuda; weak, so that a CPU-only build links too.
extern "C" int64_t deltaspec_cuda_tq_decode_launches(int kernel) __attribute__((weak));

namespace deltaspec {

namespace {

using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;
using U8 = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

void check_bits(int bits) {
    if (bits != 3 && bits != 4) throw std::invalid_argument("bits must be 3 (tq3) or 4 (tq4), got " + std::to_string(bits));
}

int64_t head_dim_of(const py::array & x) {
    const int64_t D = x.shape(x.ndim() - 1);
    if (!deltaspec_tq_head_dim_ok(D)) {
        throw std::invalid_argument("the last axis (head dim) must be 32, 64, 128 or 256, got " + std::to_string(D));
    }
    return D;
}

// One graph on one backend whose inputs are filled from arrays after allocation.
class TqGraph {
  public:
    TqGraph(const std::string & device, int n_threads) {
        const bool cuda = device == "cuda";
        if (!cuda && device != "cpu") throw std::invalid_argument("device must be 'cpu' or 'cuda', got '" + device + "'");
        ggml_backend_dev_t dev = ggml_backend_dev_by_type(cuda ? GGML_BACKEND_DEVICE_TYPE_GPU : GGML_BACKEND_DEVICE_TYPE_CPU);
        if (dev == nullptr) throw std::runtime_error("device '" + device + "' is not available in this build");
        if (cuda) enable_cuda_kernels();
        backend_ = ggml_backend_dev_init(dev, nullptr);
        if (backend_ == nullptr) throw std::runtime_error("cannot initialise device '" + device + "'");
        if (!cuda) ggml_backend_cpu_set_n_threads(backend_, n_threads);
        ggml_init_params params = {64 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true};
        ctx_ = ggml_init(params);
        gf_ = ggml_new_graph(ctx_);
    }
    ~TqGraph() {
        if (buffer_) ggml_backend_buffer_free(buffer_);
        ggml_free(ctx_);
        ggml_backend_free(backend_);
    }
    TqGraph(const TqGraph &) = delete;
    TqGraph & operator=(const TqGraph &) = delete;

    ggml_context * ctx() { return ctx_; }
    // t is filled from `bytes` bytes at `data` once allocated (zeros when data is null)
    void fill(ggml_tensor * t, const void * data) { fills_.push_back({t, data}); }
    void expand(ggml_tensor * t) { ggml_build_forward_expand(gf_, t); }

    void compute() {
        buffer_ = ggml_backend_alloc_ctx_tensors(ctx_, backend_);
        if (buffer_ == nullptr) throw std::runtime_error("cannot allocate the graph's tensors");
        ggml_backend_buffer_clear(buffer_, 0);
        for (auto & [t, data] : fills_) {
            if (data) ggml_backend_tensor_set(t, data, 0, ggml_nbytes(t));
        }
        if (ggml_backend_graph_compute(backend_, gf_) != GGML_STATUS_SUCCESS) throw std::runtime_error("compute failed");
        ggml_backend_synchronize(backend_);
    }

  private:
    ggml_backend_t backend_ = nullptr;
    ggml_context * ctx_ = nullptr;
    ggml_cgraph * gf_ = nullptr;
    ggml_backend_buffer_t buffer_ = nullptr;
    std::vector<std::pair<ggml_tensor *, const void *>> fills_;
};

// x (n, D) -> (n, head bytes) by the host codec
U8 quantize_host(int bits, const F32 & x) {
    check_bits(bits);
    const int64_t D = head_dim_of(x), n = x.size() / D;
    const py::ssize_t hb = (py::ssize_t)deltaspec_tq_head_bytes(bits, D);
    U8 out({(py::ssize_t)n, hb});
    deltaspec_tq_quantize(bits, D, n, x.data(), out.mutable_data());
    return out;
}

F32 dequantize_host(int bits, const U8 & q, int64_t D) {
    check_bits(bits);
    if (!deltaspec_tq_head_dim_ok(D)) throw std::invalid_argument("head_dim must be 32, 64, 128 or 256");
    const py::ssize_t hb = (py::ssize_t)deltaspec_tq_head_bytes(bits, D);
    if (q.ndim() != 2 || q.shape(1) != hb) throw std::invalid_argument("q must be (n, " + std::to_string(hb) + ") bytes");
    F32 out({q.shape(0), (py::ssize_t)D});
    deltaspec_tq_dequantize_rotated(bits, D, q.shape(0), q.data(), out.mutable_data());
    return out;
}

F32 rotate_host(const F32 & x, bool inverse) {
    const int64_t D = head_dim_of(x);
    F32 out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
    std::copy(x.data(), x.data() + x.size(), out.mutable_data());
    deltaspec_tq_rotate(D, x.size() / D, out.mutable_data(), inverse);
    return out;
}

// x (n, D) -> (n, head bytes) by the CUDA quantizer kernel's source run on the host
U8 quantize_cuda_source(int bits, const F32 & x) {
    check_bits(bits);
    const int64_t D = head_dim_of(x), n = x.size() / D;
    U8 out({(py::ssize_t)n, (py::ssize_t)deltaspec_tq_head_bytes(bits, D)});
    tq_cuda_source_quantize(bits, D, n, x.data(), out.mutable_data());
    return out;
}

F32 rotate_cuda_source(const F32 & x, bool inverse) {
    const int64_t D = head_dim_of(x);
    F32 out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
    tq_cuda_source_rotate(D, x.size() / D, x.data(), out.mutable_data(), inverse);
    return out;
}

// The quantize-on-write node on a backend: x (T, H, D) into rows idx of a cache of n_rows rows;
// returns the cache's bytes (n_rows, H * head bytes).
U8 set_rows_node(const std::string & device, int bits, const F32 & x, const py::array_t<int64_t> & idx, int64_t n_rows,
                 int n_threads) {
    check_bits(bits);
    if (x.ndim() != 3 || idx.ndim() != 1 || idx.shape(0) != x.shape(0)) {
        throw std::invalid_argument("x must be (T, H, D) and idx (T,)");
    }
    const int64_t T = x.shape(0), H = x.shape(1), D = head_dim_of(x);
    for (py::ssize_t i = 0; i < idx.size(); ++i) {
        if (idx.data()[i] < 0 || idx.data()[i] >= n_rows) throw std::invalid_argument("idx out of range");
    }
    TqGraph g(device, n_threads);
    ggml_tensor * cache = deltaspec_tq_new_cache(g.ctx(), bits, D, H, n_rows);
    ggml_tensor * xt = ggml_new_tensor_2d(g.ctx(), GGML_TYPE_F32, H * D, T);
    ggml_tensor * it = ggml_new_tensor_1d(g.ctx(), GGML_TYPE_I64, T);
    g.fill(cache, nullptr);
    g.fill(xt, x.data());
    g.fill(it, idx.data());
    g.expand(deltaspec_kv_set_rows(g.ctx(), cache, xt, it));
    g.compute();
    U8 out({(py::ssize_t)n_rows, (py::ssize_t)ggml_row_size(cache->type, cache->ne[0])});
    ggml_backend_tensor_get(cache, out.mutable_data(), 0, ggml_nbytes(cache));
    return out;
}

// Attention through the caches: k and v (n_kv, H_kv, D) are written into caches of type_k / type_v
// ("tq3", "tq4" or a ggml type name such as "f16") by the engine's write nodes, then attended by the
// engine's attention node with q (T, H, D) and mask (T, n_kv) (0 or -inf). Returns (T, H, D).
// "q4_0+rot" etc.: a rotated cache of that ggml type. With a leading stream axis (q (N, T, H, D), k
// and v (N, n_kv, H_kv, D), mask (N, T, n_kv)): N streams in one node, each over its own cache rows,
// as the engine's slots; returns (N, T, H, D).
F32 attention_node(const std::string & device, const F32 & q, const F32 & k, const F32 & v, const F32 & mask,
                   const std::string & type_k, const std::string & type_v, float scale, int n_threads) {
    const int s = q.ndim() == 4 ? 1 : 0;  // the stream axis, if any
    if (q.ndim() != 3 + s || k.ndim() != 3 + s || v.ndim() != 3 + s || mask.ndim() != 2 + s) {
        throw std::invalid_argument("q (T, H, D), k and v (n_kv, H_kv, D), mask (T, n_kv), each with or without a "
                                    "leading stream axis N");
    }
    const int64_t N = s ? q.shape(0) : 1;
    const int64_t T = q.shape(s), H = q.shape(s + 1), D = head_dim_of(q), n_kv = k.shape(s), Hkv = k.shape(s + 1);
    if (v.shape(s) != n_kv || v.shape(s + 1) != Hkv || k.shape(s + 2) != D || v.shape(s + 2) != D || H % Hkv != 0 ||
        mask.shape(s) != T || mask.shape(s + 1) != n_kv || n_kv < 1 ||
        (s && (k.shape(0) != N || v.shape(0) != N || mask.shape(0) != N))) {
        throw std::invalid_argument("shapes disagree (H must be a multiple of H_kv, N and n_kv the same for all)");
    }
    TqGraph g(device, n_threads);
    ggml_context * ctx = g.ctx();
    auto cache_of = [&](const std::string & type) -> ggml_tensor * {
        if (type == "tq3" || type == "tq4") return deltaspec_tq_new_cache(ctx, type == "tq3" ? 3 : 4, D, Hkv, N * n_kv);
        const bool rotated = type.size() > 4 && type.compare(type.size() - 4, 4, "+rot") == 0;
        const std::string name = rotated ? type.substr(0, type.size() - 4) : type;
        const ggml_type t = ggml_type_by_name(name);
        if (t == GGML_TYPE_COUNT) throw std::invalid_argument("unknown cache type '" + type + "'");
        return rotated ? deltaspec_kv_new_rotated_cache(ctx, t, D, Hkv, N * n_kv)
                       : ggml_new_tensor_2d(ctx, t, Hkv * D, N * n_kv);
    };
    ggml_tensor * kc = cache_of(type_k);
    ggml_tensor * vc = cache_of(type_v);
    // stream n's rows are cache rows n * n_kv .. (n + 1) * n_kv - 1
    ggml_tensor * kx = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, Hkv * D, N * n_kv);
    ggml_tensor * vx = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, Hkv * D, N * n_kv);
    ggml_tensor * idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, N * n_kv);
    ggml_tensor * qt = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, H, T, N);
    ggml_tensor * mt = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, T, 1, N);
    std::vector<int64_t> rows(N * n_kv);
    for (int64_t i = 0; i < N * n_kv; ++i) rows[i] = i;
    std::vector<ggml_fp16_t> m16(mask.size());
    for (py::ssize_t i = 0; i < mask.size(); ++i) m16[i] = ggml_fp32_to_fp16(mask.data()[i]);
    for (auto [t, data] : {std::pair<ggml_tensor *, const void *>{kc, nullptr}, {vc, nullptr}, {kx, k.data()},
                           {vx, v.data()}, {idx, rows.data()}, {qt, q.data()}, {mt, m16.data()}}) {
        g.fill(t, data);
    }
    g.expand(deltaspec_kv_set_rows(ctx, kc, kx, idx));
    g.expand(deltaspec_kv_set_rows(ctx, vc, vx, idx));
    auto heads = [&](ggml_tensor * cache) {
        ggml_tensor * view = ggml_view_4d(ctx, cache, deltaspec_kv_head_ne0(cache, D), Hkv, n_kv, N,
                                          deltaspec_kv_head_bytes(cache, D), cache->nb[1], n_kv * cache->nb[1], 0);
        return ggml_permute(ctx, view, 0, 2, 1, 3);
    };
    ggml_tensor * out = deltaspec_kv_flash_attn(ctx, ggml_permute(ctx, qt, 0, 2, 1, 3), heads(kc), heads(vc), mt, scale,
                                                deltaspec_kv_format(kc), deltaspec_kv_format(vc));
    ggml_prec_set_acc(out, GGML_PREC_F32);
    g.expand(out);
    g.compute();
    std::vector<py::ssize_t> shape = {(py::ssize_t)T, (py::ssize_t)H, (py::ssize_t)D};
    if (s) shape.insert(shape.begin(), (py::ssize_t)N);
    F32 result(shape);
    ggml_backend_tensor_get(out, result.mutable_data(), 0, ggml_nbytes(out));
    return result;
}

}  // namespace

void bind_tq(py::module_ & m) {
    m.def("tq_quantize", &quantize_host, py::arg("bits"), py::arg("x"),
          "Host codec: x (n, D) float32 -> (n, head bytes) uint8 of tq3 (bits=3) or tq4 (bits=4).");
    m.def("tq_dequantize_rotated", &dequantize_host, py::arg("bits"), py::arg("q"), py::arg("head_dim"),
          "Host codec: (n, head bytes) -> (n, D) float32 in the rotated domain.");
    m.def("tq_rotate", &rotate_host, py::arg("x"), py::arg("inverse") = false,
          "The tq rotation R = H S / sqrt(D) of each row of x (inverse: R^T).");
    m.def("tq_quantize_cuda_source", &quantize_cuda_source, py::arg("bits"), py::arg("x"),
          "The CUDA quantizer kernel's source (ggml/cuda/deltaspec_tq_warp.cuh) run on the host: x (n, D) "
          "float32 -> (n, head bytes) uint8.");
    m.def("tq_rotate_cuda_source", &rotate_cuda_source, py::arg("x"), py::arg("inverse") = false,
          "The CUDA rotation kernel's source run on the host: each row of x rotated (inverse: back).");
    m.def("tq_cuda_source_stats", [] {
        const EmulationStats s = tq_cuda_source_stats();
        py::dict d;
        d["warps"] = s.warps;
        d["shuffles"] = s.shuffles;
        return d;
    }, "What the host run of the CUDA kernels' source has executed in this process: warps, shuffles.");
    m.def("tq_set_rows", &set_rows_node, py::arg("device"), py::arg("bits"), py::arg("x"), py::arg("idx"),
          py::arg("n_rows"), py::arg("n_threads") = 1,
          "The quantize-on-write node on a backend: x (T, H, D) into rows idx; returns the cache's bytes.");
    m.def("tq_attention", &attention_node, py::arg("device"), py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("mask"), py::arg("type_k"), py::arg("type_v"), py::arg("scale"), py::arg("n_threads") = 1,
          "k, v written into caches of type_k / type_v by the engine's nodes, then attended: (T, H, D); with a "
          "leading stream axis N on q, k, v and mask, N streams in one node: (N, T, H, D).");
    m.def("tq_cuda_decode_launches", [] {
        py::dict d;
        if (deltaspec_cuda_tq_decode_launches == nullptr) return d;
        d["f16"] = deltaspec_cuda_tq_decode_launches(0);
        d["tile"] = deltaspec_cuda_tq_decode_launches(1);
        d["warp"] = deltaspec_cuda_tq_decode_launches(2);
        return d;
    }, "CUDA tq attention steps run in this process (host side) by kernel: 'tile' and 'warp' (the in-place "
       "one-token kernels, DELTASPEC_TQ_DECODE_KERNEL), 'f16' (decoded to F16 for ggml's attention); empty "
       "without ggml/cuda/deltaspec_tq.cu.");
}

}  // namespace deltaspec
