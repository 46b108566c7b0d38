/*
 * The exported interface of the CPU kernel library: every function Python calls,
 * the structs it passes and the limits compiled into the kernels.
 *
 * This header is the one declaration source of the bindings. Each kernel source
 * includes it, so the compiler rejects a definition that disagrees with it, and
 * kernels/native_abi.py parses it to build the ctypes prototypes and structs, so
 * Python cannot call with another argument list. Keep it to the subset of C that
 * parser reads: `#define TANDEM_<NAME> <integer>`, `typedef struct { ... } name;`
 * with one or more fields per line, and one prototype per declaration, over the
 * types int, int64_t, float, void and pointers (to void, uint16_t, int64_t or a
 * struct declared here).
 */
#ifndef TANDEM_KERNELS_H
#define TANDEM_KERNELS_H
#include <stdint.h>

/* Limits of the stack scratch per work item; the Python wrappers decline larger. */
#define TANDEM_MAX_HEADS 256
#define TANDEM_MAX_GROUP 32 /* query heads per KV head */
#define TANDEM_MAX_HEAD_DIM 256
#define TANDEM_MAX_HIDDEN 16384 /* row length of the fused RMSNorm */
#define TANDEM_VECTOR_WIDTH 16  /* floats per vector; decode head_dim must be a multiple */

/* A W8A8 linear for decode_layers (see int8_linear): the packed weight and row sums
 * of int8_pack_weight, float32 per-channel scales and bias (NULL: none). */
typedef struct {
    const void *wp;
    const int *wsum;
    const float *scale, *bias;
} int8_weight;

/* A GGUF linear for decode_layers (see gguf_dot_linear): the ggml type id, the blocks
 * as gguf_pack_weight packed them, float32 bias (NULL: none). */
typedef struct {
    int64_t type;
    const void *wp;
    const float *bias;
} gguf_weight;

/* A W4A8 linear for decode_layers (see int4_linear): the packed nibbles and group scales
 * of pack_int4 (kernels/quant/int4_native.py), the group size, float32 bias (NULL: none). */
typedef struct {
    const void *wp;
    const float *ws;
    int64_t group;
    const float *bias;
} int4_weight;

/* One decoder layer for decode_layers: packed weights (bf16_pack_weight),
 * optional biases (NULL), norm weights, and this layer's K/V cache views
 * (strides in decode_step: every layer's view shares them). A non-NULL
 * qkv8 / o8 / gu8 / d8 makes that linear W8A8 instead, a non-NULL qkvq / oq / guq /
 * dq a GGUF one, a non-NULL qkv4 / o4 / gu4 / d4 a W4A8 one (its bf16 fields unused). */
typedef struct {
    const uint16_t *input_norm, *post_norm;
    const uint16_t *wqkv, *bqkv, *wo, *bo, *wgu, *bgu, *wd, *bd;
    uint16_t *k_cache, *v_cache;
    int64_t window; /* sliding window in tokens, 0 = none */
    const int8_weight *qkv8, *o8, *gu8, *d8;
    const gguf_weight *qkvq, *oq, *guq, *dq;
    const int4_weight *qkv4, *o4, *gu4, *d4;
} decode_layer;

/* One decode step for decode_layers: shapes, the step's metadata and the
 * activation buffers (bf16, row-major, allocated by the caller). */
typedef struct {
    int64_t tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t ck_b, ck_o, ck_h, cv_b, cv_o, cv_h, block_size;
    const uint16_t *cos, *sin;                      /* [T, head_dim / 2] */
    const int64_t *slots, *block_tables, *seq_lens; /* [T], [T, sbt], [T] */
    int64_t sbt;
    float eps, scale;
    uint16_t *hidden_states, *residual; /* [T, E] in/out */
    uint16_t *normed;                   /* [T, E] */
    uint16_t *qkv;                      /* [T, (H + 2 KVH) D] */
    uint16_t *q_rot, *attn;             /* [T, H D] */
    uint16_t *act;                      /* [T, I] */
    uint16_t *pad;                      /* [16, max(E, H D, I)] */
    /* for W8A8 layers only (else any): the int8 path (TANDEM_INT8_*), the gate/up
     * output [T, 2 I] and the quantized activations (int8_scratch_bytes(T, max(E, H D,
     * I)) bytes, see int8_linear_cpu.c) */
    int64_t int8_path;
    uint16_t *gate_up;
    void *int8_scratch;
    /* for GGUF layers only (else any): the quantized activations (gguf_dot_scratch_size(T,
     * max(E, H D, I)) bytes; the path is int8_path, the gate/up output gate_up) */
    void *gguf_scratch;
    /* for W4A8 layers only (else any): the quantized activations and group sums (the
     * largest int4_scratch_size(T, K, G) of the step's int4 linears; the path is
     * int8_path, the gate/up output gate_up) */
    void *int4_scratch;
} decode_step;

