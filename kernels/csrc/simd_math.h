/*
 * Small AVX-512 math helpers shared by the attention kernels (header-only,
 * static inline, so each translation unit keeps its own compile flags).
 */
#ifndef TANDEM_SIMD_MATH_H
#define TANDEM_SIMD_MATH_H
#if defined(__AVX512F__)
#include <immintrin.h>

/* 2^x for x <= 0 with gradual underflow (denormals down to 2^-149, then 0; NaN
 * gives 0): a degree-5 polynomial on the fraction (its Taylor terms: relative
 * error under 3e-6, far below the bf16 rounding the attention outputs get) and
 * VSCALEFPS for the exponent; a third of libmvec's expf instructions. */
static inline __m512 exp2_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.3333558146e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* SiLU in float32: x * sigmoid(x) = x / (1 + e^-x), computed from
 * e = e^-|x| <= 1 (so exp2_nonpos serves both signs) as (x >= 0 ? x : x e) / (1 + e),
 * the division as a VRCP14PS estimate plus one Newton step (~2^-28 relative).
 * Relative error ~3e-6 (the polynomial), against one bf16 ulp of 4e-3 on the
 * rounded result. Like torch's x / (1 + e^-x) in the tails: -0 below
 * x = -ln(FLT_MAX), NaN for NaN and for -inf, +inf for +inf. Used by every
 * SwiGLU kernel, so the prefill (silu_and_mul) and decode (fused AMX) paths
 * round identically. */
static inline __m512 silu_ps(__m512 x) {
    const __m512 ax = _mm512_abs_ps(x);
    /* where e^|x| overflows float32, torch's x / (1 + e^-x) is x / inf: e := 0 */
    const __mmask16 finite = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(88.72283935546875f), _CMP_LE_OQ);
    const __m512 e = _mm512_maskz_mov_ps(
        finite, exp2_nonpos(_mm512_mul_ps(ax, _mm512_set1_ps(-1.4426950408889634f))));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
    const __m512 r0 = _mm512_rcp14_ps(d);
    const __m512 r = _mm512_mul_ps(r0, _mm512_fnmadd_ps(d, r0, _mm512_set1_ps(2.f)));
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(_mm512_mask_mul_ps(x, neg, x, e), r);
}

#endif
#endif
