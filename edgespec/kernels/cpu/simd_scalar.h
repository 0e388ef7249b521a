/* The 16-lane primitives of gguf_kernels.c in portable C (any CPU; the reference build the SIMD ones are checked
 * against bit for bit). fmaf is the correctly rounded fused multiply-add of C99. */
#include <math.h>
#include <string.h>

typedef struct {
    float f[16];
} v16;
#define ROWS_MAX_ISA 4

static inline v16 v_set1(float s) { v16 r; for (int i = 0; i < 16; i++) r.f[i] = s; return r; }
static inline v16 v_zero(void) { return v_set1(0.0f); }
static inline v16 v_load(const float *p) { v16 r; memcpy(r.f, p, sizeof r.f); return r; }
static inline void v_store(float *p, v16 x) { memcpy(p, x.f, sizeof x.f); }
#define V_LANEWISE(name, expr) \
    static inline v16 name(v16 x, v16 y) { v16 r; for (int i = 0; i < 16; i++) { float a = x.f[i], b = y.f[i]; r.f[i] = (expr); } return r; }
V_LANEWISE(v_add, a + b)
V_LANEWISE(v_sub, a - b)
V_LANEWISE(v_mul, a * b)
V_LANEWISE(v_div, a / b)
/* max/min of NaN differ between ISAs (x86 returns the second operand, NEON the NaN): NaN is not canonical */
V_LANEWISE(v_max, a > b ? a : b)
V_LANEWISE(v_min, a < b ? a : b)
static inline v16 v_fma(v16 x, v16 y, v16 z) { v16 r; for (int i = 0; i < 16; i++) r.f[i] = fmaf(x.f[i], y.f[i], z.f[i]); return r; }
static inline v16 v_round(v16 x) { v16 r; for (int i = 0; i < 16; i++) r.f[i] = rintf(x.f[i]); return r; }
static inline v16 v_pow2i(v16 n) {
    v16 r;
    for (int i = 0; i < 16; i++) {
        const uint32_t bits = (uint32_t)((int32_t)n.f[i] + 127) << 23;
        memcpy(&r.f[i], &bits, 4);
    }
    return r;
}
static inline v16 v_keep_ge(v16 x, v16 c, float lim) { v16 r; for (int i = 0; i < 16; i++) r.f[i] = c.f[i] >= lim ? x.f[i] : 0.0f; return r; }
/* The canonical sum of 16 lanes: (i, i+8), then (i, i+4), (i, i+2), (0, 1). */
static inline float v_hsum(v16 x) {
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = x.f[i] + x.f[i + 8];
    for (int i = 0; i < 4; i++) t[i] = t[i] + t[i + 4];
    for (int i = 0; i < 2; i++) t[i] = t[i] + t[i + 2];
    return t[0] + t[1];
}

/* IEEE binary16 -> binary32, exact (normals, subnormals, inf, nan). */
static inline float half_bits(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline float half_at(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return half_bits(h); }

/* 16 signed bytes -> 16 floats; the 32 nibbles of 16 bytes: low (weights 0-15), high (16-31) */
static inline v16 v_i8(const uint8_t *p) { v16 r; for (int j = 0; j < 16; j++) r.f[j] = (float)(int8_t)p[j]; return r; }
static inline void nibbles(const uint8_t *qs, v16 *lo, v16 *hi) {
    for (int j = 0; j < 16; j++) {
        lo->f[j] = (float)(qs[j] & 0xF);
        hi->f[j] = (float)(qs[j] >> 4);
    }
}

/* ---- 32 weights of one block as two vectors (weights 0-15, 16-31), exactly the reference's fp32 values ---- */
static inline void dec_f16(const uint8_t *b, v16 *lo, v16 *hi) {
    for (int j = 0; j < 16; j++) {
        lo->f[j] = half_at(b + 2 * j);
        hi->f[j] = half_at(b + 32 + 2 * j);
    }
}
static inline float bf16_at(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f; }
static inline void dec_bf16(const uint8_t *b, v16 *lo, v16 *hi) {
    for (int j = 0; j < 16; j++) {
        lo->f[j] = bf16_at(b + 2 * j);
        hi->f[j] = bf16_at(b + 32 + 2 * j);
    }
}
