/*
 * Paged decode attention for CPUs, reading K/V straight from the blocks.
 *
 * Algorithm: vLLM's PagedAttention (Kwon et al. 2023) decode phase. One work
 * item per (sequence, KV head): its G = num_heads / num_kv_heads query heads
 * score every visible key of the sequence's blocks (float32 accumulation),
 * take an exact softmax over the scores kept in a scratch row, then sum the
 * weighted values. Work items run in parallel under OpenMP.
 *
 * Why C and not torch ops: the torch path must first gather every block of
 * every sequence into a padded copy (index_select) and then run SDPA with a
 * padding mask, which moves the whole context through memory twice per layer;
 * decode attention is memory bound, so reading each K/V byte once is the win.
 *
 * Vectors: GCC/Clang vector extensions of 16 floats (one AVX-512 register, two
 * AVX2 ones, four NEON ones), so head_dim must be a multiple of 16; the Python
 * side checks that. A key row is converted to float once and scored against
 * all G query heads, so the group shares every load (GQA).
 *
 * Element types: is_bf16 != 0 means the tensors hold bfloat16 bits, else
 * float32. Strides are in elements; block tables and lengths are int64.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tandem_kernels.h"
#include "team.h"

#define MAX_HEADS TANDEM_MAX_HEADS
#define MAX_GROUP TANDEM_MAX_GROUP
#define MAX_HEAD_DIM TANDEM_MAX_HEAD_DIM
#define VL TANDEM_VECTOR_WIDTH

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef uint32_t vu32 __attribute__((vector_size(VL * sizeof(uint32_t))));
typedef uint16_t vu16 __attribute__((vector_size(VL * sizeof(uint16_t))));

static inline vf load_vec(const void *base, int64_t idx, int is_bf16) {
    vf out;
    if (is_bf16) {
        vu16 h;
        memcpy(&h, (const uint16_t *)base + idx, sizeof h);
        vu32 w = __builtin_convertvector(h, vu32) << 16;
        memcpy(&out, &w, sizeof out);
    } else {
        memcpy(&out, (const float *)base + idx, sizeof out);
    }
    return out;
}

typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

static inline float hsum(vf v) {
    /* Pairwise tree (depth 4): a serial 16-add chain was the kernel's bottleneck. */
    vf8 a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    a += b;
    vf4 c, d;
    memcpy(&c, &a, sizeof c);
    memcpy(&d, (const char *)&a + sizeof c, sizeof d);
    c += d;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline uint16_t f32_to_bf16(float f) {
    /* Round to nearest even, as torch does; NaN stays NaN. */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1

/* Sixteen 16-lane partial dot products -> one vector of their sums: lane j gets
 * the sum of the vector passed in slot REDUCE_SLOT[j]. A shuffle tree (15 adds)
 * instead of sixteen horizontal sums. */
static const int REDUCE_SLOT[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

static inline __m512 reduce16(const __m512 *d) {
    __m512 r8[8], r4[4], r2[2];
    for (int i = 0; i < 8; ++i)
        r8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(d[i], d[i + 8], 0x44),
                              _mm512_shuffle_f32x4(d[i], d[i + 8], 0xEE));
    for (int i = 0; i < 4; ++i)
        r4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r8[i], r8[i + 4], 0x88),
                              _mm512_shuffle_f32x4(r8[i], r8[i + 4], 0xDD));
    for (int i = 0; i < 2; ++i)
        r2[i] = _mm512_add_ps(_mm512_unpacklo_ps(r4[i], r4[i + 2]),
                              _mm512_unpackhi_ps(r4[i], r4[i + 2]));
    return _mm512_add_ps(_mm512_shuffle_ps(r2[0], r2[1], 0x44),
                         _mm512_shuffle_ps(r2[0], r2[1], 0xEE));
}

/* Scores of 16 consecutive cache rows (one KV head) against one bf16 query head:
 * VDPBF16PS multiplies bf16 pairs and accumulates in float32 (no conversions),
 * nb = head_dim / 32 instructions per row. Rows past the block's valid range
 * are computed too and masked out by the caller. */
static inline __attribute__((always_inline)) __m512 scores16_bf16(
    const uint16_t *k0, int64_t sk_o, const __m512bh *qg, const int64_t nb) {
    __m512 d[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
        const uint16_t *kr = k0 + j * sk_o;
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < nb; ++c)
            a = _mm512_dpbf16_ps(a, qg[c], (__m512bh)_mm512_loadu_si512(kr + c * 32));
        d[REDUCE_SLOT[j]] = a;
    }
    return reduce16(d);
}
#endif

/* Prefetch distance in blocks. A layer's K (or V) rows of one block are one
 * contiguous run of block_size * num_kv_heads * head_dim elements in the usual
 * cache layout, but consecutive blocks of a sequence sit at random places in the
 * pool, so the hardware prefetcher restarts at every block; without software
 * prefetch the kernel ran several times slower on cold caches than on hot ones. */
#define PREFETCH_BLOCKS 4

/* Prefetch `span` elements of each of the `rows` rows (row stride s_o) from
 * element `off` on, into L2. */
static inline void prefetch_rows(const void *base, int64_t off, int64_t rows, int64_t s_o,
                                 int64_t span, int64_t esize) {
    const char *p = (const char *)base + off * esize;
    for (int64_t t = 0; t < rows; ++t) {
        const char *row = p + t * s_o * esize;
        for (int64_t b = 0; b < span * esize; b += 64) __builtin_prefetch(row + b, 0, 1);
    }
}

/* What the value pass at block b (of b0..b1) prefetches, as element offsets (-1:
 * nothing): the V block PREFETCH_BLOCKS ahead and, once past the last V block,
 * the K blocks the thread's next sequence starts with. */
static inline void v_pass_prefetch(const int64_t *table, int64_t b, int64_t b1, int64_t sv_b,
                                   int64_t sk_b, const int64_t *next_table, int64_t next_b0,
                                   int64_t next_b1, int64_t *vnext, int64_t *knext) {
    const int64_t bp = b + PREFETCH_BLOCKS;
    *vnext = bp <= b1 ? table[bp] * sv_b : -1;
    *knext = next_table != NULL && bp > b1 && next_b0 + (bp - b1 - 1) <= next_b1
                 ? next_table[next_b0 + (bp - b1 - 1)] * sk_b
                 : -1;
}

/* All KV heads of one sequence, block by block: per block, every head's rows are
 * read while the block is in cache (the block is one contiguous run in memory),
 * and the blocks PREFETCH_BLOCKS ahead are prefetched. Pass 1 scores every
 * visible key against the G query heads of its KV head (scores kept in sc,
 * row (h*G+g) of length n); an exact softmax per query head; pass 2 sums the
 * weighted values into acc. Called with literal G (query heads per KV head) and
 * nv (head_dim / 16) for the common shapes, so a head's G x nv query and
 * accumulator vectors live in registers. */
