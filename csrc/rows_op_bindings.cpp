// Test-only bindings: one ggml op at a time on numpy arrays, on the CPU or CUDA backend, for the rows
// ops (ggml/deltaspec_rows.h) and the ggml ops they must agree with (tests/test_rows_op.py,
// tests/test_gpu_rows_op.py, bench/rows_op_bench.py), and a weight product's columns in one batch
// against each alone (bench/invariance_probe.py --products). Arrays are in numpy order, the reverse of
// ggml's: a ggml tensor [S, H, R, 1] is a numpy array (R, H, S).
#include "rows_op_bindings.h"

#include <pybind11/numpy.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_kernels.h"
#include "deltaspec_rows.h"
#include "ggml_type_by_name.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace py = pybind11;

namespace deltaspec {

namespace {

using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// One graph on one backend: tensors made from arrays, computed, read back. Owns everything.
class OneGraph {
  public:
    OneGraph(const std::string & device, int n_threads) {
        const bool cuda = device == "cuda";
        if (!cuda && device != "cpu") {
            throw std::invalid_argument("device must be 'cpu' or 'cuda', got '" + device + "'");
        }
        ggml_backend_dev_t dev =
            ggml_backend_dev_by_type(cuda ? GGML_BACKEND_DEVICE_TYPE_GPU : GGML_BACKEND_DEVICE_TYPE_CPU);
        if (dev == nullptr) throw std::runtime_error("device '" + device + "' is not available in this build");
        if (cuda) enable_cuda_kernels();
        backend_ = ggml_backend_dev_init(dev, nullptr);
        if (backend_ == nullptr) throw std::runtime_error("cannot initialise device '" + device + "'");
        if (!cuda) ggml_backend_cpu_set_n_threads(backend_, n_threads);
        ggml_init_params params = {1024 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true};
        ctx_ = ggml_init(params);
        gf_ = ggml_new_graph(ctx_);
    }
    ~OneGraph() {
        if (buffer_) ggml_backend_buffer_free(buffer_);
        ggml_free(ctx_);
        ggml_backend_free(backend_);
    }
    OneGraph(const OneGraph &) = delete;
    OneGraph & operator=(const OneGraph &) = delete;

    ggml_context * ctx() { return ctx_; }
    ggml_backend_t backend() { return backend_; }

    // a tensor of `type` and shape ne0 x ne1 (ggml order) holding `bytes` (kept alive by the caller)
    ggml_tensor * input_bytes(const void * bytes, ggml_type type, int64_t ne0, int64_t ne1) {
        ggml_tensor * t = ggml_new_tensor_2d(ctx_, type, ne0, ne1);
        raw_inputs_.push_back({t, bytes});
        return t;
    }

    // a tensor of the array's shape (reversed), filled once the graph is allocated
    ggml_tensor * input(const py::array & a, ggml_type type) {
        if (a.ndim() < 1 || a.ndim() > 4) throw std::invalid_argument("arrays must have 1 to 4 dimensions");
        int64_t ne[4] = {1, 1, 1, 1};
        for (py::ssize_t i = 0; i < a.ndim(); ++i) ne[i] = a.shape(a.ndim() - 1 - i);
        ggml_tensor * t = ggml_new_tensor(ctx_, type, 4, ne);
        inputs_.push_back({t, a});
        return t;
    }

    // computes `outs` (and whatever they need), repeat + 1 times; returns seconds per repeat (0 without)
    double compute(const std::vector<ggml_tensor *> & outs, int repeat) {
        for (ggml_tensor * out : outs) ggml_build_forward_expand(gf_, out);
        buffer_ = ggml_backend_alloc_ctx_tensors(ctx_, backend_);
        if (buffer_ == nullptr) throw std::runtime_error("cannot allocate the op's tensors");
        py::gil_scoped_release release;  // the arrays' memory stays: inputs_ holds them
        for (auto & [t, a] : inputs_) ggml_backend_tensor_set(t, a.data(), 0, ggml_nbytes(t));
        for (auto & [t, bytes] : raw_inputs_) ggml_backend_tensor_set(t, bytes, 0, ggml_nbytes(t));
        if (ggml_backend_graph_compute(backend_, gf_) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("computing the op failed");
        }
        ggml_backend_synchronize(backend_);
        if (repeat <= 0) return 0.0;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < repeat; ++i) ggml_backend_graph_compute(backend_, gf_);
        ggml_backend_synchronize(backend_);
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / repeat;
    }

