/* The 16-lane primitives of gguf_kernels.c on Arm NEON (AdvSIMD, baseline on AArch64: four q registers per
 * vector). Thor's Neoverse-V3AE, Graviton and Apple cores all have it. */
#include <arm_neon.h>
#include <string.h>

typedef struct {
    float32x4_t v[4]; /* lanes 0-3, 4-7, 8-11, 12-15 */
} v16;
#define ROWS_MAX_ISA 2   /* activation rows per weight pass: 16 accumulators of 32 q registers */

static inline v16 v_set1(float s) { v16 r; for (int i = 0; i < 4; i++) r.v[i] = vdupq_n_f32(s); return r; }
static inline v16 v_zero(void) { return v_set1(0.0f); }
static inline v16 v_load(const float *p) { v16 r; for (int i = 0; i < 4; i++) r.v[i] = vld1q_f32(p + 4 * i); return r; }
static inline void v_store(float *p, v16 x) { for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, x.v[i]); }
#define V_LANEWISE(name, op) \
    static inline v16 name(v16 x, v16 y) { v16 r; for (int i = 0; i < 4; i++) r.v[i] = op(x.v[i], y.v[i]); return r; }
V_LANEWISE(v_add, vaddq_f32)
V_LANEWISE(v_sub, vsubq_f32)
V_LANEWISE(v_mul, vmulq_f32)
V_LANEWISE(v_div, vdivq_f32)
V_LANEWISE(v_max, vmaxq_f32)
V_LANEWISE(v_min, vminq_f32)
/* x * y + z, one rounding (vfmaq_f32(z, x, y) = z + x * y fused) */
static inline v16 v_fma(v16 x, v16 y, v16 z) { v16 r; for (int i = 0; i < 4; i++) r.v[i] = vfmaq_f32(z.v[i], x.v[i], y.v[i]); return r; }
static inline v16 v_round(v16 x) { v16 r; for (int i = 0; i < 4; i++) r.v[i] = vrndnq_f32(x.v[i]); return r; }
static inline v16 v_pow2i(v16 n) {
    v16 r;
    for (int i = 0; i < 4; i++)
        r.v[i] = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n.v[i]), vdupq_n_s32(127)), 23));
    return r;
}
static inline v16 v_keep_ge(v16 x, v16 c, float lim) {
    v16 r;
    for (int i = 0; i < 4; i++)
        r.v[i] = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x.v[i]), vcgeq_f32(c.v[i], vdupq_n_f32(lim))));
    return r;
}
/* The canonical sum of 16 lanes: (i, i+8), then (i, i+4), (i, i+2), (0, 1). */
static inline float v_hsum(v16 x) {
    float32x4_t t4 = vaddq_f32(vaddq_f32(x.v[0], x.v[2]), vaddq_f32(x.v[1], x.v[3]));
    float32x2_t t2 = vadd_f32(vget_low_f32(t4), vget_high_f32(t4));
    return vget_lane_f32(t2, 0) + vget_lane_f32(t2, 1);
}

static inline float half_at(const uint8_t *p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* ---- 32 weights of one block as two vectors (weights 0-15, 16-31), exactly the reference's fp32 values ---- */
static inline v16 bytes_u8(uint8x16_t q) {
    const uint16x8_t a = vmovl_u8(vget_low_u8(q)), b = vmovl_high_u8(q);
    v16 r;
    r.v[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(a)));
    r.v[1] = vcvtq_f32_u32(vmovl_high_u16(a));
    r.v[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(b)));
    r.v[3] = vcvtq_f32_u32(vmovl_high_u16(b));
    return r;
}
static inline v16 v_i8(const uint8_t *p) { /* 16 signed bytes -> 16 floats */
    const int8x16_t q = vld1q_s8((const int8_t *)p);
    const int16x8_t a = vmovl_s8(vget_low_s8(q)), b = vmovl_high_s8(q);
    v16 r;
    r.v[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(a)));
    r.v[1] = vcvtq_f32_s32(vmovl_high_s16(a));
    r.v[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(b)));
    r.v[3] = vcvtq_f32_s32(vmovl_high_s16(b));
    return r;
}
/* the 32 nibbles of 16 bytes as floats: low nibbles (weights 0-15), high nibbles (16-31) */
static inline void nibbles(const uint8_t *qs, v16 *lo, v16 *hi) {
    const uint8x16_t raw = vld1q_u8(qs);
    *lo = bytes_u8(vandq_u8(raw, vdupq_n_u8(0x0F)));
    *hi = bytes_u8(vshrq_n_u8(raw, 4));
}
static inline v16 halves16(const uint8_t *p) {
    v16 r;
    for (int i = 0; i < 4; i++) {
        float16x4_t h;
        memcpy(&h, p + 8 * i, 8);
        r.v[i] = vcvt_f32_f16(h);
    }
    return r;
}
static inline void dec_f16(const uint8_t *b, v16 *lo, v16 *hi) { *lo = halves16(b); *hi = halves16(b + 32); }
static inline v16 bf16x16(const uint8_t *p) {
    v16 r;
    for (int i = 0; i < 4; i++) {
        uint16x4_t h;
        memcpy(&h, p + 8 * i, 8);
        r.v[i] = vreinterpretq_f32_u32(vshll_n_u16(h, 16));
    }
    return r;
}
static inline void dec_bf16(const uint8_t *b, v16 *lo, v16 *hi) { *lo = bf16x16(b); *hi = bf16x16(b + 32); }
