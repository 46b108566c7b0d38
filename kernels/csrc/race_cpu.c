/*
 * Random sampling by the exponential race, fused: for each row, the index of the
 * largest w[i] / E[i], with E[i] ~ Exp(1) computed on the fly from a counter-based
 * generator instead of read from a noise tensor (one pass over the weights, no
 * [rows, vocab] noise buffer, no per-entry generator state).
 *
 * The generator is Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random
 * numbers: as easy as 1, 2, 3", SC 2011; the generator of cuRAND and of torch's CUDA
 * sampling): entry i of a row with 64-bit key K is word i % 4 of
 * Philox4x32-10(counter = (i / 4, 0, 0, 0), key = (K mod 2^32, K >> 32)), so a row's
 * random bits depend on its key and nothing else (not the batch or the thread count);
 * its logarithms may differ in the last place between builds (each ISA's vector logf)
 * and from the torch reference, which changes a draw only at a near-tie. The uniform
 * is u = (bits >> 9) * 2^-23 + 2^-24, an odd multiple of 2^-24 and so exact in
 * float32, in [2^-24, 1 - 2^-24] (never 1: E = 0 would make w / E inf or NaN), and
 * E = -log(u). engine/categorical.py holds the torch reference of the same stream.
 *
 * Two entry points share that stream and the race step (race_chunk): race_rows draws
 * from weights the caller computed (probabilities after truncation), race_logits_rows
 * from logits and a temperature, without a probability tensor: per row, pass 1 finds
 * the maximum m, pass 2 computes w = exp((l - m) / T) chunk by chunk and races it. The
 * softmax's normaliser Z is a common factor of the row's w / E, so leaving it out
 * draws the same index as racing the probabilities (up to rounding: a near-tie).
 */
#include <math.h>
#include <stdint.h>

#include "elementwise.h" /* ld: a float32 or bf16 entry as float */
#include "tandem_kernels.h"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
/* entries per chunk: the noise and scores of one chunk stay in L1 */
#define RACE_CHUNK 512

/* Exp(1) draws for entries [base, base + n) of the row with key `key`; base % 4 == 0. */
static void race_noise_chunk(uint64_t key, int64_t base, int64_t n, float *e) {
    uint32_t bits[RACE_CHUNK];
    const uint32_t key0 = (uint32_t)key, key1 = (uint32_t)(key >> 32);
    const int64_t blocks = (n + 3) / 4;
    const uint32_t first = (uint32_t)(base / 4);
#pragma omp simd
    for (int64_t b = 0; b < blocks; ++b) {
        uint32_t c0 = first + (uint32_t)b, c1 = 0, c2 = 0, c3 = 0;
        uint32_t k0 = key0, k1 = key1;
        for (int round = 0; round < 10; ++round) {
            const uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
            const uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
            c0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
            c1 = (uint32_t)p1;
            c2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
            c3 = (uint32_t)p0;
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        bits[4 * b] = c0;
        bits[4 * b + 1] = c1;
        bits[4 * b + 2] = c2;
        bits[4 * b + 3] = c3;
    }
#pragma omp simd
    for (int64_t i = 0; i < n; ++i)
        e[i] = -logf((float)(bits[i] >> 9) * 0x1p-23f + 0x1p-24f);
}

/* One chunk of a row's race: entries [base, base + n) with weights w[0 .. n) (finite,
 * >= 0). Raises *best / *arg where a score w / E of this chunk beats the row's best so
 * far; ties keep the first index. Start a row with *best = -1, *arg = 0: every score is
 * >= 0, so a row whose weights are all zero draws index 0. */
static inline __attribute__((always_inline)) void race_chunk(const float *w, int64_t base,
                                                             int64_t n, uint64_t key,
                                                             float *best, int64_t *arg) {
    float score[RACE_CHUNK];
    race_noise_chunk(key, base, n, score);
    float m = -1.f;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; ++i) {
        score[i] = w[i] / score[i];
        m = score[i] > m ? score[i] : m;
    }
    if (m > *best) { /* strict: the first chunk holding the maximum wins */
        *best = m;
        for (int64_t i = 0; i < n; ++i)
            if (score[i] == m) {
                *arg = base + i;
                break;
            }
    }
}

