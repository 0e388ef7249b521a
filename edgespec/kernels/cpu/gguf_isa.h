/* The interface between the CPU driver (gguf_cpu.c: thread pool, ISA choice, the layer-stack forward) and the
 * kernels of one instruction set (gguf_kernels.c, compiled once per ISA with its own flags).
 *
 * Every kernel computes each output by one fixed sequence of IEEE fp32 operations (the "canonical order", written
 * out in gguf_kernels.c), whatever the ISA, the number of rows in the call and the thread count. The ISAs differ
 * only in how many of those operations one instruction performs, so their results are equal bit for bit: AVX-512,
 * AVX2 and the portable C build on x86, NEON on Arm (tests compare them, NEON under qemu-user).
 */
#ifndef GGUF_ISA_H
#define GGUF_ISA_H

#include <stddef.h>
#include <stdint.h>

/* ggml type ids of the weight formats the products read (dense F32 / F16 / BF16 rows too). */
enum { GG_F32 = 0, GG_F16 = 1, GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14,
       GG_BF16 = 30 };

typedef struct {
    const char *name;
    /* y[m * ldy + n] = sum_k W[n, k] * x[m * K + k] for weight rows n0 <= n < n1 and activation rows m < M.
     * W: rows of row_bytes bytes in ggml type `kind`; K a multiple of 32 (256 for K-quants). */
    void (*product)(int kind, const uint8_t *w, size_t row_bytes, int K, const float *x, int M, float *y,
                    size_t ldy, int n0, int n1);
    /* s = r + x (x NULL: s = r); y = w * (s / sqrt(mean(s^2) + eps)); T rows of D. s may alias r. */
    void (*add_rms_norm)(const float *x, const float *r, const float *w, float eps, int T, int D, float *s,
                         float *y);
    /* One attention row and head: q [hd] (normed and rotated) against keys/values 0 .. L-1 (rows of stride
     * floats), scores q.k * scale (+ bias[j] when bias is not NULL: 0 or -inf masks), o [hd]. scratch: L + 16
     * floats. hd a multiple of 16. */
    void (*attend)(const float *q, const float *k, const float *v, size_t stride, int L, int hd, float scale,
                   const float *bias, float *scratch, float *o);
    /* out[t, i] = silu(g[t, i]) * g[t, I + i] (SwiGLU of the merged gate/up rows). */
    void (*silu_mul)(const float *gate_up, int T, int I, float *out);
    /* dst[i] = v[i] + w[i] over n floats. */
    void (*add)(const float *v, const float *w, int n, float *dst);
    /* out[r, :] = W[idx[r], :] as fp32 (the reference's values exactly), r < n. */
    void (*decode_rows)(int kind, const uint8_t *w, size_t row_bytes, int K, const int64_t *idx, int n, float *out);
} gguf_isa_t;

extern const gguf_isa_t gguf_isa_scalar;
#if defined(__x86_64__)
extern const gguf_isa_t gguf_isa_avx2, gguf_isa_avx512;
#elif defined(__aarch64__)
extern const gguf_isa_t gguf_isa_neon;
#endif

/* Block geometry of a ggml type: weights per block and bytes per block (0: not a format the products read). */
static inline int gguf_block_weights(int kind) {
    return kind == GG_Q4_K || kind == GG_Q5_K || kind == GG_Q6_K ? 256 : 32;
}
static inline size_t gguf_block_bytes(int kind) {
    switch (kind) {
    case GG_F32: return 128;
    case GG_F16: case GG_BF16: return 64;
    case GG_Q4_0: return 18;
    case GG_Q4_1: return 20;
    case GG_Q8_0: return 34;
    case GG_Q4_K: return 144;
    case GG_Q5_K: return 176;
    case GG_Q6_K: return 210;
    default: return 0;
    }
}

#endif