static inline __attribute__((always_inline)) void attend_seq_impl(
    int is_bf16, const void *k, const void *v, int64_t sk_b, int64_t sk_o, int64_t sk_h,
    int64_t sv_b, int64_t sv_o, int64_t sv_h, const int64_t *table, int64_t bs, int64_t lo,
    int64_t len, int64_t num_kv_heads, const int64_t G, const int64_t nv, const vf *qv,
    const uint16_t *qb, float qscale, float *sc, vf *acc, float *inv, const int64_t *next_table,
    int64_t next_b0, int64_t next_b1) {
    const int64_t n = len - lo;
    const int64_t esize = is_bf16 ? 2 : 4;
    const int64_t b0 = lo / bs, b1 = (len - 1) / bs;
    const int64_t kspan = (num_kv_heads - 1) * sk_h + nv * VL;
    float mx[MAX_HEADS];
    for (int64_t i = 0; i < num_kv_heads * G; ++i) mx[i] = -FLT_MAX;
    for (int64_t b = b0; b < b0 + PREFETCH_BLOCKS && b <= b1; ++b)
        prefetch_rows(k, table[b] * sk_b, bs, sk_o, kspan, esize);
    for (int64_t b = b0; b <= b1; ++b) {
        const int64_t bp = b + PREFETCH_BLOCKS;
        /* prefetches are spread over the block's heads (a burst of a whole block's
         * lines stalls on the fill buffers); past the last K block, the first V
         * blocks are fetched instead */
        const void *pf_base = NULL;
        int64_t pf_o = 0, pf_h = 0;
        if (bp <= b1) {
            pf_base = (const char *)k + table[bp] * sk_b * esize;
            pf_o = sk_o, pf_h = sk_h;
        } else if (bp - b1 - 1 < PREFETCH_BLOCKS && b0 + (bp - b1 - 1) <= b1) {
            pf_base = (const char *)v + table[b0 + (bp - b1 - 1)] * sv_b * esize;
            pf_o = sv_o, pf_h = sv_h;
        }
        const int64_t t0 = b * bs > lo ? b * bs : lo;
        const int64_t t1 = (b + 1) * bs < len ? (b + 1) * bs : len;
        const int64_t base = table[b] * sk_b;
#ifdef HAVE_BF16_DOT
        if (qb != NULL) {
            for (int64_t h = 0; h < num_kv_heads; ++h) {
                if (pf_base != NULL)
                    prefetch_rows(pf_base, h * pf_h, bs, pf_o, nv * VL, esize);
                for (int64_t g = 0; g < G; ++g) {
                    __m512bh qg[MAX_HEAD_DIM / 32];
                    const uint16_t *qh = qb + (h * G + g) * nv * VL;
                    for (int64_t c = 0; c < nv / 2; ++c)
                        qg[c] = (__m512bh)_mm512_loadu_si512(qh + c * 32);
                    float *srow = sc + (h * G + g) * n - lo;
                    for (int64_t s0 = b * bs; s0 < (b + 1) * bs; s0 += 16) {
                        const int64_t j0 = t0 > s0 ? t0 - s0 : 0;
                        const int64_t j1 = t1 < s0 + 16 ? t1 - s0 : 16;
                        if (j1 <= j0) continue;
                        const __mmask16 m = (__mmask16)(((1u << j1) - 1u) & ~((1u << j0) - 1u));
                        const uint16_t *k0 = (const uint16_t *)k + base + (s0 - b * bs) * sk_o + h * sk_h;
                        const __m512 sv = _mm512_mul_ps(scores16_bf16(k0, sk_o, qg, nv / 2),
                                                        _mm512_set1_ps(qscale));
                        _mm512_mask_storeu_ps(srow + s0, m, sv);
                        const float bm = _mm512_mask_reduce_max_ps(m, sv);
                        mx[h * G + g] = bm > mx[h * G + g] ? bm : mx[h * G + g];
                    }
                }
            }
            continue;
        }
#endif
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            if (pf_base != NULL) prefetch_rows(pf_base, h * pf_h, bs, pf_o, nv * VL, esize);
            vf qr[MAX_GROUP][MAX_HEAD_DIM / VL];
            for (int64_t g = 0; g < G; ++g)
                for (int64_t c = 0; c < nv; ++c) qr[g][c] = qv[(h * G + g) * nv + c];
            float *srow = sc + h * G * n - lo;
            float *m = mx + h * G;
            for (int64_t p = t0; p < t1; ++p) {
                const int64_t ko = base + (p - b * bs) * sk_o + h * sk_h;
                vf row[MAX_HEAD_DIM / VL];
                for (int64_t c = 0; c < nv; ++c) row[c] = load_vec(k, ko + c * VL, is_bf16);
                for (int64_t g = 0; g < G; ++g) {
                    vf dot = qr[g][0] * row[0];
                    for (int64_t c = 1; c < nv; ++c) dot += qr[g][c] * row[c];
                    const float d = hsum(dot);
                    srow[g * n + p] = d;
                    m[g] = d > m[g] ? d : m[g];
                }
            }
        }
    }
    for (int64_t i = 0; i < num_kv_heads * G; ++i) {
        float sum = 0.f;
        float *r = sc + i * n;
        const float m = mx[i];
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
            r[j] = expf(r[j] - m);
            sum += r[j];
        }
        inv[i] = 1.f / sum;
    }
    for (int64_t i = 0; i < num_kv_heads * G * nv; ++i) acc[i] = (vf){0};
    for (int64_t b = b0; b <= b1; ++b) {
        int64_t vnext, knext;
        v_pass_prefetch(table, b, b1, sv_b, sk_b, next_table, next_b0, next_b1, &vnext, &knext);
        const int64_t t0 = b * bs > lo ? b * bs : lo;
        const int64_t t1 = (b + 1) * bs < len ? (b + 1) * bs : len;
        const int64_t base = table[b] * sv_b;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            if (vnext >= 0) prefetch_rows(v, vnext + h * sv_h, bs, sv_o, nv * VL, esize);
            if (knext >= 0) prefetch_rows(k, knext + h * sk_h, bs, sk_o, nv * VL, esize);
            vf a[MAX_GROUP][MAX_HEAD_DIM / VL];
            for (int64_t g = 0; g < G; ++g)
                for (int64_t c = 0; c < nv; ++c) a[g][c] = acc[(h * G + g) * nv + c];
            const float *srow = sc + h * G * n - lo;
            for (int64_t p = t0; p < t1; ++p) {
                const int64_t vo = base + (p - b * bs) * sv_o + h * sv_h;
                vf row[MAX_HEAD_DIM / VL];
                for (int64_t c = 0; c < nv; ++c) row[c] = load_vec(v, vo + c * VL, is_bf16);
                for (int64_t g = 0; g < G; ++g) {
                    const float w = srow[g * n + p];
                    for (int64_t c = 0; c < nv; ++c) a[g][c] += w * row[c];
                }
            }
            for (int64_t g = 0; g < G; ++g)
                for (int64_t c = 0; c < nv; ++c) acc[(h * G + g) * nv + c] = a[g][c];
        }
    }
}


