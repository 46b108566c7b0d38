/*
 * bf16 linear layers for small batches: on Intel AMX (Advanced Matrix
 * Extensions) tiles where the CPU has them, else with AVX512-BF16 dot products
 * (VDPBF16PS) on the same packed weights.
 *
 * Why: at decode batch sizes (M = 1..128 tokens) oneDNN's bf16 GEMM reaches a
 * few percent of what the tiles can do, so the decode step pays for its layers
 * far more than streaming their weights costs. This kernel keeps the weights pre-packed in the tile layout
 * TDPBF16PS wants and streams them through with one weight-tile load per two
 * multiply instructions. Without AMX (e.g. AMD Zen 4/5) the same packing feeds
 * VDPBF16PS, so the fused decode step (decode_layers_cpu.c), the fused SwiGLU
 * and the LM head's fused argmax run there too.
 *
 * Math: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]); bf16 inputs, float32
 * accumulation, one rounding to bf16 at the end (round to nearest even by
 * VCVTNEPS2BF16), as oneDNN does. The two paths sum in different orders.
 *
 * Tiles (TDPBF16PS, Intel SDM vol. 2 / the AMX programming reference): an A tile
 * is 16 rows x 32 bf16 taken straight from x (row stride = x's), a B tile is 16
 * rows of 16 bf16 pairs: B[kp][2n + j] = W[n][2kp + j] for a 16-column, 32-deep
 * slice of W (the "VNNI" layout, built once by bf16_pack_weight), C tiles are
 * 16 x 16 float32. Eight tile registers: C00 C10 C01 C11 (2 row chunks x 2
 * column blocks), A0 A1, B0 B1: each k step loads 2 A and 2 B tiles for 4
 * multiplies. VDPBF16PS takes a B tile row (16 columns x one pair) as its vector
 * operand and a broadcast pair of an x row as the other: 8 rows x 2 column blocks
 * of float32 accumulators in registers, the same C blocks as the tiles.
 *
 * Shapes: K % 32 == 0 and N % 16 == 0 (the Python side checks, else F.linear).
 * M is any size: rows are handled in chunks of 16, a partial last chunk through
 * a zero-padded copy of its rows.
 *
 * Built where the compiler targets AVX512-BF16 (-march=native on such a CPU);
 * the tile path also needs AMX, and the process must be granted the tile state
 * by the kernel (arch_prctl), which amx_init asks for.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_math.h"
#include "tandem_kernels.h"
#include "team.h"

/* wp[((nb * KB + kb) * 16 + kp) * 32 + 2n + j] = w[(nb*16 + n) * K + kb*32 + 2kp + j] */
void bf16_pack_weight(const uint16_t *w, int64_t N, int64_t K, uint16_t *wp) {
    const int64_t KB = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < N / 16; ++nb)
        for (int64_t kb = 0; kb < KB; ++kb) {
            uint16_t *tile = wp + (nb * KB + kb) * 512;
            for (int64_t kp = 0; kp < 16; ++kp)
                for (int64_t n = 0; n < 16; ++n)
                    for (int64_t j = 0; j < 2; ++j)
                        tile[kp * 32 + 2 * n + j] = w[(nb * 16 + n) * K + kb * 32 + 2 * kp + j];
        }
}

/* ids[r] from the per-thread row maxima best[t * M + r] (their first columns in
 * best_idx, -1 where thread t saw no column): threads hold ascending runs of
 * columns in thread order, so the first maximum (or the first NaN) over threads
 * in order is the first over all columns. */
static inline void merge_argmax(int team, int64_t M, const float *best, const int64_t *best_idx,
                                int64_t *ids) {
    for (int64_t r = 0; r < M; ++r) {
        int64_t at = -1;
        float v = 0.f;
        for (int t = 0; t < team; ++t) {
            const int64_t i = best_idx[t * M + r];
            if (i < 0) continue;
            const float b = best[t * M + r];
            if (at >= 0 && v != v) break; /* an earlier NaN won */
            if (at < 0 || b != b || b > v) {
                at = i;
                v = b;
            }
        }
        ids[r] = at < 0 ? 0 : at;
    }
}

/* The buffers of one bf16_linear_argmax call: the path's scratch (64-byte aligned)
 * and every thread's running row maxima (best_idx -1: none yet). */
typedef struct {
    void *scratch;
    float *best;
    int64_t *best_idx;
} argmax_state;

