// What the CPU sides of the rows ops share (ggml/cpu/deltaspec_rows_*cpu.cpp), inside ggml-cpu.
#pragma once

#include "deltaspec_rows.h"
#include "ggml-cpu-impl.h"

#include <cstdlib>
#include <cstring>

namespace deltaspec_rows_cpu {

inline const int32_t * rows_of(const ggml_tensor * dst, int src) { return (const int32_t *)dst->src[src]->data; }

// entry e (DELTASPEC_ROWS_*) of row, position or walk i
inline int32_t entry(const int32_t * rows, int64_t i, int e) { return rows[i * DELTASPEC_ROWS_N_COLS + e]; }

// The test-only planted bugs (tests/test_rows_op.py): DELTASPEC_TEST_ROWS_BUG names one for the whole
// process (read once, so that no op call pays for scanning the environment).
inline bool planted(const char * name) {
    static const char * const bug = std::getenv("DELTASPEC_TEST_ROWS_BUG");
    return bug != nullptr && std::strcmp(bug, name) == 0;
}

// the two ops' CPU compute (called by the dispatchers in deltaspec_rows_cpu.cpp)
void rows_gated_delta_net(const ggml_compute_params * params, ggml_tensor * dst);
void rows_ssm_conv(const ggml_compute_params * params, ggml_tensor * dst);

}  // namespace deltaspec_rows_cpu

extern "C" {
// ggml-cpu.c's calls of ggml_compute_forward_gated_delta_net and ggml_compute_forward_ssm_conv, renamed
// (inject.cmake): our nodes go to the functions above, every other node to ggml's
void deltaspec_cpu_gated_delta_net(const ggml_compute_params * params, ggml_tensor * dst);
void deltaspec_cpu_ssm_conv(const ggml_compute_params * params, ggml_tensor * dst);
// present when this ggml-cpu carries the ops (deltaspec_rows_cpu_available())
int deltaspec_rows_cpu_marker(void);
}
