// The rows ops' host side: the plan that checks a batch and tells both backends how to walk it, the
// shape checks, and the graph builders (deltaspec_rows.h). The computing sides live in ggml-cpu
// (ggml/cpu/deltaspec_rows_cpu.cpp) and ggml-cuda (ggml/cuda/deltaspec_rows.cu).
#include "deltaspec_rows.h"

#include <algorithm>
#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// Defined by ggml/cpu/deltaspec_rows_cpu.cpp inside ggml-cpu when it carries it. Weak, so that a
// ggml without it links too (a llama.cpp build's shared ggml, for instance).
extern "C" int deltaspec_rows_cpu_marker(void) __attribute__((weak));

namespace {

bool fail(char * err, size_t err_size, const char * fmt, ...) {
    if (err != nullptr && err_size > 0) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(err, err_size, fmt, args);
        va_end(args);
    }
    return false;
}

// "[a, b, c, d]" of a tensor's shape, for messages
struct Shape {
    char text[96];
    explicit Shape(const ggml_tensor * t) {
        snprintf(text, sizeof(text), "[%lld, %lld, %lld, %lld]", (long long)t->ne[0], (long long)t->ne[1],
                 (long long)t->ne[2], (long long)t->ne[3]);
    }
};

bool has_shape(const ggml_tensor * t, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
    return t->ne[0] == n0 && t->ne[1] == n1 && t->ne[2] == n2 && t->ne[3] == n3;
}

bool check_rows_tensor(const ggml_tensor * rows, int64_t R, char * err, size_t err_size) {
    if (rows->type != GGML_TYPE_I32 || !ggml_is_contiguous(rows) || rows->ne[0] != DELTASPEC_ROWS_N_COLS ||
        rows->ne[1] < R || rows->ne[1] > 2 * R || rows->ne[2] != 1 || rows->ne[3] != 1) {
        return fail(err, err_size, "rows must be a contiguous I32 tensor [%d, R = %lld .. 2 R] (deltaspec_rows_plan's), "
                    "got %s %s", DELTASPEC_ROWS_N_COLS, (long long)R, ggml_type_name(rows->type), Shape(rows).text);
    }
    if (R < 1 || R > DELTASPEC_ROWS_MAX) {
        return fail(err, err_size, "a batch holds 1 to %d rows, got %lld", DELTASPEC_ROWS_MAX, (long long)R);
    }
    return true;
}

bool check_f32(const ggml_tensor * t, const char * name, char * err, size_t err_size) {
    if (t->type != GGML_TYPE_F32) return fail(err, err_size, "%s must be F32, got %s", name, ggml_type_name(t->type));
    return true;
}

void mark_rows_node(ggml_tensor * t, ggml_tensor * rows, int src, int64_t n_saved) {
    t->src[src] = rows;
    t->op_params[0] = 2;  // ggml-cpu's planner: one S + S*S working state per thread (ggml's K > 1 size)
    t->op_params[1] = DELTASPEC_ROWS_MAGIC;
    t->op_params[2] = (int32_t)n_saved;
}

int64_t count_positions(const std::vector<std::vector<int32_t>> & walks) {
    int64_t n = 0;
    for (const auto & w : walks) n += (int64_t)w.size();
    return n;
}