/* paged_attention_cpu.c: decode attention straight from the paged cache. */
int paged_decode_attention(int is_bf16, const void *q, int64_t sq_t, int64_t sq_h,
                           const void *k, int64_t sk_b, int64_t sk_o, int64_t sk_h,
                           const void *v, int64_t sv_b, int64_t sv_o, int64_t sv_h,
                           const int64_t *bt, int64_t sbt, const int64_t *lens, void *out,
                           int64_t so_t, int64_t so_h, int64_t nd, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int64_t window, int amx, int num_threads);

/* prefill_attention_cpu.c: causal bf16 attention of every prefill sequence. */
int prefill_attention_bf16_available(void);
int prefill_attention_bf16(const uint16_t *q, int64_t sq_t, int64_t sq_h, const uint16_t *k_cache,
                           int64_t sk_b, int64_t sk_o, int64_t sk_h, const uint16_t *v_cache,
                           int64_t sv_b, int64_t sv_o, int64_t sv_h, const int64_t *desc,
                           const int64_t *tables, int64_t num_seqs, uint16_t *out, int64_t so_t,
                           int64_t so_h, int64_t num_heads, int64_t num_kv_heads, int64_t D,
                           int64_t block_size, float scale, int64_t window, int tiles,
                           int num_threads);

/* norm_cpu.c: residual add + RMSNorm. */
int add_rms_norm(int is_bf16, const void *x, const void *res, const void *w, void *out,
                 void *res_out, int64_t rows, int64_t hidden, float eps, int num_threads);
/* rotary_cpu.c: rotary embedding (GPT-NeoX layout). */
int rotary_neox(int is_bf16, const void *x, int64_t sx_t, int64_t sx_h, void *out, int64_t tokens,
                int64_t heads, int64_t head_dim, const void *cos, const void *sin,
                int num_threads);
/* activation_cpu.c: SiLU-and-multiply. */
int silu_and_mul(int is_bf16, const void *x, void *out, int64_t tokens, int64_t inter,
                 int num_threads);
/* cache_cpu.c: K/V rows into their cache slots. */
int cache_write(const void *key, int64_t sk_t, int64_t sk_h, const void *value, int64_t sv_t,
                int64_t sv_h, void *k_cache, int64_t ck_b, int64_t ck_o, int64_t ck_h,
                void *v_cache, int64_t cv_b, int64_t cv_o, int64_t cv_h, const int64_t *slots,
                int64_t tokens, int64_t heads, int64_t head_dim, int64_t block_size,
                int64_t elem_size, int num_threads);
/* sampling_cpu.c: the first index of each row's maximum. */
int argmax_rows(int is_bf16, const void *x, int64_t sx, int64_t rows, int64_t cols, int64_t *out,
                int num_threads);
/* race_cpu.c: one draw per row of float32 weights by the exponential race, its Exp(1)
 * noise from Philox4x32-10 keyed per row (race_rows); that noise itself (race_noise); the
 * same race from float32 or bf16 logits and a temperature per row, weights
 * exp((l - max) / T) computed on the fly, those with exponents below
 * TANDEM_RACE_MIN_EXPONENT (-inf included) 0 (race_logits_rows). */
#define TANDEM_RACE_MIN_EXPONENT -80
int race_rows(const void *w, int64_t sw, int64_t rows, int64_t cols, const int64_t *keys,
              int64_t *out, int num_threads);
int race_noise(const int64_t *keys, int64_t rows, int64_t cols, void *out, int num_threads);
int race_logits_rows(int is_bf16, const void *x, int64_t sx, int64_t rows, int64_t cols,
                     const float *temps, const int64_t *keys, int64_t *out, int num_threads);

/* bf16_linear_cpu.c: linears on VNNI-packed bf16 weights (AMX tiles or VDPBF16PS; the
 * FMA path widens them to float32 and has no fused SwiGLU). bf16_linear_path() says
 * which path this build runs. */
#define TANDEM_LINEAR_NONE 0
#define TANDEM_LINEAR_FMA 1  /* AVX2 + FMA */
#define TANDEM_LINEAR_BF16 2 /* AVX512-BF16, and AMX tiles where amx_available() */
int amx_available(void);
int amx_init(void);
int bf16_linear_path(void);
void bf16_pack_weight(const uint16_t *w, int64_t N, int64_t K, uint16_t *wp);
int bf16_linear(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                const uint16_t *bias, uint16_t *y, int64_t sy, int64_t M, int64_t N, int64_t K,
                int num_threads);
int bf16_linear_swiglu(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                       const uint16_t *bias, uint16_t *y, int64_t sy, int64_t M, int64_t N,
                       int64_t K, int num_threads);
