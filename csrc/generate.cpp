#include "generate.h"

#include "scheduler.h"

#include <algorithm>
#include <stdexcept>

namespace deltaspec {

namespace {

// Earliest occurrence of any stop string that ends inside the newest `fresh` bytes of `text`.
int64_t find_stop(const std::string & text, size_t fresh, const std::vector<std::string> & stop) {
    int64_t best = -1;
    for (const std::string & s : stop) {
        const size_t from = text.size() >= fresh + s.size() ? text.size() - fresh - s.size() + 1 : 0;
        const size_t at = text.find(s, from);
        if (at != std::string::npos && (best < 0 || (int64_t)at < best)) best = (int64_t)at;
    }
    return best;
}

}  // namespace

bool Emitter::emit(int32_t token) {
    if (req_.constraint) req_.constraint->commit(token);  // every loop commits through here
    res_.tokens.push_back(token);
    const std::string & piece = pieces_[token];
    text_ += piece;
    const bool eog = std::find(req_.eog_ids.begin(), req_.eog_ids.end(), token) != req_.eog_ids.end();
    if (!req_.stop.empty() && !eog) res_.stop_offset = find_stop(text_, piece.size(), req_.stop);
    if (on_token_ && !on_token_(token, res_)) {
        res_.finish = FinishReason::cancelled;
        return false;
    }
    if (eog || res_.stop_offset >= 0) {
        res_.finish = FinishReason::stop;
        return false;
    }
    if ((int32_t)res_.tokens.size() >= req_.max_tokens) {
        res_.finish = FinishReason::length;
        return false;
    }
    return true;
}

GenerateResult generate(Engine & engine, const PieceTable & pieces, const GenerateRequest & req,
                        const std::atomic<bool> & cancel, const TokenCallback & on_token) {
    // the scheduler with one sequence: the loop of generate_batch, on slot 0
    Scheduler scheduler(engine, pieces);
    scheduler.set_max_sequences(1);
    return scheduler.run_one(req, cancel, on_token);
}

}  // namespace deltaspec
