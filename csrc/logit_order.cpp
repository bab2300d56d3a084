#include "logit_order.h"

#include <cstring>

namespace deltaspec {

namespace {

// An unsigned key whose ascending order is the logits' descending order: IEEE floats order as
// sign-magnitude integers, so flip the magnitude bits of negatives, set the sign bit of
// positives (ascending floats), then complement (descending).
uint32_t descending_key(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    if (u == 0x80000000u) u = 0;  // -0.0 == +0.0 for the comparison: the same key
    const uint32_t ascending = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~ascending;
}

float logit_of(uint32_t key) {
    const uint32_t ascending = ~key;
    const uint32_t u = (ascending & 0x80000000u) ? (ascending & 0x7fffffffu) : ~ascending;
    float x;
    std::memcpy(&x, &u, sizeof(x));
    return x;
}

struct Item {
    uint32_t key;
    int32_t id;
};

}  // namespace

void order_by_logit(const float * logits, int64_t n, std::vector<int32_t> & ids, std::vector<float> * sorted) {
    // LSD radix sort, 3 digits of 11 bits: each pass is stable, and the items start in id order,
    // so equal keys keep ascending ids
    constexpr int kBits = 11, kPasses = 3;
    constexpr uint32_t kBuckets = 1u << kBits;
    thread_local std::vector<Item> a, b;
    a.resize(n);
    b.resize(n);
    uint32_t count[kPasses][kBuckets] = {};
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t k = descending_key(logits[i]);
        a[i] = {k, (int32_t)i};
        for (int p = 0; p < kPasses; ++p) count[p][(k >> (p * kBits)) & (kBuckets - 1)]++;
    }
    Item * src = a.data();
    Item * dst = b.data();
    for (int p = 0; p < kPasses; ++p) {
        uint32_t * c = count[p];
        bool one_bucket = false;  // every key has the same digit here: the pass would move nothing
        for (uint32_t d = 0; d < kBuckets; ++d) {
            if (c[d] == (uint32_t)n) one_bucket = true;
        }
        if (one_bucket) continue;
        uint32_t offset = 0;
        for (uint32_t d = 0; d < kBuckets; ++d) {
            const uint32_t m = c[d];
            c[d] = offset;
            offset += m;
        }
        const int shift = p * kBits;
        for (int64_t i = 0; i < n; ++i) dst[c[(src[i].key >> shift) & (kBuckets - 1)]++] = src[i];
        std::swap(src, dst);
    }
    ids.resize(n);
    for (int64_t i = 0; i < n; ++i) ids[i] = src[i].id;
    if (sorted) {
        sorted->resize(n);
        float * out = sorted->data();
        for (int64_t i = 0; i < n; ++i) out[i] = logit_of(src[i].key);
    }
}

}  // namespace deltaspec
