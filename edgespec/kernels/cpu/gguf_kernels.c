/* The CPU kernels of one instruction set, written once over 16-lane vectors (v16) and compiled once per ISA:
 * -DGGUF_ISA_AVX512, -DGGUF_ISA_AVX2, -DGGUF_ISA_NEON or nothing (portable C), each with its own simd_*.h and
 * flags; gguf_cpu.c chooses one at load time by what the CPU supports. Always -ffp-contract=off: the compiler
 * must not fuse or reorder what is written here, so every ISA performs the same IEEE operations.
 *
 * The canonical order (identical results on every ISA, any row count, any thread count):
 * - a product's output y[m, n] keeps two 16-lane sums A and B: for each block b of 32 weights in order,
 *   A = fma(w[32b .. 32b+15], x[..], A) and B = fma(w[32b+16 .. 32b+31], x[..], B), then y = hsum(A + B), where
 *   hsum adds lanes (i, i+8), then (i, i+4), (i, i+2), (0, 1). Weights are the reference's fp32 values exactly
 *   (fp16 scales widened exactly; d * q is exact in fp32, so Q4_1's d * q + m rounds once however it is formed);
 *   K-quant super-blocks are decoded by the reference's scalar operations, then summed as 8 blocks of 32.
 * - dot(a, b) over n: one 16-lane fma sum (a tail zero-filled), then hsum.
 * - exp: Cody-Waite reduction by ln 2 and a degree-6 polynomial (Cephes expf's), 2^n by exponent bits; inputs
 *   below ln(FLT_MIN) give 0 (so masked -inf scores vanish). About 1 ulp; the torch references are compared with
 *   a tolerance, the ISAs with each other bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gguf_isa.h"

#if defined(GGUF_ISA_AVX512)
#include "simd_avx512.h"
#define ISA_TABLE gguf_isa_avx512
#define ISA_NAME "avx512"
#elif defined(GGUF_ISA_AVX2)
#include "simd_avx2.h"
#define ISA_TABLE gguf_isa_avx2
#define ISA_NAME "avx2"
#elif defined(GGUF_ISA_NEON)
#include "simd_neon.h"
#define ISA_TABLE gguf_isa_neon
#define ISA_NAME "neon"
#else
#include "simd_scalar.h"
#define ISA_TABLE gguf_isa_scalar
#define ISA_NAME "scalar"
#endif

#define INLINE static inline __attribute__((always_inline))

/* ---- vector helpers --------------------------------------------------------------------------------------- */
/* n floats from p, zero-filled to 16 lanes (the tail of a row whose length is not a multiple of 16) */
INLINE v16 v_load_part(const float *p, int n) {
    float lane[16] = {0};
    memcpy(lane, p, sizeof(float) * (size_t)n);
    return v_load(lane);
}

INLINE void v_store_part(float *p, v16 a, int n) {
    float lane[16];
    v_store(lane, a);
    memcpy(p, lane, sizeof(float) * (size_t)n);
}

/* a 16-lane fma sum over n floats (a zero-filled tail), then hsum */
INLINE float dot(const float *a, const float *b, int n) {
    v16 acc = v_zero();
    int i = 0;
    for (; i + 16 <= n; i += 16)
        acc = v_fma(v_load(a + i), v_load(b + i), acc);
    if (i < n)
        acc = v_fma(v_load_part(a + i, n - i), v_load_part(b + i, n - i), acc);
    return v_hsum(acc);
}

INLINE v16 v_exp(v16 x) {
    const float lo = -87.3365478515625f; /* ln(FLT_MIN): below it the result is 0 */
    const v16 xc = v_min(v_max(x, v_set1(lo)), v_set1(88.0f));
    const v16 n = v_round(v_mul(xc, v_set1(1.44269504088896341f)));
    v16 r = v_fma(n, v_set1(-0.693359375f), xc);
    r = v_fma(n, v_set1(2.12194440e-4f), r);
    v16 p = v_set1(1.9875691500e-4f);
    p = v_fma(p, r, v_set1(1.3981999507e-3f));
    p = v_fma(p, r, v_set1(8.3334519073e-3f));
    p = v_fma(p, r, v_set1(4.1665795894e-2f));
    p = v_fma(p, r, v_set1(1.6666665459e-1f));
    p = v_fma(p, r, v_set1(5.0000001201e-1f));
    const v16 y = v_add(v_fma(p, v_mul(r, r), r), v_set1(1.0f));
    return v_keep_ge(v_mul(y, v_pow2i(n)), x, lo);
}

