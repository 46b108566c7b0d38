/*
 * Small AVX-512 math helpers shared by the attention kernels (header-only,
 * static inline, so each translation unit keeps its own compile flags).
 */
#ifndef TANDEM_SIMD_MATH_H
#define TANDEM_SIMD_MATH_H
#if defined(__AVX512F__)
#include <immintrin.h>

/* 2^x for x <= 0 (x below -126 gives 0): a degree-5 polynomial on the fraction
 * (its Taylor terms: relative error under 3e-6, far below the bf16 rounding the
 * attention outputs get) and VSCALEFPS for the exponent; a third of libmvec's
 * expf instructions. */
static inline __m512 exp2_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
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

#endif
#endif