static inline void argmax_free(argmax_state *st) {
    free(st->scratch);
    free(st->best);
    free(st->best_idx);
}

/* 0, or -2 (nothing left allocated) when memory runs out. */
static inline int argmax_begin(argmax_state *st, int num_threads, int64_t M,
                               size_t scratch_bytes) {
    st->scratch = aligned_alloc(64, (scratch_bytes + 63) / 64 * 64);
    st->best = (float *)malloc((size_t)(num_threads * M) * sizeof(float));
    st->best_idx = (int64_t *)malloc((size_t)(num_threads * M) * sizeof(int64_t));
    if (st->scratch == NULL || st->best == NULL || st->best_idx == NULL) {
        argmax_free(st);
        return -2;
    }
    for (int64_t i = 0; i < num_threads * M; ++i) st->best_idx[i] = -1;
    return 0;
}

/* Merge the team's maxima into ids and free the buffers. */
static inline void argmax_end(argmax_state *st, int team, int64_t M, int64_t *ids) {
    merge_argmax(team, M, st->best, st->best_idx, ids);
    argmax_free(st);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <math.h>
#include <omp.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX_LINEAR 1
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_available(void) { return 1; }

/* Ask Linux for the AMX tile state (once per process; idempotent). */
int amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    /* NOTE: not _tile_loadconfig: GCC 12's intrinsic declares an 8-byte memory
     * operand, so the compiler may drop the stores to the rest of cfg as dead
     * (seen: LDTILECFG read garbage rows/colsb and faulted once the function
     * was inlined elsewhere). The operand here is the whole 64-byte struct. */
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}
#else
int amx_available(void) { return 0; }
int amx_init(void) { return -1; }
#endif

int bf16_linear_path(void) { return TANDEM_LINEAR_BF16; }

/* 16 bf16 biases as float32 (zeros without a bias). */
static inline __m512 load_bias(const uint16_t *bias) {
    if (bias == NULL) return _mm512_setzero_ps();
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* Round a 16 x 16 float32 tile (+ bias) to bf16 rows of y; only `rows` rows. */
static inline void store_tile(const float *c, const uint16_t *bias, uint16_t *y, int64_t sy,
                              int64_t rows) {
    const __m512 b = load_bias(bias);
    for (int64_t r = 0; r < rows; ++r) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + r * 16), b);
        _mm256_storeu_si256((__m256i *)(y + r * sy), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* Rows [m0, m0 + 32) (or 16 when `one`) x column blocks nb, nb + 1 (or nb alone
 * when `single`). x rows are read with stride sx (elements). */
#define KLOOP(BODY)                                                                        \
    for (int64_t kb = 0; kb < KB; ++kb) {                                                  \
        if (pf) prefetch_tiles(b0 + (kb + PF_TILES) * 512, b1 + (kb + PF_TILES) * 512);    \
        BODY                                                                               \
    }

/* Weight tiles are prefetched PF_TILES k steps ahead: the packed weights of a
 * thread are one contiguous run, but tile loads do not seem to train the
 * hardware prefetchers (without this the kernel ran much slower on weights not in
 * cache). The
 * addresses run past a column pair's panel into the next one's, which is the
 * one this thread reads next. Only a pair's first row chunk prefetches: the
 * later chunks find the panel in cache, and their 32 prefetch instructions
 * per k step only took issue slots (faster both at decode and at prefill
 * sizes: docs/benchmarks.md). */
#define PF_TILES 4
static inline void prefetch_tiles(const uint16_t *a, const uint16_t *b) {
    for (int i = 0; i < 1024; i += 64) {
        _mm_prefetch((const char *)a + i, _MM_HINT_T0);
        _mm_prefetch((const char *)b + i, _MM_HINT_T0);
    }
}

#ifdef HAVE_AMX_LINEAR
static inline void tile_block(const uint16_t *x, int64_t sx, const uint16_t *wp, int64_t KB,
                              int64_t nb0, int64_t nb1, int one, int single, float *cbuf,
                              int pf) {
    const uint16_t *b0 = wp + nb0 * KB * 512;
    const uint16_t *b1 = wp + (single ? nb0 + 1 : nb1) * KB * 512; /* prefetch only if single */
    const int64_t xs = sx * 2; /* bytes */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (!one && !single) {
        KLOOP(_tile_loadd(4, x + kb * 32, xs); _tile_loadd(5, x + 16 * sx + kb * 32, xs);
              _tile_loadd(6, b0 + kb * 512, 64); _tile_loadd(7, b1 + kb * 512, 64);
              _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6); _tile_dpbf16ps(2, 4, 7);
              _tile_dpbf16ps(3, 5, 7);)
    } else if (one && !single) {
        KLOOP(_tile_loadd(4, x + kb * 32, xs); _tile_loadd(6, b0 + kb * 512, 64);
              _tile_loadd(7, b1 + kb * 512, 64); _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(2, 4, 7);)
    } else if (!one) {
        KLOOP(_tile_loadd(4, x + kb * 32, xs); _tile_loadd(5, x + 16 * sx + kb * 32, xs);
              _tile_loadd(6, b0 + kb * 512, 64); _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(1, 5, 6);)
    } else {
        KLOOP(_tile_loadd(4, x + kb * 32, xs); _tile_loadd(6, b0 + kb * 512, 64);
              _tile_dpbf16ps(0, 4, 6);)
    }
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
}
#endif

