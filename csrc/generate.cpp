#include "generate.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace deltaspec {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

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
    res_.tokens.push_back(token);
    const std::string & piece = pieces_[token];
    text_ += piece;
    const bool eog = std::find(req_.eog_ids.begin(), req_.eog_ids.end(), token) != req_.eog_ids.end();
    if (!req_.stop.empty() && !eog) res_.stop_offset = find_stop(text_, piece.size(), req_.stop);
    if (on_token_ && !on_token_(token)) {
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
    const int64_t n_vocab = engine.hparams().n_vocab;
    if (req.prompt.empty()) throw std::invalid_argument("the prompt is empty");
    if ((int64_t)pieces.size() != n_vocab) throw std::invalid_argument("piece table does not match the vocabulary");

    GenerateResult res;
    Emitter out(pieces, req, on_token, res);
    std::vector<float> logits(n_vocab);
    std::vector<int32_t> history = req.prompt;
    Sampler sampler(req.sampling);

    // Plain greedy needs only the argmax, which the device computes: no logits cross over.
    const bool device_argmax = req.sampling.argmax_only();
    int32_t next = -1;

    auto t0 = Clock::now();
    engine.reset();
    if (device_argmax) {
        next = engine.eval_argmax(req.prompt.data(), (int64_t)req.prompt.size());
    } else {
        engine.eval(req.prompt.data(), (int64_t)req.prompt.size(), LogitsWanted::last, logits.data());
    }
    res.prefill_seconds = seconds_since(t0);

    t0 = Clock::now();
    while (true) {
        if (cancel.load()) {
            res.finish = FinishReason::cancelled;
            break;
        }
        const int32_t token = device_argmax ? next : sampler.sample(logits.data(), n_vocab, history);
        history.push_back(token);
        if (!out.emit(token)) break;
        if (engine.n_past() >= engine.n_ctx()) {
            res.finish = FinishReason::length;
            break;
        }
        if (device_argmax) {
            next = engine.eval_argmax(&token, 1);
        } else {
            engine.eval(&token, 1, LogitsWanted::last, logits.data());
        }
    }
    res.decode_seconds = seconds_since(t0);
    return res;
}

}  // namespace deltaspec
