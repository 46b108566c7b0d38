/*
 * The SIMD micro-kernels of gguf_dot_cpu.c (included by it once, after its scalar path):
 * body_<path>(T, ..., RB, CB, out) with the type T, rows RB and streams CB compile-time
 * constants, each tile's int32 sums turned into float32 block terms at once (see the
 * Math in gguf_dot_cpu.c), and their dot_<path> dispatchers.
 */
#ifndef GGUF_DOT_SIMD_H
#define GGUF_DOT_SIMD_H


#if defined(__AVX2__) && defined(__F16C__)
static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The zero-point term of Q4_0 / Q8_0 folded into the int sum (exact): D - k sa. */
#define ZP(T) ((T) == Q4_0 ? 8 : 128)

/* 256-bit paths: each 64-byte chunk as two ymm halves (rows 0-7, 8-15). VNNI: 1 for
 * VPDPBUSD, 0 for VPMADDUBSW. Q4 sums its 8 VPMADDUBSW pairs in int16 first (at most
 * 8 * 2 * 15 * 127 < 2^15); Q8_0 takes |q| (q = code ^ 0x80; |-128| is 128 as an
 * unsigned byte) and a with q's sign (|a| <= 127, so negating it is exact), so its sum
 * is already D - 128 sa. */
#define BODY256(name, ATTR, VNNI, DPB)                                                        \
    INLINE ATTR void body_##name(const int T, const int8_t *xq, int64_t sq, const float *da,  \
                                 const int32_t *sa, const uint8_t *w, int64_t sb, int64_t KB, \
                                 const int RB, const int CB, float *out) {                    \
        const int NQ = T == Q8_0 ? 32 : 16;                                                   \
        const int64_t TB = 16 * (T == Q4_0 ? 18 : T == Q4_1 ? 20 : 34);                       \
        const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);               \
        const __m256i flip = _mm256_set1_epi8((char)0x80);                                    \
        __m256 acc[2][2][2];                                                                  \
        for (int r = 0; r < RB; ++r)                                                          \
            for (int c = 0; c < CB; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();   \
        for (int64_t kb = 0; kb < KB; ++kb)                                                   \
            for (int c = 0; c < CB; ++c) {                                                    \
                const uint8_t *t = w + c * sb + kb * TB;                                      \
                __m256i is[2][2];                                                             \
                for (int r = 0; r < RB; ++r) is[r][0] = is[r][1] = _mm256_setzero_si256();    \
                for (int h = 0; h < 2; ++h) {                                                 \
                    if (T != Q8_0) {                                                          \
                        __m256i p[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};      \
                        for (int ch = 0; ch < 4; ++ch) {                                      \
                            const __m256i v =                                                 \
                                _mm256_loadu_si256((const __m256i *)(t + ch * 64 + h * 32));  \
                            const __m256i lo = _mm256_and_si256(v, mask);                     \
                            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask); \
                            for (int r = 0; r < RB; ++r) {                                    \
                                const int8_t *a = xq + r * sq + kb * 32;                      \
                                const __m256i x0 = _mm256_set1_epi32(load4(a + 4 * ch));      \
                                const __m256i x1 = _mm256_set1_epi32(load4(a + 16 + 4 * ch)); \
                                if (VNNI) {                                                   \
                                    is[r][h] = DPB(is[r][h], lo, x0);                         \
                                    is[r][h] = DPB(is[r][h], hi, x1);                         \
                                } else {                                                      \
                                    p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(lo, x0)); \
                                    p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(hi, x1)); \
                                }                                                             \
                            }                                                                 \
                        }                                                                     \
                        if (!VNNI)                                                            \
                            for (int r = 0; r < RB; ++r) is[r][h] = _mm256_madd_epi16(p[r], ones); \
                    } else {                                                                  \
                        for (int ch = 0; ch < 8; ++ch) {                                      \
                            const __m256i v =                                                 \
                                _mm256_loadu_si256((const __m256i *)(t + ch * 64 + h * 32));  \
                            const __m256i q = _mm256_xor_si256(v, flip);                      \
                            const __m256i aq = _mm256_sign_epi8(q, q);                        \
                            for (int r = 0; r < RB; ++r) {                                    \
                                const __m256i x0 =                                            \
                                    _mm256_set1_epi32(load4(xq + r * sq + kb * 32 + 4 * ch)); \
                                if (VNNI) {                                                   \
                                    is[r][h] = DPB(is[r][h], v, x0);                          \
                                } else {                                                      \
                                    const __m256i pr =                                        \
                                        _mm256_maddubs_epi16(aq, _mm256_sign_epi8(x0, q));    \
                                    is[r][h] = _mm256_add_epi32(is[r][h],                     \
                                                                _mm256_madd_epi16(pr, ones)); \
                                }                                                             \
                            }                                                                 \
                        }                                                                     \
                    }                                                                         \
                    const __m256 dw =                                                         \
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16 * NQ + h * 16))); \
                    for (int r = 0; r < RB; ++r) {                                            \
                        const float d = da[r * KB + kb];                                      \
                        const int32_t s = sa[r * KB + kb];                                    \
                        const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(d));               \
                        if (T == Q4_1) {                                                      \
                            const __m256 mw = _mm256_cvtph_ps(                                \
                                _mm_loadu_si128((const __m128i *)(t + 16 * NQ + 32 + h * 16))); \
                            acc[r][c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r][h]), dd,  \
                                                           acc[r][c][h]);                     \
                            acc[r][c][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(d * (float)s),  \
                                                           acc[r][c][h]);                     \
                        } else {                                                              \
                            const int32_t zp = (T == Q8_0 && !VNNI) ? 0 : ZP(T) * s;          \
                            const __m256i cor = _mm256_sub_epi32(is[r][h], _mm256_set1_epi32(zp)); \
                            acc[r][c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(cor), dd,       \
                                                           acc[r][c][h]);                     \
                        }                                                                     \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        for (int r = 0; r < RB; ++r)                                                          \
            for (int c = 0; c < CB; ++c) {                                                    \
                _mm256_storeu_ps(out + r * 64 + c * 16, acc[r][c][0]);                        \
                _mm256_storeu_ps(out + r * 64 + c * 16 + 8, acc[r][c][1]);                    \
            }                                                                                 \
    }

