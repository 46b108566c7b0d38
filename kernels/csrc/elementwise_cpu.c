/*
 * Fused elementwise kernels for CPUs: residual add + RMSNorm, rotary embedding
 * (GPT-NeoX / rotate_half layout), SiLU-and-multiply (SwiGLU). The same fusions
 * vLLM's csrc/cpu kernels make; they replace chains of 5-10 small torch ops per
 * call, each a pass over memory and an OpenMP region of its own.
 *
 * Rounding follows the torch reference ops step by step: every intermediate that
 * torch would store in the model dtype is rounded to it here too (bf16: round to
 * nearest even), so rotary is bit-identical to the torch path, RMSNorm differs
 * only in summation order, and the bf16 SiLU in the last bits of its float32
 * sigmoid (a polynomial exp, simd_math.h; the float32 path uses expf). This file is built
 * with -ffp-contract=off (no FMA contraction: a*b - c*d rounds as torch does)
 * after -ffast-math (which lets `omp simd` loops call glibc's vector expf); the
 * explicit bit-level rounding steps cannot be reassociated away.
 *
 * is_bf16 != 0: tensors hold bfloat16 bits, else float32. Rows are contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_math.h"
#include "tandem_kernels.h"
#include "team.h"

#define MAX_HIDDEN TANDEM_MAX_HIDDEN

static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, int is_bf16) {
    if (is_bf16) {
        uint32_t u = ((uint32_t)((const uint16_t *)p)[i]) << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return ((const float *)p)[i];
}

/* Branch-free (a select, not an if) so that the `omp simd` loops calling it
 * vectorize: with an if, GCC gave up on them ("control flow in loop") and the
 * generic bf16 path (CPUs without AVX512-BF16) ran far slower than torch. */
static inline __attribute__((always_inline)) float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    const uint32_t quiet_nan = u | 0x00400000u;
    u = ((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to the storage dtype (identity for float32). */
static inline __attribute__((always_inline)) float rd(float f, int is_bf16) { return is_bf16 ? round_bf16(f) : f; }

static inline __attribute__((always_inline)) void st(void *p, int64_t i, float f, int is_bf16) {
    if (is_bf16) {
        uint32_t u;
        f = round_bf16(f);
        memcpy(&u, &f, sizeof u);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        ((float *)p)[i] = f;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
/* bf16 paths on AVX512-BF16 CPUs: 16 lanes, and VCVTNEPS2BF16 (round to nearest
 * even, NaN kept NaN, as torch rounds) in place of the bit-twiddled rounding,
 * which cost ~6 instructions per vector; the results are the same bits except
 * for float32 denormals, which the instruction flushes. Tails use masks. */

static inline __m512 ld16(const uint16_t *p, __mmask16 m) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

static inline __m512 rd16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

static inline void st16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, to_bf16(v));
}

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

/* add_rms_norm_impl for bf16: same rounding steps, 16 lanes; a team body (team.h). */
void team_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w,
                            uint16_t *out, uint16_t *res_out, int64_t rows, int64_t hidden,
                            float eps) {
    float h[MAX_HIDDEN];
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t base = r * hidden;
        __m512 sumsq = _mm512_setzero_ps();
        for (int64_t i = 0; i < hidden; i += 16) {
            const __mmask16 m = tail_mask(hidden - i);
            __m512 v = ld16(x + base + i, m);
            if (res != NULL) {
                v = rd16(_mm512_add_ps(v, ld16(res + base + i, m)));
                st16(res_out + base + i, v, m);
            }
            _mm512_mask_storeu_ps(h + i, m, v);
            sumsq = _mm512_add_ps(sumsq, _mm512_mul_ps(v, v));
        }
        const float rs = 1.f / sqrtf(_mm512_reduce_add_ps(sumsq) / (float)hidden + eps);
        const __m512 vrs = _mm512_set1_ps(rs);
        for (int64_t i = 0; i < hidden; i += 16) {
            const __mmask16 m = tail_mask(hidden - i);
            const __m512 n = rd16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, h + i), vrs));
            st16(out + base + i, _mm512_mul_ps(ld16(w + i, m), n), m);
        }
    }
}

