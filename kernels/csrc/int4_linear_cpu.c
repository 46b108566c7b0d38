/*
 * W4A8 linear layers for on-load int4: 4-bit weights quantized per group of G
 * inputs (symmetric, stored as 0..15 around the zero point 8, a float32 scale per
 * output channel and group), int8 activations quantized per token on the fly
 * (symmetric, dynamic, as the W8A8 kernel), int32 dot products per group, the
 * group's weight scale applied in float32 and the token's scale once at the end.
 *
 * Why: a batch-1 decode step streams every weight once, so its time is the bytes
 * read; 4-bit weights are a quarter of bf16's. With int8 activations the nibbles
 * are VPDPBUSD operands as they are (unsigned, 0..15), so unpacking costs one AND
 * (and a shift) per 128 weights, where a W4A16 kernel would widen every weight to
 * bf16 or float before its dot product.
 *
 * Math (the torch reference is kernels/quant/grouped.py w4a8_group_linear, which
 * this equals exactly):
 *   sx[m] = max(max_k |x[m, k]|, 1e-12) / 127                      (float32)
 *   xq[m, k] = clamp(round_half_even(x[m, k] / sx[m]), -128, 127)   (true division)
 *   acc[m, n, g] = sum_{k in g} xq[m, k] * (v[n, k] - 8)            (int32, exact)
 *   f[m, n] = 0; for g = 0, 1, ...: f = f + (float)acc[m, n, g] * s[n, g]
 *   y[m, n] = f * sx[m] (+ bias[n])                                 (float32, then
 *                                                                    bf16 RNE if bf16)
 * The kernel forms acc as sum v * xq - 8 * sum xq (the group sums of xq come
 * with the quantization). Built with -ffp-contract=off (native_build.py) so the
 * float steps round one by one as torch does.
 *
 * Weight layout (kernels/quant/int4_native.py pack_int4, once at load): 16 output
 * channels x 8 inputs per 64-byte unit, byte 4 i + j of unit (nb, kp) holding
 * v[16 nb + i, 8 kp + j] in its low nibble and v[16 nb + i, 8 kp + 4 + j] in its
 * high one; units ordered (nb, kp), so each block of 16 channels is one contiguous
 * stream of K / 8 units; N zero-padded to 16. Scales: ws[(nb * NG + g) * 16 + i] =
 * s[16 nb + i, g] (0 on padding channels). G is a multiple of 8 dividing K, so a
 * unit never straddles two groups.
 *
 * Paths (TANDEM_INT8_*, the W8A8 kernel's; int8_linear_paths() says which run here):
 *  - AVX512_VNNI: VPDPBUSD on zmm (nibbles unsigned, xq signed);
 *  - AVX_VNNI: the VEX-encoded VPDPBUSD on ymm;
 *  - AVX2: VPMADDUBSW + VPMADDWD (nibbles as the unsigned operand: a pair sums
 *    at most 2 * 15 * 128, so the 16-bit step never saturates, nor the sum of the
 *    low and high nibbles' pairs);
 *  - SCALAR: portable C.
 *
 * Threads split the 16-channel blocks into contiguous runs; each walks its blocks
 * in groups of up to 4, every row tile against one group, as the W8A8 kernel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "elementwise.h"
#include "tandem_kernels.h"
#include "team.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define HAVE_AVXVNNI 1
#define T_AVXVNNI __attribute__((target("avx2,fma,avxvnni")))
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512VNNI 1
#define T_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#endif
#define INLINE static inline __attribute__((always_inline))

/* One row -> xq (K signed bytes), its scale and the NG group sums of xq. */
static void quantize_row(const void *x, int is_bf16, int64_t K, int64_t G, int8_t *xq,
                         int32_t *xsum, float *scale) {
    *scale = quantize_row_int8(x, is_bf16, K, 0, (uint8_t *)xq);
    for (int64_t g = 0; g < K / G; ++g) {
        int32_t sum = 0;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += xq[k];
        xsum[g] = sum;
    }
}

/* A micro-kernel: f[r * 64 + c * 16 + i] for RB rows of xq (row stride sq, group
 * sums xsum[r * NG + g]) against CB blocks at w (block stride sb bytes) with their
 * scales at ws (block stride NG * 16 floats), over NG groups of UG units each. */
typedef void (*micro_fn)(const int8_t *xq, int64_t sq, const int32_t *xsum, const uint8_t *w,
                         int64_t sb, const float *ws, int64_t NG, int64_t UG, int rb, int cb,
                         float *f);