#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX2_ATTN 1
/* Most floats of one block's rows of one KV head widened on the stack. */
#define AVX2_MAX_BLOCK_FLOATS 8192

/* ---- AVX2 path (CPUs without AVX-512) ---------------------------------------
 * The generic code above keeps G x head_dim / 16 query and accumulator vectors of
 * 16 floats "in registers"; AVX2 has sixteen 8-float registers, so GCC spilled
 * them and the loops ran through the stack (an order of magnitude slower than
 * streaming the K/V takes). Here a block's K (then V) rows of one KV head
 * are widened to float32 once into L1 scratch; scores take eight rows at a time
 * (eight accumulators, one transposing reduction, hsum8x8), and the value pass
 * keeps one query head's accumulator (HD / 8 registers) while it walks the rows. */

static inline __m256 ld8(const void *base, int64_t idx, int is_bf16) {
    if (is_bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + idx));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + idx);
}

/* Lane j of the result: the sum of the 8 lanes of a[j]. */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20),
                         _mm256_permute2f128_ps(q0, q1, 0x31));
}

static inline float hsum8(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* rows x HD elements (row stride s_o) from element off of src, as float32 into dst
 * (row r at dst + r * HD). */
static inline __attribute__((always_inline)) void widen_rows(const void *src, int64_t off,
                                                             int64_t s_o, int64_t rows,
                                                             const int64_t HD, int is_bf16,
                                                             float *dst) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < HD; c += 8)
            _mm256_storeu_ps(dst + r * HD + c, ld8(src, off + r * s_o + c, is_bf16));
}

/* Block b's visible rows [t0, t1) of KV head h (t0 into *t0_out), widened into dst
 * (see widen_rows); first prefetches head h of the block PREFETCH_BLOCKS ahead.
 * Returns t1 - t0. */
static inline __attribute__((always_inline)) int64_t widen_block_head(
    const void *src, int64_t s_b, int64_t s_o, int64_t s_h, const int64_t *table, int64_t b,
    int64_t b1, int64_t bs, int64_t lo, int64_t len, int64_t h, const int64_t HD, int is_bf16,
    float *dst, int64_t *t0_out) {
    const int64_t t0 = b * bs > lo ? b * bs : lo;
    const int64_t t1 = (b + 1) * bs < len ? (b + 1) * bs : len;
    if (b + PREFETCH_BLOCKS <= b1)
        prefetch_rows(src, table[b + PREFETCH_BLOCKS] * s_b + h * s_h, bs, s_o, HD,
                      is_bf16 ? 2 : 4);
    widen_rows(src, table[b] * s_b + (t0 - b * bs) * s_o + h * s_h, s_o, t1 - t0, HD, is_bf16,
               dst);
    *t0_out = t0;
    return t1 - t0;
}

/* Same contract as attend_seq_impl (qv: scaled queries, H x HD floats; sc: H x n
 * scores; acc: H x HD float sums; inv: 1 / softmax denominators), HD = head_dim. */
static inline __attribute__((always_inline)) void attend_seq_avx2_impl(
    int is_bf16, const void *k, const void *v, int64_t sk_b, int64_t sk_o, int64_t sk_h,
    int64_t sv_b, int64_t sv_o, int64_t sv_h, const int64_t *table, int64_t bs, int64_t lo,
    int64_t len, int64_t num_kv_heads, int64_t G, const int64_t HD, const float *qv, float *sc,
    float *acc, float *inv) {
    const int64_t n = len - lo;
    const int64_t esize = is_bf16 ? 2 : 4;
    const int64_t b0 = lo / bs, b1 = (len - 1) / bs;
    float rows_f[AVX2_MAX_BLOCK_FLOATS] __attribute__((aligned(32)));
    for (int64_t b = b0; b < b0 + PREFETCH_BLOCKS && b <= b1; ++b)
        prefetch_rows(k, table[b] * sk_b, bs, sk_o, (num_kv_heads - 1) * sk_h + HD, esize);
    for (int64_t b = b0; b <= b1; ++b) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            int64_t t0;
            const int64_t rows = widen_block_head(k, sk_b, sk_o, sk_h, table, b, b1, bs, lo, len,
                                                  h, HD, is_bf16, rows_f, &t0);
            for (int64_t g = 0; g < G; ++g) {
                const float *qh = qv + (h * G + g) * HD;
                float *srow = sc + (h * G + g) * n + (t0 - lo);
                int64_t j0 = 0;
                for (; j0 + 8 <= rows; j0 += 8) {
                    __m256 a[8];
                    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
                    for (int64_t c = 0; c < HD; c += 8) {
                        const __m256 qc = _mm256_loadu_ps(qh + c);
                        for (int j = 0; j < 8; ++j)
                            a[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows_f + (j0 + j) * HD + c),
                                                   a[j]);
                    }
                    _mm256_storeu_ps(srow + j0, hsum8x8(a));
                }
                for (; j0 < rows; ++j0) {
                    __m256 a = _mm256_setzero_ps();
                    for (int64_t c = 0; c < HD; c += 8)
                        a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + c),
                                            _mm256_loadu_ps(rows_f + j0 * HD + c), a);
                    srow[j0] = hsum8(a);
                }
            }
        }
    }
    /* prefetch the first V blocks while the softmax runs */
    for (int64_t b = b0; b < b0 + PREFETCH_BLOCKS && b <= b1; ++b)
        prefetch_rows(v, table[b] * sv_b, bs, sv_o, (num_kv_heads - 1) * sv_h + HD, esize);
    for (int64_t i = 0; i < num_kv_heads * G; ++i) {
        float *r = sc + i * n;
        float m = -FLT_MAX;
        for (int64_t j = 0; j < n; ++j) m = r[j] > m ? r[j] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
            r[j] = expf(r[j] - m);
            sum += r[j];
        }
        inv[i] = 1.f / sum;
    }
    for (int64_t i = 0; i < num_kv_heads * G * HD; ++i) acc[i] = 0.f;
    for (int64_t b = b0; b <= b1; ++b) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            int64_t t0;
            const int64_t rows = widen_block_head(v, sv_b, sv_o, sv_h, table, b, b1, bs, lo, len,
                                                  h, HD, is_bf16, rows_f, &t0);
            for (int64_t g = 0; g < G; ++g) {
                float *ah = acc + (h * G + g) * HD;
                const float *srow = sc + (h * G + g) * n + (t0 - lo);
                __m256 a[MAX_HEAD_DIM / 8];
                for (int64_t c = 0; c < HD / 8; ++c) a[c] = _mm256_loadu_ps(ah + c * 8);
                for (int64_t j = 0; j < rows; ++j) {
                    const __m256 w = _mm256_broadcast_ss(srow + j);
                    for (int64_t c = 0; c < HD / 8; ++c)
                        a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows_f + j * HD + c * 8), a[c]);
                }
                for (int64_t c = 0; c < HD / 8; ++c) _mm256_storeu_ps(ah + c * 8, a[c]);
            }
        }
    }
}

