/* The CPU engine's compiled kernels, float32 (built and loaded by kernels/cpu_ops.py).
 *
 * On the 2-core development machine every torch op costs several microseconds before it does
 * any work, and a decode step calls hundreds per layer; these kernels each replace a chain of
 * them. Strides are in elements; the last dimension has unit stride everywhere.
 *
 * kvp_decode_attention: paged attention of one query token per sequence. Reads each sequence's
 * keys and values straight from the paged cache (no gathered copy) and computes a plain softmax
 * in float32: scores, their maximum, exp and sum, then the weighted sum of values. Work items
 * are (sequence, KV head) pairs (OpenMP); an item holds the GQA group's query heads, so each
 * cached key and value row is read from memory once for the group.
 *
 * Layouts (strides in elements; head_dim has unit stride everywhere):
 *   q, out        rows q_rows[i] of (num_tokens, num_heads, head_dim), strides (sq_t, sq_h), (so_t, so_h)
 *   k/v cache     (num_blocks, block_size, num_kv_heads, head_dim), strides (s_b, s_s, s_h) each
 *   block_tables  int32 (num_seqs, max_blocks), row stride s_bt; seq_ids[i] picks the row
 *   seq_lens      int32 (num_seqs,): context length, the new token included
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* glibc's libmvec has vector versions of expf (link with -lmvec); declaring it lets the
 * compiler vectorize the softmax loop without -ffast-math */
#pragma omp declare simd notinbranch
float expf(float);

/* One (sequence, KV head) item, inlined with head_dim as a constant (64, 128) so the head_dim
 * loops unroll into vector registers. Both passes walk the context block by block and run the
 * group's query heads over each block while its keys or values are in L1, so a long context is
 * read from memory once per group, not once per query head. */
static inline __attribute__((always_inline)) void attend_item(
    const int head_dim, const int group, const int ctx, float scale, float *scores, float *acc,
    const float *qg, float *og, const float *k_base, const float *v_base, const int32_t *table,
    int block_size, int64_t sq_h, int64_t so_h, int64_t sk_b, int64_t sk_s, int64_t sv_b, int64_t sv_s) {
    for (int t0 = 0; t0 < ctx; t0 += block_size) {  /* scores[g * ctx + t] = q_g . k_t * scale */
        const float *kb = k_base + table[t0 / block_size] * sk_b;
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int g = 0; g < group; g++) {
            const float *qh = qg + g * sq_h;
            float *s = scores + (int64_t)g * ctx + t0;
            for (int j = 0; j < n; j++) {
                const float *kt = kb + j * sk_s;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head_dim; d++) dot = fmaf(qh[d], kt[d], dot);
                s[j] = dot * scale;
            }
        }
    }
    for (int g = 0; g < group; g++) {  /* softmax numerators, in place; acc_g = 0 */
        float *s = scores + (int64_t)g * ctx;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int t = 0; t < ctx; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd
        for (int t = 0; t < ctx; t++) s[t] = expf(s[t] - m);
        for (int d = 0; d < head_dim; d++) acc[g * head_dim + d] = 0.0f;
    }
    for (int t0 = 0; t0 < ctx; t0 += block_size) {  /* acc_g += p_g[t] v_t */
        const float *vb = v_base + table[t0 / block_size] * sv_b;
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int g = 0; g < group; g++) {
            const float *p = scores + (int64_t)g * ctx + t0;
            float o[head_dim];
            for (int d = 0; d < head_dim; d++) o[d] = acc[g * head_dim + d];
            for (int j = 0; j < n; j++) {
                const float *vt = vb + j * sv_s;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) o[d] = fmaf(p[j], vt[d], o[d]);
            }
            for (int d = 0; d < head_dim; d++) acc[g * head_dim + d] = o[d];
        }
    }
    for (int g = 0; g < group; g++) {  /* out_g = acc_g / sum_t p_g[t] */
        const float *s = scores + (int64_t)g * ctx;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < ctx; t++) sum += s[t];
        const float inv = ctx > 0 ? 1.0f / sum : 0.0f;
        for (int d = 0; d < head_dim; d++) og[g * so_h + d] = acc[g * head_dim + d] * inv;
    }
}

int kvp_decode_attention(
    float *out, const float *q, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, const int32_t *seq_lens, const int32_t *seq_ids, const int64_t *q_rows,
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
    int64_t sq_t, int64_t sq_h, int64_t so_t, int64_t so_h,
    int64_t sk_b, int64_t sk_s, int64_t sk_h, int64_t sv_b, int64_t sv_s, int64_t sv_h, int64_t s_bt) {
    const int group = num_heads / num_kv_heads;
    const int items = num_seqs * num_kv_heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int item = 0; item < items; item++) {
        const int i = item / num_kv_heads, kvh = item % num_kv_heads;
        const int ctx = seq_lens[seq_ids[i]];
        const int32_t *table = block_tables + (int64_t)seq_ids[i] * s_bt;
        /* scores (group, ctx), then the output accumulators (group, head_dim) */
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)(ctx + head_dim));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        const float *qg = q + q_rows[i] * sq_t + (int64_t)kvh * group * sq_h;
        float *og = out + q_rows[i] * so_t + (int64_t)kvh * group * so_h;
        const float *k_base = k_cache + kvh * sk_h, *v_base = v_cache + kvh * sv_h;