static void micro_scalar(const int8_t *xq, int64_t sq, const int32_t *xsum, const uint8_t *w,
                         int64_t sb, const float *ws, int64_t NG, int64_t UG, int rb, int cb,
                         float *f) {
    for (int r = 0; r < rb; ++r)
        for (int c = 0; c < cb; ++c) {
            float out[16] = {0};
            const int8_t *x = xq + r * sq;
            const uint8_t *blk = w + c * sb;
            for (int64_t g = 0; g < NG; ++g) {
                int32_t a[16] = {0};
                for (int64_t kp = g * UG; kp < (g + 1) * UG; ++kp)
                    for (int i = 0; i < 16; ++i)
                        for (int j = 0; j < 4; ++j) {
                            const uint8_t b = blk[kp * 64 + i * 4 + j];
                            a[i] += (int32_t)(b & 15) * x[kp * 8 + j] +
                                    (int32_t)(b >> 4) * x[kp * 8 + 4 + j];
                        }
                const float *s = ws + c * NG * 16 + g * 16;
                const int32_t corr = 8 * xsum[r * NG + g];
                for (int i = 0; i < 16; ++i) out[i] = out[i] + (float)(a[i] - corr) * s[i];
            }
            memcpy(f + r * 64 + c * 16, out, sizeof out);
        }
}

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Expands to micro_<name>(..., rb, cb, ...), dispatching (rb, cb) to the inlined
 * body with both constant, so its accumulators stay in registers (the callers
 * keep rb x cb within path_micro's cbmax). */
#define DISPATCH(name, ATTR)                                                                   \
    static ATTR void micro_##name(const int8_t *xq, int64_t sq, const int32_t *xsum,           \
                                  const uint8_t *w, int64_t sb, const float *ws, int64_t NG,   \
                                  int64_t UG, int rb, int cb, float *f) {                      \
        switch (rb * 8 + cb) {                                                                 \
        case 9: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 1, 1, f); break;                  \
        case 10: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 1, 2, f); break;                 \
        case 11: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 1, 3, f); break;                 \
        case 12: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 1, 4, f); break;                 \
        case 17: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 2, 1, f); break;                 \
        case 18: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 2, 2, f); break;                 \
        case 19: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 2, 3, f); break;                 \
        case 20: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 2, 4, f); break;                 \
        case 25: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 3, 1, f); break;                 \
        case 26: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 3, 2, f); break;                 \
        case 33: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 4, 1, f); break;                 \
        case 34: body_##name(xq, sq, xsum, w, sb, ws, NG, UG, 4, 2, f); break;                 \
        default: break;                                                                        \
        }                                                                                      \
    }

/* Blocks per tile at rb rows: the 512-bit path holds an int32 and a float
 * accumulator per block and row plus two nibble vectors per block (at most 28 of
 * 32 zmm); the 256-bit paths twice as many registers of half the width. */
#define CBMAX_512(rb) ((rb) <= 2 ? 4 : 2)
#define CBMAX_256(rb) ((rb) == 1 ? 2 : 1)

#if defined(__AVX2__)
/* The 256-bit bodies: block c's channels 0-7 in accumulator 2 c, 8-15 in 2 c + 1. */
#define BODY_256(name, ATTR, DOT)                                                              \
    INLINE ATTR void body_##name(const int8_t *xq, int64_t sq, const int32_t *xsum,            \
                                 const uint8_t *w, int64_t sb, const float *ws, int64_t NG,    \
                                 int64_t UG, const int RB, const int CB, float *f) {           \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                             \
        const __m256i ones = _mm256_set1_epi16(1);                                             \
        (void)ones;                                                                            \
        __m256 fa[4][8];                                                                       \
        for (int r = 0; r < RB; ++r)                                                           \
            for (int c = 0; c < 2 * CB; ++c) fa[r][c] = _mm256_setzero_ps();                   \
        for (int64_t g = 0; g < NG; ++g) {                                                     \
            __m256i a[4][8];                                                                   \
            for (int r = 0; r < RB; ++r)                                                       \
                for (int c = 0; c < 2 * CB; ++c) a[r][c] = _mm256_setzero_si256();             \
            for (int64_t kp = g * UG; kp < (g + 1) * UG; ++kp) {                               \
                __m256i lo[8], hi[8];                                                          \
                for (int c = 0; c < 2 * CB; ++c) {                                             \
                    const __m256i v = _mm256_loadu_si256(                                      \
                        (const __m256i *)(w + (c >> 1) * sb + kp * 64 + (c & 1) * 32));        \
                    lo[c] = _mm256_and_si256(v, m4);                                           \
                    hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);                     \
                }                                                                              \
                for (int r = 0; r < RB; ++r) {                                                 \
                    const __m256i x0 = _mm256_set1_epi32(load4(xq + r * sq + kp * 8));         \
                    const __m256i x1 = _mm256_set1_epi32(load4(xq + r * sq + kp * 8 + 4));     \
                    for (int c = 0; c < 2 * CB; ++c) DOT(a[r][c], lo[c], hi[c], x0, x1);       \
                }                                                                              \
            }                                                                                  \
            for (int r = 0; r < RB; ++r) {                                                     \
                const __m256i corr = _mm256_set1_epi32(8 * xsum[r * NG + g]);                  \
                for (int c = 0; c < 2 * CB; ++c) {                                             \
                    const __m256 s = _mm256_loadu_ps(ws + (c >> 1) * NG * 16 + g * 16 +        \
                                                     (c & 1) * 8);                             \
                    const __m256 p =                                                           \
                        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a[r][c], corr)), s); \
                    fa[r][c] = _mm256_add_ps(fa[r][c], p);                                     \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < RB; ++r)                                                           \
            for (int c = 0; c < 2 * CB; ++c) _mm256_storeu_ps(f + r * 64 + c * 8, fa[r][c]);   \
    }

