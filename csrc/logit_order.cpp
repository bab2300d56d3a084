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
    for (int64_t i = 0; i < n; ++i) a[i] = {descending_key(logits[i]), (int32_t)i};
    // one histogram pass per digit, each over 4 interleaved counters: a row's keys crowd into a few
    // top digits, and consecutive increments of one counter would wait on each other's stores
    uint32_t count[kPasses][kBuckets];
    {
        thread_local std::vector<uint32_t> part;
        part.assign(4 * kBuckets, 0);
        uint32_t * c0 = part.data();
        uint32_t * c1 = c0 + kBuckets;
        uint32_t * c2 = c1 + kBuckets;
        uint32_t * c3 = c2 + kBuckets;
        for (int p = 0; p < kPasses; ++p) {
            const int shift = p * kBits;
            int64_t i = 0;
            for (; i + 4 <= n; i += 4) {
                c0[(a[i].key >> shift) & (kBuckets - 1)]++;
                c1[(a[i + 1].key >> shift) & (kBuckets - 1)]++;
                c2[(a[i + 2].key >> shift) & (kBuckets - 1)]++;
                c3[(a[i + 3].key >> shift) & (kBuckets - 1)]++;
            }
            for (; i < n; ++i) c0[(a[i].key >> shift) & (kBuckets - 1)]++;
            for (uint32_t d = 0; d < kBuckets; ++d) {
                count[p][d] = c0[d] + c1[d] + c2[d] + c3[d];
                c0[d] = c1[d] = c2[d] = c3[d] = 0;
            }
        }
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
    int32_t * out_ids = ids.data();
    if (sorted) {
        sorted->resize(n);
        float * out = sorted->data();
        for (int64_t i = 0; i < n; ++i) {
            out_ids[i] = src[i].id;
            out[i] = logit_of(src[i].key);
        }
    } else {
        for (int64_t i = 0; i < n; ++i) out_ids[i] = src[i].id;
    }
}

}  // namespace deltaspec
