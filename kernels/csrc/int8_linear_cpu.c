/*
 * W8A8 linear layers: int8 weights quantized per output channel (symmetric), int8
 * activations quantized per token on the fly (symmetric, dynamic), int32 dot
 * products, the two scales applied once at the end.
 *
 * Why: a decode step streams every weight once, so its time is the bytes read;
 * int8 weights are half of bf16's. The dot products run on the integer units
 * (VPDPBUSD where the CPU has VNNI), so expanding the weights costs nothing.
 *
 * Math (compressed-tensors' int-quantized scheme; the torch reference is
 * kernels/quant/grouped.py int8_rowwise_linear, which this equals exactly):
 *   sx[m] = max(max_k |x[m, k]|, 1e-12) / 127                      (float32)
 *   xq[m, k] = clamp(round_half_even(x[m, k] / sx[m]), -128, 127)   (true division)
 *   acc[m, n] = sum_k xq[m, k] * q[n, k]                            (int32, exact)
 *   y[m, n] = ((float)acc * sx[m]) * s[n] (+ bias[n])               (float32, then
 *                                                                    bf16 RNE if bf16)
 * Built with -ffp-contract=off (native_build.py) so the epilogue rounds step by
 * step as torch does.
 *
 * Weight layout (int8_pack_weight, once at load): 16 output channels x 4 inputs
 * per 64-byte group, wp[(nb * KQ + kq) * 64 + 4 i + j] = q[16 nb + i, 4 kq + j],
 * KQ = ceil(K / 4), N and K zero-padded to 16 and 4. One 64-byte load is the
 * operand of one 512-bit VPDPBUSD (16 int32 lanes, each a 4-deep dot product)
 * or of two 256-bit ones; each block of 16 channels is one contiguous stream.
 *
 * Paths (TANDEM_INT8_*; int8_linear_paths() says which this build runs here):
 *  - AVX512_VNNI: VPDPBUSD on zmm, up to 4 rows x 64 channels of accumulators;
 *  - AVX_VNNI: the VEX-encoded VPDPBUSD on ymm (Alder Lake and later, Zen 4/5);
 *  - AVX2: VPMADDUBSW + VPMADDWD (llama.cpp's sign trick: |x| as the unsigned
 *    operand, w with x's sign as the signed one, so a pair sums at most
 *    2 * 128 * 127 < 2^15 and the 16-bit step never saturates);
 *  - SCALAR: portable C.
 * VPDPBUSD multiplies unsigned by signed bytes, so its paths store xq + 128 (u8)
 * and subtract 128 * sum_k q[n, k] (wsum, from the packing) from the sum. The
 * VNNI paths are compiled with function target attributes and chosen at run
 * time (__builtin_cpu_supports): VNNI is in no psABI level, so the x86-64-v3/v4
 * builds would otherwise never use it.
 *
 * Threads split the 16-channel blocks into contiguous runs (at most one block
 * apart in size); each walks its blocks in groups, every row tile against one
 * group, so a group's weights stay in cache across a prefill's rows.
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

static int64_t kq_of(int64_t K) { return (K + 3) / 4; }

int int8_linear_paths(void) {
    int paths = 1 << TANDEM_INT8_SCALAR;
    __builtin_cpu_init();
#if defined(__AVX2__)
    paths |= 1 << TANDEM_INT8_AVX2;
#endif
#ifdef HAVE_AVXVNNI
    if (__builtin_cpu_supports("avxvnni")) paths |= 1 << TANDEM_INT8_AVX_VNNI;
#endif
#ifdef HAVE_AVX512VNNI
    if (__builtin_cpu_supports("avx512vnni")) paths |= 1 << TANDEM_INT8_AVX512_VNNI;
#endif
    return paths;
}

void int8_pack_weight(const void *q, int64_t N, int64_t K, void *wp, int *wsum) {
    const int8_t *w = (const int8_t *)q;
    int8_t *out = (int8_t *)wp;
    const int64_t NB = (N + 15) / 16, KQ = kq_of(K);
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < NB; ++nb) {
        int8_t *blk = out + nb * KQ * 64;
        for (int64_t i = 0; i < 16; ++i) {
            const int64_t n = nb * 16 + i;
            int sum = 0;
            for (int64_t k = 0; k < KQ * 4; ++k) {
                const int8_t v = (n < N && k < K) ? w[n * K + k] : 0;
                blk[(k / 4) * 64 + i * 4 + (k % 4)] = v;
                sum += v;
            }
            wsum[n] = sum;
        }
    }
}

/* One row -> xq (K4 bytes, the padding at the zero point) and its scale. offset:
 * 128 for the VPDPBUSD paths (u8), 0 for the others (s8). */
