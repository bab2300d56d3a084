#include "ggml_log.h"

#include "ggml.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

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
    constexpr std::pair<const char *, int> kLevels[] = {{"debug", GGML_LOG_LEVEL_DEBUG},
                                                         {"info", GGML_LOG_LEVEL_INFO},
                                                         {"warn", GGML_LOG_LEVEL_WARN},
                                                         {"error", GGML_LOG_LEVEL_ERROR},
                                                         {"none", GGML_LOG_LEVEL_CONT + 1}};  // above every level
    const auto * level = std::find_if(std::begin(kLevels), std::end(kLevels),
                                      [&](const auto & l) { return value == l.first; });
    if (level == std::end(kLevels)) {
        throw std::invalid_argument("DELTASPEC_GGML_LOG must be debug, info, warn, error or none, not '" + value +
                                    "'");
    }
    g_min_level = level->second;
    ggml_log_set(filtered_log, nullptr);
}

}  // namespace deltaspec