// The split of deltaspec_rows.h ("A SPLIT walk"): the walk it shortens most, if any, becomes its
// deepest root-to-leaf path and, right after it, its other rows with their ancestors (both ascending,
// so every parent comes before its child, and each walk starts at a root). Only where the shared
// ancestors fit the `room` for more positions and the longer of the two is shorter than the walk was.
void split_longest_walk(std::vector<std::vector<int32_t>> & walks, const int32_t * parent,
                        const std::vector<int32_t> & write_back_row, const int32_t * slot, int64_t room,
                        bool bug_no_ancestors) {
    static_assert(DELTASPEC_ROWS_EXTRA_WALKS == 1, "one split per batch");
    size_t best = walks.size();
    int64_t best_gain = 0;
    std::vector<int32_t> best_path, best_rest;
    for (size_t wi = 0; wi < walks.size(); ++wi) {
        const std::vector<int32_t> & w = walks[wi];
        if (w.size() < 3 || write_back_row[slot[w[0]]] >= 0) continue;
        // depth along the walk (parents come first), and the deepest row (the first of that depth)
        std::vector<int32_t> depth(w.size());
        std::vector<int32_t> at(w.back() + 1, -1);  // row -> index in w
        size_t deepest = 0;
        for (size_t i = 0; i < w.size(); ++i) {
            at[w[i]] = (int32_t)i;
            const int32_t p = parent[w[i]];
            depth[i] = p < 0 ? 0 : depth[at[p]] + 1;
            if (depth[i] > depth[deepest]) deepest = i;
        }
        std::vector<char> in_path(w.size(), 0), in_rest(w.size(), 0);
        for (int32_t r = w[deepest]; r >= 0; r = parent[r]) in_path[at[r]] = 1;
        for (size_t i = w.size(); i-- > 0;) {  // children before parents: mark each other row's ancestors
            if (!in_path[i]) in_rest[i] = 1;
            if (in_rest[i] && parent[w[i]] >= 0 && !(bug_no_ancestors && in_path[at[parent[w[i]]]])) {
                in_rest[at[parent[w[i]]]] = 1;
            }
        }
        std::vector<int32_t> path, rest;
        int64_t shared = 0;
        for (size_t i = 0; i < w.size(); ++i) {
            if (in_path[i]) path.push_back(w[i]);
            if (in_rest[i]) rest.push_back(w[i]);
            shared += in_path[i] && in_rest[i];
        }
        const int64_t gain = (int64_t)w.size() - (int64_t)std::max(path.size(), rest.size());
        if (shared <= room && gain > best_gain) {
            best = wi;
            best_gain = gain;
            best_path = std::move(path);
            best_rest = std::move(rest);
        }
    }
    if (best == walks.size()) return;
    walks[best] = std::move(best_path);
    walks.insert(walks.begin() + (std::ptrdiff_t)best + 1, std::move(best_rest));
}

}  // namespace