static void quantize_row(const void *x, int is_bf16, int64_t K, int64_t K4, int offset,
                         uint8_t *xq, float *scale) {
    *scale = quantize_row_int8(x, is_bf16, K, offset, xq);
    for (int64_t k = K; k < K4; ++k) xq[k] = (uint8_t)offset;
}

/* The tile's accumulators acc[r][c * 16 + i] (rows r, blocks b0 + c) -> y. */
static void epilogue(const int32_t *acc, int rb, int cb, int64_t r0, int64_t b0, int offset,
                     const int *wsum, const float *xs, const float *ws, const float *bias,
                     int is_bf16, void *y, int64_t sy, int64_t N) {
    for (int r = 0; r < rb; ++r) {
        const float sxr = xs[r0 + r];
        for (int64_t c = 0; c < cb; ++c) {
            const int64_t n0 = (b0 + c) * 16;
            const int64_t nn = N - n0 < 16 ? N - n0 : 16;
            const int32_t *a = acc + (r * 4 + c) * 16;
            float out[16];
            for (int64_t i = 0; i < nn; ++i) {
                const int32_t v = a[i] - offset * wsum[n0 + i];
                float f = (float)v * sxr;
                f = f * ws[n0 + i];
                if (bias) f = f + bias[n0 + i];
                out[i] = f;
            }
            if (is_bf16) {
                uint16_t *yr = (uint16_t *)y + (r0 + r) * sy + n0;
                for (int64_t i = 0; i < nn; ++i) yr[i] = bf16_bits(out[i]);
            } else {
                memcpy((float *)y + (r0 + r) * sy + n0, out, (size_t)nn * 4);
            }
        }
    }
}

/* A micro-kernel: acc[r][c * 16 ..] for RB rows of xq (row stride sq) against CB
 * blocks at w (block stride sb bytes), over KQ input quads. */
typedef void (*micro_fn)(const uint8_t *xq, int64_t sq, const int8_t *w, int64_t sb, int64_t KQ,
                         int rb, int cb, int32_t *acc);

static void micro_scalar(const uint8_t *xq, int64_t sq, const int8_t *w, int64_t sb, int64_t KQ,
                         int rb, int cb, int32_t *acc) {
    for (int r = 0; r < rb; ++r)
        for (int c = 0; c < cb; ++c) {
            int32_t a[16] = {0};
            const int8_t *x = (const int8_t *)(xq + r * sq);
            const int8_t *blk = w + c * sb;
            for (int64_t kq = 0; kq < KQ; ++kq)
                for (int i = 0; i < 16; ++i)
                    for (int j = 0; j < 4; ++j)
                        a[i] += (int32_t)x[kq * 4 + j] * blk[kq * 64 + i * 4 + j];
            memcpy(acc + (r * 4 + c) * 16, a, sizeof a);
        }
}

