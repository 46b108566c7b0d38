/*
 * The vector paths of gguf_quant_cpu.c (included by it once, after its scalar block
 * decoders): AVX-512, AVX2 + FMA, or portable C, by the build's target.
 *
 *   fused_type(t)          whether fused_rows serves type t (Q4_0, Q4_1, Q8_0)
 *   FUSED_MAX_ROWS         the most x rows fused_rows takes per call
 *   fused_rows(...)        y[r * sy] = dot(x row r, weight row) for r < M, the weight
 *                          row's blocks expanded to float32 in registers
 *   dequant_row_fast(...)  a weight row into a float buffer (vectorized where fused)
 *   dot_f32(a, b, K)       sum a[k] b[k], K % 16 == 0
 *
 * A Q4 block's 16 bytes hold elements 0..15 in their low nibbles and 16..31 in their
 * high nibbles (ggml's block_q4_0/block_q4_1), so a zero-extended byte vector masked
 * gives the first half and shifted the second, each already in element order.
 */
#ifndef GGUF_QUANT_SIMD_H
#define GGUF_QUANT_SIMD_H

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VW 16 /* floats per vector */
#define NV 2  /* vectors per 32-element block */
typedef __m512 vf;
#define V_LOAD _mm512_loadu_ps
#define V_STORE _mm512_storeu_ps
#define V_FMA _mm512_fmadd_ps
#define V_ZERO _mm512_setzero_ps
#define V_SET1 _mm512_set1_ps
#define V_SUM _mm512_reduce_add_ps
#define FUSED_MAX_ROWS 4

/* One Q4_0 / Q4_1 / Q8_0 block (type a compile-time constant) -> w[0..1]. */
static inline __attribute__((always_inline)) void expand(const int type, const uint8_t *b,
                                                         vf *w) {
    const float d = half_to_float(b);
    if (type == Q8_0) {
        const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
        const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)));
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), V_SET1(d));
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), V_SET1(d));
        return;
    }
    /* Q4_0: d * (q - 8) == fma(q, d, -8 d) exactly (-8 d is exact) */
    const float m = type == Q4_1 ? half_to_float(b + 2) : -8.f * d;
    const __m512i q =
        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (type == Q4_1 ? 4 : 2))));
    const __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(15));
    const __m512i hi = _mm512_srli_epi32(q, 4);
    w[0] = V_FMA(_mm512_cvtepi32_ps(lo), V_SET1(d), V_SET1(m));
    w[1] = V_FMA(_mm512_cvtepi32_ps(hi), V_SET1(d), V_SET1(m));
}

#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define NV 4
typedef __m256 vf;
#define V_LOAD _mm256_loadu_ps
#define V_STORE _mm256_storeu_ps
#define V_FMA _mm256_fmadd_ps
#define V_ZERO _mm256_setzero_ps
#define V_SET1 _mm256_set1_ps
/* 4 rows x 4 accumulators would take all 16 ymm registers before the weights */
#define FUSED_MAX_ROWS 2

static inline float V_SUM(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void expand(const int type, const uint8_t *b,
                                                         vf *w) {
    const float d = half_to_float(b);
    if (type == Q8_0) {
        for (int i = 0; i < 4; ++i) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)));
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), V_SET1(d));
        }
        return;
    }
    const float m = type == Q4_1 ? half_to_float(b + 2) : -8.f * d;
    const uint8_t *qs = b + (type == Q4_1 ? 4 : 2);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));       /* 0..7 */
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8))); /* 8.. */
    const __m256i mask = _mm256_set1_epi32(15);
    w[0] = V_FMA(_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), V_SET1(d), V_SET1(m));
    w[1] = V_FMA(_mm256_cvtepi32_ps(_mm256_and_si256(c, mask)), V_SET1(d), V_SET1(m));
    w[2] = V_FMA(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), V_SET1(d), V_SET1(m));
    w[3] = V_FMA(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), V_SET1(d), V_SET1(m));
}
#endif

#ifdef VW
static inline int fused_type(int type) { return type == Q4_0 || type == Q4_1 || type == Q8_0; }

