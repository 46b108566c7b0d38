/*
 * "Team" entry points of the CPU kernels: the body of a kernel without its own
 * OpenMP parallel region. Each distributes its work with orphaned `omp for`
 * constructs, so it must be called by every thread of an enclosing parallel
 * region (or by one thread outside any, which then does all the work); each
 * ends in the `omp for`'s implicit barrier. The public kernels wrap them in a
 * parallel region; decode_layers_cpu.c chains them inside one region per step,
 * so a decode layer costs barriers instead of Python calls and thread wake-ups.
 */
#ifndef TANDEM_TEAM_H
#define TANDEM_TEAM_H
#include <stdint.h>

/* paged_attention_cpu.c: decode attention of nd sequences (see there); amx != 0:
 * bf16 scores on AMX tiles where the shapes allow (every thread must have run
 * team_amx_begin); counter: a work counter shared by the team (any value; reset
 * inside); sets *failed on an empty sequence or a failed allocation. */
void team_paged_decode_attention(int is_bf16, const void *q, int64_t sq_t, int64_t sq_h,
                                 const void *k, int64_t sk_b, int64_t sk_o, int64_t sk_h,
                                 const void *v, int64_t sv_b, int64_t sv_o, int64_t sv_h,
                                 const int64_t *bt, int64_t sbt, const int64_t *lens, void *out,
                                 int64_t so_t, int64_t so_h, int64_t nd, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int64_t window, int amx, int64_t *counter,
                                 int *failed);

/* norm_cpu.c, rotary_cpu.c (bf16 with AVX512-BF16 only): residual add + RMSNorm (res
 * NULL: plain RMSNorm, res_out untouched); rotary of the query heads of each
 * qkv row into q_out [T, H, D] and of its key heads straight into the cache
 * slot, the value heads copied there (rotary + reshape_and_cache in one pass). */
int team_elementwise_bf16_available(void);
void team_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w,
                            uint16_t *out, uint16_t *res_out, int64_t rows, int64_t hidden,
                            float eps);
void team_rotary_cache_bf16(const uint16_t *qkv, int64_t s_qkv, uint16_t *q_out, int64_t tokens,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            const uint16_t *cos, const uint16_t *sin, uint16_t *k_cache,
                            int64_t ck_b, int64_t ck_o, int64_t ck_h, uint16_t *v_cache,
                            int64_t cv_b, int64_t cv_o, int64_t cv_h, const int64_t *slots,
                            int64_t block_size);

/* activation_cpu.c (AVX512-BF16 builds; elsewhere a no-op): out = silu(gate) * up of
 * x = [T, 2 I] (gate | up), rounded as silu_and_mul. */
void team_silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t tokens, int64_t inter);

/* bf16_linear_cpu.c: y = x @ W^T (+ bias), or its SwiGLU when swiglu != 0 (see
 * there), on AMX tiles when tiles != 0, else with VDPBF16PS. pad: a 16 x K bf16
 * scratch for a partial last row chunk (any content). With tiles, every thread
 * must have run team_amx_begin (tile configuration) first and run team_amx_end
 * after its last tile instruction. Returns -1 on shapes the kernel does not take
 * (every thread gets the same answer and nothing runs). */
int team_bf16_linear_available(void);
int team_amx_available(void);
void team_amx_begin(void);
void team_amx_end(void);
int team_bf16_matmul(int tiles, const uint16_t *x, int64_t sx, const uint16_t *wp,
                     const uint16_t *bias, uint16_t *y, int64_t sy, int64_t M, int64_t N,
                     int64_t K, int swiglu, uint16_t *pad);

/* int8_linear_cpu.c: y = W8A8 linear of x (see int8_linear in tandem_kernels.h);
 * scratch: int8_scratch_bytes(M, K) bytes shared by the team. Returns -1 on a
 * path this build or CPU does not run (every thread, and nothing runs). */
int64_t int8_scratch_bytes(int64_t M, int64_t K);
int team_int8_matmul(int path, int is_bf16, const void *x, int64_t sx, const void *wp,
                     const int *wsum, const float *ws, const float *bias, void *y, int64_t sy,
                     int64_t M, int64_t N, int64_t K, void *scratch);

/* int4_linear_cpu.c: y = W4A8 linear of x (see int4_linear in tandem_kernels.h);
 * scratch: int4_scratch_bytes(M, K, G) bytes shared by the team. Returns -1 on a
 * path or shape it does not run (every thread, and nothing runs). */
int64_t int4_scratch_bytes(int64_t M, int64_t K, int64_t G);
int team_int4_matmul(int path, int is_bf16, const void *x, int64_t sx, const void *wp,
                     const float *ws, int64_t G, const float *bias, void *y, int64_t sy,
                     int64_t M, int64_t N, int64_t K, void *scratch);

/* gguf_dot_cpu.c: y = GGUF linear of x (see gguf_dot_linear in tandem_kernels.h);
 * scratch: gguf_dot_scratch_bytes(M, K) bytes shared by the team. Returns -1 on a
 * path, type or shape it does not run (every thread, and nothing runs). */
int64_t gguf_dot_scratch_bytes(int64_t M, int64_t K);
int team_gguf_matmul(int path, int type, int is_bf16, const void *x, int64_t sx, const void *wp,
                     const float *bias, void *y, int64_t sy, int64_t M, int64_t N, int64_t K,
                     void *scratch);

#endif
