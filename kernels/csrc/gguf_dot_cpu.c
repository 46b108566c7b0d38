/*
 * GGUF Q4_0 / Q4_1 / Q8_0 linears on integer dot products: y[M, N] = x[M, K] @ W[N, K]^T
 * with W in its file's blocks (repacked once at load) and x quantized per 32-element
 * block to int8 on the fly, as llama.cpp's vec_dot_q4_1_q8_1 does (ggml-quants.c).
 *
 * Why: a batch-1 decode step streams every weight once, so its time is the bytes read;
 * Q4_1 is 20 bytes per 32 weights (bf16: 64). Expanding the nibbles to float32
 * (gguf_quant_cpu.c) makes the step compute bound instead; here the nibbles go straight
 * into VPDPBUSD as its unsigned operand, 8 instructions per 16 rows x 32 weights.
 *
 * Math, per row m of x and 32-block b (float32 unless said):
 *   da[m, b] = max_k |x| / 127;  xq[m, k] = round_half_even(x / da) (0 where da == 0)
 *   sa[m, b] = sum_k xq[m, k]                                          (int32, exact)
 *   D[n, b]  = sum_k u[n, k] xq[m, k]                                  (int32, exact)
 *   u: the stored unsigned weight code: Q4 nibbles q (0..15), Q8_0 q + 128 (0..255)
 *   Q4_0: t = dw * da * (float)(D - 8 sa)     (w = dw (q - 8))
 *   Q8_0: t = dw * da * (float)(D - 128 sa)   (w = dw q)
 *   Q4_1: t = dw * da * (float)D + mw * (da * (float)sa)   (w = dw q + mw)
 *   y[m, n] = sum_b t (blocks in order, one float32 accumulator) (+ bias[n])
 * so y equals a float64 evaluation of the same quantized operands within float32
 * rounding, and dequantize-then-matmul within the activation's quantization error.
 *
 * Packed layout (gguf_pack_weight; gguf_unpack_weight restores the blocks bit for bit):
 * 16 output rows per stream (N zero-padded), one tile per 32-block, tiles of a stream
 * contiguous. A Q4 tile: 4 chunks of 64 bytes, chunk c holding row i's quant bytes
 * qs[4c .. 4c + 3] at 4 i (low nibbles: weights 4c.., high: 16 + 4c..), then 16 fp16 d,
 * then (Q4_1) 16 fp16 m: 288 / 320 bytes, the blocks' own bytes. A Q8_0 tile: 8
 * chunks (weights 4c..4c + 3 of each row) of q ^ 0x80, then 16 fp16 d: 544 bytes.
 * One 64-byte chunk is the operand of one 512-bit VPDPBUSD (16 lanes, 4 weights each).
 *
 * Paths (int8_linear_cpu.c's TANDEM_INT8_*, run where int8_linear_paths() says):
 * AVX512_VNNI, AVX_VNNI (ymm halves of each chunk), AVX2 (VPMADDUBSW: a Q4 pair sums
 * at most 2 * 15 * 128, no saturation; Q8_0 takes the sign trick on q itself and adds
 * 128 sa back), and portable C. VNNI is in no psABI level, so its paths are compiled
 * with target attributes and chosen at run time.
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

#if defined(__AVX2__) && defined(__F16C__) && \
    (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define HAVE_AVXVNNI 1
#define T_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512VNNI 1
#define T_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#endif
#define INLINE static inline __attribute__((always_inline))

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

static int64_t src_block_bytes(int type) {
    return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : 0;
}

/* Bytes of one packed tile (16 rows x 32 weights), 0 for a type this file does not run. */
static int64_t tile_bytes(int type) { return 16 * src_block_bytes(type); }

int gguf_dot_type(int type) { return tile_bytes(type) != 0; }

int64_t gguf_packed_bytes(int type, int64_t N, int64_t K) {
    return (N + 15) / 16 * (K / 32) * tile_bytes(type);
}

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
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
}

