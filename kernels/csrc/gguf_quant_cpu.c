/*
 * GGUF (ggml) block-quantized linear layers: y[M, N] = x[M, K] @ dequant(W)[N, K]^T
 * with W kept in its file's blocks, dequantized in registers.
 *
 * Why: a decode step is bound by reading the weights; a Q4_1 row costs 5 bits per
 * weight against bf16's 16, so reading the blocks and expanding them in registers
 * beats dequantizing at load. The weight is never written out in float.
 *
 * Block layouts: ggml's (ggml/src/ggml-common.h block_q4_0 ... block_q6_K; see
 * kernels/gguf_quants.py for the table). Type ids are ggml's GGMLQuantizationType.
 *
 * Paths (by the compiler target of this build, kernels/native_build.py):
 *  - AVX-512 / AVX2+FMA: Q4_0, Q4_1 and Q8_0 blocks expanded to float32 vectors
 *    (zero-extend, nibble mask/shift, convert, one FMA with the block's scale and
 *    offset) and multiplied into up to 4 rows of x at once (the "fused" path);
 *  - every other type, and batches of more than 4 rows: one weight row dequantized
 *    into an L1-resident float buffer, then dotted with every x row (SIMD dot);
 *  - a portable scalar build of both (the generic / baseline variants).
 * Prefill-sized batches go through gguf_dequant_rows (a dequantized copy for the
 * GEMM) from Python instead.
 *
 * Math: float32 throughout; a weight is d*q + m computed with one rounding (FMA) on
 * the SIMD paths where ggml's reference rounds twice, so results equal dequantize-
 * then-matmul within float32 rounding, summed in another order.
 *
 * Built with -ffp-contract=off (native_build.py) so the scalar dequantization rounds
 * step by step as the gguf package's reference (bit-equal, tested).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "elementwise.h"
#include "tandem_kernels.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* Elements and bytes per block, 0 for a type this file does not know. */
static int64_t block_elems(int type) {
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
    }
}

static int64_t block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

int gguf_block_size(int type) { return (int)block_elems(type); }
int gguf_type_size(int type) { return (int)block_bytes(type); }

/* IEEE half -> float, exactly (denormals, inf, NaN included). */
static inline float half_to_float(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            --exp;
        }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j of a K-quant. */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One block of `type` -> its elements, in the reference's rounding steps. */
