/*
 * Prefill attention (causal, optional sliding window) in bf16, reading K/V from
 * the paged cache: on Intel AMX tiles where the CPU has them, else with
 * AVX512-BF16 dot products (VDPBF16PS; e.g. AMD Zen 4/5).
 *
 * Why: torch's SDPA runs bf16 prefill attention far below what the AMX tiles or
 * VDPBF16PS can do (a large share of a prefill step, plus per-sequence Python
 * and copies); the tiles, or VDPBF16PS on the same packed operands, multiply
 * bf16 several times faster, and one call serves every prefill sequence of a
 * layer.
 *
 * Algorithm: for each (sequence, query head, block of 16 query tokens) the scores
 * of every visible key are computed at once (S = Q K^T, float32), the softmax
 * runs exactly over each row (max, exp, sum in float32; the probabilities
 * rounded to bf16 for the second product, as torch's CPU flash attention does),
 * then O = P V and O / sum is rounded to bf16. The score rows are held whole, so
 * no online-softmax rescaling is needed (Milakov & Gimelshein 2018 is what a
 * bounded buffer would need instead); memory is 16 x context x 6 bytes per thread.
 *
 * Packed operands: keys and values are first packed per (sequence, KV head,
 * chunk of 32 keys) into the B layout TDPBF16PS takes, shared by the G query
 * heads of that KV head:
 *   K chunk: [2 key tiles][D/32 k steps][16 pairs][16 keys x 2], element
 *            [t][ks][kp][2n + j] = K[32c + 16t + n][32ks + 2kp + j];
 *   V chunk: [D/16 dim tiles][16 key pairs][16 dims x 2], element
 *            [db][kp][2n + j] = V[32c + 2kp + j][16db + n].
 * Each 64-byte row of a tile is also what VDPBF16PS takes as its vector operand
 * (16 float32 lanes, each summing one pair), with the other operand a broadcast
 * 32-bit pair of the query row (for S) or of the probability row (for O), so the
 * AVX-512 path reads the same packing. Keys past the sequence end are packed as
 * zeros and masked out of the softmax.
 *
 * Shapes: head_dim % 32 == 0 and <= 256, num_heads % num_kv_heads == 0 (the
 * Python side checks). Visible keys of query position p: max(0, p - window + 1)
 * .. p (window <= 0: no window).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_math.h"
#include "tandem_kernels.h"
#include "team.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_PREFILL_AMX 1
#endif

#define CHUNK 32  /* keys per packed chunk: one k step of the P V product */
#define ROWS 16   /* query tokens per work item: one tile of rows */

typedef struct {
    int64_t token_start, num_new, num_computed, table_off;
} prefill_seq;

/* Pack chunk c of (sequence s, KV head h) from the paged cache into kp / vp.
 * Keys outside [key_lo, seq_len) are packed as zeros: no query of this step sees
 * them, and a slot before a sliding window may hold anything (as the decode
 * kernel allows), which P = 0 times NaN would otherwise carry into the output. */