/* attend_seq on AVX2: literal head dims 64 and 128 (the accumulators then live in
 * registers), else the same code with a runtime head_dim. Returns 0 when the
 * block does not fit the stack scratch (the caller runs the generic code). */
static int attend_seq_avx2(int is_bf16, const void *k, const void *v, int64_t sk_b, int64_t sk_o,
                           int64_t sk_h, int64_t sv_b, int64_t sv_o, int64_t sv_h,
                           const int64_t *table, int64_t bs, int64_t lo, int64_t len,
                           int64_t num_kv_heads, int64_t G, int64_t head_dim, const float *qv,
                           float *sc, float *acc, float *inv) {
    if (bs * head_dim > AVX2_MAX_BLOCK_FLOATS || head_dim % 8) return 0;
    if (head_dim == 64)
        attend_seq_avx2_impl(is_bf16, k, v, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, table, bs, lo,
                             len, num_kv_heads, G, 64, qv, sc, acc, inv);
    else if (head_dim == 128)
        attend_seq_avx2_impl(is_bf16, k, v, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, table, bs, lo,
                             len, num_kv_heads, G, 128, qv, sc, acc, inv);
    else
        attend_seq_avx2_impl(is_bf16, k, v, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, table, bs, lo,
                             len, num_kv_heads, G, head_dim, qv, sc, acc, inv);
    return 1;
}
#endif

#define SEQ_CASE(GG, NV)                                                                    \
    if (G == GG && nv == NV) {                                                              \
        attend_seq_impl(is_bf16, k, v, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, table,           \
                        block_size, lo, len, num_kv_heads, GG, NV, qv, qb, qscale, sc, acc, inv,   \
                        next_table, next_b0, next_b1);       \
        return;                                                                             \
    }

/* All heads of one sequence: a literal-shape specialisation where one fits
 * (group sizes 1-8, head_dim 64 or 128), else the same code with runtime shapes. */
static void attend_seq(int is_bf16, const void *k, const void *v, int64_t sk_b, int64_t sk_o,
                       int64_t sk_h, int64_t sv_b, int64_t sv_o, int64_t sv_h,
                       const int64_t *table, int64_t block_size, int64_t lo, int64_t len,
                       int64_t num_kv_heads, int64_t G, int64_t nv, const vf *qv,
                       const uint16_t *qb, float qscale, float *sc, vf *acc, float *inv,
                       const int64_t *next_table, int64_t next_b0, int64_t next_b1) {
#ifdef HAVE_AVX2_ATTN
    if (attend_seq_avx2(is_bf16, k, v, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, table, block_size, lo,
                        len, num_kv_heads, G, nv * VL, (const float *)qv, sc, (float *)acc, inv))
        return;
#endif
    SEQ_CASE(1, 4) SEQ_CASE(2, 4) SEQ_CASE(3, 4) SEQ_CASE(4, 4)
    SEQ_CASE(5, 4) SEQ_CASE(6, 4) SEQ_CASE(7, 4) SEQ_CASE(8, 4)
    SEQ_CASE(1, 8) SEQ_CASE(2, 8) SEQ_CASE(3, 8) SEQ_CASE(4, 8)
    SEQ_CASE(5, 8) SEQ_CASE(6, 8) SEQ_CASE(7, 8) SEQ_CASE(8, 8)
    attend_seq_impl(is_bf16, k, v, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, table, block_size, lo,
                    len, num_kv_heads, G, nv, qv, qb, qscale, sc, acc, inv, next_table, next_b0,
                    next_b1);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16_DECODE 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX_DECODE 1
#endif
#include "simd_math.h"

/* ---- bf16 decode attention, scores as rows of 16 query heads per key ---------
 *
 * Why: the VDPBF16PS scores above need a horizontal reduction per key and query
 * head (~5 vector instructions per score), which made the kernel compute bound
 * (below the DRAM bandwidth even hot in cache). TDPBF16PS does that reduction in the tile unit.
 * Without AMX (e.g. AMD Zen 4/5) the same layout is computed with VDPBF16PS, one
 * 16-way reduction per key and group of 16 query heads instead of one per key
 * and query head, and GCC keeps this loop's vectors in registers where the
 * generic code above spilled them: the generic code is compute bound, this
 * path bound by reading the scattered block runs from DRAM when the cache is
 * cold (docs/benchmarks.md).
 *
 * Scores: S[key][column] = K[key, :] . Q[column, :] with A = 16 key rows of the
 * cache block (32 dims per k step, any row stride: straight from the cache) and
 * B = the queries in the VNNI layout, packed once per sequence. The query heads
 * of up to 16 / G consecutive KV heads share one 16-column C tile ("group"):
 * column c of group gi is query head gi * GS * G + c, and the B tile of KV head
 * h, dims [32s, 32s + 32) holds only the columns of h's own query heads (zeros
 * elsewhere), so the k steps of the group's KV heads add up to each column's own
 * head. S is kept as rows of 16 floats per key, so the softmax runs down the
 * columns with plain vertical vector ops.
 *
 * Softmax: exact per column, in float32, as 2^(s * scale * log2(e) - max).
 * Values: P V with the float32 probabilities on AVX-512 FMAs after the tile
 * scores (value_pass_fma), with bf16 probability pairs on VDPBF16PS after the
 * VDPBF16PS scores (value_pass_dp); either way the accumulators hold the dims in
 * an order of their own, put back once per sequence. */

/* VDPBF16PS path: prefetch distance in blocks (1 to 8 measured alike; without
 * these prefetches it ran slower) */
#define DP_PF 2
#define QTILE_ELEMS 512 /* bf16 per 16 x 64-byte tile */

/* Scores of the 16 key rows from kr (row stride sk_o) against the query heads of
 * KV heads [h0, h0 + nh) (nh <= GS), with VDPBF16PS: dst row r, column
 * (h - h0) * G + g = K[r, h, :] . q[h * G + g, :] (q: [H][32 * S] bf16, unscaled).
 * G, GS and S are literals in the callers, so the 16 partial vectors of a row
 * stay in registers. kpf / vpf (or NULL): the same rows of a later block, whose
 * first kspan / vspan elements are prefetched a row at a time (so the requests
 * trickle out with the work instead of in a burst that stalls on the fill buffers). */
static inline __attribute__((always_inline)) void group_scores_dp(
    const uint16_t *kr, int64_t sk_o, int64_t sk_h, const uint16_t *q, int64_t h0, int64_t nh,
    const int64_t G, const int64_t GS, const int64_t S, float *dst, const uint16_t *kpf,
    int64_t kspan, const uint16_t *vpf, int64_t sv_o, int64_t vspan) {
    for (int64_t r = 0; r < 16; ++r, kr += sk_o) {
        if (kpf != NULL)
            for (int64_t e = 0; e < kspan; e += 32) __builtin_prefetch(kpf + r * sk_o + e, 0, 1);
        if (vpf != NULL)
            for (int64_t e = 0; e < vspan; e += 32) __builtin_prefetch(vpf + r * sv_o + e, 0, 1);
        __m512 d[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) d[j] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int64_t hh = 0; hh < GS; ++hh) {
            if (hh >= nh) break;
            const uint16_t *krow = kr + (h0 + hh) * sk_h;
            const uint16_t *qh = q + (h0 + hh) * G * S * 32;
#pragma GCC unroll 16
            for (int64_t g = 0; g < G; ++g) {
                __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
                for (int64_t c = 0; c < S; ++c)
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(krow + c * 32),
                                         (__m512bh)_mm512_loadu_si512(qh + (g * S + c) * 32));
                d[REDUCE_SLOT[(hh * G + g) & 15]] = a; /* < 16: GS * G <= 16 */
            }
        }
        _mm512_store_ps(dst + r * 16, reduce16(d));
    }
}