/* R (1, 2, 4 or 8) rows from x (stride sx) x column blocks b0 (and b1 unless
 * SINGLE) with VDPBF16PS: c0[i] / c1[i] accumulate row i's 16 columns of each
 * block. Each row's sum runs over k in the same order whatever R is, so a row's
 * result does not depend on how many rows share its call (batch invariance). */
static inline __attribute__((always_inline)) void dp_rows(const uint16_t *x, int64_t sx,
                                                          const uint16_t *b0, const uint16_t *b1,
                                                          int64_t KB, const int R, const int SINGLE,
                                                          int pf, __m512 *c0, __m512 *c1) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; ++kb) {
        if (pf) prefetch_tiles(b0 + (kb + PF_TILES) * 512, b1 + (kb + PF_TILES) * 512);
        const uint16_t *w0 = b0 + kb * 512, *w1 = b1 + kb * 512;
        const uint16_t *xk = x + kb * 32;
        for (int64_t kp = 0; kp < 16; ++kp) {
            /* unaligned loads: a packed weight may be a view at any offset */
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + kp * 32);
            const __m512bh v1 = SINGLE ? v0 : (__m512bh)_mm512_loadu_si512(w1 + kp * 32);
#pragma GCC unroll 8
            for (int i = 0; i < R; ++i) {
                int32_t pair;
                memcpy(&pair, xk + i * sx + 2 * kp, 4);
                const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
                c0[i] = _mm512_dpbf16_ps(c0[i], a, v0);
                if (!SINGLE) c1[i] = _mm512_dpbf16_ps(c1[i], a, v1);
            }
        }
    }
}

/* The VDPBF16PS counterpart of tile_block: the same C blocks in cbuf (C00 at 0,
 * C10 at 256, C01 at 512, C11 at 768), eight rows at a time; the weight panels
 * come from L1 after the first eight rows. Only the first `valid` rows are
 * computed (the rest of cbuf is left as it was): a decode batch of one row used
 * to pay for the sixteen of a padded chunk. */
#define DP_ROWS(R)                                                                          \
    dp_rows(x + r0 * sx, sx, b0, b1, KB, R, SINGLE, pf && r0 == 0, c0, c1)
static inline __attribute__((always_inline)) void dp_block_impl(
    const uint16_t *x, int64_t sx, const uint16_t *wp, int64_t KB, int64_t nb0, int64_t nb1,
    int64_t valid, const int SINGLE, float *cbuf, int pf) {
    const uint16_t *b0 = wp + nb0 * KB * 512;
    const uint16_t *b1 = wp + (SINGLE ? nb0 + 1 : nb1) * KB * 512; /* prefetch only if single */
    for (int r0 = 0; r0 < valid; r0 += 8) {
        __m512 c0[8], c1[8];
        const int64_t left = valid - r0;
        const int n = left >= 8 ? 8 : left > 4 ? 8 : left > 2 ? 4 : left;
        if (n == 8)
            DP_ROWS(8);
        else if (n == 4)
            DP_ROWS(4);
        else if (n == 2)
            DP_ROWS(2);
        else
            DP_ROWS(1);
        float *t = cbuf + (r0 / 16) * 256 + (r0 % 16) * 16;
        for (int i = 0; i < n; ++i) {
            _mm512_store_ps(t + i * 16, c0[i]);
            if (!SINGLE) _mm512_store_ps(t + 512 + i * 16, c1[i]);
        }
    }
}
#undef DP_ROWS

