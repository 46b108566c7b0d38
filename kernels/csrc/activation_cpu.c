/*
 * SiLU-and-multiply (SwiGLU, Shazeer 2020) (helpers and rounding rules: elementwise.h).
 */
#include "elementwise.h"

#ifdef HAVE_AVX512_BF16
/* A team body (team.h); the fused decode step runs it after an int8 gate/up projection. */
void team_silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t tokens, int64_t inter) {
#pragma omp for schedule(static)
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

static void silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t tokens, int64_t inter,
                              int num_threads) {
#pragma omp parallel num_threads(num_threads)
    team_silu_and_mul_bf16(x, out, tokens, inter);
}
#else
void team_silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t tokens, int64_t inter) {
    (void)x, (void)out, (void)tokens, (void)inter; /* decode_layers_available() is 0 here */
}
#endif

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