/* B tiles of one sequence's queries: tile (h, s) at bq + (h * S + s) * 512,
 * element [kp][2c + j] = q[head of column c][32s + 2kp + j] for the columns of
 * KV head h, zero elsewhere. */
static void pack_query_tiles(const uint16_t *q, int64_t sq_h, int64_t KVH, int64_t G, int64_t D,
                             uint16_t *bq) {
    const int64_t S = D / 32, GS = 16 / G;
    memset(bq, 0, (size_t)(KVH * S * QTILE_ELEMS * 2));
    for (int64_t h = 0; h < KVH; ++h) {
        const int64_t c0 = (h % GS) * G;
        for (int64_t s = 0; s < S; ++s) {
            uint16_t *tile = bq + (h * S + s) * QTILE_ELEMS;
            for (int64_t g = 0; g < G; ++g) {
                const uint16_t *qh = q + (h * G + g) * sq_h + s * 32;
                for (int64_t kp = 0; kp < 16; ++kp)
                    memcpy(tile + kp * 32 + 2 * (c0 + g), qh + 2 * kp, 4);
            }
        }
    }
}

/* The tile path's value pass, acc += P V on float32 FMAs: a bf16 value row is
 * widened without shuffles, its even dims as (x << 16) and its odd ones as
 * (x & 0xffff0000), so acc vectors 2s / 2s + 1 of a head hold the even / odd dims
 * of 32-dim slab s, put back once per sequence by the caller. sc: the softmax
 * output of attend_seq_bf16_impl (float32 rows of 16 query heads per key); the V
 * blocks are prefetched ahead here, then the next sequence's first K blocks. */
static inline __attribute__((always_inline)) void value_pass_fma(
    const uint16_t *v, int64_t sv_b, int64_t sv_o, int64_t sv_h, const int64_t *table, int64_t bs,
    int64_t lo, int64_t len, int64_t KVH, const int64_t G, const int64_t NV, const float *sc,
    __m512 *acc, const uint16_t *k, int64_t sk_b, int64_t sk_o, int64_t sk_h,
    const int64_t *next_table, int64_t next_b0, int64_t next_b1) {
    const int64_t S = NV / 2, GS = 16 / G;
    const int64_t b0 = lo / bs, b1 = (len - 1) / bs, R = (b1 - b0 + 1) * bs;
    const __m512i odd_mask = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t b = b0; b <= b1; ++b) {
        int64_t vnext, knext;
        v_pass_prefetch(table, b, b1, sv_b, sk_b, next_table, next_b0, next_b1, &vnext, &knext);
        const int64_t t0 = b * bs > lo ? b * bs : lo;
        const int64_t t1 = (b + 1) * bs < len ? (b + 1) * bs : len;
        const uint16_t *vb = v + table[b] * sv_b;
        for (int64_t h = 0; h < KVH; ++h) {
            if (vnext >= 0) prefetch_rows(v, vnext + h * sv_h, bs, sv_o, NV * VL, 2);
            if (knext >= 0) prefetch_rows(k, knext + h * sk_h, bs, sk_o, NV * VL, 2);
            const float *sg = sc + ((h / GS) * R - b0 * bs) * 16 + (h % GS) * G;
            __m512 a[MAX_GROUP][MAX_HEAD_DIM / VL];
            for (int64_t g = 0; g < G; ++g)
                for (int64_t i = 0; i < NV; ++i) a[g][i] = acc[(h * G + g) * NV + i];
            for (int64_t t = t0; t < t1; ++t) {
                const uint16_t *row = vb + (t - b * bs) * sv_o + h * sv_h;
                __m512 x[MAX_HEAD_DIM / VL];
                for (int64_t s = 0; s < S; ++s) {
                    const __m512i w = _mm512_loadu_si512(row + s * 32);
                    x[2 * s] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                    x[2 * s + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, odd_mask));
                }
                for (int64_t g = 0; g < G; ++g) {
                    const __m512 p = _mm512_set1_ps(sg[t * 16 + g]);
                    for (int64_t i = 0; i < NV; ++i) a[g][i] = _mm512_fmadd_ps(p, x[i], a[g][i]);
                }
            }
            for (int64_t g = 0; g < G; ++g)
                for (int64_t i = 0; i < NV; ++i) acc[(h * G + g) * NV + i] = a[g][i];
        }
    }
}

/* The value pass with VDPBF16PS (the path without AMX): the probabilities of
 * consecutive keys 2j, 2j + 1 are rounded to bf16 and paired (as torch's CPU flash
 * attention rounds them for its bf16 product), and each pair of value rows is
 * interleaved by VPUNPCK{L,H}WD into 16 dims x one key pair per vector, so one
 * VDPBF16PS does what two FMAs and two widenings did. acc vector 2s of a head
 * holds dims 32s + 8L + i, vector 2s + 1 dims 32s + 8L + 4 + i, in lane 4L + i
 * (L, i < 4): the unpacks' order, put back once per sequence by the caller. Keys
 * outside [lo, len) get probability 0 and their value rows are not read (a slot
 * outside may hold NaN). sc: the softmax output of attend_seq_bf16_impl, rewritten
 * in place as the bf16 pairs (row j of a group: keys b0 * bs + 2j, + 1). */