static void dp_block(const uint16_t *x, int64_t sx, const uint16_t *wp, int64_t KB, int64_t nb0,
                     int64_t nb1, int64_t valid, int single, float *cbuf, int pf) {
    if (single)
        dp_block_impl(x, sx, wp, KB, nb0, nb1, valid, 1, cbuf, pf);
    else
        dp_block_impl(x, sx, wp, KB, nb0, nb1, valid, 0, cbuf, pf);
}

/* One C block on tiles or with VDPBF16PS; `valid`: the rows of the block that
 * are read back (the tiles compute all of them). */
static inline void c_block(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                           int64_t KB, int64_t nb0, int64_t nb1, int one, int64_t valid,
                           int single, float *cbuf, int pf) {
#ifdef HAVE_AMX_LINEAR
    if (tiles) {
        tile_block(x, sx, wp, KB, nb0, nb1, one, single, cbuf, pf);
        return;
    }
#else
    (void)tiles;
#endif
    (void)one;
    dp_block(x, sx, wp, KB, nb0, nb1, valid, single, cbuf, pf);
}

/* Rows of x per outer block: its slice (M_BLOCK x K bf16) stays in L2 while
 * every column block streams past it. */
#define M_BLOCK 256

static inline __m512 bf16_round(__m512 v) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* SwiGLU epilogue (Shazeer 2020) of a fused gate/up projection: out[r] =
 * bf16(bf16(silu(g)) * u) with g, u the bf16-rounded gate and up outputs, the
 * same rounding steps (and silu_ps) as the unfused linear + silu_and_mul kernels,
 * so the result is bit-identical to running them one after the other. */
static inline void swiglu_tile(const float *cg, const float *cu, const uint16_t *bg,
                               const uint16_t *bu, uint16_t *y, int64_t sy, int64_t rows) {
    const __m512 vbg = load_bias(bg), vbu = load_bias(bu);
    for (int64_t r = 0; r < rows; ++r) {
        const __m512 g = bf16_round(_mm512_add_ps(_mm512_loadu_ps(cg + r * 16), vbg));
        const __m512 u = bf16_round(_mm512_add_ps(_mm512_loadu_ps(cu + r * 16), vbu));
        const __m512 a = bf16_round(silu_ps(g));
        _mm256_storeu_si256((__m256i *)(y + r * sy), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a, u)));
    }
}

typedef struct {
    const uint16_t *bias;
    uint16_t *y;
    int64_t sy;
    int swiglu; /* y = silu(gate) * up, y is [M, N / 2] */
    /* argmax instead of y (when best_idx != NULL): this thread's running row
     * maxima of the bf16-rounded outputs and their first columns */
    float *best;
    int64_t *best_idx;
} epilogue;

/* Fold one 16 x 16 tile (columns col0..) into the running row argmax: the value
 * compared is the bf16 output store_tile would write, so ties resolve as they
 * would on the stored logits (first column); a NaN wins at its first column, as
 * in torch's max. */
static inline void argmax_tile(const float *c, const uint16_t *bias, int64_t col0, int64_t rows,
                               float *best, int64_t *best_idx) {
    const __m512 b = load_bias(bias);
    for (int64_t r = 0; r < rows; ++r) {
        if (best_idx[r] >= 0 && best[r] != best[r]) continue; /* a NaN already won */
        const __m512 v = bf16_round(_mm512_add_ps(_mm512_loadu_ps(c + r * 16), b));
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        if (nan) {
            best[r] = NAN;
            best_idx[r] = col0 + __builtin_ctz(nan);
            continue;
        }
        const float m = _mm512_reduce_max_ps(v);
        if (best_idx[r] < 0 || m > best[r]) {
            best[r] = m;
            best_idx[r] = col0 + __builtin_ctz(_mm512_cmp_ps_mask(v, _mm512_set1_ps(m), _CMP_EQ_OQ));
        }
    }
}

/* Write one 16-row chunk (rows from `row`): c0 holds column block nb0, c1 block
 * nb1 (NULL when there is none). */
