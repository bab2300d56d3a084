#include "ggml_log.h"

#include "ggml.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace deltaspec {

namespace {

int g_min_level = GGML_LOG_LEVEL_WARN;
bool g_last_kept = false;  // a CONT message continues the one before it and shares its fate

void filtered_log(ggml_log_level level, const char * text, void *) {
    // GGML_LOG (level NONE) is ggml's plain message, kept as info
    const int effective = level == GGML_LOG_LEVEL_NONE ? GGML_LOG_LEVEL_INFO : level;
    const bool keep = level == GGML_LOG_LEVEL_CONT ? g_last_kept : effective >= g_min_level;
    g_last_kept = keep;
    if (keep) {
        std::fputs(text, stderr);
        std::fflush(stderr);
    }
}

}  // namespace

void install_ggml_log() {
    const char * env = std::getenv("DELTASPEC_GGML_LOG");
    const std::string value = env != nullptr ? env : "warn";
    if (value == "debug") {
        g_min_level = GGML_LOG_LEVEL_DEBUG;
    } else if (value == "info") {
        g_min_level = GGML_LOG_LEVEL_INFO;
    } else if (value == "warn") {
        g_min_level = GGML_LOG_LEVEL_WARN;
    } else if (value == "error") {
        g_min_level = GGML_LOG_LEVEL_ERROR;
    } else if (value == "none") {
        g_min_level = GGML_LOG_LEVEL_CONT + 1;  // above every level
    } else {
        throw std::invalid_argument("DELTASPEC_GGML_LOG must be debug, info, warn, error or none, not '" + value +
                                    "'");
    }
    ggml_log_set(filtered_log, nullptr);
}

}  // namespace deltaspec