static void add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w,
                              uint16_t *out, uint16_t *res_out, int64_t rows, int64_t hidden,
                              float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    team_add_rms_norm_bf16(x, res, w, out, res_out, rows, hidden, eps);
}

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

int team_elementwise_bf16_available(void) { return 1; }

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

static void silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t tokens, int64_t inter,
                              int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t *g = x + t * 2 * inter, *u = g + inter;
        uint16_t *o = out + t * inter;
        for (int64_t i = 0; i < inter; i += 16) {
            const __mmask16 m = tail_mask(inter - i);
            const __m512 gv = ld16(g + i, m);
            const __m512 a = rd16(silu_ps(gv));
            st16(o + i, _mm512_mul_ps(a, ld16(u + i, m)), m);
        }
    }
}
#endif

/* One row of add_rms_norm_impl; h: scratch of `hidden` floats. */
static inline __attribute__((always_inline)) void add_rms_norm_row(
    const int is_bf16, const int has_res, const void *x, const void *res, const void *w,
    void *out, void *res_out, int64_t base, int64_t hidden, float eps, float *h) {
    float sumsq = 0.f;
#pragma omp simd reduction(+ : sumsq)
    for (int64_t i = 0; i < hidden; ++i) {
        float v = ld(x, base + i, is_bf16);
        if (has_res) v = rd(v + ld(res, base + i, is_bf16), is_bf16);
        h[i] = v;
        sumsq += v * v;
    }
    const float rs = 1.f / sqrtf(sumsq / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) {
        if (has_res) st(res_out, base + i, h[i], is_bf16);
        st(out, base + i, ld(w, i, is_bf16) * rd(h[i] * rs, is_bf16), is_bf16);
    }
}

/* out = weight * dtype(h * rsqrt(mean(h^2) + eps)), h = dtype(x + residual)
 * (h = x without a residual); res_out receives h.
 * NOTE: the flags are branched on per row, each branch calling the row with
 * literals: inside the OpenMP-outlined loop body they are variables, and a test
 * of one inside an `omp simd` loop kept GCC from vectorising it. */
static void add_rms_norm_impl(const int is_bf16, const int has_res, const void *x,
                              const void *res, const void *w, void *out, void *res_out,
                              int64_t rows, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        float h[MAX_HIDDEN]; /* the Python side declines larger rows */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t base = r * hidden;
            if (is_bf16 && has_res)
                add_rms_norm_row(1, 1, x, res, w, out, res_out, base, hidden, eps, h);
            else if (is_bf16)
                add_rms_norm_row(1, 0, x, res, w, out, res_out, base, hidden, eps, h);
            else if (has_res)
                add_rms_norm_row(0, 1, x, res, w, out, res_out, base, hidden, eps, h);
            else
                add_rms_norm_row(0, 0, x, res, w, out, res_out, base, hidden, eps, h);
        }
    }
}

int add_rms_norm(int is_bf16, const void *x, const void *res, const void *w, void *out,
                 void *res_out, int64_t rows, int64_t hidden, float eps, int num_threads) {
    if (hidden > MAX_HIDDEN) return -1;
    const int has_res = res != NULL && res_out != NULL;
#ifdef HAVE_AVX512_BF16
    if (is_bf16) {
        add_rms_norm_bf16(x, has_res ? res : NULL, w, out, res_out, rows, hidden, eps,
                          num_threads);
        return 0;
    }
#endif
    add_rms_norm_impl(is_bf16 != 0, has_res, x, res, w, out, res_out, rows, hidden, eps,
                      num_threads);
    return 0;
}

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