/* the two nibbles' pairs summed in 16 bits (at most 4 * 15 * 128), then widened */
#define DOT_AVX2(acc, lo, hi, x0, x1)                                                          \
    acc = _mm256_add_epi32(                                                                    \
        acc, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, x0),                  \
                                                _mm256_maddubs_epi16(hi, x1)),                 \
                               ones))
BODY_256(avx2, , DOT_AVX2)
DISPATCH(avx2, )
#endif

#ifdef HAVE_AVXVNNI
#define DOT_AVXVNNI(acc, lo, hi, x0, x1)                                                       \
    acc = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, lo, x0), hi, x1)
BODY_256(avxvnni, T_AVXVNNI, DOT_AVXVNNI)
DISPATCH(avxvnni, T_AVXVNNI)
#endif

#ifdef HAVE_AVX512VNNI
INLINE T_AVX512VNNI void body_avx512vnni(const int8_t *xq, int64_t sq, const int32_t *xsum,
                                         const uint8_t *w, int64_t sb, const float *ws,
                                         int64_t NG, int64_t UG, const int RB, const int CB,
                                         float *f) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 fa[4][4];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CB; ++c) fa[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NG; ++g) {
        __m512i a[4][4];
        for (int r = 0; r < RB; ++r)
            for (int c = 0; c < CB; ++c) a[r][c] = _mm512_setzero_si512();
        for (int64_t kp = g * UG; kp < (g + 1) * UG; ++kp) {
            __m512i lo[4], hi[4];
            for (int c = 0; c < CB; ++c) {
                const __m512i v = _mm512_loadu_si512(w + c * sb + kp * 64);
                lo[c] = _mm512_and_si512(v, m4);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            for (int r = 0; r < RB; ++r) {
                const __m512i x0 = _mm512_set1_epi32(load4(xq + r * sq + kp * 8));
                const __m512i x1 = _mm512_set1_epi32(load4(xq + r * sq + kp * 8 + 4));
                for (int c = 0; c < CB; ++c)
                    a[r][c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[r][c], lo[c], x0), hi[c],
                                                  x1);
            }
        }
        for (int r = 0; r < RB; ++r) {
            const __m512i corr = _mm512_set1_epi32(8 * xsum[r * NG + g]);
            for (int c = 0; c < CB; ++c) {
                const __m512 s = _mm512_loadu_ps(ws + c * NG * 16 + g * 16);
                const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][c], corr)),
                                               s);
                fa[r][c] = _mm512_add_ps(fa[r][c], p);
            }
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CB; ++c) _mm512_storeu_ps(f + r * 64 + c * 16, fa[r][c]);
}
DISPATCH(avx512vnni, T_AVX512VNNI)
#endif

/* The path's micro-kernel and blocks per tile at rb rows (NULL: not built). */
static micro_fn path_micro(int path, int rb, int *cbmax) {
    (void)rb; /* unused where no SIMD path is built */
    *cbmax = 4;
    switch (path) {
    case TANDEM_INT8_SCALAR: return micro_scalar;
#if defined(__AVX2__)
    case TANDEM_INT8_AVX2: *cbmax = CBMAX_256(rb); return micro_avx2;
#endif
#ifdef HAVE_AVXVNNI
    case TANDEM_INT8_AVX_VNNI: *cbmax = CBMAX_256(rb); return micro_avxvnni;
#endif
#ifdef HAVE_AVX512VNNI
    case TANDEM_INT8_AVX512_VNNI: *cbmax = CBMAX_512(rb); return micro_avx512vnni;
#endif
    default: return NULL;
    }
}