#define ATTEND(D) attend_item(D, group, ctx, scale, scores, scores + (int64_t)group * ctx, qg, og, \
                              k_base, v_base, table, block_size, sq_h, so_h, sk_b, sk_s, sv_b, sv_s)
        switch (head_dim) {
            case 64: ATTEND(64); break;
            case 128: ATTEND(128); break;
            default: ATTEND(head_dim);
        }
#undef ATTEND
        free(scores);
    }
    return failed;
}

/* kvp_rms_norm: out = x / sqrt(mean(x^2) + eps) * weight, row by row, in HF's order of
 * operations (scale the row, then multiply by the weight). */
static inline void rms_norm_row(float *out, const float *x, const float *weight, int hidden, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < hidden; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
    for (int i = 0; i < hidden; i++) out[i] = weight[i] * (x[i] * inv);
}

void kvp_rms_norm(float *out, const float *x, const float *weight, int rows, int hidden, float eps,
                  int64_t s_out, int64_t s_x) {
#pragma omp parallel for if (rows > 64)
    for (int r = 0; r < rows; r++) rms_norm_row(out + r * s_out, x + r * s_x, weight, hidden, eps);
}

/* kvp_fused_add_rms_norm: residual += x, then x = rms_norm(residual) * weight, in place. */
void kvp_fused_add_rms_norm(float *x, float *residual, const float *weight, int rows, int hidden, float eps,
                            int64_t s_x, int64_t s_res) {
#pragma omp parallel for if (rows > 64)
    for (int r = 0; r < rows; r++) {
        float *xr = x + r * s_x, *rr = residual + r * s_res;
#pragma omp simd
        for (int i = 0; i < hidden; i++) rr[i] += xr[i];
        rms_norm_row(xr, rr, weight, hidden, eps);
    }
}

/* kvp_rotary: GPT-NeoX rotation of q (tokens, q_heads, head_dim) and k (tokens, k_heads, head_dim)
 * in place; cos_sin (max_position, head_dim) holds cos in the first half, sin in the second.
 * x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin: HF's x * cos + rotate_half(x) * sin, the same
 * roundings (the file is built as ISO C, so products and sums are not fused). */
static inline void rotate_heads(float *x, int heads, int64_t s_h, int half, const float *cs) {
    for (int h = 0; h < heads; h++) {
        float *x1 = x + h * s_h, *x2 = x1 + half;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i], c = cs[i], s = cs[half + i];
            x1[i] = a * c + (-b) * s;
            x2[i] = b * c + a * s;
        }
    }
}

void kvp_rotary(const int64_t *positions, float *q, float *k, const float *cos_sin, int tokens,
                int q_heads, int k_heads, int head_dim, int64_t sq_t, int64_t sq_h, int64_t sk_t,
                int64_t sk_h, int64_t s_cs) {
    const int half = head_dim / 2;
#pragma omp parallel for if (tokens > 64)
    for (int t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * s_cs;
        rotate_heads(q + t * sq_t, q_heads, sq_h, half, cs);
        rotate_heads(k + t * sk_t, k_heads, sk_h, half, cs);
    }
}

/* kvp_write_kv_cache: token t's keys and values (heads, head_dim) into slot slot_mapping[t]
 * (block = slot / block_size, offset = slot % block_size); slot -1 is padding, skipped. */
void kvp_write_kv_cache(const float *k, const float *v, float *k_cache, float *v_cache, const int64_t *slots,
                        int tokens, int heads, int head_dim, int block_size, int64_t sk_t, int64_t sk_h,
                        int64_t sv_t, int64_t sv_h, int64_t skc_b, int64_t skc_s, int64_t skc_h,
                        int64_t svc_b, int64_t svc_s, int64_t svc_h) {
#pragma omp parallel for if (tokens > 64)
    for (int t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        for (int h = 0; h < heads; h++) {
            const float *ks = k + t * sk_t + h * sk_h, *vs = v + t * sv_t + h * sv_h;
            float *kd = k_cache + block * skc_b + offset * skc_s + h * skc_h;
            float *vd = v_cache + block * svc_b + offset * svc_s + h * svc_h;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) {
                kd[d] = ks[d];
                vd[d] = vs[d];
            }
        }
    }
}
