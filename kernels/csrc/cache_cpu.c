/*
 * The KV cache write (reshape_and_cache) (helpers and rounding rules: elementwise.h).
 */
#include "elementwise.h"

/* k_cache[slot // bs, slot % bs] = key[t] (and the same for value), row by row:
 * the CPU reshape_and_cache (vLLM's name). key/value rows: [T, H, D] with
 * token/head strides; cache views [blocks, bs, H, D] strided; elem_size bytes
 * per element. A negative slot (vLLM's padding marker) skips the token. */
int cache_write(const void *key, int64_t sk_t, int64_t sk_h, const void *value, int64_t sv_t,
                int64_t sv_h, void *k_cache, int64_t ck_b, int64_t ck_o, int64_t ck_h,
                void *v_cache, int64_t cv_b, int64_t cv_o, int64_t cv_h, const int64_t *slots,
                int64_t tokens, int64_t heads, int64_t head_dim, int64_t block_size,
                int64_t elem_size, int num_threads) {
    const size_t row = (size_t)(head_dim * elem_size);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t b = slot / block_size, o = slot % block_size;
        for (int64_t h = 0; h < heads; ++h) {
            memcpy((char *)k_cache + (b * ck_b + o * ck_o + h * ck_h) * elem_size,
                   (const char *)key + (t * sk_t + h * sk_h) * elem_size, row);
            memcpy((char *)v_cache + (b * cv_b + o * cv_o + h * cv_h) * elem_size,
                   (const char *)value + (t * sv_t + h * sv_h) * elem_size, row);
        }
    }
    return 0;
}