static int shape_ok(int64_t M, int64_t N, int64_t K, int64_t G) {
    return M >= 1 && N >= 1 && K >= 1 && G >= 8 && G % 8 == 0 && K % G == 0;
}

int64_t int4_scratch_bytes(int64_t M, int64_t K, int64_t G) {
    const int64_t xq = (M * K + 63) & ~(int64_t)63;
    return xq + ((M * 4 + 63) & ~(int64_t)63) + M * (K / G) * 4;
}

void int4_scratch_size(int64_t M, int64_t K, int64_t G, int64_t *bytes) {
    *bytes = G > 0 ? int4_scratch_bytes(M, K, G) : 0;
}

int team_int4_matmul(int path, int is_bf16, const void *x, int64_t sx, const void *wp,
                     const float *ws, int64_t G, const float *bias, void *y, int64_t sy,
                     int64_t M, int64_t N, int64_t K, void *scratch) {
    int cbmax;
    const int rb_main = M < 4 ? (int)M : 4;
    const micro_fn micro = path_micro(path, rb_main, &cbmax);
    if (micro == NULL || !(int8_linear_paths() >> path & 1) || !shape_ok(M, N, K, G)) return -1;
    const int64_t NB = (N + 15) / 16, NG = K / G, UG = G / 8, sb = K / 8 * 64;
    int8_t *xq = (int8_t *)scratch;
    float *xs = (float *)((char *)scratch + ((M * K + 63) & ~(int64_t)63));
    int32_t *xsum = (int32_t *)((char *)xs + ((M * 4 + 63) & ~(int64_t)63));
    const size_t esize = is_bf16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
        quantize_row((const char *)x + m * sx * esize, is_bf16, K, G, xq + m * K, xsum + m * NG,
                     xs + m);
    int tid = 0, team = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    const int64_t nb0 = NB * tid / team, nb1 = NB * (tid + 1) / team;
    const uint8_t *w = (const uint8_t *)wp;
    for (int64_t b = nb0; b < nb1; b += cbmax) {
        const int cb = (int)(nb1 - b < cbmax ? nb1 - b : cbmax);
        for (int64_t m = 0; m < M; m += rb_main) {
            const int rb = (int)(M - m < rb_main ? M - m : rb_main);
            float f[4 * 64];
            micro(xq + m * K, K, xsum + m * NG, w + b * sb, sb, ws + b * NG * 16, NG, UG, rb, cb,
                  f);
            for (int r = 0; r < rb; ++r) {
                const float sxr = xs[m + r];
                const int64_t n0 = b * 16, nn = N - n0 < cb * 16 ? N - n0 : cb * 16;
                float out[64];
                for (int64_t i = 0; i < nn; ++i) {
                    float v = f[r * 64 + i] * sxr;
                    if (bias) v = v + bias[n0 + i];
                    out[i] = v;
                }
                if (is_bf16) {
                    uint16_t *yr = (uint16_t *)y + (m + r) * sy + n0;
                    for (int64_t i = 0; i < nn; ++i) yr[i] = bf16_bits(out[i]);
                } else {
                    memcpy((float *)y + (m + r) * sy + n0, out, (size_t)nn * 4);
                }
            }
        }
    }
#pragma omp barrier
    return 0;
}

int int4_linear(int path, int is_bf16, const void *x, int64_t sx, const void *wp, const float *ws,
                int64_t G, const float *bias, void *y, int64_t sy, int64_t M, int64_t N,
                int64_t K, int num_threads) {
    int cbmax;
    if (path_micro(path, 1, &cbmax) == NULL || !(int8_linear_paths() >> path & 1)) return -1;
    if (!shape_ok(M, N, K, G)) return -2;
    void *scratch = malloc((size_t)int4_scratch_bytes(M, K, G));
    if (scratch == NULL) return -3;
    int rc = 0;
    /* a tiny layer is not worth waking the team for */
#pragma omp parallel num_threads(num_threads) if (M * N * K > (1 << 17))
    {
        const int r = team_int4_matmul(path, is_bf16, x, sx, wp, ws, G, bias, y, sy, M, N, K,
                                       scratch);
        if (r != 0) {
#pragma omp atomic write
            rc = r;
        }
    }
    free(scratch);
    return rc;
}