static inline __attribute__((always_inline)) void value_pass_dp(
    const uint16_t *v, int64_t sv_b, int64_t sv_o, int64_t sv_h, const int64_t *table, int64_t bs,
    int64_t lo, int64_t len, int64_t KVH, const int64_t G, const int64_t NV, float *sc,
    __m512 *acc, const uint16_t *k, int64_t sk_b, int64_t sk_o, int64_t sk_h,
    const int64_t *next_table, int64_t next_b0, int64_t next_b1) {
    static const uint16_t PAIR_IDX[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                          21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                          11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const int64_t S = NV / 2, GS = 16 / G, NG = (KVH + GS - 1) / GS;
    const int64_t b0 = lo / bs, b1 = (len - 1) / bs, R = (b1 - b0 + 1) * bs;
    const __m512i pair_idx = _mm512_loadu_si512(PAIR_IDX);
    for (int64_t gi = 0; gi < NG; ++gi) {
        float *base = sc + gi * R * 16;
        for (int64_t j = 0; j < R / 2; ++j) {
            const int64_t t = b0 * bs + 2 * j;
            const __m512 p0 = t >= lo && t < len ? _mm512_load_ps(base + 2 * j * 16)
                                                 : _mm512_setzero_ps();
            const __m512 p1 = t + 1 >= lo && t + 1 < len ? _mm512_load_ps(base + (2 * j + 1) * 16)
                                                         : _mm512_setzero_ps();
            const __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* p0 low, p1 high */
            _mm512_store_si512(base + j * 16, _mm512_permutexvar_epi16(pair_idx, pb));
        }
    }
    for (int64_t b = b0; b <= b1; ++b) {
        int64_t vnext, knext;
        v_pass_prefetch(table, b, b1, sv_b, sk_b, next_table, next_b0, next_b1, &vnext, &knext);
        const uint16_t *vb = v + table[b] * sv_b;
        for (int64_t h = 0; h < KVH; ++h) {
            if (knext >= 0) prefetch_rows(k, knext + h * sk_h, bs, sk_o, NV * VL, 2);
            const uint32_t *pp = (const uint32_t *)(sc + (h / GS) * R * 16) + (h % GS) * G;
            __m512 a[MAX_GROUP][MAX_HEAD_DIM / VL];
            for (int64_t g = 0; g < G; ++g)
                for (int64_t i = 0; i < NV; ++i) a[g][i] = acc[(h * G + g) * NV + i];
            for (int64_t t = b * bs; t < (b + 1) * bs; t += 2) {
                if (t + 1 < lo || t >= len) continue;
                const uint16_t *r0 = vb + (t - b * bs) * sv_o + h * sv_h, *r1 = r0 + sv_o;
                const int in0 = t >= lo, in1 = t + 1 < len;
                __m512i ulo[MAX_HEAD_DIM / 32], uhi[MAX_HEAD_DIM / 32];
                for (int64_t s = 0; s < S; ++s) {
                    const __m512i x0 = in0 ? _mm512_loadu_si512(r0 + s * 32) : _mm512_setzero_si512();
                    const __m512i x1 = in1 ? _mm512_loadu_si512(r1 + s * 32) : _mm512_setzero_si512();
                    ulo[s] = _mm512_unpacklo_epi16(x0, x1);
                    uhi[s] = _mm512_unpackhi_epi16(x0, x1);
                }
                const uint32_t *pj = pp + (t - b0 * bs) / 2 * 16;
                for (int64_t g = 0; g < G; ++g) {
                    const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pj[g]);
                    for (int64_t s = 0; s < S; ++s) {
                        a[g][2 * s] = _mm512_dpbf16_ps(a[g][2 * s], w, (__m512bh)ulo[s]);
                        a[g][2 * s + 1] = _mm512_dpbf16_ps(a[g][2 * s + 1], w, (__m512bh)uhi[s]);
                    }
                }
            }
            for (int64_t g = 0; g < G; ++g)
                for (int64_t i = 0; i < NV; ++i) acc[(h * G + g) * NV + i] = a[g][i];
        }
    }
}

/* One sequence, every head; see above. sc: (b1 - b0 + 1) * bs * 16 floats per
 * group; acc: H * D floats. tiles: bq holds the B tiles of pack_query_tiles and
 * the scores run on AMX; else bq is the plain [H][D] bf16 queries and they run on
 * VDPBF16PS. tiles, G and NV (= D / 16) are literals in the callers. */
