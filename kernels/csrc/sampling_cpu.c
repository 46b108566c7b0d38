/*
 * Greedy sampling: the row argmax (helpers and rounding rules: elementwise.h).
 */
#include "elementwise.h"

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