static inline int32_t load4(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Expands to micro_<name>(..., rb, cb, ...), dispatching (rb, cb) to the inlined
 * body with both constant, so its accumulators stay in registers (the callers
 * keep rb x cb within what the register file holds: path_micro's cbmax). */
#define DISPATCH(name, ATTR)                                                                 \
    static ATTR void micro_##name(const uint8_t *xq, int64_t sq, const int8_t *w, int64_t sb, \
                                  int64_t KQ, int rb, int cb, int32_t *acc) {                \
        switch (rb * 8 + cb) {                                                               \
        case 9: body_##name(xq, sq, w, sb, KQ, 1, 1, acc); break;                            \
        case 10: body_##name(xq, sq, w, sb, KQ, 1, 2, acc); break;                           \
        case 11: body_##name(xq, sq, w, sb, KQ, 1, 3, acc); break;                           \
        case 12: body_##name(xq, sq, w, sb, KQ, 1, 4, acc); break;                           \
        case 17: body_##name(xq, sq, w, sb, KQ, 2, 1, acc); break;                           \
        case 18: body_##name(xq, sq, w, sb, KQ, 2, 2, acc); break;                           \
        case 19: body_##name(xq, sq, w, sb, KQ, 2, 3, acc); break;                           \
        case 20: body_##name(xq, sq, w, sb, KQ, 2, 4, acc); break;                           \
        case 25: body_##name(xq, sq, w, sb, KQ, 3, 1, acc); break;                           \
        case 26: body_##name(xq, sq, w, sb, KQ, 3, 2, acc); break;                           \
        case 27: body_##name(xq, sq, w, sb, KQ, 3, 3, acc); break;                           \
        case 28: body_##name(xq, sq, w, sb, KQ, 3, 4, acc); break;                           \
        case 33: body_##name(xq, sq, w, sb, KQ, 4, 1, acc); break;                           \
        case 34: body_##name(xq, sq, w, sb, KQ, 4, 2, acc); break;                           \
        case 35: body_##name(xq, sq, w, sb, KQ, 4, 3, acc); break;                           \
        case 36: body_##name(xq, sq, w, sb, KQ, 4, 4, acc); break;                           \
        default: break;                                                                      \
        }                                                                                    \
    }

/* 256-bit paths hold two ymm accumulators per block and row (of 16): at most 8. */
#define CBMAX_256(rb) ((rb) == 1 ? 4 : (rb) == 2 ? 2 : 1)

#if defined(__AVX2__)
INLINE void body_avx2(const uint8_t *xq, int64_t sq, const int8_t *w, int64_t sb, int64_t KQ,
                      const int RB, const int CB, int32_t *acc) {
    __m256i a[4][8];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < 2 * CB; ++c) a[r][c] = _mm256_setzero_si256();
    for (int64_t kq = 0; kq < KQ; ++kq) {
        __m256i wv[8];
        for (int c = 0; c < CB; ++c) {
            wv[2 * c] = _mm256_loadu_si256((const __m256i *)(w + c * sb + kq * 64));
            wv[2 * c + 1] = _mm256_loadu_si256((const __m256i *)(w + c * sb + kq * 64 + 32));
        }
        for (int r = 0; r < RB; ++r) {
            const __m256i xb = _mm256_set1_epi32(load4(xq + r * sq + kq * 4));
            const __m256i ax = _mm256_sign_epi8(xb, xb);
            for (int c = 0; c < 2 * CB; ++c) {
                const __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[c], xb));
                a[r][c] = _mm256_add_epi32(a[r][c], _mm256_madd_epi16(p, ones));
            }
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < 2 * CB; ++c)
            _mm256_storeu_si256((__m256i *)(acc + r * 64 + c * 8), a[r][c]);
}
DISPATCH(avx2, )
#endif

#ifdef HAVE_AVXVNNI
INLINE T_AVXVNNI void body_avxvnni(const uint8_t *xq, int64_t sq, const int8_t *w, int64_t sb,
                                   int64_t KQ, const int RB, const int CB, int32_t *acc) {
    __m256i a[4][8];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < 2 * CB; ++c) a[r][c] = _mm256_setzero_si256();
    for (int64_t kq = 0; kq < KQ; ++kq) {
        __m256i wv[8];
        for (int c = 0; c < CB; ++c) {
            wv[2 * c] = _mm256_loadu_si256((const __m256i *)(w + c * sb + kq * 64));
            wv[2 * c + 1] = _mm256_loadu_si256((const __m256i *)(w + c * sb + kq * 64 + 32));
        }
        for (int r = 0; r < RB; ++r) {
            const __m256i xb = _mm256_set1_epi32(load4(xq + r * sq + kq * 4));
            for (int c = 0; c < 2 * CB; ++c) a[r][c] = _mm256_dpbusd_avx_epi32(a[r][c], xb, wv[c]);
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < 2 * CB; ++c)
            _mm256_storeu_si256((__m256i *)(acc + r * 64 + c * 8), a[r][c]);
}
DISPATCH(avxvnni, T_AVXVNNI)
#endif

#ifdef HAVE_AVX512VNNI
INLINE T_AVX512VNNI void body_avx512vnni(const uint8_t *xq, int64_t sq, const int8_t *w,
                                         int64_t sb, int64_t KQ, const int RB, const int CB,
                                         int32_t *acc) {
    __m512i a[4][4];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CB; ++c) a[r][c] = _mm512_setzero_si512();
    for (int64_t kq = 0; kq < KQ; ++kq) {
        __m512i wv[4];
        for (int c = 0; c < CB; ++c) wv[c] = _mm512_loadu_si512(w + c * sb + kq * 64);
        for (int r = 0; r < RB; ++r) {
            const __m512i xb = _mm512_set1_epi32(load4(xq + r * sq + kq * 4));
            for (int c = 0; c < CB; ++c) a[r][c] = _mm512_dpbusd_epi32(a[r][c], xb, wv[c]);
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CB; ++c) _mm512_storeu_si512(acc + r * 64 + c * 16, a[r][c]);
}
DISPATCH(avx512vnni, T_AVX512VNNI)
#endif