static inline __attribute__((always_inline)) void attend_seq_bf16_impl(
    const uint16_t *k, const uint16_t *v, int64_t sk_b, int64_t sk_o, int64_t sk_h, int64_t sv_b,
    int64_t sv_o, int64_t sv_h, const int64_t *table, int64_t bs, int64_t lo, int64_t len,
    int64_t KVH, const int tiles, const int64_t G, const int64_t NV, const uint16_t *bq,
    float scale, float *sc, __m512 *acc, uint16_t *out, int64_t so_h, const int64_t *next_table,
    int64_t next_b0, int64_t next_b1) {
    const int64_t S = NV / 2, GS = 16 / G, NG = (KVH + GS - 1) / GS;
    const int64_t b0 = lo / bs, b1 = (len - 1) / bs;
    const int64_t R = (b1 - b0 + 1) * bs; /* score rows per group */
    const int64_t kspan = (KVH - 1) * sk_h + NV * VL, vspan = (KVH - 1) * sv_h + NV * VL;
    for (int64_t b = b0; b < b0 + PREFETCH_BLOCKS && b <= b1; ++b) {
        prefetch_rows(k, table[b] * sk_b, bs, sk_o, kspan, 2);
        if (!tiles) prefetch_rows(v, table[b] * sv_b, bs, sv_o, vspan, 2);
    }

    /* S = K Q^T, 16 keys per tile. The tile path prefetches K blocks ahead, then
     * the first V blocks; the VDPBF16PS path, whose blocks go by faster, K and V
     * blocks ahead, row by row (group_scores_dp), so the value pass reads L2. */
    for (int64_t b = b0; b <= b1; ++b) {
        const int64_t bp = b + PREFETCH_BLOCKS;
        const int64_t bpd = b + DP_PF;
        const uint16_t *kpf = NULL, *vpf = NULL;
        if (!tiles) {
            if (bpd <= b1) kpf = k + table[bpd] * sk_b, vpf = v + table[bpd] * sv_b;
        } else if (bp <= b1) {
            prefetch_rows(k, table[bp] * sk_b, bs, sk_o, kspan, 2);
        } else if (b0 + (bp - b1 - 1) <= b1) {
            prefetch_rows(v, table[b0 + (bp - b1 - 1)] * sv_b, bs, sv_o, vspan, 2);
        }
        const uint16_t *kb = k + table[b] * sk_b;
        for (int64_t t0 = 0; t0 < bs; t0 += 16) {
            const int64_t key0 = b * bs + t0;
            if (key0 + 16 <= lo || key0 >= len) continue;
            for (int64_t gi = 0; gi < NG; ++gi) {
                const int64_t h1 = (gi + 1) * GS < KVH ? (gi + 1) * GS : KVH;
                float *dst = sc + (gi * R + key0 - b0 * bs) * 16;
#ifdef HAVE_AMX_DECODE
                if (tiles) {
                    _tile_zero(0);
                    for (int64_t h = gi * GS; h < h1; ++h)
                        for (int64_t s = 0; s < S; ++s) {
                            _tile_loadd(1, kb + t0 * sk_o + h * sk_h + s * 32, sk_o * 2);
                            _tile_loadd(2, bq + (h * S + s) * QTILE_ELEMS, 64);
                            _tile_dpbf16ps(0, 1, 2);
                        }
                    _tile_stored(0, dst, 64);
                    continue;
                }
#endif
                const int pf = gi == 0 && kpf != NULL;
                group_scores_dp(kb + t0 * sk_o, sk_o, sk_h, bq, gi * GS, h1 - gi * GS, G, 16 / G,
                                S, dst, pf ? kpf + t0 * sk_o : NULL, kspan,
                                pf ? vpf + t0 * sv_o : NULL, sv_o, vspan);
            }
        }
    }

    /* softmax down each column over the visible keys [lo, len) */
    const __m512 c = _mm512_set1_ps(scale * 1.4426950408889634f);
    float inv[MAX_HEADS + 16];
    for (int64_t gi = 0; gi < NG; ++gi) {
        float *sg = sc + (gi * R - b0 * bs) * 16;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t t = lo; t < len; ++t) {
            const __m512 x = _mm512_mul_ps(_mm512_load_ps(sg + t * 16), c);
            _mm512_store_ps(sg + t * 16, x);
            m = _mm512_max_ps(m, x);
        }
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = lo; t < len; ++t) {
            const __m512 e = exp2_nonpos(_mm512_sub_ps(_mm512_load_ps(sg + t * 16), m));
            _mm512_store_ps(sg + t * 16, e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(inv + gi * GS * G, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
    }

    for (int64_t i = 0; i < KVH * G * NV; ++i) acc[i] = _mm512_setzero_ps();
    if (tiles)
        value_pass_fma(v, sv_b, sv_o, sv_h, table, bs, lo, len, KVH, G, NV, sc, acc, k, sk_b, sk_o,
                       sk_h, next_table, next_b0, next_b1);
    else
        value_pass_dp(v, sv_b, sv_o, sv_h, table, bs, lo, len, KVH, G, NV, sc, acc, k, sk_b, sk_o,
                      sk_h, next_table, next_b0, next_b1);

    /* out = acc / sum, the dims put back in order (even / odd after the tile path,
     * value_pass_dp's unpack order after it), rounded to bf16 */
    const __m512i lo_idx =
        tiles ? _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23)
              : _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    for (int64_t hq = 0; hq < KVH * G; ++hq) {
        const __m512 f = _mm512_set1_ps(inv[hq]);
        uint16_t *o = out + hq * so_h;
        for (int64_t s = 0; s < S; ++s) {
            const __m512 ev = _mm512_mul_ps(acc[hq * NV + 2 * s], f);
            const __m512 od = _mm512_mul_ps(acc[hq * NV + 2 * s + 1], f);
            _mm256_storeu_si256((__m256i *)(o + s * 32),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(ev, lo_idx, od)));
            _mm256_storeu_si256((__m256i *)(o + s * 32 + 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(ev, hi_idx, od)));
        }
    }
}

#define BF16_SEQ_CASE(TT, GG, NVV)                                                          \
    if (tiles == TT && G == GG && NV == NVV) {                                              \
        attend_seq_bf16_impl(k, v, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, table, bs, lo, len,   \
                             KVH, TT, GG, NVV, bq, scale, sc, acc, out, so_h, next_table,    \
                             next_b0, next_b1);                                             \
        return;                                                                             \
    }
#define BF16_SEQ_CASES(TT)                                                                  \
    BF16_SEQ_CASE(TT, 1, 4) BF16_SEQ_CASE(TT, 2, 4) BF16_SEQ_CASE(TT, 3, 4)                  \
    BF16_SEQ_CASE(TT, 4, 4) BF16_SEQ_CASE(TT, 5, 4) BF16_SEQ_CASE(TT, 6, 4)                  \
    BF16_SEQ_CASE(TT, 7, 4) BF16_SEQ_CASE(TT, 8, 4) BF16_SEQ_CASE(TT, 1, 8)                  \
    BF16_SEQ_CASE(TT, 2, 8) BF16_SEQ_CASE(TT, 4, 8) BF16_SEQ_CASE(TT, 8, 8)

/* tiles: see attend_seq_bf16_impl; literal-shape specialisations for the common
 * group sizes and head_dim 64 / 128, else the same code with runtime shapes. */
static void attend_seq_bf16(const uint16_t *k, const uint16_t *v, int64_t sk_b, int64_t sk_o,
                            int64_t sk_h, int64_t sv_b, int64_t sv_o, int64_t sv_h,
                            const int64_t *table, int64_t bs, int64_t lo, int64_t len,
                            int64_t KVH, int tiles, int64_t G, int64_t NV, const uint16_t *bq,
                            float scale, float *sc, __m512 *acc, uint16_t *out, int64_t so_h,
                            const int64_t *next_table, int64_t next_b0, int64_t next_b1) {
#ifdef HAVE_AMX_DECODE
    BF16_SEQ_CASES(1)
    if (tiles) {
        attend_seq_bf16_impl(k, v, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, table, bs, lo, len, KVH, 1,
                             G, NV, bq, scale, sc, acc, out, so_h, next_table, next_b0, next_b1);
        return;
    }
#endif
    BF16_SEQ_CASES(0)
    attend_seq_bf16_impl(k, v, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, table, bs, lo, len, KVH, 0, G,
                         NV, bq, scale, sc, acc, out, so_h, next_table, next_b0, next_b1);
}
#endif