    // floats of t from byte `offset`, as a numpy array of `shape`
    F32 read(const ggml_tensor * t, std::vector<py::ssize_t> shape, size_t offset = 0) {
        F32 out(shape);
        ggml_backend_tensor_get(t, out.mutable_data(), offset, out.size() * sizeof(float));
        return out;
    }

  private:
    ggml_backend_t backend_ = nullptr;
    ggml_context * ctx_ = nullptr;
    ggml_cgraph * gf_ = nullptr;
    ggml_backend_buffer_t buffer_ = nullptr;
    std::vector<std::pair<ggml_tensor *, py::array>> inputs_;
    std::vector<std::pair<ggml_tensor *, const void *>> raw_inputs_;
};

void require_cpu_side() {
    if (!deltaspec_rows_cpu_available()) {
        throw std::runtime_error("this ggml-cpu lacks deltaspec's rows ops (built without ggml/cpu/inject.cmake)");
    }
}

// The test-only planted bug "lenient": every check below is skipped and nothing computes, which the
// bad-input tests must notice (they see no exception).
bool lenient() {
    static const char * const bug = std::getenv("DELTASPEC_TEST_ROWS_BUG");
    return bug != nullptr && std::strcmp(bug, "lenient") == 0;
}

// copies: that many nodes of the op over the same inputs in one graph (a benchmark's, so that one
// launch of the graph times many kernels); they must not write the pool back, or they would race.
void check_copies(int copies, const I32 & flags) {
    if (copies < 1 || copies > 512) throw std::invalid_argument("copies must be 1..512");
    for (py::ssize_t i = 0; copies > 1 && i < flags.size(); ++i) {
        if (flags.data()[i] & DELTASPEC_ROW_WRITE_BACK) throw std::invalid_argument("copies > 1 with a write-back row");
    }
}

// The rows tensor's data for parent/slot/flags (R values each), to be filled by plan(): room for R
// walk positions, or 2 R where the plan may split a walk (deltaspec_rows.h).
I32 rows_array(const I32 & parent, const I32 & slot, const I32 & flags, bool split = false) {
    const py::ssize_t R = parent.size();
    if (parent.ndim() != 1 || slot.size() != R || flags.size() != R || R < 1) {
        throw std::invalid_argument("parent, slot and flags must hold one value per row (at least one row), got " +
                                    std::to_string(R) + " parents, " + std::to_string(slot.size()) + " slots and " +
                                    std::to_string(flags.size()) + " flags");
    }
    return I32({split ? 2 * R : R, (py::ssize_t)DELTASPEC_ROWS_N_COLS});
}

// deltaspec_rows_plan into rows (from rows_array); returns the saved count.
int64_t plan(const I32 & parent, const I32 & slot, const I32 & flags, int64_t n_slots, I32 & rows) {
    char err[512];
    const int64_t n_saved = deltaspec_rows_plan(parent.size(), parent.data(), slot.data(), flags.data(), n_slots,
                                                rows.shape(0), rows.mutable_data(), err, sizeof(err));
    if (n_saved < 0) throw std::invalid_argument(std::string("rows: ") + err);
    return n_saved;
}

py::object rows_plan_py(const I32 & parent, const I32 & slot, const I32 & flags, int64_t n_slots, bool split) {
    if (lenient()) return py::none();
    I32 rows = rows_array(parent, slot, flags, split);
    const int64_t n_saved = plan(parent, slot, flags, n_slots, rows);
    return py::make_tuple(rows, n_saved);
}

py::object rows_gated_delta_net_py(const std::string & device, const F32 & q, const F32 & k, const F32 & v,
                                   const F32 & g, const F32 & beta, const F32 & pool, const I32 & parent,
                                   const I32 & slot, const I32 & flags, int64_t n_saved, int n_threads, int repeat,
                                   int copies, bool split, int64_t max_walks) {
    if (lenient()) return py::none();
    check_copies(copies, flags);
    require_cpu_side();
    OneGraph graph(device, n_threads);
    ggml_tensor *tq = graph.input(q, GGML_TYPE_F32), *tk = graph.input(k, GGML_TYPE_F32),
                *tv = graph.input(v, GGML_TYPE_F32), *tg = graph.input(g, GGML_TYPE_F32),
                *tb = graph.input(beta, GGML_TYPE_F32), *tp = graph.input(pool, GGML_TYPE_F32);
    I32 rows_data = rows_array(parent, slot, flags, split);
    ggml_tensor * trows = graph.input(rows_data, GGML_TYPE_I32);
    char err[512];
    if (!deltaspec_rows_gated_delta_net_check(tq, tk, tv, tg, tb, tp, trows, n_saved < 0 ? 0 : n_saved, err,
                                              sizeof(err))) {
        throw std::invalid_argument(std::string("rows_gated_delta_net: ") + err);
    }
    const int64_t n_slots = tp->ne[3];
    const int64_t needed = plan(parent, slot, flags, n_slots, rows_data);
    if (n_saved < 0) n_saved = needed;
    if (n_saved < needed) {
        throw std::invalid_argument("n_saved " + std::to_string(n_saved) + " is less than the " +
                                    std::to_string(needed) + " saved states these rows need");
    }
    std::vector<ggml_tensor *> outs;
    for (int i = 0; i < copies; ++i) {
        outs.push_back(deltaspec_rows_gated_delta_net(graph.ctx(), tq, tk, tv, tg, tb, tp, trows, n_saved));
        if (max_walks > 0) deltaspec_rows_set_max_walks(outs.back(), max_walks);
    }
    ggml_tensor * out = outs[0];
    // the pool is a source the op writes: read it back after the compute
    const double seconds = graph.compute(outs, repeat);
    const py::ssize_t S = tv->ne[0], H = tv->ne[1], R = tv->ne[2];
    py::dict res;
    res["y"] = graph.read(out, {R, H, S});
    res["saved"] = graph.read(out, {(py::ssize_t)n_saved, H, S, S}, R * H * S * sizeof(float));
    res["pool"] = graph.read(tp, {(py::ssize_t)n_slots, H, S, S});
    res["n_saved"] = needed;
    res["rows"] = rows_data;
    res["seconds"] = seconds;
    return res;
}

py::object gated_delta_net_py(const std::string & device, const F32 & q, const F32 & k, const F32 & v, const F32 & g,
                              const F32 & beta, const F32 & state, int n_threads, int repeat, int copies) {
    check_copies(copies, I32(0));
    OneGraph graph(device, n_threads);
    ggml_tensor *tq = graph.input(q, GGML_TYPE_F32), *tk = graph.input(k, GGML_TYPE_F32),
                *tv = graph.input(v, GGML_TYPE_F32), *tg = graph.input(g, GGML_TYPE_F32),
                *tb = graph.input(beta, GGML_TYPE_F32), *ts = graph.input(state, GGML_TYPE_F32);
    const py::ssize_t S = tv->ne[0], H = tv->ne[1], T = tv->ne[2];
    if (tq->ne[0] != S || tk->ne[0] != S || tq->ne[2] != T || ts->ne[0] != S || ts->ne[1] != S || ts->ne[2] != H ||
        tg->ne[0] != 1 || tg->ne[1] != H || tg->ne[2] != T || tb->ne[1] != H || tb->ne[2] != T || H % tq->ne[1] != 0) {
        throw std::invalid_argument("gated_delta_net: shapes must be q, k (T, H_k, S), v (T, H, S), g, beta (T, H, 1), "
                                    "state (1, H, S, S)");
    }
    std::vector<ggml_tensor *> outs;
    for (int i = 0; i < copies; ++i) outs.push_back(ggml_gated_delta_net(graph.ctx(), tq, tk, tv, tg, tb, ts, 1));
    ggml_tensor * out = outs[0];
    const double seconds = graph.compute(outs, repeat);
    py::dict res;
    res["y"] = graph.read(out, {T, H, S});
    res["state"] = graph.read(out, {H, S, S}, T * H * S * sizeof(float));
    res["seconds"] = seconds;
    return res;
}

py::object rows_ssm_conv_py(const std::string & device, const F32 & pool, const F32 & x, const F32 & c,
                            const I32 & parent, const I32 & slot, const I32 & flags, bool silu, int n_threads,
                            int repeat) {
    if (lenient()) return py::none();
    require_cpu_side();
    OneGraph graph(device, n_threads);
    ggml_tensor *tp = graph.input(pool, GGML_TYPE_F32), *tx = graph.input(x, GGML_TYPE_F32),
                *tc = graph.input(c, GGML_TYPE_F32);
    I32 rows_data = rows_array(parent, slot, flags);
    ggml_tensor * trows = graph.input(rows_data, GGML_TYPE_I32);
    char err[512];
    if (!deltaspec_rows_ssm_conv_check(tp, tx, tc, trows, err, sizeof(err))) {
        throw std::invalid_argument(std::string("rows_ssm_conv: ") + err);
    }
    const int64_t n_slots = tp->ne[2];
    plan(parent, slot, flags, n_slots, rows_data);
    ggml_tensor * out = deltaspec_rows_ssm_conv(graph.ctx(), tp, tx, tc, trows);
    if (silu) out = ggml_silu(graph.ctx(), out);  // ggml-cuda fuses it into the conv node
    const double seconds = graph.compute({out}, repeat);
    py::dict res;
    res["y"] = graph.read(out, {(py::ssize_t)tx->ne[1], (py::ssize_t)tc->ne[1]});
    res["pool"] = graph.read(tp, {(py::ssize_t)n_slots, (py::ssize_t)tc->ne[1], (py::ssize_t)tc->ne[0] - 1});
    res["seconds"] = seconds;
    return res;
}

py::object ssm_conv_py(const std::string & device, const F32 & sx, const F32 & c, bool silu, int n_threads) {
    OneGraph graph(device, n_threads);
    ggml_tensor *tsx = graph.input(sx, GGML_TYPE_F32), *tc = graph.input(c, GGML_TYPE_F32);
    if (tc->ne[2] != 1 || tsx->ne[1] != tc->ne[1] || tsx->ne[0] < tc->ne[0] || tsx->ne[3] != 1) {
        throw std::invalid_argument("ssm_conv: shapes must be sx (n_s, C, Kc-1+T), c (C, Kc)");
    }
    ggml_tensor * out = ggml_ssm_conv(graph.ctx(), tsx, tc);
    if (silu) out = ggml_silu(graph.ctx(), out);
    graph.compute({out}, 0);
    return graph.read(out, {(py::ssize_t)out->ne[2], (py::ssize_t)out->ne[1], (py::ssize_t)out->ne[0]});
}

// y = W x for the columns of x (N, K) all in one product and each in a product of its own (one graph
// each), W (rows, K) quantized to `type` by ggml_quantize_chunk. batch_invariant: the backend as
// Model(batch_invariant=True) registers it (CUDA: our invariant routes; the CPU: ggml-cpu's reference
// paths). Returns {batch: (N, rows), alone: (N, rows)}; with head_rows (1 .. rows - 1) also
// head: (N, head_rows), the columns in one product of W's first head_rows rows alone, as a stacked
// matrix's part is in a graph that multiplies it on its own.
py::dict matmul_columns_py(const std::string & device, const F32 & w, const std::string & type_name, const F32 & x,
                           bool batch_invariant, int64_t head_rows) {
    const ggml_type type = ggml_type_by_name(type_name);
    if (type == GGML_TYPE_COUNT) throw std::invalid_argument("matmul_columns: no ggml type named '" + type_name + "'");
    if (w.ndim() != 2 || x.ndim() != 2 || x.shape(1) != w.shape(1) || x.shape(0) < 1) {
        throw std::invalid_argument("matmul_columns: w must be (rows, K) and x (N >= 1, K)");
    }
    const int64_t rows = w.shape(0), K = w.shape(1), N = x.shape(0);
    if (head_rows < 0 || head_rows >= rows) {
        throw std::invalid_argument("matmul_columns: head_rows = " + std::to_string(head_rows) + " must be 0 (none) or 1 .. " +
                                    std::to_string(rows - 1));
    }
    if (K % ggml_blck_size(type) != 0) {
        throw std::invalid_argument("matmul_columns: K = " + std::to_string(K) + " is not a multiple of " + type_name +
                                    "'s block of " + std::to_string(ggml_blck_size(type)));
    }
    std::vector<uint8_t> q(ggml_row_size(type, K) * rows);
    ggml_quantize_chunk(type, w.data(), q.data(), 0, rows, K, nullptr);
    // a CUDA backend's batch-invariant registration, released before the backend goes
    struct Registration {
        ggml_backend_t backend = nullptr;
        ~Registration() {
            if (backend != nullptr) cuda_set_batch_invariant(backend, false);
        }
    };
    auto product = [&](int64_t first, int64_t n, int64_t w_rows) {
        OneGraph graph(device, 1);
        Registration registered;
        if (batch_invariant && device == "cuda") {
            if (!cuda_set_batch_invariant(graph.backend(), true)) {
                throw std::runtime_error("matmul_columns: this CUDA build has no batch-invariant mode");
            }
            registered.backend = graph.backend();
        } else if (batch_invariant) {
            ggml_backend_cpu_set_use_ref(graph.backend(), true);
        }
        F32 cols(std::vector<py::ssize_t>{(py::ssize_t)n, (py::ssize_t)K});
        std::memcpy(cols.mutable_data(), x.data() + first * K, n * K * sizeof(float));
        ggml_tensor * tw = graph.input_bytes(q.data(), type, K, w_rows);  // rows are stored back to back
        ggml_tensor * y = ggml_mul_mat(graph.ctx(), tw, graph.input(cols, GGML_TYPE_F32));
        graph.compute({y}, 0);
        return graph.read(y, {(py::ssize_t)n, (py::ssize_t)w_rows});
    };
    F32 batch = product(0, N, rows), alone(std::vector<py::ssize_t>{(py::ssize_t)N, (py::ssize_t)rows});
    for (int64_t c = 0; c < N; ++c) {
        F32 one = product(c, 1, rows);
        std::memcpy(alone.mutable_data() + c * rows, one.data(), rows * sizeof(float));
    }
    py::dict res;
    res["batch"] = batch;
    res["alone"] = alone;
    if (head_rows > 0) res["head"] = product(0, N, head_rows);
    return res;
}

}  // namespace