static inline void emit(const epilogue *e, const float *c0, const float *c1, int64_t nb0,
                        int64_t nb1, int64_t row, int64_t rows) {
    const uint16_t *b0 = e->bias != NULL ? e->bias + nb0 * 16 : NULL;
    const uint16_t *b1 = e->bias != NULL ? e->bias + nb1 * 16 : NULL;
    if (e->best_idx != NULL) {
        argmax_tile(c0, b0, nb0 * 16, rows, e->best + row, e->best_idx + row);
        if (c1 != NULL) argmax_tile(c1, b1, nb1 * 16, rows, e->best + row, e->best_idx + row);
        return;
    }
    uint16_t *y0 = e->y + row * e->sy + nb0 * 16;
    if (e->swiglu) {
        swiglu_tile(c0, c1, b0, b1, y0, e->sy, rows);
        return;
    }
    store_tile(c0, b0, y0, e->sy, rows);
    if (c1 != NULL) store_tile(c1, b1, e->y + row * e->sy + nb1 * 16, e->sy, rows);
}

/* Column blocks in pairs (nb0, nb1) per thread, rows in chunks of 32 (two C
 * tiles each), a partial last chunk through `pad`; a team body (team.h). */
static void matmul_body(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp, int64_t M,
                        int64_t N, int64_t K, uint16_t *pad, const epilogue *e);

int team_bf16_matmul(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                     const uint16_t *bias, uint16_t *y, int64_t sy, int64_t M, int64_t N,
                     int64_t K, int swiglu, uint16_t *pad) {
    if (K % 32 || N % 16 || M < 1 || (swiglu && N % 32)) return -1;
#ifndef HAVE_AMX_LINEAR
    if (tiles) return -1;
#endif
    const epilogue ep = {bias, y, sy, swiglu, NULL, NULL};
    matmul_body(tiles, x, sx, wp, M, N, K, pad, &ep);
    return 0;
}

static void matmul_body(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp, int64_t M,
                        int64_t N, int64_t K, uint16_t *pad, const epilogue *e) {
    const int64_t KB = K / 32, NB = N / 16;
    /* swiglu: gate block j pairs with up block NB/2 + j (same output columns) */
    const int64_t npairs = e->swiglu ? NB / 2 : (NB + 1) / 2;
    const int64_t mfull = M / 16 * 16, mtail = M - mfull;
    if (mtail) {
#pragma omp single
        for (int64_t r = 0; r < 16; ++r) {
            if (r < mtail)
                memcpy(pad + r * K, x + (mfull + r) * sx, (size_t)(K * 2));
            else
                memset(pad + r * K, 0, (size_t)(K * 2));
        }
    }
    float cbuf[4 * 256] __attribute__((aligned(64)));
    for (int64_t mb = 0; mb < M; mb += M_BLOCK) {
        const int64_t me = mb + M_BLOCK < M ? mb + M_BLOCK : M;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < npairs; ++p) {
            const int64_t nb0 = e->swiglu ? p : 2 * p;
            const int64_t nb1 = e->swiglu ? NB / 2 + p : 2 * p + 1;
            const int single = !e->swiglu && nb1 >= NB;
            for (int64_t m0 = mb; m0 < me; m0 += 32) {
                const int64_t rows0 = me - m0 < 16 ? me - m0 : 16;
                const int64_t rows1 = me - m0 - 16 < 16 ? me - m0 - 16 : 16;
                const int one = rows1 <= 0;
                const int tail0 = rows0 < 16, tail1 = !one && rows1 < 16;
                if (tail1) {
                    /* rows m0..m0+15 full, the next chunk partial: two passes */
                    c_block(tiles, x + m0 * sx, sx, wp, KB, nb0, nb1, 1, 16, single, cbuf,
                            m0 == mb);
                    emit(e, cbuf, single ? NULL : cbuf + 512, nb0, nb1, m0, 16);
                    c_block(tiles, pad, K, wp, KB, nb0, nb1, 1, rows1, single, cbuf, 0);
                    emit(e, cbuf, single ? NULL : cbuf + 512, nb0, nb1, m0 + 16, rows1);
                    continue;
                }
                const uint16_t *xa = tail0 ? pad : x + m0 * sx;
                c_block(tiles, xa, tail0 ? K : sx, wp, KB, nb0, nb1, one,
                        one ? rows0 : 16 + rows1, single, cbuf, m0 == mb);
                emit(e, cbuf, single ? NULL : cbuf + 512, nb0, nb1, m0, rows0);
                if (!one)
                    emit(e, cbuf + 256, single ? NULL : cbuf + 768, nb0, nb1, m0 + 16, rows1);
            }
        }
    }
}

int team_bf16_linear_available(void) { return 1; }
#ifdef HAVE_AMX_LINEAR
int team_amx_available(void) { return 1; }
void team_amx_begin(void) { configure_tiles(); }
void team_amx_end(void) { _tile_release(); }
#else
int team_amx_available(void) { return 0; }
void team_amx_begin(void) {}
void team_amx_end(void) {}
#endif

