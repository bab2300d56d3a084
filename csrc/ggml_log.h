// Where ggml's own log messages go.
#pragma once

namespace deltaspec {

// Routes ggml's log (ggml, ggml-cpu, ggml-cuda) to stderr, keeping the messages at or above the level
// DELTASPEC_GGML_LOG names: debug, info, warn (the default), error or none. Without it ggml prints
// every level, among them a debug line per replayed CUDA graph: one per decoded token on a GPU.
// Throws std::invalid_argument for any other value.
void install_ggml_log();

}  // namespace deltaspec
