// Runs llama.cpp's own DFlash drafting (common/speculative.cpp's draft-dflash implementation, the
// dflash graph of the pinned tree's libllama) for given token sequences, for tests/test_dflash_peer.py
// to compare deltaspec's drafter with. Built against the pinned tree's libllama and libllama-common
// by the test.
//
//   llama_dflash_draft TARGET.gguf DRAFT.gguf IN.bin OUT.bin
//
// IN:  int32 n_cases, then per case int32 n (>= 2) and n int32 tokens: the target reads tokens
//      0 .. n-2 from an empty state, their target-layer features go into the drafter's cache, and
//      token n-1 is the block's anchor (at position n-1), as in a decode round of llama.cpp.
// OUT: int32 block_size, int32 n_vocab, then per case: int32 n_draft and n_draft int32 tokens (the
//      greedy draft common_speculative_draft returned), then (block_size - 1) * n_vocab float32
//      logits of the block's slots 1 .. block_size-1 (the rows that draft reads).
// KV caches F32, flash attention off, one sequence, CPU only; every case starts from cleared memories.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"
#include "speculative.h"
#include "llama.h"

static void fail(const char * msg) {
    std::fprintf(stderr, "llama_dflash_draft: %s\n", msg);
    std::exit(1);
}

static int32_t read_i32(FILE * f) {
    int32_t v = 0;
    if (std::fread(&v, 4, 1, f) != 1) fail("IN is truncated");
    return v;
}

static llama_context * make_context(llama_model * model, llama_context * other) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_seq_max = 1;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    // the CPU flash-attention kernel rounds Q to F16 (block logits then move by ~4e-3): off, so that
    // the comparison can be tight
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.ctx_other = other;  // the drafter borrows the target's embedding and LM head through it
    return llama_init_from_model(model, cp);
}

int main(int argc, char ** argv) {
    if (argc != 5) fail("usage: llama_dflash_draft TARGET.gguf DRAFT.gguf IN.bin OUT.bin");
    FILE * in = std::fopen(argv[3], "rb");
    if (!in) fail("cannot open IN");
    const int32_t n_cases = read_i32(in);
    std::vector<std::vector<llama_token>> cases(n_cases);
    for (auto & c : cases) {
        const int32_t n = read_i32(in);
        if (n < 2 || n > 256) fail("a case needs 2 .. 256 tokens");
        c.resize(n);
        for (auto & t : c) t = read_i32(in);
    }
    std::fclose(in);

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model_tgt = llama_model_load_from_file(argv[1], mp);
    if (!model_tgt) fail("cannot load the target");
    llama_model * model_dft = llama_model_load_from_file(argv[2], mp);
    if (!model_dft) fail("cannot load the drafter");
    llama_context * ctx_tgt = make_context(model_tgt, nullptr);
    if (!ctx_tgt) fail("cannot create the target context");
    llama_context * ctx_dft = make_context(model_dft, ctx_tgt);
    if (!ctx_dft) fail("cannot create the drafter context");
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model_tgt));

    int32_t block_size = 16;  // as the draft-dflash implementation reads it
    {
        char buf[32] = {};
        if (llama_model_meta_val_str(model_dft, "dflash.block_size", buf, sizeof(buf)) >= 0) block_size = std::atoi(buf);
    }

    common_params_speculative sp;
    sp.types = {COMMON_SPECULATIVE_TYPE_DRAFT_DFLASH};
    sp.draft.n_max = block_size - 1;  // the whole block
    sp.draft.n_min = 0;
    sp.draft.p_min = 0.0f;            // greedy, no confidence cut
    sp.draft.backend_sampling = false;  // the CPU sampler: its candidates come from the logits read below
    sp.draft.ctx_tgt = ctx_tgt;
    sp.draft.ctx_dft = ctx_dft;
    common_speculative * spec = common_speculative_init(sp, 1);
    if (!spec) fail("common_speculative_init made no draft-dflash implementation");

    FILE * out = std::fopen(argv[4], "wb");
    if (!out) fail("cannot open OUT");
    std::fwrite(&block_size, 4, 1, out);
    std::fwrite(&n_vocab, 4, 1, out);

    for (const auto & c : cases) {
        const int32_t n = (int32_t) c.size();
        llama_memory_clear(llama_get_memory(ctx_tgt), true);
        llama_memory_clear(llama_get_memory(ctx_dft), true);

        // the target reads the context; the speculative driver injects its features into the drafter
        common_batch batch(ctx_tgt);
        for (int32_t i = 0; i < n - 1; ++i) batch.add(c[i], i, 0, i == n - 2);
        if (llama_process(ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, batch.get()) != 0) fail("target decode failed");
        if (!common_speculative_process(spec, batch)) fail("common_speculative_process failed");

        llama_tokens prompt(c.begin(), c.end() - 1), result;
        auto & dp = common_speculative_get_draft_params(spec, 0);
        dp.drafting = true;
        dp.n_max = -1;
        dp.pos0 = n - 1;
        dp.id_last = c[n - 1];
        dp.prompt = &prompt;
        dp.result = &result;
        common_speculative_draft(spec);

        const int32_t n_draft = (int32_t) result.size();
        std::fwrite(&n_draft, 4, 1, out);
        std::fwrite(result.data(), 4, result.size(), out);
        // the block was the drafter's last decode: batch index i holds slot i
        for (int32_t i = 1; i < block_size; ++i) {
            const float * l = llama_get_logits_ith(ctx_dft, i);
            if (!l) fail("no logits for a block slot");
            std::fwrite(l, 4, n_vocab, out);
        }
    }
    std::fclose(out);

    common_speculative_free(spec);
    llama_free(ctx_dft);
    llama_free(ctx_tgt);
    llama_model_free(model_dft);
    llama_model_free(model_tgt);
    llama_backend_free();
    return 0;
}