/* One row of silu_and_mul_impl. */
static inline __attribute__((always_inline)) void silu_and_mul_row(
    const int is_bf16, const void *x, void *out, int64_t xi, int64_t oi, int64_t inter) {
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
        const float g = ld(x, xi + i, is_bf16);
        /* silu(g) = g / (1 + e^-g), from e = e^-|g| <= 1 (as silu_ps does): the
         * divisor stays in [1, 2], where -ffast-math's reciprocal estimate is
         * exact enough; g / (1 + inf) through it gave NaN instead of -0 in the
         * vectorised loop. Tails as torch's: -0 far below 0, NaN for NaN and -inf. */
        const float e = expf(-fabsf(g));
        const float a = rd((g >= 0.f ? g : g * e) / (1.f + e), is_bf16);
        st(out, oi + i, a * ld(x, xi + inter + i, is_bf16), is_bf16);
    }
}

/* out[t, i] = dtype(silu(gate[t, i])) * up[t, i]; x = [T, 2I] holds gate | up.
 * is_bf16 is branched on per row (see add_rms_norm_impl). */
static void silu_and_mul_impl(const int is_bf16, const void *x, void *out, int64_t tokens,
                              int64_t inter, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; ++t) {
        if (is_bf16)
            silu_and_mul_row(1, x, out, t * 2 * inter, t * inter, inter);
        else
            silu_and_mul_row(0, x, out, t * 2 * inter, t * inter, inter);
    }
}

int silu_and_mul(int is_bf16, const void *x, void *out, int64_t tokens, int64_t inter,
                 int num_threads) {
#ifdef HAVE_AVX512_BF16
    if (is_bf16) {
        silu_and_mul_bf16(x, out, tokens, inter, num_threads);
        return 0;
    }
#endif
    silu_and_mul_impl(is_bf16 != 0, x, out, tokens, inter, num_threads);
    return 0;
}

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

/* Row-wise argmax: out[r] = the first index of the largest value of row r, or of
 * its first NaN when it has one (torch's max(dim).indices convention). Rows of
 * `cols` elements, row stride sx (elements). Two passes per row (the maximum,
 * then its first position): the second one re-reads the row from L1/L2, and
 * the vector loop needs no per-lane index bookkeeping. */
/* NaN test on the bits: -ffast-math lets the compiler assume `v != v` is false. */
static inline __attribute__((always_inline)) int is_nan(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7fffffffu) > 0x7f800000u;
}

static inline __attribute__((always_inline)) int64_t argmax_row_impl(const void *x, int64_t cols,
                                                                     int is_bf16) {
    float best = ld(x, 0, is_bf16);
    if (is_nan(best)) return 0;
    for (int64_t i = 1; i < cols; ++i) {
        const float v = ld(x, i, is_bf16);
        if (is_nan(v)) return i;
        if (v > best) best = v;
    }
    for (int64_t i = 0; i < cols; ++i)
        if (ld(x, i, is_bf16) == best) return i;
    return 0;
}

#ifdef HAVE_AVX512_BF16
static int64_t argmax_row_bf16(const uint16_t *x, int64_t cols) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < cols; i += 16) {
        const __mmask16 m = tail_mask(cols - i);
        const __m512 v = ld16(x + i, m);
        nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
        vmax = _mm512_mask_max_ps(vmax, m, vmax, v);
    }
    if (nan) return argmax_row_impl(x, cols, 1);
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    for (int64_t i = 0; i < cols; i += 16) {
        const __mmask16 m = tail_mask(cols - i);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, ld16(x + i, m), best, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0;
}
#endif

int argmax_rows(int is_bf16, const void *x, int64_t sx, int64_t rows, int64_t cols, int64_t *out,
                int num_threads) {
    if (cols < 1) return -1;
    const int64_t esize = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        const void *row = (const char *)x + r * sx * esize;
#ifdef HAVE_AVX512_BF16
        if (is_bf16) {
            out[r] = argmax_row_bf16(row, cols);
            continue;
        }
#endif
        out[r] = is_bf16 ? argmax_row_impl(row, cols, 1) : argmax_row_impl(row, cols, 0);
    }
    return 0;
}

#ifndef HAVE_AVX512_BF16
int team_elementwise_bf16_available(void) { return 0; }
void team_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w,
                            uint16_t *out, uint16_t *res_out, int64_t rows, int64_t hidden,
                            float eps) {
    (void)x, (void)res, (void)w, (void)out, (void)res_out, (void)rows, (void)hidden, (void)eps;
}
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
