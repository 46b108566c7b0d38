/*
 * Shared helpers of the fused elementwise kernels (norm_cpu.c, rotary_cpu.c,
 * activation_cpu.c, sampling_cpu.c, cache_cpu.c): residual add + RMSNorm, rotary
 * embedding (GPT-NeoX / rotate_half layout), SiLU-and-multiply (SwiGLU), the row
 * argmax and the cache write. The same fusions vLLM's csrc/cpu kernels make; they
 * replace chains of small torch ops per call, each a pass over memory and an
 * OpenMP region of its own.
 *
 * Rounding follows the torch reference ops step by step: every intermediate that
 * torch would store in the model dtype is rounded to it here too (bf16: round to
 * nearest even), so rotary is bit-identical to the torch path, RMSNorm differs
 * only in summation order, and the bf16 SiLU in the last bits of its float32
 * sigmoid (a polynomial exp, simd_math.h; the float32 path uses expf). These files are built
 * with -ffp-contract=off (no FMA contraction: a*b - c*d rounds as torch does)
 * after -ffast-math (which lets `omp simd` loops call glibc's vector expf); the
 * explicit bit-level rounding steps cannot be reassociated away.
 *
 * is_bf16 != 0: tensors hold bfloat16 bits, else float32. Rows are contiguous.
 */
#ifndef TANDEM_ELEMENTWISE_H
#define TANDEM_ELEMENTWISE_H
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

/* The bfloat16 bits of f, rounded to nearest even (a NaN stays a quiet NaN). */
static inline __attribute__((always_inline)) uint16_t bf16_bits(float f) {
    uint32_t u;
    f = round_bf16(f);
    memcpy(&u, &f, sizeof u);
    return (uint16_t)(u >> 16);
}

/* Per-token symmetric int8 quantization of one activation row (the W8A8 / W4A8
 * integer-dot kernels): scale = max|x| / 127 (at least 1e-12 / 127), codes
 * round(x / scale) half to even, clamped to [-128, 127], stored as code + offset
 * (offset 128: unsigned bytes for VPDPBUSD; 0: the two's-complement int8 bytes).
 * Returns the scale. */
static inline float quantize_row_int8(const void *x, int is_bf16, int64_t K, int offset,
                                      uint8_t *xq) {
    /* |x| compared as bit patterns: for non-negative floats their order is the
     * integer order, and an integer max reduction vectorises without fast-math */
    uint32_t amax_bits = 0;
    for (int64_t k = 0; k < K; ++k) {
        const float v = ld(x, k, is_bf16);
        uint32_t u;
        memcpy(&u, &v, 4);
        u &= 0x7FFFFFFFu;
        amax_bits = u > amax_bits ? u : amax_bits;
    }
    float amax;
    memcpy(&amax, &amax_bits, 4);
    const float s = (amax > 1e-12f ? amax : 1e-12f) / 127.0f;
    for (int64_t k = 0; k < K; ++k) {
        float r = __builtin_nearbyintf(ld(x, k, is_bf16) / s); /* half to even */
        r = r < -128.0f ? -128.0f : (r > 127.0f ? 127.0f : r);
        xq[k] = (uint8_t)((int)r + offset);
    }
    return s;
}

static inline __attribute__((always_inline)) void st(void *p, int64_t i, float f, int is_bf16) {
    if (is_bf16) {
        ((uint16_t *)p)[i] = bf16_bits(f);
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
#endif /* AVX512-BF16 */
#endif
