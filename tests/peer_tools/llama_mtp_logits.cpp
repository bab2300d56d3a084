// Runs llama.cpp's own MTP head (graph_mtp of the pinned tree, an MTP context on the model loaded
// with its MTP layer) on given (token, hidden state) rows, for tests/test_mtp.py to compare
// deltaspec's head with. Built against the pinned tree's libllama by the test.
//
//   llama_mtp_logits MODEL.gguf IN.bin OUT.bin CHUNK
//
// IN:  int32 T, int32 E, T int32 tokens, T*E float32 hidden rows (row t is paired with token t;
//      token t sits at position t of the MTP context's sequence).
// OUT: T*n_vocab float32 logits, then T*E float32 h_nextn (the head's normed output hidden).
// The rows go to llama_process in chunks of CHUNK, so later chunks attend to the KV cache the
// earlier ones wrote. KV cache F32, one thread.
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <vector>

#include "llama-ext.h"
#include "llama.h"

static void die(const char * msg) {
    std::fprintf(stderr, "llama_mtp_logits: %s\n", msg);
    std::exit(1);
}

int main(int argc, char ** argv) {
    if (argc != 5) die("usage: llama_mtp_logits MODEL.gguf IN.bin OUT.bin CHUNK");
    const int chunk = std::atoi(argv[4]);
    FILE * in = std::fopen(argv[2], "rb");
    if (!in) die("cannot open IN");
    int32_t T = 0, E = 0;
    if (std::fread(&T, 4, 1, in) != 1 || std::fread(&E, 4, 1, in) != 1 || T < 1 || E < 1) die("bad IN header");
    std::vector<int32_t> tokens(T);
    std::vector<float> hidden((size_t)T * E);
    if (std::fread(tokens.data(), 4, T, in) != (size_t)T || std::fread(hidden.data(), 4, hidden.size(), in) != hidden.size()) {
        die("IN is truncated");
    }
    std::fclose(in);

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.load_mtp = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) die("cannot load the model");
    if (llama_model_n_embd(model) != E) die("E differs from the model's n_embd");
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) die("cannot create the MTP context");
    llama_set_embeddings_nextn(ctx, true, /*masked =*/true);

    std::vector<float> logits((size_t)T * n_vocab), h_out((size_t)T * E);
    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    for (int32_t t0 = 0; t0 < T; t0 += chunk) {
        const int32_t n = std::min(chunk, T - t0);
        llama_batch_ext_clear(batch);
        for (int32_t i = 0; i < n; ++i) {
            const int32_t t = t0 + i;
            const int32_t idx = llama_batch_ext_add_token(batch, 0, tokens[t]);
            if (idx != i) die("llama_batch_ext_add_token failed");
            const llama_pos pos[4] = {t, 0, 0, 0};
            llama_batch_ext_set_pos(batch, idx, pos);
            // the hidden row travels in the token's embedding slot, as common/speculative.cpp's draft-mtp passes it
            if (!llama_batch_ext_set_embd_token(batch, idx, {hidden.data() + (size_t)t * E, 1, (size_t)E})) {
                die("llama_batch_ext_set_embd_token failed");
            }
            llama_batch_ext_set_output_logits(batch, idx, true);
        }
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch) != 0) die("llama_process failed");
        for (int32_t i = 0; i < n; ++i) {
            const float * l = llama_get_logits_ith(ctx, i);
            const float * h = llama_get_embeddings_nextn_ith(ctx, i);
            if (!l || !h) die("no logits / h_nextn for a row");
            std::copy(l, l + n_vocab, logits.data() + (size_t)(t0 + i) * n_vocab);
            std::copy(h, h + E, h_out.data() + (size_t)(t0 + i) * E);
        }
    }
    llama_batch_ext_free(batch);

    FILE * out = std::fopen(argv[3], "wb");
    if (!out) die("cannot open OUT");
    std::fwrite(logits.data(), 4, logits.size(), out);
    std::fwrite(h_out.data(), 4, h_out.size(), out);
    std::fclose(out);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