/* Row n's block b <-> tile bytes; dir 0 packs (src -> tile), 1 unpacks. */
static void move_block(int type, uint8_t *blk, uint8_t *tile, int i, int dir) {
    const int q4 = type != Q8_0, nq = q4 ? 16 : 32, qoff = type == Q4_1 ? 4 : 2;
    uint8_t *qdst = tile, *d = tile + 16 * nq + 2 * i, *m = tile + 16 * nq + 32 + 2 * i;
    for (int c = 0; c < nq / 4; ++c)
        for (int j = 0; j < 4; ++j) {
            uint8_t *t = qdst + c * 64 + 4 * i + j, *s = blk + qoff + 4 * c + j;
            if (dir == 0) *t = q4 ? *s : (uint8_t)(*s ^ 0x80);
            else *s = q4 ? *t : (uint8_t)(*t ^ 0x80);
        }
    if (dir == 0) {
        memcpy(d, blk, 2);
        if (type == Q4_1) memcpy(m, blk + 2, 2);
    } else {
        memcpy(blk, d, 2);
        if (type == Q4_1) memcpy(blk + 2, m, 2);
    }
}

static int pack_or_unpack(int type, uint8_t *raw, int64_t N, int64_t K, uint8_t *wp, int dir) {
    if (!gguf_dot_type(type)) return -1;
    if (K % 32 || K < 32 || N < 1) return -2;
    const int64_t KB = K / 32, bb = src_block_bytes(type), tb = tile_bytes(type);
    const int64_t NB = (N + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < NB; ++nb)
        for (int64_t kb = 0; kb < KB; ++kb) {
            uint8_t *tile = wp + (nb * KB + kb) * tb;
            if (dir == 0) memset(tile, 0, (size_t)tb); /* padding rows: zero codes and scales */
            for (int i = 0; i < 16 && nb * 16 + i < N; ++i)
                move_block(type, raw + (nb * 16 + i) * KB * bb + kb * bb, tile, i, dir);
        }
    return 0;
}

int gguf_pack_weight(int type, const void *raw, int64_t N, int64_t K, void *wp) {
    return pack_or_unpack(type, (uint8_t *)raw, N, K, (uint8_t *)wp, 0);
}

int gguf_unpack_weight(int type, const void *wp, int64_t N, int64_t K, void *raw) {
    return pack_or_unpack(type, (uint8_t *)raw, N, K, (uint8_t *)wp, 1);
}

/* One row -> K int8 codes, KB scales and KB code sums. */
static void quantize_row(const void *x, int is_bf16, int64_t K, int8_t *xq, float *da,
                         int32_t *sa) {
    for (int64_t b = 0; b < K / 32; ++b) {
        float v[32];
        uint32_t amax_bits = 0; /* |x| as bit patterns: integer order for non-negatives */
        for (int k = 0; k < 32; ++k) {
            v[k] = ld(x, b * 32 + k, is_bf16);
            uint32_t u;
            memcpy(&u, &v[k], 4);
            u &= 0x7FFFFFFFu;
            amax_bits = u > amax_bits ? u : amax_bits;
        }
        float amax;
        memcpy(&amax, &amax_bits, 4);
        const float d = amax / 127.0f;
        int32_t s = 0;
        for (int k = 0; k < 32; ++k) {
            float r = d > 0.0f ? __builtin_nearbyintf(v[k] / d) : 0.0f; /* half to even */
            r = r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r);
            xq[b * 32 + k] = (int8_t)r;
            s += (int32_t)r;
        }
        da[b] = d;
        sa[b] = s;
    }
}

/* A micro-kernel: out[r * 64 + c * 16 + i] = y of row r of the tile, row 16 (b0 + c) + i
 * of W, for RB rows of xq (stride sq bytes; scales / sums stride KB) against CB streams
 * at w (stream stride sb bytes). */
typedef void (*dot_fn)(int type, const int8_t *xq, int64_t sq, const float *da,
                       const int32_t *sa, const uint8_t *w, int64_t sb, int64_t KB, int rb,
                       int cb, float *out);