/* The public kernels: one parallel region around the team body; tiles != 0:
 * on AMX (the caller has the tile state from Linux), else VDPBF16PS. */
static int bf16_matmul(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                       const uint16_t *bias, uint16_t *y, int64_t sy, int64_t M, int64_t N,
                       int64_t K, int swiglu, int num_threads) {
    if (K % 32 || N % 16 || M < 1 || (swiglu && N % 32)) return -1;
#ifndef HAVE_AMX_LINEAR
    if (tiles) return -1;
#endif
    uint16_t *pad = NULL;
    if (M % 16) {
        pad = (uint16_t *)aligned_alloc(64, (size_t)(16 * K * 2));
        if (pad == NULL) return -2;
    }
#pragma omp parallel num_threads(num_threads)
    {
        if (tiles) team_amx_begin();
        team_bf16_matmul(tiles, x, sx, wp, bias, y, sy, M, N, K, swiglu, pad);
        if (tiles) team_amx_end();
    }
    free(pad);
    return 0;
}

int bf16_linear(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                const uint16_t *bias, uint16_t *y, int64_t sy, int64_t M, int64_t N, int64_t K,
                int num_threads) {
    return bf16_matmul(tiles, x, sx, wp, bias, y, sy, M, N, K, 0, num_threads);
}

/* y[M, N/2] = silu(x @ Wg^T + bg) * (x @ Wu^T + bu) for W = [Wg; Wu] ([N, K],
 * packed by bf16_pack_weight), N % 32 == 0: a gate/up projection and its SwiGLU
 * in one pass, so the [M, N] intermediate is never written back and re-read. */
int bf16_linear_swiglu(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                       const uint16_t *bias, uint16_t *y, int64_t sy, int64_t M, int64_t N,
                       int64_t K, int num_threads) {
    return bf16_matmul(tiles, x, sx, wp, bias, y, sy, M, N, K, 1, num_threads);
}

/* ids[M] = argmax over the N outputs of each row of x @ W^T + bias, as the
 * bf16 outputs bf16_linear would write (first maximal column; a NaN wins at
 * its first column): an LM head and greedy sampling in one pass, without
 * writing the [M, N] logits and reading them back. Each thread keeps row maxima
 * over its (contiguous, ascending) columns; the threads' results are merged in
 * thread order, so ties keep the lowest column. */
int bf16_linear_argmax(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                       const uint16_t *bias, int64_t *ids, int64_t M, int64_t N, int64_t K,
                       int num_threads) {
    if (K % 32 || N % 16 || M < 1 || num_threads < 1) return -1;
#ifndef HAVE_AMX_LINEAR
    if (tiles) return -1;
#endif
    argmax_state st;
    if (argmax_begin(&st, num_threads, M, (size_t)(16 * K * 2)) != 0) return -2;
    int team = 1;
#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num();
#pragma omp single
        team = omp_get_num_threads();
        if (tiles) team_amx_begin();
        const epilogue ep = {bias, NULL, 0, 0, st.best + tid * M, st.best_idx + tid * M};
        matmul_body(tiles, x, sx, wp, M, N, K, (uint16_t *)st.scratch, &ep);
        if (tiles) team_amx_end();
    }
    argmax_end(&st, team, M, ids);
    return 0;
}

#else /* no AVX512-BF16 in this build */

int team_bf16_linear_available(void) { return 0; }
int team_amx_available(void) { return 0; }
void team_amx_begin(void) {}
void team_amx_end(void) {}
int team_bf16_matmul(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                     const uint16_t *bias, uint16_t *y, int64_t sy, int64_t M, int64_t N,
                     int64_t K, int swiglu, uint16_t *pad) {
    (void)tiles, (void)x, (void)sx, (void)wp, (void)bias, (void)y, (void)sy, (void)M, (void)N;
    (void)K, (void)swiglu, (void)pad;
    return -1;
}
int amx_available(void) { return 0; }
int amx_init(void) { return -1; }
/* No fused SwiGLU without AVX512-BF16: the caller runs the linear and silu_and_mul. */
int bf16_linear_swiglu(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                       const uint16_t *bias, uint16_t *y, int64_t sy, int64_t M, int64_t N,
                       int64_t K, int num_threads) {
    (void)tiles, (void)x, (void)sx, (void)wp, (void)bias, (void)y, (void)sy, (void)M, (void)N;
    (void)K, (void)num_threads;
    return -1;
}