/* ---- 32-weight blocks ------------------------------------------------------------------------------------- *
 * The Q4/Q8 decoders over the primitives (nibbles, v_i8); an ISA with a better way defines SIMD_OWN_Q4 and its own
 * Q4 decoders (AVX-512: a 16-entry table). F16 / BF16 rows: each simd_*.h's dec_f16 / dec_bf16. */
#ifndef SIMD_OWN_Q4
INLINE void dec_q4_0(const uint8_t *b, v16 *lo, v16 *hi) {
    const v16 d = v_set1(half_at(b)), eight = v_set1(8.0f);
    nibbles(b + 2, lo, hi);
    *lo = v_mul(v_sub(*lo, eight), d);
    *hi = v_mul(v_sub(*hi, eight), d);
}
INLINE void dec_q4_1(const uint8_t *b, v16 *lo, v16 *hi) {
    /* d * q is exact (11 x 4 bits), so the fused d * q + m rounds once, as the reference's d * q + m does */
    const v16 d = v_set1(half_at(b)), m = v_set1(half_at(b + 2));
    nibbles(b + 4, lo, hi);
    *lo = v_fma(*lo, d, m);
    *hi = v_fma(*hi, d, m);
}
#endif
INLINE void dec_q8_0(const uint8_t *b, v16 *lo, v16 *hi) {
    const v16 d = v_set1(half_at(b));
    *lo = v_mul(v_i8(b + 2), d);
    *hi = v_mul(v_i8(b + 18), d);
}

INLINE void decode32(int kind, const uint8_t *blk, v16 *lo, v16 *hi) {
    switch (kind) {
    case GG_Q4_0: dec_q4_0(blk, lo, hi); break;
    case GG_Q4_1: dec_q4_1(blk, lo, hi); break;
    case GG_Q8_0: dec_q8_0(blk, lo, hi); break;
    case GG_F16: dec_f16(blk, lo, hi); break;
    case GG_BF16: dec_bf16(blk, lo, hi); break;
    default: /* GG_F32 */
        *lo = v_load((const float *)blk);
        *hi = v_load((const float *)blk + 16);
    }
}

/* One weight row against R activation rows (R a constant after inlining): each block decoded once, used R times. */
INLINE void rows_r(int kind, const uint8_t *row, int nb, size_t bpb, const float *x, size_t K, float *y,
                   size_t ldy, const int R) {
    v16 A[ROWS_MAX_ISA], B[ROWS_MAX_ISA];
    for (int r = 0; r < R; r++)
        A[r] = B[r] = v_zero();
    for (int b = 0; b < nb; b++) {
        v16 lo, hi;
        decode32(kind, row + bpb * (size_t)b, &lo, &hi);
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * K + 32 * (size_t)b;
            A[r] = v_fma(lo, v_load(xb), A[r]);
            B[r] = v_fma(hi, v_load(xb + 16), B[r]);
        }
    }
    for (int r = 0; r < R; r++)
        y[r * ldy] = v_hsum(v_add(A[r], B[r]));
}

#define ROWS_CASES(KIND)                                                                                         \
    switch (R) {                                                                                                 \
    case 1: rows_r(KIND, row, nb, bpb, x, K, y, ldy, 1); break;                                                  \
    case 2: rows_r(KIND, row, nb, bpb, x, K, y, ldy, 2); break;                                                  \
    case 3: rows_r(KIND, row, nb, bpb, x, K, y, ldy, ROWS_MAX_ISA >= 3 ? 3 : 1); break;                          \
    case 4: rows_r(KIND, row, nb, bpb, x, K, y, ldy, ROWS_MAX_ISA >= 4 ? 4 : 1); break;                          \
    case 5: rows_r(KIND, row, nb, bpb, x, K, y, ldy, ROWS_MAX_ISA >= 5 ? 5 : 1); break;                          \
    case 6: rows_r(KIND, row, nb, bpb, x, K, y, ldy, ROWS_MAX_ISA >= 6 ? 6 : 1); break;                          \
    case 7: rows_r(KIND, row, nb, bpb, x, K, y, ldy, ROWS_MAX_ISA >= 7 ? 7 : 1); break;                          \
    default: rows_r(KIND, row, nb, bpb, x, K, y, ldy, ROWS_MAX_ISA >= 8 ? 8 : 1); break;                         \
    }