/* A team body (team.h): one work item per sequence, all its heads. */
void team_paged_decode_attention(int is_bf16, const void *q, int64_t sq_t, int64_t sq_h,
                                 const void *k, int64_t sk_b, int64_t sk_o, int64_t sk_h,
                                 const void *v, int64_t sv_b, int64_t sv_o, int64_t sv_h,
                                 const int64_t *bt, int64_t sbt, const int64_t *lens, void *out,
                                 int64_t so_t, int64_t so_h, int64_t nd, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int64_t window, int amx, int64_t *counter,
                                 int *failed) {
    const int64_t G = num_heads / num_kv_heads;
    const int64_t nv = head_dim / VL;
#ifdef HAVE_BF16_DECODE
    const int use_bf16 = is_bf16 && block_size % 16 == 0 && head_dim % 32 == 0 && G <= 16;
#endif
#ifdef HAVE_AMX_DECODE
    const int use_tiles = amx && use_bf16;
#elif defined(HAVE_BF16_DECODE)
    const int use_tiles = 0;
    (void)amx;
#else
    (void)amx;
#endif
    /* Dynamic schedule with a lookahead of one: a thread claims its next
     * sequence when it starts the current one, so the tail of the current one
     * prefetches the next one's first K blocks (a cold start per sequence
     * otherwise). The counter is shared by the team. */
#pragma omp single
    *counter = 0;
    int64_t s_next = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
    while (s_next < nd) {
        const int64_t s = s_next;
        s_next = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
        const int64_t *next_table = NULL;
        int64_t next_b0 = 0, next_b1 = -1;
        if (s_next < nd && lens[s_next] > 0) {
            const int64_t nlen = lens[s_next];
            const int64_t nlo = nlen - window > 0 ? nlen - window : 0;
            next_table = bt + s_next * sbt;
            next_b0 = nlo / block_size;
            next_b1 = (nlen - 1) / block_size;
        }
        const int64_t len = lens[s];
        const int64_t q_pos = len - 1;
        const int64_t lo = q_pos - window + 1 > 0 ? q_pos - window + 1 : 0;
        const int64_t n = len - lo;
        if (n < 1) {
#pragma omp atomic write
            *failed = 1;
            continue;
        }
#ifdef HAVE_BF16_DECODE
        if (use_bf16) {
            /* Scratch: accumulators (H x head_dim floats), scores (16 floats per
             * key row of every group), query tiles (or the plain queries). */
            const int64_t GS = 16 / G, NG = (num_kv_heads + GS - 1) / GS;
            const int64_t rows = ((len - 1) / block_size - lo / block_size + 1) * block_size;
            const size_t acc_b = (size_t)(num_heads * head_dim * 4);
            const size_t sc_b = (size_t)(NG * rows * 64);
            const size_t bq_b = use_tiles
                                    ? (size_t)(num_kv_heads * (head_dim / 32) * QTILE_ELEMS * 2)
                                    : (size_t)(num_heads * head_dim * 2);
            char *buf = (char *)aligned_alloc(64, acc_b + sc_b + bq_b);
            if (buf == NULL) {
#pragma omp atomic write
                *failed = 1;
                continue;
            }
            uint16_t *bq = (uint16_t *)(buf + acc_b + sc_b);
            if (use_tiles)
                pack_query_tiles((const uint16_t *)q + s * sq_t, sq_h, num_kv_heads, G, head_dim,
                                 bq);
            else
                for (int64_t hq = 0; hq < num_heads; ++hq)
                    memcpy(bq + hq * head_dim, (const uint16_t *)q + s * sq_t + hq * sq_h,
                           (size_t)head_dim * 2);
            attend_seq_bf16((const uint16_t *)k, (const uint16_t *)v, sk_b, sk_o, sk_h, sv_b, sv_o,
                            sv_h, bt + s * sbt, block_size, lo, len, num_kv_heads, use_tiles, G, nv,
                            bq, scale, (float *)(buf + acc_b), (__m512 *)buf,
                            (uint16_t *)out + s * so_t, so_h, next_table, next_b0, next_b1);
            free(buf);
            continue;
        }
#endif
        const size_t nvec = (size_t)(num_heads * nv);
        /* Scratch: scaled queries, accumulators (H x head_dim each), scores (H x n). */
        const size_t score_vecs = (size_t)((num_heads * n + VL - 1) / VL);
        vf *buf = (vf *)aligned_alloc(sizeof(vf), sizeof(vf) * (2 * nvec + score_vecs));
        if (buf == NULL) {
#pragma omp atomic write
            *failed = 1;
            continue;
        }
        vf *qv = buf, *acc = buf + nvec;
        float *sc = (float *)(buf + 2 * nvec);
        float inv[MAX_HEADS];
        for (int64_t hq = 0; hq < num_heads; ++hq) {
            const int64_t qo = s * sq_t + hq * sq_h;
            for (int64_t c = 0; c < nv; ++c)
                qv[hq * nv + c] = load_vec(q, qo + c * VL, is_bf16) * scale;
        }
        const int64_t *table = bt + s * sbt;
        /* bf16 queries for the VDPBF16PS scores: the unscaled bits (the scale is
         * applied to the float32 scores, so no extra rounding). */
        uint16_t qbuf[MAX_HEADS * MAX_HEAD_DIM / 8];
        const uint16_t *qb = NULL;
#ifdef HAVE_BF16_DOT
        if (is_bf16 && block_size % 16 == 0 && nv % 2 == 0 &&
            (size_t)(num_heads * head_dim) <= sizeof qbuf / sizeof qbuf[0]) {
            for (int64_t hq = 0; hq < num_heads; ++hq)
                memcpy(qbuf + hq * head_dim, (const uint16_t *)q + s * sq_t + hq * sq_h,
                       (size_t)head_dim * 2);
            qb = qbuf;
        }
#endif
        attend_seq(is_bf16, k, v, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, table, block_size, lo, len,
                   num_kv_heads, G, nv, qv, qb, scale, sc, acc, inv, next_table, next_b0, next_b1);
        for (int64_t hq = 0; hq < num_heads; ++hq) {
            const int64_t oo = s * so_t + hq * so_h;
            for (int64_t c = 0; c < nv; ++c) {
                const vf r = acc[hq * nv + c] * inv[hq];
                for (int i = 0; i < VL; ++i) {
                    if (is_bf16)
                        ((uint16_t *)out)[oo + c * VL + i] = f32_to_bf16(r[i]);
                    else
                        ((float *)out)[oo + c * VL + i] = r[i];
                }
            }
        }
        free(buf);
    }
#pragma omp barrier
}

int paged_decode_attention(
    int is_bf16,
    const void *q, int64_t sq_t, int64_t sq_h,
    const void *k, int64_t sk_b, int64_t sk_o, int64_t sk_h,
    const void *v, int64_t sv_b, int64_t sv_o, int64_t sv_h,
    const int64_t *bt, int64_t sbt, const int64_t *lens,
    void *out, int64_t so_t, int64_t so_h,
    int64_t nd, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int64_t window, int amx, int num_threads) {
    const int64_t G = num_heads / num_kv_heads;
    if (num_heads > MAX_HEADS || G > MAX_GROUP || head_dim > MAX_HEAD_DIM || head_dim % VL)
        return -1;
    int failed = 0;
    int64_t counter = 0;
    /* amx: the caller has the tile state from Linux (amx_init); the scores then
     * run on tiles, configured per thread here */
#pragma omp parallel num_threads(num_threads)
    {
        if (amx) team_amx_begin();
        team_paged_decode_attention(is_bf16, q, sq_t, sq_h, k, sk_b, sk_o, sk_h, v, sv_b, sv_o,
                                    sv_h, bt, sbt, lens, out, so_t, so_h, nd, num_heads,
                                    num_kv_heads, head_dim, block_size, scale, window, amx,
                                    &counter, &failed);
        if (amx) team_amx_end();
    }
    return failed ? -2 : 0;
}
