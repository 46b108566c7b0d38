/*
 * Residual add + RMSNorm (helpers and rounding rules: elementwise.h).
 */
#include "elementwise.h"

#ifdef HAVE_AVX512_BF16
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

/* norm_cpu.c and rotary_cpu.c share the macro: both bf16 team bodies exist. */
int team_elementwise_bf16_available(void) { return 1; }
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

#ifndef HAVE_AVX512_BF16
int team_elementwise_bf16_available(void) { return 0; }
void team_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w,
                            uint16_t *out, uint16_t *res_out, int64_t rows, int64_t hidden,
                            float eps) {
    (void)x, (void)res, (void)w, (void)out, (void)res_out, (void)rows, (void)hidden, (void)eps;
}
#endif
