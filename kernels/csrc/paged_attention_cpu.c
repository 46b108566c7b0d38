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

#define MAX_HEADS 256
#define MAX_GROUP 32
#define MAX_HEAD_DIM 256
#define VL 16

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

/* One KV head of one sequence: its G query heads score every visible key, take
 * an exact softmax, and sum the weighted values. Called with literal G (query
 * heads per KV head) and nv (head_dim / 16) for the common shapes, so the G x nv
 * query and accumulator vectors live in registers; the head's rows are re-read
 * from cache per head (a sequence's K/V of one layer is a few hundred KB). */
static inline __attribute__((always_inline)) void attend_head(
    int is_bf16, const void *k, const void *v, int64_t sk_b, int64_t sk_o, int64_t sv_b,
    int64_t sv_o, int64_t koff, int64_t voff, const int64_t *table, int64_t block_size,
    int64_t lo, int64_t len, const int64_t G, const int64_t nv, const vf *qh, float *sh,
    vf *ah, float *inv) {
    const int64_t n = len - lo;
    vf qr[MAX_GROUP][MAX_HEAD_DIM / VL];
    float mx[MAX_GROUP];
    for (int64_t g = 0; g < G; ++g) {
        for (int64_t c = 0; c < nv; ++c) qr[g][c] = qh[g * nv + c];
        mx[g] = -FLT_MAX;
    }
    for (int64_t p = lo; p < len; ++p) {
        const int64_t ko = table[p / block_size] * sk_b + (p % block_size) * sk_o + koff;
        vf row[MAX_HEAD_DIM / VL];
        for (int64_t c = 0; c < nv; ++c) row[c] = load_vec(k, ko + c * VL, is_bf16);
        for (int64_t g = 0; g < G; ++g) {
            vf dot = qr[g][0] * row[0];
            for (int64_t c = 1; c < nv; ++c) dot += qr[g][c] * row[c];
            const float d = hsum(dot);
            sh[g * n + (p - lo)] = d;
            mx[g] = d > mx[g] ? d : mx[g];
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float sum = 0.f;
        float *r = sh + g * n;
        const float m = mx[g];
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
            r[i] = expf(r[i] - m);
            sum += r[i];
        }
        inv[g] = 1.f / sum;
    }
    vf acc[MAX_GROUP][MAX_HEAD_DIM / VL];
    for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < nv; ++c) acc[g][c] = (vf){0};
    for (int64_t p = lo; p < len; ++p) {
        const int64_t vo = table[p / block_size] * sv_b + (p % block_size) * sv_o + voff;
        vf row[MAX_HEAD_DIM / VL];
        for (int64_t c = 0; c < nv; ++c) row[c] = load_vec(v, vo + c * VL, is_bf16);
        for (int64_t g = 0; g < G; ++g) {
            const float w = sh[g * n + (p - lo)];
            for (int64_t c = 0; c < nv; ++c) acc[g][c] += w * row[c];
        }
    }
    for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < nv; ++c) ah[g * nv + c] = acc[g][c];
}

#define HEAD_CASE(GG, NV)                                                                   \
    if (G == GG && nv == NV) {                                                              \
        for (int64_t h = 0; h < num_kv_heads; ++h)                                          \
            attend_head(is_bf16, k, v, sk_b, sk_o, sv_b, sv_o, h * sk_h, h * sv_h, table,   \
                        block_size, lo, len, GG, NV, qv + h * GG * NV,                      \
                        sc + h * GG * (len - lo), acc + h * GG * NV, inv + h * GG);         \
        return;                                                                             \
    }

/* All heads of one sequence: a literal-shape specialisation where one fits
 * (group sizes 1-8, head_dim 64 or 128), else the same code with runtime shapes. */
static void attend_seq(int is_bf16, const void *k, const void *v, int64_t sk_b, int64_t sk_o,
                       int64_t sk_h, int64_t sv_b, int64_t sv_o, int64_t sv_h,
                       const int64_t *table, int64_t block_size, int64_t lo, int64_t len,
                       int64_t num_kv_heads, int64_t G, int64_t nv, const vf *qv, float *sc,
                       vf *acc, float *inv) {
    HEAD_CASE(1, 4) HEAD_CASE(2, 4) HEAD_CASE(3, 4) HEAD_CASE(4, 4)
    HEAD_CASE(5, 4) HEAD_CASE(6, 4) HEAD_CASE(7, 4) HEAD_CASE(8, 4)
    HEAD_CASE(1, 8) HEAD_CASE(2, 8) HEAD_CASE(3, 8) HEAD_CASE(4, 8)
    HEAD_CASE(5, 8) HEAD_CASE(6, 8) HEAD_CASE(7, 8) HEAD_CASE(8, 8)
    for (int64_t h = 0; h < num_kv_heads; ++h)
        attend_head(is_bf16, k, v, sk_b, sk_o, sv_b, sv_o, h * sk_h, h * sv_h, table, block_size,
                    lo, len, G, nv, qv + h * G * nv, sc + h * G * (len - lo), acc + h * G * nv,
                    inv + h * G);
}

int paged_decode_attention(
    int is_bf16,
    const void *q, int64_t sq_t, int64_t sq_h,
    const void *k, int64_t sk_b, int64_t sk_o, int64_t sk_h,
    const void *v, int64_t sv_b, int64_t sv_o, int64_t sv_h,
    const int64_t *bt, int64_t sbt, const int64_t *lens,
    void *out, int64_t so_t, int64_t so_h,
    int64_t nd, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int64_t window, int num_threads) {
    const int64_t G = num_heads / num_kv_heads;
    const int64_t nv = head_dim / VL;
    if (num_heads > MAX_HEADS || G > MAX_GROUP || head_dim > MAX_HEAD_DIM || head_dim % VL)
        return -1;
    int failed = 0;
    /* One work item per sequence, all its heads. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t s = 0; s < nd; ++s) {
        const int64_t len = lens[s];
        const int64_t q_pos = len - 1;
        const int64_t lo = q_pos - window + 1 > 0 ? q_pos - window + 1 : 0;
        const int64_t n = len - lo;
        if (n < 1) {
            failed = 1;
            continue;
        }
        const size_t nvec = (size_t)(num_heads * nv);
        /* Scratch: scaled queries, accumulators (H x head_dim each), scores (H x n). */
        const size_t score_vecs = (size_t)((num_heads * n + VL - 1) / VL);
        vf *buf = (vf *)aligned_alloc(sizeof(vf), sizeof(vf) * (2 * nvec + score_vecs));
        if (buf == NULL) {
            failed = 1;
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
        attend_seq(is_bf16, k, v, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, table, block_size, lo, len,
                   num_kv_heads, G, nv, qv, sc, acc, inv);
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
    return failed ? -2 : 0;
}