/* R rows of x (R a compile-time constant) against one weight row of nb blocks. */
static inline __attribute__((always_inline)) void fused_impl(const int type, const int R,
                                                             const uint8_t *row, int64_t nb,
                                                             const float *x, int64_t sx,
                                                             float *y, int64_t sy) {
    const int64_t bb = type == Q8_0 ? 34 : type == Q4_1 ? 20 : 18;
    vf acc[FUSED_MAX_ROWS][NV];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = V_ZERO();
    for (int64_t b = 0; b < nb; ++b) {
        vf w[NV];
        expand(type, row + b * bb, w);
        for (int r = 0; r < R; ++r)
            for (int v = 0; v < NV; ++v)
                acc[r][v] = V_FMA(w[v], V_LOAD(x + r * sx + b * 32 + v * VW), acc[r][v]);
    }
    for (int r = 0; r < R; ++r) {
        vf s = acc[r][0];
        for (int v = 1; v < NV; ++v) s += acc[r][v];
        y[r * sy] = V_SUM(s);
    }
}

#define FUSED_TYPES(R)                                                                      \
    do {                                                                                    \
        if (type == Q4_1) fused_impl(Q4_1, R, row, nb, x, sx, y, sy);                       \
        else if (type == Q4_0) fused_impl(Q4_0, R, row, nb, x, sx, y, sy);                  \
        else fused_impl(Q8_0, R, row, nb, x, sx, y, sy);                                    \
    } while (0)

static void fused_rows(int type, const uint8_t *row, int64_t nb, const float *x, int64_t sx,
                       int64_t M, float *y, int64_t sy) {
    for (int64_t r0 = 0; r0 < M; r0 += FUSED_MAX_ROWS) {
        const int64_t left = M - r0;
        const float *xr = x + r0 * sx;
        float *yr = y + r0 * sy;
        if (left >= FUSED_MAX_ROWS) {
            const float *x = xr;
            float *y = yr;
            FUSED_TYPES(FUSED_MAX_ROWS);
        } else {
            const float *x = xr;
            float *y = yr;
            for (int64_t r = 0; r < left; ++r, x += sx, y += sy) FUSED_TYPES(1);
        }
    }
}
#undef FUSED_TYPES

static void dequant_row_fast(int type, const uint8_t *row, int64_t K, float *out) {
    if (!fused_type(type)) {
        dequant_row(type, row, K, out);
        return;
    }
    const int64_t bb = block_bytes(type);
    for (int64_t b = 0; b < K / 32; ++b) {
        vf w[NV];
        if (type == Q4_1) expand(Q4_1, row + b * bb, w);
        else if (type == Q4_0) expand(Q4_0, row + b * bb, w);
        else expand(Q8_0, row + b * bb, w);
        for (int v = 0; v < NV; ++v) V_STORE(out + b * 32 + v * VW, w[v]);
    }
}

static inline float dot_f32(const float *a, const float *b, int64_t K) {
    vf s0 = V_ZERO(), s1 = V_ZERO();
    int64_t k = 0;
    for (; k + 2 * VW <= K; k += 2 * VW) {
        s0 = V_FMA(V_LOAD(a + k), V_LOAD(b + k), s0);
        s1 = V_FMA(V_LOAD(a + k + VW), V_LOAD(b + k + VW), s1);
    }
    float s = V_SUM(s0 + s1);
    for (; k < K; ++k) s += a[k] * b[k];
    return s;
}

#else /* portable C: no fused path */
#define FUSED_MAX_ROWS 1
static inline int fused_type(int type) {
    (void)type;
    return 0;
}

static void fused_rows(int type, const uint8_t *row, int64_t nb, const float *x, int64_t sx,
                       int64_t M, float *y, int64_t sy) {
    (void)type, (void)row, (void)nb, (void)x, (void)sx, (void)M, (void)y, (void)sy;
}

static void dequant_row_fast(int type, const uint8_t *row, int64_t K, float *out) {
    dequant_row(type, row, K, out);
}

static inline float dot_f32(const float *a, const float *b, int64_t K) {
    float s[8] = {0};
    for (int64_t k = 0; k < K; k += 8)
        for (int j = 0; j < 8; ++j) s[j] += a[k + j] * b[k + j];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}
#endif

#endif
