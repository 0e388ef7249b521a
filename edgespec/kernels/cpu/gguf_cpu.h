/* The functions of the compiled CPU path (gguf_cpu.c), as edgespec.kernels.cpu.gguf_native / cpu_step / cpu_stack call
 * them through ctypes and the test harness (tests/kernels/gguf_harness.c) calls them natively and under qemu. */
#ifndef GGUF_CPU_H
#define GGUF_CPU_H

#include <stdint.h>

/* The kernels in use ("avx512", "avx2", "neon", "scalar") and a switch to a lesser set (0, or -1). */
const char *gguf_isa(void);
int gguf_use_isa(const char *name);
void gguf_set_pinning(int on);

int gguf_matmul(int kind, const uint8_t *w, int N, int K, const float *x, int M, float *y, int threads);
int gguf_rows(int kind, const uint8_t *w, int N, int K, const int64_t *idx, int n, float *out);
void add_rms_norm_f32(const float *x, const float *residual, const float *w, float eps, int T, int D, float *sum,
                      float *norm);
void silu_mul_f32(const float *gate_up, int T, int I, float *out);
int llama_attention_f32(const float *qkv, int T, int H, int Hkv, int hd, const float *cos, const float *sin, int rd,
                        const float *q_norm, const float *k_norm, float eps, float *kc, float *vc, int start,
                        float scale, float *out, int threads);
/* The same over keys 0 .. kv_row+T-1 with the rows' K/V written at kv_row: causal (row t sees keys up to
 * kv_row + t) or not (every row sees all kv_row + T keys), bias [T, kv_row + T] added to the scores (or NULL). */
int block_attention_f32(const float *qkv, int T, int H, int Hkv, int hd, const float *cos, const float *sin, int rd,
                        const float *q_norm, const float *k_norm, float eps, float *kc, float *vc, int kv_row,
                        int causal, const float *bias, float scale, float *out, int threads);

/* ---- the layer stack: a Llama / Qwen3 decoder described once, run for T rows per call ---- */
typedef struct {
    int kind, N, K;     /* ggml type, [N, K] */
    const void *data;   /* rows as stored (GGUF blocks, dense F32 / F16 / BF16) */
    const float *bias;  /* [N] or NULL */
} gguf_weight_t;

typedef struct {
    const float *in_norm, *post_norm; /* [D] */
    const float *q_norm, *k_norm;     /* [hd] (Qwen3) or NULL (Llama) */
    gguf_weight_t qkv, o, gate_up, down;
    int causal;                       /* block rows see only earlier rows (a decoder: 1) */
} gguf_layer_t;

typedef struct {
    int n_layers, D, H, Hkv, hd, I, rd;
    float eps, scale;
    const gguf_layer_t *layers;
    const float *final_norm;
} gguf_stack_t;

int gguf_stack_check(const gguf_stack_t *s);
int gguf_stack_forward(const gguf_stack_t *s, float *const *kc, float *const *vc, int kv_row, int T,
                       const float *cos, const float *sin, const float *const *bias, float *h, const int *tap_ids,
                       int n_taps, float *taps, float *hidden, int threads);

#endif