static void pack_chunk(const uint16_t *k_cache, int64_t sk_b, int64_t sk_o, int64_t sk_h,
                       const uint16_t *v_cache, int64_t sv_b, int64_t sv_o, int64_t sv_h,
                       const int64_t *table, int64_t key_lo, int64_t seq_len, int64_t block_size,
                       int64_t h, int64_t c, int64_t D, uint16_t *kp, uint16_t *vp) {
    const int64_t KS = D / 32;
    const uint16_t *krow[CHUNK], *vrow[CHUNK];
    for (int64_t i = 0; i < CHUNK; ++i) {
        const int64_t key = c * CHUNK + i;
        if (key < key_lo || key >= seq_len) {
            krow[i] = vrow[i] = NULL;
            continue;
        }
        const int64_t blk = table[key / block_size], off = key % block_size;
        krow[i] = k_cache + blk * sk_b + off * sk_o + h * sk_h;
        vrow[i] = v_cache + blk * sv_b + off * sv_o + h * sv_h;
    }
    /* K: a key's dim pairs are 32-bit units; tile (t, ks) row kp holds pair
     * 16ks + kp of the tile's 16 keys, i.e. a 16 x 16 dword transpose. Where the
     * 16 keys sit in one cache block (block_size % 16 == 0) a row is one gather. */
    uint32_t *kp32 = (uint32_t *)kp;
    for (int64_t t = 0; t < 2; ++t) {
        const uint16_t *const *rows = krow + 16 * t;
        __mmask16 live = 0;
        for (int n = 0; n < 16; ++n) live |= (__mmask16)((rows[n] != NULL) << n);
        uint32_t *tile = kp32 + t * KS * 256;
        if (block_size % 16 == 0 && live) {
            const __m512i idx = _mm512_mullo_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32((int)(sk_o / 2)));
            /* the row of the tile's first key, whether visible or not: its live
             * keys sit in the same block at n * sk_o past it */
            const int64_t key0 = c * CHUNK + 16 * t;
            const uint32_t *base = (const uint32_t *)(k_cache + table[key0 / block_size] * sk_b +
                                                      (key0 % block_size) * sk_o + h * sk_h);
            for (int64_t d2 = 0; d2 < D / 2; ++d2)
                _mm512_storeu_si512(tile + d2 * 16,
                                    _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx,
                                                                base + d2, 4));
            continue;
        }
        for (int64_t d2 = 0; d2 < D / 2; ++d2)
            for (int n = 0; n < 16; ++n)
                tile[d2 * 16 + n] = rows[n] != NULL ? ((const uint32_t *)rows[n])[d2] : 0;
    }
    /* V: dim tile db row kp interleaves keys 2kp and 2kp + 1 over dims 16db.. */
    const __m512i lo_idx = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004,
                                             0x250005, 0x260006, 0x270007, 0x280008, 0x290009,
                                             0x2a000a, 0x2b000b, 0x2c000c, 0x2d000d, 0x2e000e,
                                             0x2f000f);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t kp2 = 0; kp2 < 16; ++kp2) {
        const uint16_t *r0 = vrow[2 * kp2], *r1 = vrow[2 * kp2 + 1];
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i a = r0 != NULL ? _mm512_loadu_si512(r0 + d) : _mm512_setzero_si512();
            const __m512i b = r1 != NULL ? _mm512_loadu_si512(r1 + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + ((d / 16) * 16 + kp2) * 32,
                                _mm512_permutex2var_epi16(a, lo_idx, b));
            _mm512_storeu_si512(vp + ((d / 16 + 1) * 16 + kp2) * 32,
                                _mm512_permutex2var_epi16(a, hi_idx, b));
        }
    }
}

/* Lanes of the 16 columns from j that fall in [lo, hi). */
static inline __mmask16 span_mask(int64_t j, int64_t lo, int64_t hi) {
    uint32_t m = 0xffffu;
    if (lo > j) m &= 0xffffu << (lo - j);
    if (hi < j + 16) m &= 0xffffu >> (j + 16 - hi);
    return (__mmask16)m;
}

/* Softmax of one score row over its visible columns [lo, hi) (relative to the
 * row's first chunk): p = bf16(exp(s * scale - max)) there, 0 elsewhere; returns
 * the float32 sum of the exponentials. Computed as 2^(s * scale * log2(e) - m). */
