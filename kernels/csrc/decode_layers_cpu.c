/*
 * A whole decode step's decoder layers in one call and one OpenMP parallel
 * region (Llama-family layout, bf16, the linears of bf16_linear_cpu.c on AMX
 * tiles or with AVX512-BF16 dot products).
 *
 * Why: per op, a small model's decode step pays Python, ctypes and thread
 * wake-ups around nine calls per layer, each a parallel region of its own. Here the same kernels run back to back as
 * team bodies (team.h) separated by barriers, the rotary embedding writes the
 * keys straight into their cache slots, and Python is entered once per step.
 * The result is bit-identical to the per-op path: the same kernels in the same
 * order with the same roundings.
 *
 * Per layer, with hidden [T, E] and residual [T, E] carried across layers:
 *   normed, residual = add_rms_norm(hidden, residual)   (layer 0: rms_norm, residual = hidden)
 *   qkv = normed @ Wqkv^T + b;  q = rotary(q);  cache[slot] = rotary(k), v
 *   attn = paged_decode_attention(q, cache)
 *   hidden = attn @ Wo^T + b
 *   normed, residual = add_rms_norm(hidden, residual)
 *   act = silu(normed @ Wg^T + bg) * (normed @ Wu^T + bu);  hidden = act @ Wd^T + bd
 * The final norm and the LM head stay with the caller. Any of a layer's linears may
 * be W8A8 (int8_linear_cpu.c: on-load or checkpoint int8), W4A8 (int4_linear_cpu.c:
 * on-load int4) or GGUF blocks (gguf_dot_cpu.c) instead of packed bf16; such a gate/up
 * projection is rounded to bf16 before the SwiGLU, as per op.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tandem_kernels.h"
#include "team.h"

/* decode_layer and decode_step are declared in tandem_kernels.h. */

/* One linear of a layer: GGUF blocks where wq is set (gguf_dot_cpu.c), W8A8 where w8 is
 * (int8_linear_cpu.c), W4A8 where w4 is (int4_linear_cpu.c), else packed bf16. */
static void layer_linear(int tiles, const decode_step *st, const int8_weight *w8,
                         const gguf_weight *wq, const int4_weight *w4, const uint16_t *x,
                         int64_t sx, const uint16_t *wp, const uint16_t *b, uint16_t *y,
                         int64_t sy, int64_t N, int64_t K) {
    if (w4)
        team_int4_matmul((int)st->int8_path, 1, x, sx, w4->wp, w4->ws, w4->group, w4->bias, y,
                         sy, st->tokens, N, K, st->int4_scratch);
    else if (wq)
        team_gguf_matmul((int)st->int8_path, (int)wq->type, 1, x, sx, wq->wp, wq->bias, y, sy,
                         st->tokens, N, K, st->gguf_scratch);
    else if (w8)
        team_int8_matmul((int)st->int8_path, 1, x, sx, w8->wp, w8->wsum, w8->scale, w8->bias, y,
                         sy, st->tokens, N, K, st->int8_scratch);
    else
        team_bf16_matmul(tiles, x, sx, wp, b, y, sy, st->tokens, N, K, 0, st->pad);
}

/* Whether a W4A8 linear's group size fits its K inputs (int4_linear's rule). */
static int int4_fits(const int4_weight *w, int64_t K) {
    return w == NULL || (w->group >= 8 && w->group % 8 == 0 && K % w->group == 0);
}

/* Whether the int8, int4 and GGUF layers (if any) can run: the path here, their types
 * and group sizes, the step's buffers. */
static int int8_ready(const decode_layer *layers, int64_t num_layers, const decode_step *st) {
    const int64_t E = st->hidden, HD = st->num_heads * st->head_dim, I = st->intermediate;
    int any8 = 0, anyq = 0, any4 = 0, types = 1;
    for (int64_t l = 0; l < num_layers; ++l) {
        const decode_layer *ly = &layers[l];
        any8 |= ly->qkv8 || ly->o8 || ly->gu8 || ly->d8;
        anyq |= ly->qkvq || ly->oq || ly->guq || ly->dq;
        any4 |= ly->qkv4 || ly->o4 || ly->gu4 || ly->d4;
        const gguf_weight *q[4] = {ly->qkvq, ly->oq, ly->guq, ly->dq};
        for (int i = 0; i < 4; ++i) types &= q[i] == NULL || gguf_dot_type((int)q[i]->type);
        types &= int4_fits(ly->qkv4, E) && int4_fits(ly->o4, HD) && int4_fits(ly->gu4, E) &&
                 int4_fits(ly->d4, I);
    }
    if (!any8 && !anyq && !any4) return 1;
    return st->int8_path >= 0 && st->int8_path < 31 && (int8_linear_paths() >> st->int8_path & 1) &&
           (!any8 || st->int8_scratch != NULL) && (!anyq || st->gguf_scratch != NULL) &&
           (!any4 || st->int4_scratch != NULL) && types && st->gate_up != NULL;
}