#if defined(__AVX2__) && defined(__FMA__)
/*
 * The FMA path (CPUs with AVX2 + FMA and no AVX512-BF16, e.g. AVX2-only EPYC VMs,
 * where PyTorch has no fast bf16 GEMM): the same VNNI-packed bf16 weights, widened
 * to float32 in registers, float32 FMAs, one rounding to bf16 at the end.
 *
 * A VNNI row of a column block (16 columns x one k pair, 64 bytes) is two 8-lane
 * vectors of 32-bit pairs: the even k's float32 is the pair shifted left by 16, the
 * odd k's the pair with its low half cleared (bf16 is a float32's upper half), two
 * integer ops per vector, so the weights stream at bf16 size. x is widened once per
 * call into a float32 copy whose elements are broadcast. Register block: FMA_ROWS
 * rows x 16 columns: 12 accumulators, two weight vectors and a broadcast of the 16
 * ymm registers (fma_rows says why two weight vectors); with four rows and all
 * four weight vectors live the kernel was ~20% slower at prefill sizes than with
 * this block (docs/benchmarks.md).
 * Rows in blocks of FMA_M_BLOCK (their float32 copy stays in L2 while every column
 * block streams past), columns split over the threads in ascending runs.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>

#include "elementwise.h"

#define FMA_ROWS 6
#define FMA_M_BLOCK 64

int bf16_linear_path(void) { return TANDEM_LINEAR_FMA; }

/* c[i * 16 + n] = sum_k xf[i * K + k] * W[n][k] over the column block at wb (its KB
 * k-blocks contiguous) for rows i < R. The even k of a pair for every row, then the
 * odd k (the pair loaded again from L1): two weight vectors live at a time, and an
 * accumulator's two FMAs a pair are R FMAs apart. */
static inline __attribute__((always_inline)) void fma_rows(const float *xf, int64_t K,
                                                           const uint16_t *wb, int64_t KB,
                                                           const int R, float *c) {
    __m256 lo[FMA_ROWS], hi[FMA_ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t kp = 0; kp < KB * 16; ++kp) {
        const __m256i *w = (const __m256i *)(wb + kp * 32);
        const __m256 el = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(w), 16));
        const __m256 eh = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(w + 1), 16));
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            const __m256 xe = _mm256_broadcast_ss(xf + i * K + 2 * kp);
            lo[i] = _mm256_fmadd_ps(xe, el, lo[i]);
            hi[i] = _mm256_fmadd_ps(xe, eh, hi[i]);
        }
        const __m256 ol = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w), odd));
        const __m256 oh = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w + 1), odd));
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            const __m256 xo = _mm256_broadcast_ss(xf + i * K + 2 * kp + 1);
            lo[i] = _mm256_fmadd_ps(xo, ol, lo[i]);
            hi[i] = _mm256_fmadd_ps(xo, oh, hi[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
        _mm256_storeu_ps(c + i * 16, lo[i]);
        _mm256_storeu_ps(c + i * 16 + 8, hi[i]);
    }
}

static void fma_block(const float *xf, int64_t K, const uint16_t *wb, int64_t KB, int R,
                      float *c) {
    switch (R) {
    case 6: fma_rows(xf, K, wb, KB, 6, c); break;
    case 5: fma_rows(xf, K, wb, KB, 5, c); break;
    case 4: fma_rows(xf, K, wb, KB, 4, c); break;
    case 3: fma_rows(xf, K, wb, KB, 3, c); break;
    case 2: fma_rows(xf, K, wb, KB, 2, c); break;
    default: fma_rows(xf, K, wb, KB, 1, c); break;
    }
}

/* Where one R x 16 block of outputs goes: bf16 rows of y, or (best_idx != NULL) this
 * thread's running row argmax of the bf16-rounded outputs (as argmax_tile). */
typedef struct {
    const uint16_t *bias;
    uint16_t *y;
    int64_t sy;
    float *best;
    int64_t *best_idx;
} fma_epilogue;

