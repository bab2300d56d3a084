// Switches read from the environment.
#pragma once

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace deltaspec {

// Speed features that are on unless the environment sets them to 0 (for A/B measurements and the
// tests that compare both ways): DELTASPEC_STACK_PROJECTIONS (weights.h), DELTASPEC_FOLD_INPUTS
// (graph_qwen35.h), and our CUDA kernels' DELTASPEC_CUDA_KERNELS, DELTASPEC_CUDA_DELTANET,
// DELTASPEC_CUDA_PDL, DELTASPEC_MMA_PAIRS (cuda_kernels.h).
inline bool env_on(const char * name) {
    const char * env = std::getenv(name);
    return env == nullptr || std::strcmp(env, "0") != 0;
}

// Features that are off unless the environment sets them to something other than 0 (not yet shown
// to pay): DELTASPEC_ROWS_SPLIT (engine.cpp).
inline bool env_flag(const char * name) {
    const char * env = std::getenv(name);
    return env != nullptr && *env != '\0' && std::strcmp(env, "0") != 0;
}

// A test-only switch (a planted bug, DELTASPEC_TEST_*): 0 when `name` is unset or empty, i + 1 when it
// is values[i]; anything else throws std::invalid_argument naming the variable and its values, so a
// misspelt plant cannot pass for an unplanted run. The planted enums list `none` first, then the
// values in this order.
inline int planted_choice(const char * name, std::initializer_list<const char *> values) {
    const char * env = std::getenv(name);
    const std::string v = env ? env : "";
    if (v.empty()) return 0;
    int i = 1;
    std::string allowed = "unset";
    for (const char * value : values) {
        if (v == value) return i;
        allowed += std::string(i == (int)values.size() ? " or '" : ", '") + value + "'";
        ++i;
    }
    throw std::invalid_argument(std::string(name) + " (test only) must be " + allowed + ", not '" + v + "'");
}

}  // namespace deltaspec