static void dequant_block(int type, const uint8_t *b, float *out) {
    switch (type) {
    case Q8_0: {
        const float d = half_to_float(b);
        for (int i = 0; i < 32; ++i) out[i] = (float)(int8_t)b[2 + i] * d;
        return;
    }
    case Q4_0: case Q4_1: {
        const float d = half_to_float(b), m = type == Q4_1 ? half_to_float(b + 2) : 0.f;
        const uint8_t *qs = b + (type == Q4_1 ? 4 : 2);
        for (int i = 0; i < 16; ++i) {
            const int lo = qs[i] & 15, hi = qs[i] >> 4;
            out[i] = type == Q4_1 ? d * (float)lo + m : d * (float)(lo - 8);
            out[i + 16] = type == Q4_1 ? d * (float)hi + m : d * (float)(hi - 8);
        }
        return;
    }
    case Q5_0: case Q5_1: {
        const int one = type == Q5_1;
        const float d = half_to_float(b), m = one ? half_to_float(b + 2) : 0.f;
        const uint8_t *h = b + (one ? 4 : 2), *qs = h + 4;
        const uint32_t qh = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
                            (uint32_t)h[3] << 24;
        for (int i = 0; i < 16; ++i) {
            const int lo = (qs[i] & 15) | (int)((qh >> i) & 1) << 4;
            const int hi = (qs[i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4;
            out[i] = one ? d * (float)lo + m : d * (float)(lo - 16);
            out[i + 16] = one ? d * (float)hi + m : d * (float)(hi - 16);
        }
        return;
    }
    case Q4_K: case Q5_K: {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16;
        const uint8_t *qs = b + (type == Q5_K ? 48 : 16);
        for (int j = 0; j < 8; ++j) { /* sub-block j: nibble j & 1 of bytes 32 (j / 2) .. */
            int sc, mn;
            scale_min_k4(j, scales, &sc, &mn);
            const float dl = d * (float)sc, ml = dmin * (float)mn;
            const uint8_t *q = qs + 32 * (j / 2);
            for (int l = 0; l < 32; ++l) {
                int v = (j & 1) ? q[l] >> 4 : q[l] & 15;
                if (type == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
                out[32 * j + l] = dl * (float)v - ml;
            }
        }
        return;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_to_float(b + 208);
        for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, out += 128)
            for (int l = 0; l < 32; ++l) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4) - 32;
                const int q2 = ((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32;
                const int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
                const int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
                out[l] = d * (float)sc[is] * (float)q1;
                out[l + 32] = d * (float)sc[is + 2] * (float)q2;
                out[l + 64] = d * (float)sc[is + 4] * (float)q3;
                out[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        return;
    }
    default:
        return;
    }
}

static void dequant_row(int type, const uint8_t *row, int64_t K, float *out) {
    const int64_t be = block_elems(type), bb = block_bytes(type);
    for (int64_t b = 0; b < K / be; ++b) dequant_block(type, row + b * bb, out + b * be);
}

/* Rows ids[i] (ids NULL: rows 0..n-1) of a [*, K] matrix of `type` -> out[i] (float32,
 * or bf16 rounded to nearest even when out_bf16), rows so elements apart. */
int gguf_dequant_rows(int type, const void *w, int64_t row_bytes, const int64_t *ids, int64_t n,
                      int64_t K, void *out, int64_t so, int out_bf16, int num_threads) {
    const int64_t be = block_elems(type);
    if (be == 0) return -1;
    if (K % be || row_bytes != K / be * block_bytes(type)) return -2;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (n * K > (1 << 16))
    {
        float *buf = out_bf16 ? (float *)malloc((size_t)K * sizeof(float)) : NULL;
        if (out_bf16 && buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
            const uint8_t *row = (const uint8_t *)w + (ids ? ids[i] : i) * row_bytes;
            if (!out_bf16) {
                dequant_row(type, row, K, (float *)out + i * so);
            } else if (buf != NULL) {
                dequant_row(type, row, K, buf);
                uint16_t *o = (uint16_t *)out + i * so;
                for (int64_t k = 0; k < K; ++k) o[k] = bf16_bits(buf[k]);
            }
        }
        free(buf);
    }
    return failed ? -3 : 0;
}

#include "gguf_quant_simd.h"

/* y[m, n] = sum_k x[m, k] w[n, k]; x rows sx floats apart, y rows sy apart. */
int gguf_matmul(int type, const float *x, int64_t sx, int64_t M, int64_t K, const void *w,
                int64_t N, float *y, int64_t sy, int num_threads) {
    const int64_t be = block_elems(type), bb = block_bytes(type);
    if (be == 0) return -1;
    if (K % be) return -2;
    const int64_t row_bytes = K / be * bb;
    const int fused = M <= 4 && fused_type(type);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (M * N * K > (1 << 15))
    {
        float *buf = fused ? NULL : (float *)aligned_alloc(64, (size_t)(K + 16) / 16 * 64);
        if (!fused && buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const uint8_t *row = (const uint8_t *)w + n * row_bytes;
            if (fused) {
                fused_rows(type, row, K / be, x, sx, M, y + n, sy);
            } else if (buf != NULL) {
                dequant_row_fast(type, row, K, buf);
                for (int64_t m = 0; m < M; ++m) y[m * sy + n] = dot_f32(x + m * sx, buf, K);
            }
        }
        free(buf);
    }
    return failed ? -3 : 0;
}

int gguf_matmul_path(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return TANDEM_GGUF_AVX512;
#elif defined(__AVX2__) && defined(__FMA__)
    return TANDEM_GGUF_AVX2;
#else
    return TANDEM_GGUF_SCALAR;
#endif
}