static float softmax_row(const float *s, uint16_t *p, int64_t ncols, int64_t lo, int64_t hi,
                         float scale) {
    const int64_t j0 = lo & ~(int64_t)15, j1 = (hi + 15) & ~(int64_t)15;
    memset(p, 0, (size_t)(j0 * 2));
    memset(p + j1, 0, (size_t)((ncols - j1) * 2));
    const __m512 vscale = _mm512_set1_ps(scale * 1.4426950408889634f);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = j0; j < j1; j += 16)
        vmax = _mm512_mask_max_ps(vmax, span_mask(j, lo, hi), vmax,
                                  _mm512_mul_ps(_mm512_loadu_ps(s + j), vscale));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j += 16) {
        const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, mx);
        const __m512 e = _mm512_maskz_mov_ps(span_mask(j, lo, hi), exp2_nonpos(x));
        vsum = _mm512_add_ps(vsum, e);
        _mm256_storeu_si256((__m256i *)(p + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return _mm512_reduce_add_ps(vsum);
}

#ifdef HAVE_PREFILL_AMX
/* S = Q K^T on tiles for chunks [c0, c1): S row r, column (c - c0) * 32 + n. */
static void scores_tiles(const uint16_t *qbuf, const uint16_t *kp, int64_t c0, int64_t c1,
                         int64_t D, float *S, int64_t ncols) {
    const int64_t KS = D / 32, chunk_elems = CHUNK * D;
    for (int64_t c = c0; c < c1; ++c) {
        const uint16_t *kc = kp + c * chunk_elems;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t ks = 0; ks < KS; ++ks) {
            _tile_loadd(2, qbuf + ks * 32, D * 2);
            _tile_loadd(3, kc + ks * 512, 64);
            _tile_loadd(4, kc + (KS + ks) * 512, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, S + (c - c0) * CHUNK, ncols * 4);
        _tile_stored(1, S + (c - c0) * CHUNK + 16, ncols * 4);
    }
}

/* obuf[r][16t + n] = (P V)[r][16(g + t) + n] for the nt <= 4 dim tiles from g,
 * on tiles (tile registers 0-3 accumulate; tile numbers must be immediates). */
static void pv_tiles(const uint16_t *P, int64_t ncols, const uint16_t *vp, int64_t c0,
                     int64_t c1, int64_t D, int64_t g, int64_t nt, float *obuf) {
    const int64_t chunk_elems = CHUNK * D;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = c0; c < c1; ++c) {
        const uint16_t *vc = vp + c * chunk_elems + g * 512;
        _tile_loadd(4, P + (c - c0) * CHUNK, ncols * 2);
        _tile_loadd(5, vc, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nt > 1) {
            _tile_loadd(6, vc + 512, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (nt > 2) {
            _tile_loadd(7, vc + 1024, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (nt > 3) {
            _tile_loadd(5, vc + 1536, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, obuf, 64 * 4);
    _tile_stored(1, obuf + 16, 64 * 4);
    _tile_stored(2, obuf + 32, 64 * 4);
    _tile_stored(3, obuf + 48, 64 * 4);
}
#endif

/* The 32-bit pair i of a bf16 row, broadcast to the 16 lanes VDPBF16PS sums in. */
static inline __m512bh bcast_pair(const uint16_t *row, int64_t i) {
    int32_t v;
    memcpy(&v, row + 2 * i, 4);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* S = Q K^T for chunks [c0, c1) with VDPBF16PS: eight query rows against the
 * chunk's two 16-key tiles at a time (16 accumulators), each packed tile row
 * (one dim pair of 16 keys) loaded once per eight rows. Same S layout as
 * scores_tiles. */
static void scores_dp(const uint16_t *qbuf, const uint16_t *kp, int64_t c0, int64_t c1,
                      int64_t D, float *S, int64_t ncols) {
    const int64_t D2 = D / 2, chunk_elems = CHUNK * D;
    for (int64_t c = c0; c < c1; ++c) {
        const uint16_t *k0 = kp + c * chunk_elems, *k1 = k0 + D2 * 32;
        for (int64_t rb = 0; rb < ROWS; rb += 8) {
            __m512 acc[8][2];
#pragma GCC unroll 8
            for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
            for (int64_t d2 = 0; d2 < D2; ++d2) {
                const __m512bh b0 = (__m512bh)_mm512_load_si512(k0 + d2 * 32);
                const __m512bh b1 = (__m512bh)_mm512_load_si512(k1 + d2 * 32);
#pragma GCC unroll 8
                for (int i = 0; i < 8; ++i) {
                    const __m512bh a = bcast_pair(qbuf + (rb + i) * D, d2);
                    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
                    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
                }
            }
            float *s = S + rb * ncols + (c - c0) * CHUNK;
#pragma GCC unroll 8
            for (int i = 0; i < 8; ++i) {
                _mm512_storeu_ps(s + i * ncols, acc[i][0]);
                _mm512_storeu_ps(s + i * ncols + 16, acc[i][1]);
            }
        }
    }
}

/* Four rows of P V over NT dim tiles with VDPBF16PS (4 x NT accumulators): each
 * packed V row (one key pair over 16 dims) is loaded once per four rows. */
static inline __attribute__((always_inline)) void pv_dp_rows(
    const uint16_t *P, int64_t ncols, const uint16_t *vp, int64_t c0, int64_t c1, int64_t D,
    int64_t g, int NT, float *obuf) {
    const int64_t chunk_elems = CHUNK * D;
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) acc[i][t] = _mm512_setzero_ps();
    for (int64_t c = c0; c < c1; ++c) {
        const uint16_t *vc = vp + c * chunk_elems + g * 512;
        const uint16_t *p = P + (c - c0) * CHUNK;
        for (int64_t kp = 0; kp < 16; ++kp) {
            __m512bh b[4];
#pragma GCC unroll 4
            for (int t = 0; t < NT; ++t) b[t] = (__m512bh)_mm512_load_si512(vc + t * 512 + kp * 32);
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
                const __m512bh a = bcast_pair(p + i * ncols, kp);
#pragma GCC unroll 4
                for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], a, b[t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) _mm512_storeu_ps(obuf + i * 64 + t * 16, acc[i][t]);
}

/* The VDPBF16PS counterpart of pv_tiles (same obuf layout). */
static void pv_dp(const uint16_t *P, int64_t ncols, const uint16_t *vp, int64_t c0, int64_t c1,
                  int64_t D, int64_t g, int64_t nt, float *obuf) {
    for (int64_t rb = 0; rb < ROWS; rb += 4) {
        const uint16_t *p = P + rb * ncols;
        float *o = obuf + rb * 64;
        switch (nt) { /* literal tile counts, so the accumulators stay in registers */
        case 1: pv_dp_rows(p, ncols, vp, c0, c1, D, g, 1, o); break;
        case 2: pv_dp_rows(p, ncols, vp, c0, c1, D, g, 2, o); break;
        case 3: pv_dp_rows(p, ncols, vp, c0, c1, D, g, 3, o); break;
        default: pv_dp_rows(p, ncols, vp, c0, c1, D, g, 4, o); break;
        }
    }
}

/* One work item: query head hq, query tokens [r0, r0 + rows) of sequence sq;
 * tiles != 0: the products on AMX tiles (the thread ran team_amx_begin). */
static void attend_rows(const uint16_t *q, int64_t sq_t, int64_t sq_h, const prefill_seq *sq,
                        int64_t r0, int64_t rows, int64_t hq, const uint16_t *kp,
                        const uint16_t *vp, uint16_t *out, int64_t so_t, int64_t so_h,
                        int64_t D, float scale, int64_t window, int tiles, float *S,
                        uint16_t *P, uint16_t *qbuf, float *obuf) {
#ifndef HAVE_PREFILL_AMX
    (void)tiles;
#endif
    const int64_t DB = D / 16;
    const int64_t pos0 = sq->num_computed + r0, pos_last = pos0 + rows - 1;
    const int64_t lo_key = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
    const int64_t c0 = lo_key / CHUNK, c1 = (pos_last + CHUNK) / CHUNK;
    const int64_t ncols = (c1 - c0) * CHUNK;

    memset(qbuf, 0, (size_t)(ROWS * D * 2));
    for (int64_t r = 0; r < rows; ++r)
        memcpy(qbuf + r * D, q + (sq->token_start + r0 + r) * sq_t + hq * sq_h, (size_t)(D * 2));

#ifdef HAVE_PREFILL_AMX
    if (tiles)
        scores_tiles(qbuf, kp, c0, c1, D, S, ncols);
    else
#endif
        scores_dp(qbuf, kp, c0, c1, D, S, ncols);

    float inv_sum[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) {
        if (r >= rows) {
            memset(P + r * ncols, 0, (size_t)(ncols * 2));
            inv_sum[r] = 0.f;
            continue;
        }
        const int64_t pos = pos0 + r;
        const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        const float sum =
            softmax_row(S + r * ncols, P + r * ncols, ncols, lo - c0 * CHUNK, pos + 1 - c0 * CHUNK,
                        scale);
        inv_sum[r] = 1.f / sum;
    }

    /* O = P V in groups of up to four 16-dim tiles */
    for (int64_t g = 0; g < DB; g += 4) {
        const int64_t nt = DB - g < 4 ? DB - g : 4;
#ifdef HAVE_PREFILL_AMX
        if (tiles)
            pv_tiles(P, ncols, vp, c0, c1, D, g, nt, obuf);
        else
#endif
            pv_dp(P, ncols, vp, c0, c1, D, g, nt, obuf);
        for (int64_t r = 0; r < rows; ++r) {
            uint16_t *o = out + (sq->token_start + r0 + r) * so_t + hq * so_h + g * 16;
            const __m512 inv = _mm512_set1_ps(inv_sum[r]);
            for (int64_t t = 0; t < nt; ++t)
                _mm256_storeu_si256(
                    (__m256i *)(o + t * 16),
                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(obuf + r * 64 + t * 16), inv)));
        }
    }
}

int prefill_attention_bf16_available(void) { return 1; }

int prefill_attention_bf16(const uint16_t *q, int64_t sq_t, int64_t sq_h, const uint16_t *k_cache,
                           int64_t sk_b, int64_t sk_o, int64_t sk_h, const uint16_t *v_cache,
                           int64_t sv_b, int64_t sv_o, int64_t sv_h, const int64_t *desc,
                           const int64_t *tables, int64_t num_seqs, uint16_t *out, int64_t so_t,
                           int64_t so_h, int64_t num_heads, int64_t num_kv_heads, int64_t D,
                           int64_t block_size, float scale, int64_t window, int tiles,
                           int num_threads) {
    if (D % 32 || D > 256 || num_kv_heads < 1 || num_heads % num_kv_heads || num_seqs < 1)
        return -1;
#ifndef HAVE_PREFILL_AMX
    if (tiles) return -1;
#endif
    const prefill_seq *seqs = (const prefill_seq *)desc;
    const int64_t G = num_heads / num_kv_heads, chunk_elems = CHUNK * D;
    /* chunk offsets of each sequence in the packed buffers, and work items */
    int64_t *chunk_off = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    int64_t *item_off = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    if (chunk_off == NULL || item_off == NULL) {
        free(chunk_off);
        free(item_off);
        return -2;
    }
    chunk_off[0] = item_off[0] = 0;
    int64_t max_chunks = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t seq_len = seqs[s].num_computed + seqs[s].num_new;
        const int64_t nc = (seq_len + CHUNK - 1) / CHUNK;
        max_chunks = nc > max_chunks ? nc : max_chunks;
        chunk_off[s + 1] = chunk_off[s] + nc;
        item_off[s + 1] = item_off[s] + num_heads * ((seqs[s].num_new + ROWS - 1) / ROWS);
    }
    const int64_t total_chunks = chunk_off[num_seqs], total_items = item_off[num_seqs];
    /* packed K/V: per sequence [kv head][its chunks][chunk_elems] */
    const size_t packed_bytes = (size_t)(total_chunks * num_kv_heads * chunk_elems * 2);
    uint16_t *kp = aligned_alloc(64, packed_bytes), *vp = aligned_alloc(64, packed_bytes);
    int rc = 0;
    if (kp == NULL || vp == NULL) {
        rc = -2;
        goto done;
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < total_chunks * num_kv_heads; ++i) {
            int64_t s = 0;
            while (chunk_off[s + 1] * num_kv_heads <= i) ++s;
            const int64_t nc = chunk_off[s + 1] - chunk_off[s];
            const int64_t local = i - chunk_off[s] * num_kv_heads;
            const int64_t h = local / nc, c = local % nc;
            /* the first key any of the sequence's new queries sees */
            const int64_t first = seqs[s].num_computed - window + 1;
            pack_chunk(k_cache, sk_b, sk_o, sk_h, v_cache, sv_b, sv_o, sv_h,
                       tables + seqs[s].table_off, window > 0 && first > 0 ? first : 0,
                       seqs[s].num_computed + seqs[s].num_new, block_size, h, c, D,
                       kp + i * chunk_elems, vp + i * chunk_elems);
        }
        const int64_t ncols_max = max_chunks * CHUNK;
        float *S = aligned_alloc(64, (size_t)(ROWS * ncols_max * 4));
        uint16_t *P = aligned_alloc(64, (size_t)(ROWS * ncols_max * 2));
        uint16_t qbuf[ROWS * 256] __attribute__((aligned(64)));
        float obuf[ROWS * 64] __attribute__((aligned(64)));
        if (S == NULL || P == NULL) {
#pragma omp atomic write
            rc = -2;
        }
#pragma omp barrier
        if (rc == 0) {
            if (tiles) team_amx_begin(); /* the tile configuration (bf16_linear_cpu.c) */
            /* causal rows cost more the later they sit: hand items out one by one */
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < total_items; ++it) {
                int64_t s = 0;
                while (item_off[s + 1] <= it) ++s;
                const int64_t local = it - item_off[s];
                const int64_t blocks = (seqs[s].num_new + ROWS - 1) / ROWS;
                const int64_t hq = local / blocks, rb = local % blocks;
                const int64_t r0 = rb * ROWS;
                const int64_t rows = seqs[s].num_new - r0 < ROWS ? seqs[s].num_new - r0 : ROWS;
                const int64_t nc = chunk_off[s + 1] - chunk_off[s];
                const int64_t base = (chunk_off[s] * num_kv_heads + hq / G * nc) * chunk_elems;
                attend_rows(q, sq_t, sq_h, &seqs[s], r0, rows, hq, kp + base, vp + base, out,
                            so_t, so_h, D, scale, window, tiles, S, P, qbuf, obuf);
            }
            if (tiles) team_amx_end();
        }
        free(S);
        free(P);
    }
done:
    free(kp);
    free(vp);
    free(chunk_off);
    free(item_off);
    return rc;
}

#else /* no AVX512-BF16 in this build */

int prefill_attention_bf16_available(void) { return 0; }

int prefill_attention_bf16(const uint16_t *q, int64_t sq_t, int64_t sq_h, const uint16_t *k_cache,
                           int64_t sk_b, int64_t sk_o, int64_t sk_h, const uint16_t *v_cache,
                           int64_t sv_b, int64_t sv_o, int64_t sv_h, const int64_t *desc,
                           const int64_t *tables, int64_t num_seqs, uint16_t *out, int64_t so_t,
                           int64_t so_h, int64_t num_heads, int64_t num_kv_heads, int64_t D,
                           int64_t block_size, float scale, int64_t window, int tiles,
                           int num_threads) {
    (void)q, (void)sq_t, (void)sq_h, (void)k_cache, (void)sk_b, (void)sk_o, (void)sk_h;
    (void)v_cache, (void)sv_b, (void)sv_o, (void)sv_h, (void)desc, (void)tables, (void)num_seqs;
    (void)out, (void)so_t, (void)so_h, (void)num_heads, (void)num_kv_heads, (void)D;
    (void)block_size, (void)scale, (void)window, (void)tiles, (void)num_threads;
    return -1;
}

#endif