int bf16_linear_argmax(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                       const uint16_t *bias, int64_t *ids, int64_t M, int64_t N, int64_t K,
                       int num_threads);

/* decode_layers_cpu.c: every decoder layer of a decode-only step in one call. */
int decode_layers_available(void);
int decode_layers(const decode_layer *layers, int64_t num_layers, const decode_step *st,
                  int tiles, int num_threads);

/* gguf_quant_cpu.c: linears on GGUF (ggml) quantized blocks, dequantized in registers;
 * type: ggml's GGMLQuantizationType id (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12,
 * Q5_K 13, Q6_K 14). Return -1 on an unknown type, -2 on a row length that is not whole
 * blocks, -3 when memory runs out. gguf_matmul_path() says which path this build runs. */
#define TANDEM_GGUF_SCALAR 0
#define TANDEM_GGUF_AVX2 1
#define TANDEM_GGUF_AVX512 2
int gguf_block_size(int type);
int gguf_type_size(int type);
int gguf_matmul_path(void);
int gguf_dequant_rows(int type, const void *w, int64_t row_bytes, const int64_t *ids, int64_t n,
                      int64_t K, void *out, int64_t so, int out_bf16, int num_threads);
int gguf_matmul(int type, const float *x, int64_t sx, int64_t M, int64_t K, const void *w,
                int64_t N, float *y, int64_t sy, int num_threads);

/* int4_linear_cpu.c: W4A8 linears for on-load int4: 4-bit weights per group of G inputs
 * (0..15 around the zero point 8, float32 scales per channel and group), int8
 * activations per token, int32 dot products per group (see there). The paths are
 * int8_linear's (TANDEM_INT8_*, int8_linear_paths()). wp: ceil(N / 16) * K / 8 * 64
 * bytes, ws: ceil(N / 16) * K / G * 16 floats (kernels/quant/int4_native.py pack_int4).
 * int4_linear returns -1 on a path outside int8_linear_paths(), -2 on an empty shape
 * or a G that is not a multiple of 8 dividing K, -3 when memory runs out. */
void int4_scratch_size(int64_t M, int64_t K, int64_t G, int64_t *bytes);
int int4_linear(int path, int is_bf16, const void *x, int64_t sx, const void *wp, const float *ws,
                int64_t G, const float *bias, void *y, int64_t sy, int64_t M, int64_t N,
                int64_t K, int num_threads);

/* int8_linear_cpu.c: W8A8 linears, int8 weights per output channel and int8
 * activations per token (both symmetric), int32 dot products (see there).
 * int8_linear_paths() is a bit mask (1 << path) of the paths this build runs on
 * this CPU; int8_linear returns -1 on a path outside it or an empty shape, -3
 * when memory runs out. wp: ceil(N / 16) * 64 * ceil(K / 4) bytes, wsum: ceil(N / 16)
 * * 16 ints, both from int8_pack_weight. */
#define TANDEM_INT8_SCALAR 0
#define TANDEM_INT8_AVX2 1
#define TANDEM_INT8_AVX_VNNI 2
#define TANDEM_INT8_AVX512_VNNI 3
int int8_linear_paths(void);
void int8_scratch_size(int64_t M, int64_t K, int64_t *bytes);
void int8_pack_weight(const void *q, int64_t N, int64_t K, void *wp, int *wsum);
int int8_linear(int path, int is_bf16, const void *x, int64_t sx, const void *wp, const int *wsum,
                const float *ws, const float *bias, void *y, int64_t sy, int64_t M, int64_t N,
                int64_t K, int num_threads);

/* gguf_dot_cpu.c: GGUF Q4_0 / Q4_1 / Q8_0 linears on int8 activations quantized per
 * 32-element block, int32 dot products per block (see there); the paths are
 * int8_linear's (TANDEM_INT8_*, int8_linear_paths()). gguf_dot_type: whether a ggml
 * type runs here. gguf_pack_weight / gguf_unpack_weight: [N, K / 32 * type_size]
 * blocks <-> ceil(N / 16) * K / 32 * 16 * type_size packed bytes. Return -1 on a type or
 * path outside these, -2 on K not whole blocks or an empty shape, -3 out of memory. */
int gguf_dot_type(int type);
int gguf_pack_weight(int type, const void *raw, int64_t N, int64_t K, void *wp);
int gguf_unpack_weight(int type, const void *wp, int64_t N, int64_t K, void *raw);
void gguf_dot_scratch_size(int64_t M, int64_t K, int64_t *bytes);
int gguf_dot_linear(int path, int type, int is_bf16, const void *x, int64_t sx, const void *wp,
                    const float *bias, void *y, int64_t sy, int64_t M, int64_t N, int64_t K,
                    int num_threads);

#endif