/* Block result t of one (row, tile row) from its int sum, as the header's Math says. */
INLINE float scalar_term(int type, int32_t D, int32_t s, float dw, float mw, float d) {
    if (type == Q4_1) return dw * d * (float)D + mw * (d * (float)s);
    return dw * d * (float)(D - (type == Q4_0 ? 8 : 128) * s);
}

static void dot_scalar(int type, const int8_t *xq, int64_t sq, const float *da,
                       const int32_t *sa, const uint8_t *w, int64_t sb, int64_t KB, int rb,
                       int cb, float *out) {
    const int q4 = type != Q8_0, nq = q4 ? 16 : 32, tb = (int)tile_bytes(type);
    for (int r = 0; r < rb; ++r)
        for (int c = 0; c < cb; ++c)
            for (int i = 0; i < 16; ++i) {
                float acc = 0.0f;
                for (int64_t kb = 0; kb < KB; ++kb) {
                    const uint8_t *t = w + c * sb + kb * tb;
                    const int8_t *a = xq + r * sq + kb * 32;
                    int32_t D = 0;
                    for (int ch = 0; ch < nq / 4; ++ch)
                        for (int j = 0; j < 4; ++j) {
                            const uint8_t v = t[ch * 64 + 4 * i + j];
                            if (q4) D += (v & 15) * a[4 * ch + j] + (v >> 4) * a[16 + 4 * ch + j];
                            else D += v * a[4 * ch + j];
                        }
                    uint16_t hd, hm = 0;
                    memcpy(&hd, t + 16 * nq + 2 * i, 2);
                    if (type == Q4_1) memcpy(&hm, t + 16 * nq + 32 + 2 * i, 2);
                    acc += scalar_term(type, D, sa[r * KB + kb], half_to_float(hd),
                                       half_to_float(hm), da[r * KB + kb]);
                }
                out[r * 64 + c * 16 + i] = acc;
            }
}

/* Expands to dot_<name>(...), dispatching the type to DISPATCH_RC (each SIMD path's
 * (rb, cb) switch, in gguf_dot_simd.h) so type, rows and streams are all constants in
 * the inlined body and its accumulators stay in registers. */
#define DISPATCH(name, ATTR)                                                                 \
    static ATTR void dot_##name(int type, const int8_t *xq, int64_t sq, const float *da,     \
                                const int32_t *sa, const uint8_t *w, int64_t sb, int64_t KB, \
                                int rb, int cb, float *out) {                                \
        if (type == Q4_1) {                                                                  \
            DISPATCH_RC(name, Q4_1)                                                          \
        } else if (type == Q4_0) {                                                           \
            DISPATCH_RC(name, Q4_0)                                                          \
        } else {                                                                             \
            DISPATCH_RC(name, Q8_0)                                                          \
        }                                                                                    \
    }

#include "gguf_dot_simd.h"

static dot_fn path_dot(int path) {
    switch (path) {
    case TANDEM_INT8_SCALAR: return dot_scalar;
#if defined(__AVX2__) && defined(__F16C__)
    case TANDEM_INT8_AVX2: return dot_avx2;
#endif
#ifdef HAVE_AVXVNNI
    case TANDEM_INT8_AVX_VNNI: return dot_avxvnni;
#endif
#ifdef HAVE_AVX512VNNI
    case TANDEM_INT8_AVX512_VNNI: return dot_avx512vnni;
#endif
    default: return NULL;
    }
}

int64_t gguf_dot_scratch_bytes(int64_t M, int64_t K) {
    return ((M * K + 63) & ~(int64_t)63) + M * (K / 32) * 8;
}

void gguf_dot_scratch_size(int64_t M, int64_t K, int64_t *bytes) {
    *bytes = gguf_dot_scratch_bytes(M, K);
}

