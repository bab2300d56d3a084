// Switches read from the environment.
#pragma once

#include <cstdlib>
#include <cstring>

namespace deltaspec {

// Speed features that are on unless the environment sets them to 0 (for A/B measurements and the
// tests that compare both ways): DELTASPEC_STACK_PROJECTIONS (weights.h), DELTASPEC_FOLD_INPUTS
// (graph_qwen35.h), and our CUDA kernels' DELTASPEC_CUDA_KERNELS, DELTASPEC_CUDA_DELTANET,
// DELTASPEC_CUDA_PDL (cuda_kernels.h).
inline bool env_on(const char * name) {
    const char * env = std::getenv(name);
    return env == nullptr || std::strcmp(env, "0") != 0;
}

}  // namespace deltaspec