extern "C" {

int64_t deltaspec_rows_plan(int64_t n_rows, const int32_t * parent, const int32_t * slot, const int32_t * flags,
                            int64_t n_slots, int64_t n_positions, int32_t * rows, char * err, size_t err_size) {
    const int64_t R = n_rows;
    if (R < 1 || R > DELTASPEC_ROWS_MAX) {
        fail(err, err_size, "a batch holds 1 to %d rows, got %lld", DELTASPEC_ROWS_MAX, (long long)R);
        return -1;
    }
    if (n_slots < 1 || n_slots > INT32_MAX) {
        fail(err, err_size, "the pool must hold at least one slot, got n_slots = %lld", (long long)n_slots);
        return -1;
    }
    if (n_positions < R || n_positions > 2 * R) {
        fail(err, err_size, "the rows tensor's room for positions must be R = %lld to 2 R, got %lld", (long long)R,
             (long long)n_positions);
        return -1;
    }
    const int32_t known_flags = DELTASPEC_ROW_WRITE_BACK | DELTASPEC_ROW_KEEP_STATE;
    std::vector<int32_t> last_row(n_slots, -1), write_back_row(n_slots, -1);
    for (int64_t r = 0; r < R; ++r) {
        const int32_t p = parent[r], s = slot[r], f = flags != nullptr ? flags[r] : 0;
        if (p < -1 || p >= r) {
            fail(err, err_size, "row %lld: parent %d must be an earlier row (0..%lld) or -1", (long long)r, p,
                 (long long)r - 1);
            return -1;
        }
        if (s < -1 || s >= n_slots) {
            fail(err, err_size, "row %lld: slot %d out of range (0..%lld, or -1 to skip the row)", (long long)r, s,
                 (long long)n_slots - 1);
            return -1;
        }
        if (s == -1) continue;  // skipped: its flags mean nothing
        if (p >= 0 && slot[p] != s) {
            fail(err, err_size, "row %lld: slot %d differs from its parent row %d's slot %d%s", (long long)r, s, p,
                 slot[p], slot[p] == -1 ? " (a skipped row cannot be a parent)" : "");
            return -1;
        }
        if ((f & ~known_flags) != 0) {
            fail(err, err_size, "row %lld: flags 0x%x hold bits other than DELTASPEC_ROW_WRITE_BACK (1) and "
                 "DELTASPEC_ROW_KEEP_STATE (2)", (long long)r, f);
            return -1;
        }
        if (f & DELTASPEC_ROW_WRITE_BACK) {
            if (write_back_row[s] >= 0) {
                fail(err, err_size, "rows %d and %lld both write back slot %d (at most one row per slot)",
                     write_back_row[s], (long long)r, s);
                return -1;
            }
            write_back_row[s] = (int32_t)r;
        }
        last_row[s] = (int32_t)r;
    }
    for (int64_t s = 0; s < n_slots; ++s) {
        if (write_back_row[s] >= 0 && write_back_row[s] != last_row[s]) {
            fail(err, err_size, "row %d writes back slot %lld but row %d comes after it in that slot (the "
                 "write-back row must be its slot's last)", write_back_row[s], (long long)s, last_row[s]);
            return -1;
        }
    }

    // walks: the rows of each slot, slots ascending, rows ascending; then the split, if any
    std::vector<std::vector<int32_t>> walks;
    {
        std::vector<std::vector<int32_t>> of_slot(n_slots);
        for (int64_t r = 0; r < R; ++r) {
            if (slot[r] >= 0) of_slot[slot[r]].push_back((int32_t)r);
        }
        for (auto & w : of_slot) {
            if (!w.empty()) walks.push_back(std::move(w));
        }
    }
    // test-only planted bug (tests/test_rows_op.py), read once: the side walk without the ancestors it shares
    static const bool bug_no_ancestors = [] {
        const char * bug = std::getenv("DELTASPEC_TEST_ROWS_BUG");
        return bug != nullptr && std::strcmp(bug, "split_no_ancestors") == 0;
    }();
    if (n_positions > R) {  // room beyond R: the caller lets the plan split (its recurrence has a walk more)
        split_longest_walk(walks, parent, write_back_row, slot, n_positions - count_positions(walks), bug_no_ancestors);
    }

    // a row is saved when, in a walk, a child of it does not come right after it, or when asked to
    std::vector<char> saved(R, 0);
    for (const auto & w : walks) {
        for (size_t i = 0; i < w.size(); ++i) {
            const int32_t r = w[i], p = parent[r];
            if (p >= 0 && (i == 0 || w[i - 1] != p)) saved[p] = 1;
            if (flags != nullptr && (flags[r] & DELTASPEC_ROW_KEEP_STATE)) saved[r] = 1;
        }
    }
    for (int64_t i = 0; i < n_positions * DELTASPEC_ROWS_N_COLS; ++i) rows[i] = -1;
    int32_t n_saved = 0;
    for (int64_t r = 0; r < R; ++r) {
        int32_t * row = rows + r * DELTASPEC_ROWS_N_COLS;
        row[DELTASPEC_ROWS_PARENT] = parent[r];
        row[DELTASPEC_ROWS_SLOT] = slot[r];
        row[DELTASPEC_ROWS_FLAGS] = slot[r] >= 0 && flags != nullptr ? flags[r] : 0;
        row[DELTASPEC_ROWS_SAVED] = saved[r] ? n_saved++ : -1;
    }
    int64_t pos = 0, n_walks = 0;
    for (const auto & w : walks) {
        for (size_t i = 0; i < w.size(); ++i, ++pos) {
            const int32_t r = w[i], p = parent[r];
            int32_t * at = rows + pos * DELTASPEC_ROWS_N_COLS;
            at[DELTASPEC_ROWS_ORDER] = r;
            const bool continues = i > 0 && w[i - 1] == p;
            at[DELTASPEC_ROWS_START] = p < 0 ? -2 : continues ? -1 : rows[p * DELTASPEC_ROWS_N_COLS + DELTASPEC_ROWS_SAVED];
        }
        rows[n_walks++ * DELTASPEC_ROWS_N_COLS + DELTASPEC_ROWS_WALK_END] = (int32_t)pos;
    }
    return n_saved;
}

bool deltaspec_rows_gated_delta_net_check(const ggml_tensor * q, const ggml_tensor * k, const ggml_tensor * v,
                                          const ggml_tensor * g, const ggml_tensor * beta, const ggml_tensor * pool,
                                          const ggml_tensor * rows, int64_t n_saved, char * err, size_t err_size) {
    const struct {
        const ggml_tensor * t;
        const char * name;
    } floats[] = {{q, "q"}, {k, "k"}, {v, "v"}, {g, "g"}, {beta, "beta"}, {pool, "pool"}};
    for (const auto & f : floats) {
        if (!check_f32(f.t, f.name, err, err_size)) return false;
    }
    const int64_t S = v->ne[0], H = v->ne[1], R = v->ne[2], Hk = q->ne[1];
    if (v->ne[3] != 1 || v->nb[0] != sizeof(float) || S < 1) {
        return fail(err, err_size, "v must be [S, H_v, R, 1] with rows of S contiguous, got %s", Shape(v).text);
    }
    if (!has_shape(q, S, Hk, R, 1) || !has_shape(k, S, Hk, R, 1) || q->nb[0] != sizeof(float) ||
        k->nb[0] != sizeof(float) || Hk < 1 || H % Hk != 0) {
        return fail(err, err_size, "q and k must be [S=%lld, H_k, R=%lld, 1] with H_v=%lld a multiple of H_k and rows "
                    "contiguous, got q %s, k %s", (long long)S, (long long)R, (long long)H, Shape(q).text,
                    Shape(k).text);
    }
    for (const ggml_tensor * t : {g, beta}) {
        if (!has_shape(t, 1, H, R, 1) || !ggml_is_contiguous(t)) {
            return fail(err, err_size, "%s must be contiguous [1, H_v=%lld, R=%lld, 1] (a scalar gate per head), "
                        "got %s", t == g ? "g" : "beta", (long long)H, (long long)R, Shape(t).text);
        }
    }
    if (pool->ne[0] != S || pool->ne[1] != S || pool->ne[2] != H || !ggml_is_contiguous(pool)) {
        return fail(err, err_size, "pool must be contiguous [S=%lld, S, H_v=%lld, n_slots], got %s", (long long)S,
                    (long long)H, Shape(pool).text);
    }
    if (n_saved < 0 || n_saved > DELTASPEC_ROWS_MAX) {
        return fail(err, err_size, "n_saved must be 0..%d, got %lld", DELTASPEC_ROWS_MAX, (long long)n_saved);
    }
    return check_rows_tensor(rows, R, err, err_size);
}

bool deltaspec_rows_ssm_conv_check(const ggml_tensor * pool, const ggml_tensor * x, const ggml_tensor * c,
                                   const ggml_tensor * rows, char * err, size_t err_size) {
    for (const ggml_tensor * t : {pool, x, c}) {
        if (!check_f32(t, t == pool ? "pool" : t == x ? "x" : "c", err, err_size)) return false;
    }
    const int64_t Kc = c->ne[0], C = c->ne[1], R = x->ne[1];
    if (!has_shape(c, Kc, C, 1, 1) || !ggml_is_contiguous(c) || Kc < 2 || Kc > DELTASPEC_ROWS_MAX_KC) {
        return fail(err, err_size, "c must be contiguous [Kc, C] with 2 <= Kc <= %d, got %s", DELTASPEC_ROWS_MAX_KC,
                    Shape(c).text);
    }
    if (!has_shape(x, C, R, 1, 1) || x->nb[0] != sizeof(float)) {
        return fail(err, err_size, "x must be [C=%lld, R] with rows of C contiguous, got %s", (long long)C,
                    Shape(x).text);
    }
    if (pool->ne[0] != Kc - 1 || pool->ne[1] != C || pool->ne[3] != 1 || !ggml_is_contiguous(pool)) {
        return fail(err, err_size, "pool must be contiguous [Kc-1=%lld, C=%lld, n_slots], got %s", (long long)Kc - 1,
                    (long long)C, Shape(pool).text);
    }
    return check_rows_tensor(rows, R, err, err_size);
}

ggml_tensor * deltaspec_rows_gated_delta_net(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                                             ggml_tensor * g, ggml_tensor * beta, ggml_tensor * pool,
                                             ggml_tensor * rows, int64_t n_saved) {
    char err[512];
    if (!deltaspec_rows_gated_delta_net_check(q, k, v, g, beta, pool, rows, n_saved, err, sizeof(err))) {
        GGML_ABORT("deltaspec_rows_gated_delta_net: %s", err);
    }
    const int64_t S = v->ne[0], H = v->ne[1], R = v->ne[2];
    ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, S * H, R + S * n_saved);
    result->op = GGML_OP_GATED_DELTA_NET;
    ggml_tensor * srcs[] = {q, k, v, g, beta, pool};
    for (int i = 0; i < 6; ++i) result->src[i] = srcs[i];
    mark_rows_node(result, rows, 6, n_saved);
    return result;
}

void deltaspec_rows_set_max_walks(ggml_tensor * node, int64_t max_walks) {
    GGML_ASSERT(deltaspec_is_rows_node(node) && node->op == GGML_OP_GATED_DELTA_NET && max_walks >= 1 &&
                max_walks <= INT32_MAX);
    node->op_params[3] = (int32_t)max_walks;
}

ggml_tensor * deltaspec_rows_ssm_conv(ggml_context * ctx, ggml_tensor * pool, ggml_tensor * x, ggml_tensor * c,
                                      ggml_tensor * rows) {
    char err[512];
    if (!deltaspec_rows_ssm_conv_check(pool, x, c, rows, err, sizeof(err))) {
        GGML_ABORT("deltaspec_rows_ssm_conv: %s", err);
    }
    ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c->ne[1], x->ne[1], 1);
    result->op = GGML_OP_SSM_CONV;
    result->src[0] = pool;  // ggml-cuda's supports_op reads the channel count from src[0]->ne[1]
    result->src[1] = c;
    result->src[2] = x;
    mark_rows_node(result, rows, 3, 0);
    return result;
}

bool deltaspec_rows_cpu_available(void) { return deltaspec_rows_cpu_marker != nullptr; }

}  // extern "C"
