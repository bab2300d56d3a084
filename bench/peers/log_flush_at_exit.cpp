// Linked into llama.cpp's example programs that bench/peers/ compiles: at exit, stop llama.cpp's
// common logger, whose worker thread then prints every message still queued. The logger is leaked
// on purpose upstream (never destroyed), so without this the last lines a program logs (its
// summary: tokens decoded, drafts accepted) are sometimes lost when main returns.
#include <cstdlib>

#include "log.h"

namespace {

const int registered = std::atexit([] { common_log_pause(common_log_main()); });

}  // namespace