int decode_layers_available(void) {
    return team_bf16_linear_available() && team_elementwise_bf16_available();
}

/* tiles != 0: the linears and the attention scores on AMX tiles (the caller has
 * the tile state from Linux), else with VDPBF16PS. */
int decode_layers(const decode_layer *layers, int64_t num_layers, const decode_step *st,
                  int tiles, int num_threads) {
    if (!decode_layers_available() || (tiles && !team_amx_available())) return -1;
    const int64_t T = st->tokens, E = st->hidden, H = st->num_heads, KVH = st->num_kv_heads;
    const int64_t D = st->head_dim, I = st->intermediate, QKV = (H + 2 * KVH) * D;
    /* the linears' shape rules (K % 32, N % 16, SwiGLU N % 32) and the
     * attention kernel's limits, checked once up front */
    if (E % 32 || (H * D) % 32 || I % 32 || QKV % 16 || D % 16 || D > TANDEM_MAX_HEAD_DIM ||
        H > TANDEM_MAX_HEADS || KVH < 1 || H % KVH || H / KVH > TANDEM_MAX_GROUP ||
        E > TANDEM_MAX_HIDDEN || T < 1 || !int8_ready(layers, num_layers, st))
        return -1;
    int failed = 0;
    int64_t counter = 0; /* the attention's shared work counter */
#pragma omp parallel num_threads(num_threads)
    {
        if (tiles) team_amx_begin();
        for (int64_t l = 0; l < num_layers; ++l) {
            const decode_layer *ly = &layers[l];
            if (l == 0) {
                team_add_rms_norm_bf16(st->hidden_states, NULL, ly->input_norm, st->normed, NULL,
                                       T, E, st->eps);
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; ++t)
                    memcpy(st->residual + t * E, st->hidden_states + t * E, (size_t)(E * 2));
            } else {
                team_add_rms_norm_bf16(st->hidden_states, st->residual, ly->input_norm,
                                       st->normed, st->residual, T, E, st->eps);
            }
            layer_linear(tiles, st, ly->qkv8, ly->qkvq, ly->qkv4, st->normed, E, ly->wqkv,
                         ly->bqkv, st->qkv, QKV, QKV, E);
            team_rotary_cache_bf16(st->qkv, QKV, st->q_rot, T, H, KVH, D, st->cos, st->sin,
                                   ly->k_cache, st->ck_b, st->ck_o, st->ck_h, ly->v_cache,
                                   st->cv_b, st->cv_o, st->cv_h, st->slots, st->block_size);
            team_paged_decode_attention(1, st->q_rot, H * D, D, ly->k_cache, st->ck_b, st->ck_o,
                                        st->ck_h, ly->v_cache, st->cv_b, st->cv_o, st->cv_h,
                                        st->block_tables, st->sbt, st->seq_lens, st->attn, H * D,
                                        D, T, H, KVH, D, st->block_size, st->scale,
                                        ly->window > 0 ? ly->window : (int64_t)1 << 62, tiles,
                                        &counter, &failed);
            layer_linear(tiles, st, ly->o8, ly->oq, ly->o4, st->attn, H * D, ly->wo, ly->bo,
                         st->hidden_states, E, E, H * D);
            team_add_rms_norm_bf16(st->hidden_states, st->residual, ly->post_norm, st->normed,
                                   st->residual, T, E, st->eps);
            if (ly->gu8 || ly->guq || ly->gu4) { /* as per op: the projection rounded, then SwiGLU */
                layer_linear(tiles, st, ly->gu8, ly->guq, ly->gu4, st->normed, E, NULL, NULL,
                             st->gate_up, 2 * I, 2 * I, E);
                team_silu_and_mul_bf16(st->gate_up, st->act, T, I);
            } else {
                team_bf16_matmul(tiles, st->normed, E, ly->wgu, ly->bgu, st->act, I, T, 2 * I, E,
                                 1, st->pad);
            }
            layer_linear(tiles, st, ly->d8, ly->dq, ly->d4, st->act, I, ly->wd, ly->bd,
                         st->hidden_states, E, E, I);
        }
        if (tiles) team_amx_end();
    }
    return failed ? -2 : 0;
}