static void rows_kind(int kind, const uint8_t *row, int nb, size_t bpb, const float *x, size_t K, float *y,
                      size_t ldy, int R) {
    switch (kind) {
    case GG_Q4_0: ROWS_CASES(GG_Q4_0) break;
    case GG_Q4_1: ROWS_CASES(GG_Q4_1) break;
    case GG_Q8_0: ROWS_CASES(GG_Q8_0) break;
    case GG_F16: ROWS_CASES(GG_F16) break;
    case GG_BF16: ROWS_CASES(GG_BF16) break;
    default: ROWS_CASES(GG_F32) break;
    }
}

/* ---- K-quants: super-blocks of 256 weights (layouts in edgespec/weights/gguf_kquants.py) ----------------------
 * Decoded to 256 fp32 weights with the reference's scalar operations in its order (d * sc first, then times the
 * code, minus dmin * m), so the weights are the oracle's bit for bit. */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static void decode_k(int kind, const uint8_t *b, float *w) {
    if (kind == GG_Q6_K) { /* ql[128], qh[64], int8 scales[16], fp16 d */
        const float d = half_at(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        float ds[16];
        for (int i = 0; i < 16; i++)
            ds[i] = d * (float)sc[i];
        for (int n = 0; n < 2; n++) {
            /* weight l + 32k of this half: nibble k / 2 of ql[l + 32 (k % 2)], bits 2k..2k+1 of qh[l] above */
            const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
            const float *s = ds + 8 * n;
            float *o = w + 128 * n;
            for (int l = 0; l < 32; l++) {
                const int h = qh[l], is = l / 16;
                o[l] = s[is] * (float)(((ql[l] & 0xF) | ((h & 3) << 4)) - 32);
                o[l + 32] = s[is + 2] * (float)(((ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32);
                o[l + 64] = s[is + 4] * (float)(((ql[l] >> 4) | (((h >> 4) & 3) << 4)) - 32);
                o[l + 96] = s[is + 6] * (float)(((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32);
            }
        }
        return;
    }
    /* Q4_K / Q5_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, (Q5_K: qh[32]), qs[128] */
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *qh = b + 16, *qs = b + (kind == GG_Q5_K ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, b + 4, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> shift) & 0xF;
            if (kind == GG_Q5_K)
                v += ((qh[l] >> j) & 1) << 4;
            w[32 * j + l] = d1 * (float)v - m1;
        }
    }
}

static void rows_k(int kind, const uint8_t *row, int nb, size_t bpb, const float *x, size_t K, float *y,
                   size_t ldy, int R) {
    v16 A[ROWS_MAX_ISA], B[ROWS_MAX_ISA];
    float w[256];
    for (int r = 0; r < R; r++)
        A[r] = B[r] = v_zero();
    for (int b = 0; b < nb; b++) {
        decode_k(kind, row + bpb * (size_t)b, w);
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * K + 256 * (size_t)b;
            for (int i = 0; i < 256; i += 32) {
                A[r] = v_fma(v_load(w + i), v_load(xb + i), A[r]);
                B[r] = v_fma(v_load(w + i + 16), v_load(xb + i + 16), B[r]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        y[r * ldy] = v_hsum(v_add(A[r], B[r]));
}

static void product(int kind, const uint8_t *w, size_t row_bytes, int K, const float *x, int M, float *y,
                    size_t ldy, int n0, int n1) {
    const int bw = gguf_block_weights(kind), nb = K / bw;
    const size_t bpb = gguf_block_bytes(kind);
    const int kquant = bw == 256;
    for (int m = 0; m < M; m += ROWS_MAX_ISA) {
        const int R = M - m < ROWS_MAX_ISA ? M - m : ROWS_MAX_ISA;
        const float *xm = x + (size_t)m * K;
        float *ym = y + (size_t)m * ldy;
        for (int n = n0; n < n1; n++) {
            const uint8_t *row = w + (size_t)n * row_bytes;
            if (kquant)
                rows_k(kind, row, nb, bpb, xm, (size_t)K, ym + n, ldy, R);
            else
                rows_kind(kind, row, nb, bpb, xm, (size_t)K, ym + n, ldy, R);
        }
    }
}

/* ---- step helpers ------------------------------------------------------------------------------------------- */
static void add_rms_norm(const float *x, const float *r, const float *w, float eps, int T, int D, float *s,
                         float *y) {
    for (int t = 0; t < T; t++) {
        const float *rt = r + (size_t)t * D;
        float *st = s + (size_t)t * D, *yt = y + (size_t)t * D;
        if (x != NULL) {
            const float *xt = x + (size_t)t * D;
            for (int i = 0; i < D; i++)
                st[i] = rt[i] + xt[i];
        } else if (st != rt) {
            memcpy(st, rt, sizeof(float) * D);
        }
        const float inv = 1.0f / sqrtf(dot(st, st, D) / (float)D + eps);
        const v16 iv = v_set1(inv);
        int i = 0;
        for (; i + 16 <= D; i += 16)
            v_store(yt + i, v_mul(v_load(w + i), v_mul(v_load(st + i), iv)));
        for (; i < D; i++)
            yt[i] = w[i] * (st[i] * inv);
    }
}

static void attend(const float *q, const float *k, const float *v, size_t stride, int L, int hd, float scale,
                   const float *bias, float *scratch, float *o) {
    float m = -INFINITY;
    for (int j = 0; j < L; j++) {
        float s = dot(q, k + (size_t)j * stride, hd) * scale;
        if (bias != NULL)
            s = s + bias[j];
        scratch[j] = s;
        m = s > m ? s : m;
    }
    const int Lp = (L + 15) & ~15;
    for (int j = L; j < Lp; j++)
        scratch[j] = -INFINITY; /* padding lanes: exp gives 0 */
    if (m == -INFINITY) { /* every key masked: no attention (zeros), as a -inf row's softmax has no mass */
        memset(o, 0, sizeof(float) * (size_t)hd);
        return;
    }
    const v16 mv = v_set1(m);
    v16 total = v_zero();
    for (int j = 0; j < Lp; j += 16) {
        const v16 p = v_exp(v_sub(v_load(scratch + j), mv));
        v_store(scratch + j, p);
        total = v_add(total, p);
    }
    for (int i = 0; i < hd; i += 16) {
        v16 acc = v_zero();
        for (int j = 0; j < L; j++)
            acc = v_fma(v_set1(scratch[j]), v_load(v + (size_t)j * stride + i), acc);
        v_store(o + i, acc);
    }
    const v16 inv = v_set1(1.0f / v_hsum(total));
    for (int i = 0; i < hd; i += 16)
        v_store(o + i, v_mul(v_load(o + i), inv));
}

INLINE v16 silu_times(v16 g, v16 u) {
    return v_mul(v_div(g, v_add(v_set1(1.0f), v_exp(v_sub(v_zero(), g)))), u);
}

static void silu_mul(const float *gate_up, int T, int I, float *out) {
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + (size_t)t * 2 * I, *u = g + I;
        float *o = out + (size_t)t * I;
        int i = 0;
        for (; i + 16 <= I; i += 16)
            v_store(o + i, silu_times(v_load(g + i), v_load(u + i)));
        if (i < I)
            v_store_part(o + i, silu_times(v_load_part(g + i, I - i), v_load_part(u + i, I - i)), I - i);
    }
}

static void add(const float *a, const float *b, int n, float *dst) {
    int i = 0;
    for (; i + 16 <= n; i += 16)
        v_store(dst + i, v_add(v_load(a + i), v_load(b + i)));
    for (; i < n; i++)
        dst[i] = a[i] + b[i];
}

static void decode_rows(int kind, const uint8_t *w, size_t row_bytes, int K, const int64_t *idx, int n, float *out) {
    const int bw = gguf_block_weights(kind), nb = K / bw;
    const size_t bpb = gguf_block_bytes(kind);
    for (int r = 0; r < n; r++) {
        const uint8_t *row = w + (size_t)idx[r] * row_bytes;
        float *o = out + (size_t)r * K;
        for (int b = 0; b < nb; b++) {
            if (bw == 256) {
                decode_k(kind, row + bpb * (size_t)b, o + 256 * (size_t)b);
            } else {
                v16 lo, hi;
                decode32(kind, row + bpb * (size_t)b, &lo, &hi);
                v_store(o + 32 * (size_t)b, lo);
                v_store(o + 32 * (size_t)b + 16, hi);
            }
        }
    }
}

const gguf_isa_t ISA_TABLE = {ISA_NAME, product, add_rms_norm, attend, silu_mul, add, decode_rows};