/* The path's micro-kernel, activation offset and blocks per tile at rb rows. */
static micro_fn path_micro(int path, int *offset, int rb, int *cbmax) {
    (void)rb; /* unused where no 256-bit path is built */
    *offset = 0;
    *cbmax = 4;
    switch (path) {
    case TANDEM_INT8_SCALAR: return micro_scalar;
#if defined(__AVX2__)
    case TANDEM_INT8_AVX2: *cbmax = CBMAX_256(rb); return micro_avx2;
#endif
#ifdef HAVE_AVXVNNI
    case TANDEM_INT8_AVX_VNNI: *offset = 128; *cbmax = CBMAX_256(rb); return micro_avxvnni;
#endif
#ifdef HAVE_AVX512VNNI
    case TANDEM_INT8_AVX512_VNNI: *offset = 128; return micro_avx512vnni;
#endif
    default: return NULL;
    }
}

int team_int8_matmul(int path, int is_bf16, const void *x, int64_t sx, const void *wp,
                     const int *wsum, const float *ws, const float *bias, void *y, int64_t sy,
                     int64_t M, int64_t N, int64_t K, void *scratch) {
    int offset, cbmax;
    const int rb_main = M < 4 ? (int)M : 4;
    const micro_fn micro = path_micro(path, &offset, rb_main, &cbmax);
    if (micro == NULL || !(int8_linear_paths() >> path & 1) || M < 1 || N < 1 || K < 1) return -1;
    const int64_t KQ = kq_of(K), K4 = KQ * 4, NB = (N + 15) / 16, sb = KQ * 64;
    uint8_t *xq = (uint8_t *)scratch;
    float *xs = (float *)(xq + ((M * K4 + 63) & ~(int64_t)63));
    const size_t esize = is_bf16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
        quantize_row((const char *)x + m * sx * esize, is_bf16, K, K4, offset, xq + m * K4,
                     xs + m);
    int tid = 0, team = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    const int64_t nb0 = NB * tid / team, nb1 = NB * (tid + 1) / team;
    const int8_t *w = (const int8_t *)wp;
    for (int64_t b = nb0; b < nb1; b += cbmax) {
        const int cb = (int)(nb1 - b < cbmax ? nb1 - b : cbmax);
        for (int64_t m = 0; m < M; m += rb_main) {
            const int rb = (int)(M - m < rb_main ? M - m : rb_main);
            int32_t acc[4 * 4 * 16];
            micro(xq + m * K4, K4, w + b * sb, sb, KQ, rb, cb, acc);
            epilogue(acc, rb, cb, m, b, offset, wsum, xs, ws, bias, is_bf16, y, sy, N);
        }
    }
#pragma omp barrier
    return 0;
}

int64_t int8_scratch_bytes(int64_t M, int64_t K) {
    return ((M * kq_of(K) * 4 + 63) & ~(int64_t)63) + M * 4;
}

void int8_scratch_size(int64_t M, int64_t K, int64_t *bytes) { *bytes = int8_scratch_bytes(M, K); }

int int8_linear(int path, int is_bf16, const void *x, int64_t sx, const void *wp, const int *wsum,
                const float *ws, const float *bias, void *y, int64_t sy, int64_t M, int64_t N,
                int64_t K, int num_threads) {
    int offset, cbmax;
    if (path_micro(path, &offset, 1, &cbmax) == NULL || !(int8_linear_paths() >> path & 1) ||
        M < 1 || N < 1 || K < 1)
        return -1;
    void *scratch = malloc((size_t)int8_scratch_bytes(M, K));
    if (scratch == NULL) return -3;
    int rc = 0;
    /* a tiny layer is not worth waking the team for */
#pragma omp parallel num_threads(num_threads) if (M * N * K > (1 << 16))
    {
        const int r = team_int8_matmul(path, is_bf16, x, sx, wp, wsum, ws, bias, y, sy, M, N, K,
                                       scratch);
        if (r != 0) {
#pragma omp atomic write
            rc = r;
        }
    }
    free(scratch);
    return rc;
}
