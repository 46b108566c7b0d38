/*
 * Rotary embedding (GPT-NeoX layout), and rotary + cache write for the fused decode (helpers and rounding rules: elementwise.h).
 */
#include "elementwise.h"

#ifdef HAVE_AVX512_BF16
/* One head of one token: out = rotate(x) by that token's cos/sin [D/2]. */
static inline void rotary_head_bf16(const uint16_t *x, uint16_t *out, const uint16_t *cos,
                                    const uint16_t *sin, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = tail_mask(half - i);
        const __m512 c = ld16(cos + i, m), s = ld16(sin + i, m);
        const __m512 x1 = ld16(x + i, m), x2 = ld16(x + half + i, m);
        st16(out + i, _mm512_sub_ps(rd16(_mm512_mul_ps(x1, c)), rd16(_mm512_mul_ps(x2, s))), m);
        st16(out + half + i, _mm512_add_ps(rd16(_mm512_mul_ps(x2, c)), rd16(_mm512_mul_ps(x1, s))),
             m);
    }
}

static void rotary_neox_bf16(const uint16_t *x, int64_t sx_t, int64_t sx_h, uint16_t *out,
                             int64_t tokens, int64_t heads, int64_t head_dim,
                             const uint16_t *cos, const uint16_t *sin, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < heads; ++h)
            rotary_head_bf16(x + t * sx_t + h * sx_h, out + (t * heads + h) * head_dim,
                             cos + t * half, sin + t * half, half);
}

void team_rotary_cache_bf16(const uint16_t *qkv, int64_t s_qkv, uint16_t *q_out, int64_t tokens,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            const uint16_t *cos, const uint16_t *sin, uint16_t *k_cache,
                            int64_t ck_b, int64_t ck_o, int64_t ck_h, uint16_t *v_cache,
                            int64_t cv_b, int64_t cv_o, int64_t cv_h, const int64_t *slots,
                            int64_t block_size) {
    const int64_t half = head_dim / 2;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t *row = qkv + t * s_qkv, *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_heads; ++h)
            rotary_head_bf16(row + h * head_dim, q_out + (t * num_heads + h) * head_dim, c, s,
                             half);
        const int64_t slot = slots[t];
        if (slot < 0) continue; /* vLLM's padding marker, as cache_write */
        const int64_t b = slot / block_size, o = slot % block_size;
        const uint16_t *k = row + num_heads * head_dim, *v = k + num_kv_heads * head_dim;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            rotary_head_bf16(k + h * head_dim, k_cache + b * ck_b + o * ck_o + h * ck_h, c, s,
                             half);
            memcpy(v_cache + b * cv_b + o * cv_o + h * cv_h, v + h * head_dim,
                   (size_t)(head_dim * 2));
        }
    }
}

#endif

/* One head of one token of rotary_neox_impl (ci: the token's offset in cos/sin). */
static inline __attribute__((always_inline)) void rotary_neox_row(
    const int is_bf16, const void *x, int64_t xi, void *out, int64_t oi, int64_t half,
    const void *cos, const void *sin, int64_t ci) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
        const float c = ld(cos, ci + i, is_bf16);
        const float s = ld(sin, ci + i, is_bf16);
        const float x1 = ld(x, xi + i, is_bf16);
        const float x2 = ld(x, xi + half + i, is_bf16);
        st(out, oi + i, rd(x1 * c, is_bf16) - rd(x2 * s, is_bf16), is_bf16);
        st(out, oi + half + i, rd(x2 * c, is_bf16) + rd(x1 * s, is_bf16), is_bf16);
    }
}

/* out[t, h] = rotate(x[t, h]) by the angles of token t: with x = (x1, x2) halves,
 * (x1*cos - x2*sin, x2*cos + x1*sin). cos/sin: [T, D/2] contiguous; x strided
 * (token stride sx_t, head stride sx_h); out contiguous [T, H, D]. is_bf16 is
 * branched on per head (see add_rms_norm_impl). */
static void rotary_neox_impl(const int is_bf16, const void *x, int64_t sx_t, int64_t sx_h,
                             void *out, int64_t tokens, int64_t heads, int64_t head_dim,
                             const void *cos, const void *sin, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t xi = t * sx_t + h * sx_h;
            const int64_t oi = (t * heads + h) * head_dim;
            if (is_bf16)
                rotary_neox_row(1, x, xi, out, oi, half, cos, sin, t * half);
            else
                rotary_neox_row(0, x, xi, out, oi, half, cos, sin, t * half);
        }
    }
}

int rotary_neox(int is_bf16, const void *x, int64_t sx_t, int64_t sx_h, void *out, int64_t tokens,
                int64_t heads, int64_t head_dim, const void *cos, const void *sin,
                int num_threads) {
#ifdef HAVE_AVX512_BF16
    if (is_bf16) {
        rotary_neox_bf16(x, sx_t, sx_h, out, tokens, heads, head_dim, cos, sin, num_threads);
        return 0;
    }
#endif
    rotary_neox_impl(is_bf16 != 0, x, sx_t, sx_h, out, tokens, heads, head_dim, cos, sin,
                     num_threads);
    return 0;
}

#ifndef HAVE_AVX512_BF16
void team_rotary_cache_bf16(const uint16_t *qkv, int64_t s_qkv, uint16_t *q_out, int64_t tokens,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            const uint16_t *cos, const uint16_t *sin, uint16_t *k_cache,
                            int64_t ck_b, int64_t ck_o, int64_t ck_h, uint16_t *v_cache,
                            int64_t cv_b, int64_t cv_o, int64_t cv_h, const int64_t *slots,
                            int64_t block_size) {
    (void)qkv, (void)s_qkv, (void)q_out, (void)tokens, (void)num_heads, (void)num_kv_heads;
    (void)head_dim, (void)cos, (void)sin, (void)k_cache, (void)ck_b, (void)ck_o, (void)ck_h;
    (void)v_cache, (void)cv_b, (void)cv_o, (void)cv_h, (void)slots, (void)block_size;
}
#endif