static int64_t race_row(const float *w, int64_t cols, uint64_t key) {
    float best = -1.f;
    int64_t arg = 0;
    for (int64_t base = 0; base < cols; base += RACE_CHUNK) {
        const int64_t n = cols - base < RACE_CHUNK ? cols - base : RACE_CHUNK;
        race_chunk(w + base, base, n, key, &best, &arg);
    }
    return arg;
}

int race_rows(const void *w, int64_t sw, int64_t rows, int64_t cols, const int64_t *keys,
              int64_t *out, int num_threads) {
    if (cols < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r)
        out[r] = race_row((const float *)w + r * sw, cols, (uint64_t)keys[r]);
    return 0;
}

int race_noise(const int64_t *keys, int64_t rows, int64_t cols, void *out, int num_threads) {
    if (cols < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t base = 0; base < cols; base += RACE_CHUNK) {
            const int64_t n = cols - base < RACE_CHUNK ? cols - base : RACE_CHUNK;
            race_noise_chunk((uint64_t)keys[r], base, n, (float *)out + r * cols + base);
        }
    return 0;
}

/* -inf tested on the bits: -ffast-math lets the compiler assume no value is infinite. */
static inline __attribute__((always_inline)) int is_neg_inf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u == 0xff800000u;
}

/* The race of one row of logits at inverse temperature inv_t (the two passes of the
 * header comment). Exponents z = (l - m) * inv_t below TANDEM_RACE_MIN_EXPONENT get
 * weight 0 (-inf, a masked token, among them): such a weight, < e^-80, could not win
 * against the maximum's (1, score >= 1 / 16.7, E being at most 16.7), and the clamp
 * keeps every lane of the vector expf in its fast range (glibc's takes a scalar
 * detour per lane beyond about -87, -inf included, which a grammar mask would make
 * most of them). A row of -inf only: m := 0 makes every weight 0, index 0. */
static inline __attribute__((always_inline)) int64_t race_logits_row(const void *x, int64_t cols,
                                                                     float inv_t, uint64_t key,
                                                                     int is_bf16) {
    float m = ld(x, 0, is_bf16);
#pragma omp simd reduction(max : m)
    for (int64_t i = 1; i < cols; ++i) {
        const float v = ld(x, i, is_bf16);
        m = v > m ? v : m;
    }
    if (is_neg_inf(m)) m = 0.f;
    const float z_min = (float)TANDEM_RACE_MIN_EXPONENT;
    float w[RACE_CHUNK];
    float best = -1.f;
    int64_t arg = 0;
    for (int64_t base = 0; base < cols; base += RACE_CHUNK) {
        const int64_t n = cols - base < RACE_CHUNK ? cols - base : RACE_CHUNK;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float z = (ld(x, base + i, is_bf16) - m) * inv_t;
            const float e = expf(z > z_min ? z : z_min); /* unconditional: vectorizes */
            w[i] = z < z_min ? 0.f : e;
        }
        race_chunk(w, base, n, key, &best, &arg);
    }
    return arg;
}

int race_logits_rows(int is_bf16, const void *x, int64_t sx, int64_t rows, int64_t cols,
                     const float *temps, const int64_t *keys, int64_t *out, int num_threads) {
    if (cols < 1) return -1;
    const int64_t esize = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        const void *row = (const char *)x + r * sx * esize;
        const float inv_t = 1.f / temps[r];
        /* a constant is_bf16 per call: each loop compiles for one dtype */
        out[r] = is_bf16 ? race_logits_row(row, cols, inv_t, (uint64_t)keys[r], 1)
                         : race_logits_row(row, cols, inv_t, (uint64_t)keys[r], 0);
    }
    return 0;
}