void bind_rows_ops(py::module_ & m) {
    m.def("matmul_columns", &matmul_columns_py, py::arg("device"), py::arg("w"), py::arg("type"), py::arg("x"),
          py::arg("batch_invariant") = false, py::arg("head_rows") = 0,
          "Test-only: W (rows, K) quantized to `type` times the columns of x (N, K), in one product and each alone; "
          "returns {batch, alone}, both (N, rows), and with head_rows {head: (N, head_rows)}, the product of W's "
          "first head_rows rows alone.");
    m.def("rows_plan", &rows_plan_py, py::arg("parent"), py::arg("slot"), py::arg("flags"), py::arg("n_slots"),
          py::arg("split") = false,
          "Test-only: deltaspec_rows_plan; returns (rows (P, DELTASPEC_ROWS_N_COLS) int32, n_saved), P = R, or 2 R "
          "with room to split a walk (split).");
    m.def("rows_gated_delta_net", &rows_gated_delta_net_py, py::arg("device"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("pool"), py::arg("parent"), py::arg("slot"),
          py::arg("flags"), py::arg("n_saved") = -1, py::arg("n_threads") = 1, py::arg("repeat") = 0,
          py::arg("copies") = 1, py::arg("split") = false, py::arg("max_walks") = 0,
          "Test-only: the rows recurrence on numpy arrays q, k (R, H_k, S), v (R, H, S), g, beta (R, H, 1), pool "
          "(n_slots, H, S, S); returns {y, saved, pool (after), n_saved, rows, seconds}.");
    m.def("gated_delta_net", &gated_delta_net_py, py::arg("device"), py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("g"), py::arg("beta"), py::arg("state"), py::arg("n_threads") = 1, py::arg("repeat") = 0,
          py::arg("copies") = 1,
          "Test-only: ggml_gated_delta_net over one sequence; returns {y (T, H, S), state (H, S, S), seconds}.");
    m.def("rows_ssm_conv", &rows_ssm_conv_py, py::arg("device"), py::arg("pool"), py::arg("x"), py::arg("c"),
          py::arg("parent"), py::arg("slot"), py::arg("flags"), py::arg("silu") = false, py::arg("n_threads") = 1,
          py::arg("repeat") = 0,
          "Test-only: the rows conv on pool (n_slots, C, Kc-1), x (R, C), c (C, Kc); "
          "returns {y (R, C), pool, seconds}.");
    m.def("ssm_conv", &ssm_conv_py, py::arg("device"), py::arg("sx"), py::arg("c"), py::arg("silu") = false,
          py::arg("n_threads") = 1,
          "Test-only: ggml_ssm_conv on sx (n_s, C, Kc-1+T), c (C, Kc); returns y (n_s, T, C).");
}

}  // namespace deltaspec