int team_gguf_matmul(int path, int type, int is_bf16, const void *x, int64_t sx, const void *wp,
                     const float *bias, void *y, int64_t sy, int64_t M, int64_t N, int64_t K,
                     void *scratch) {
    const dot_fn dot = path_dot(path);
    if (dot == NULL || !(int8_linear_paths() >> path & 1) || !gguf_dot_type(type) || M < 1 ||
        N < 1 || K < 32 || K % 32)
        return -1;
    const int64_t KB = K / 32, NB = (N + 15) / 16, sb = KB * tile_bytes(type);
    int8_t *xq = (int8_t *)scratch;
    float *da = (float *)((uint8_t *)scratch + ((M * K + 63) & ~(int64_t)63));
    int32_t *sa = (int32_t *)(da + M * KB);
    const size_t esize = is_bf16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
        quantize_row((const char *)x + m * sx * esize, is_bf16, K, xq + m * K, da + m * KB,
                     sa + m * KB);
    int tid = 0, team = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    const int64_t nb0 = NB * tid / team, nb1 = NB * (tid + 1) / team;
    /* Rows x streams per tile: what each path's register file holds (the 256-bit paths
     * keep two ymm per stream and row). One row takes one stream at a time, so the
     * weight is read front to back, one sequential stream (several interleaved streams
     * read it more slowly from DRAM); more rows share each loaded tile across two. */
    const int wide = path == TANDEM_INT8_SCALAR || path == TANDEM_INT8_AVX512_VNNI;
    const int rbmax = wide ? 4 : 2;
    const int rb_main = M < rbmax ? (int)M : rbmax;
    const int cbmax = rb_main == 1 ? 1 : 2;
    const uint8_t *w = (const uint8_t *)wp;
    for (int64_t b = nb0; b < nb1; b += cbmax) {
        const int cb = (int)(nb1 - b < cbmax ? nb1 - b : cbmax);
        for (int64_t m = 0; m < M; m += rb_main) {
            const int rb = (int)(M - m < rb_main ? M - m : rb_main);
            float out[4 * 64];
            dot(type, xq + m * K, K, da + m * KB, sa + m * KB, w + b * sb, sb, KB, rb, cb, out);
            for (int r = 0; r < rb; ++r)
                for (int c = 0; c < cb; ++c) {
                    const int64_t n0 = (b + c) * 16, nn = N - n0 < 16 ? N - n0 : 16;
                    const float *o = out + r * 64 + c * 16;
                    if (is_bf16) {
                        uint16_t *yr = (uint16_t *)y + (m + r) * sy + n0;
                        for (int64_t i = 0; i < nn; ++i)
                            yr[i] = bf16_bits(bias ? o[i] + bias[n0 + i] : o[i]);
                    } else {
                        float *yr = (float *)y + (m + r) * sy + n0;
                        for (int64_t i = 0; i < nn; ++i) yr[i] = bias ? o[i] + bias[n0 + i] : o[i];
                    }
                }
        }
    }
#pragma omp barrier
    return 0;
}

int gguf_dot_linear(int path, int type, int is_bf16, const void *x, int64_t sx, const void *wp,
                    const float *bias, void *y, int64_t sy, int64_t M, int64_t N, int64_t K,
                    int num_threads) {
    if (path_dot(path) == NULL || !(int8_linear_paths() >> path & 1) || !gguf_dot_type(type) ||
        M < 1 || N < 1 || K < 32 || K % 32)
        return -1;
    void *scratch = malloc((size_t)gguf_dot_scratch_bytes(M, K));
    if (scratch == NULL) return -3;
    int rc = 0;
    /* a tiny layer is not worth waking the team for */
#pragma omp parallel num_threads(num_threads) if (M * N * K > (1 << 16))
    {
        const int r = team_gguf_matmul(path, type, is_bf16, x, sx, wp, bias, y, sy, M, N, K,
                                       scratch);
        if (r != 0) {
#pragma omp atomic write
            rc = r;
        }
    }
    free(scratch);
    return rc;
}