#define NO_DPB(a, b, c) (a)
BODY256(avx2, , 0, NO_DPB)
/* 256-bit paths: at most 2 rows x 2 streams (acc[2][2][2]). */
#define DISPATCH_RC(name, T)                                                                 \
    switch (rb * 8 + cb) {                                                                   \
    case 9: body_##name(T, xq, sq, da, sa, w, sb, KB, 1, 1, out); break;                     \
    case 10: body_##name(T, xq, sq, da, sa, w, sb, KB, 1, 2, out); break;                    \
    case 17: body_##name(T, xq, sq, da, sa, w, sb, KB, 2, 1, out); break;                    \
    case 18: body_##name(T, xq, sq, da, sa, w, sb, KB, 2, 2, out); break;                    \
    default: break;                                                                          \
    }
DISPATCH(avx2, )
#ifdef HAVE_AVXVNNI
BODY256(avxvnni, T_AVXVNNI, 1, _mm256_dpbusd_avx_epi32)
DISPATCH(avxvnni, T_AVXVNNI)
#endif
#endif

#ifdef HAVE_AVX512VNNI
#undef DISPATCH_RC
#define DISPATCH_RC(name, T)                                                                 \
    switch (rb * 8 + cb) {                                                                   \
    case 9: body_##name(T, xq, sq, da, sa, w, sb, KB, 1, 1, out); break;                     \
    case 10: body_##name(T, xq, sq, da, sa, w, sb, KB, 1, 2, out); break;                    \
    case 17: body_##name(T, xq, sq, da, sa, w, sb, KB, 2, 1, out); break;                    \
    case 18: body_##name(T, xq, sq, da, sa, w, sb, KB, 2, 2, out); break;                    \
    case 25: body_##name(T, xq, sq, da, sa, w, sb, KB, 3, 1, out); break;                    \
    case 26: body_##name(T, xq, sq, da, sa, w, sb, KB, 3, 2, out); break;                    \
    case 33: body_##name(T, xq, sq, da, sa, w, sb, KB, 4, 1, out); break;                    \
    case 34: body_##name(T, xq, sq, da, sa, w, sb, KB, 4, 2, out); break;                    \
    default: break;                                                                          \
    }
INLINE T_AVX512VNNI void body_avx512vnni(const int T, const int8_t *xq, int64_t sq,
                                         const float *da, const int32_t *sa, const uint8_t *w,
                                         int64_t sb, int64_t KB, const int RB, const int CB,
                                         float *out) {
    const int NQ = T == Q8_0 ? 32 : 16;
    const int64_t TB = 16 * (T == Q4_0 ? 18 : T == Q4_1 ? 20 : 34);
    const __m512i mask = _mm512_set1_epi8(15);
    __m512 acc[4][2];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; ++kb)
        for (int c = 0; c < CB; ++c) {
            const uint8_t *t = w + c * sb + kb * TB;
            __m512i is[4];
            for (int r = 0; r < RB; ++r) is[r] = _mm512_setzero_si512();
            for (int ch = 0; ch < NQ / 4; ++ch) {
                const __m512i v = _mm512_loadu_si512(t + ch * 64);
                if (T != Q8_0) {
                    const __m512i lo = _mm512_and_si512(v, mask);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                    for (int r = 0; r < RB; ++r) {
                        const int8_t *a = xq + r * sq + kb * 32;
                        int32_t a0, a1;
                        memcpy(&a0, a + 4 * ch, 4);
                        memcpy(&a1, a + 16 + 4 * ch, 4);
                        is[r] = _mm512_dpbusd_epi32(is[r], lo, _mm512_set1_epi32(a0));
                        is[r] = _mm512_dpbusd_epi32(is[r], hi, _mm512_set1_epi32(a1));
                    }
                } else {
                    for (int r = 0; r < RB; ++r) {
                        int32_t a0;
                        memcpy(&a0, xq + r * sq + kb * 32 + 4 * ch, 4);
                        is[r] = _mm512_dpbusd_epi32(is[r], v, _mm512_set1_epi32(a0));
                    }
                }
            }
            const __m512 dw =
                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 16 * NQ)));
            for (int r = 0; r < RB; ++r) {
                const float d = da[r * KB + kb];
                const int32_t s = sa[r * KB + kb];
                const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(d));
                if (T == Q4_1) {
                    const __m512 mw =
                        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 16 * NQ + 32)));
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), dd, acc[r][c]);
                    acc[r][c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(d * (float)s), acc[r][c]);
                } else {
                    const int32_t zp = (T == Q4_0 ? 8 : 128) * s;
                    const __m512i cor = _mm512_sub_epi32(is[r], _mm512_set1_epi32(zp));
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(cor), dd, acc[r][c]);
                }
            }
        }
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CB; ++c) _mm512_storeu_ps(out + r * 64 + c * 16, acc[r][c]);
}
DISPATCH(avx512vnni, T_AVX512VNNI)
#endif

#endif