static void fma_emit(const fma_epilogue *e, const float *c, int64_t row, int64_t nb, int R) {
    float b[16];
    for (int n = 0; n < 16; ++n) b[n] = e->bias != NULL ? ld(e->bias, nb * 16 + n, 1) : 0.f;
    for (int i = 0; i < R; ++i) {
        const float *ci = c + i * 16;
        if (e->best_idx == NULL) {
            uint16_t *yr = e->y + (row + i) * e->sy + nb * 16;
#pragma omp simd
            for (int n = 0; n < 16; ++n) st(yr, n, ci[n] + b[n], 1);
            continue;
        }
        float *best = e->best + row + i;
        int64_t *at = e->best_idx + row + i;
        if (*at >= 0 && *best != *best) continue; /* a NaN already won */
        for (int n = 0; n < 16; ++n) {
            const float v = round_bf16(ci[n] + b[n]);
            if (v != v) {
                *best = NAN;
                *at = nb * 16 + n;
                break;
            }
            if (*at < 0 || v > *best) {
                *best = v;
                *at = nb * 16 + n;
            }
        }
    }
}

/* The body of a parallel region: xf = float32(x), then every output block. */
static void fma_matmul(const uint16_t *x, int64_t sx, const uint16_t *wp, float *xf, int64_t M,
                       int64_t N, int64_t K, const fma_epilogue *e) {
    const int64_t KB = K / 32, NB = N / 16;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; ++r)
        for (int64_t k = 0; k < K; ++k) xf[r * K + k] = ld(x, r * sx + k, 1);
    float c[FMA_ROWS * 16];
    for (int64_t mb = 0; mb < M; mb += FMA_M_BLOCK) {
        const int64_t me = mb + FMA_M_BLOCK < M ? mb + FMA_M_BLOCK : M;
        /* the same static split for every row block: each thread's columns stay one
         * ascending run (merge_argmax relies on it) */
#pragma omp for schedule(static) nowait
        for (int64_t nb = 0; nb < NB; ++nb)
            for (int64_t m0 = mb; m0 < me; m0 += FMA_ROWS) {
                const int R = me - m0 < FMA_ROWS ? (int)(me - m0) : FMA_ROWS;
                fma_block(xf + m0 * K, K, wp + nb * KB * 512, KB, R, c);
                fma_emit(e, c, m0, nb, R);
            }
    }
}

int bf16_linear(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                const uint16_t *bias, uint16_t *y, int64_t sy, int64_t M, int64_t N, int64_t K,
                int num_threads) {
    if (tiles || K % 32 || N % 16 || M < 1) return -1;
    float *xf = (float *)malloc((size_t)(M * K) * sizeof(float));
    if (xf == NULL) return -2;
    const fma_epilogue ep = {bias, y, sy, NULL, NULL};
#pragma omp parallel num_threads(num_threads)
    fma_matmul(x, sx, wp, xf, M, N, K, &ep);
    free(xf);
    return 0;
}

/* As the AVX512-BF16 bf16_linear_argmax: the argmax of the bf16 outputs bf16_linear
 * would write, without writing them. */
int bf16_linear_argmax(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                       const uint16_t *bias, int64_t *ids, int64_t M, int64_t N, int64_t K,
                       int num_threads) {
    if (tiles || K % 32 || N % 16 || M < 1 || num_threads < 1) return -1;
    argmax_state st;
    if (argmax_begin(&st, num_threads, M, (size_t)(M * K) * sizeof(float)) != 0) return -2;
    int team = 1;
#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num();
#pragma omp single
        team = omp_get_num_threads();
        const fma_epilogue ep = {bias, NULL, 0, st.best + tid * M, st.best_idx + tid * M};
        fma_matmul(x, sx, wp, (float *)st.scratch, M, N, K, &ep);
    }
    argmax_end(&st, team, M, ids);
    return 0;
}

#else /* neither AVX512-BF16 nor AVX2 + FMA */

int bf16_linear_path(void) { return TANDEM_LINEAR_NONE; }
int bf16_linear(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                const uint16_t *bias, uint16_t *y, int64_t sy, int64_t M, int64_t N, int64_t K,
                int num_threads) {
    (void)tiles, (void)x, (void)sx, (void)wp, (void)bias, (void)y, (void)sy, (void)M, (void)N;
    (void)K, (void)num_threads;
    return -1;
}
int bf16_linear_argmax(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                       const uint16_t *bias, int64_t *ids, int64_t M, int64_t N, int64_t K,
                       int num_threads) {
    (void)tiles, (void)x, (void)sx, (void)wp, (void)bias, (void)ids, (void)M, (void)N, (void)K;
    (void)num_threads;
    return -1;
}

#endif /* AVX2 + FMA */
#endif /* AVX512-BF16 */
