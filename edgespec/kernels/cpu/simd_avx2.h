/* The 16-lane primitives of gguf_kernels.c on AVX2 + FMA + F16C (two ymm registers per vector). */
#include "simd_x86.h"

typedef struct {
    __m256 a, b; /* lanes 0-7, 8-15 */
} v16;
#define ROWS_MAX_ISA 2   /* activation rows per weight pass: 8 accumulators of 16 ymm registers */

static inline v16 v_make(__m256 a, __m256 b) { v16 r = {a, b}; return r; }
static inline v16 v_zero(void) { return v_make(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline v16 v_set1(float s) { return v_make(_mm256_set1_ps(s), _mm256_set1_ps(s)); }
static inline v16 v_load(const float *p) { return v_make(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void v_store(float *p, v16 x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
#define V_LANEWISE(name, op) \
    static inline v16 name(v16 x, v16 y) { return v_make(op(x.a, y.a), op(x.b, y.b)); }
V_LANEWISE(v_add, _mm256_add_ps)
V_LANEWISE(v_sub, _mm256_sub_ps)
V_LANEWISE(v_mul, _mm256_mul_ps)
V_LANEWISE(v_div, _mm256_div_ps)
V_LANEWISE(v_max, _mm256_max_ps)
V_LANEWISE(v_min, _mm256_min_ps)
static inline v16 v_fma(v16 x, v16 y, v16 z) { return v_make(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)); }
static inline v16 v_round(v16 x) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return v_make(_mm256_round_ps(x.a, mode), _mm256_round_ps(x.b, mode));
}
static inline __m256 pow2i8(__m256 n) {
    __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(i, 23));
}
static inline v16 v_pow2i(v16 n) { return v_make(pow2i8(n.a), pow2i8(n.b)); }
static inline v16 v_keep_ge(v16 x, v16 c, float lim) {
    const __m256 l = _mm256_set1_ps(lim);
    return v_make(_mm256_and_ps(x.a, _mm256_cmp_ps(c.a, l, _CMP_GE_OQ)),
                  _mm256_and_ps(x.b, _mm256_cmp_ps(c.b, l, _CMP_GE_OQ)));
}
/* The canonical sum of 16 lanes: (i, i+8), then (i, i+4), (i, i+2), (0, 1). */
static inline float v_hsum(v16 x) {
    return hsum8(_mm256_add_ps(x.a, x.b));
}

/* ---- 32 weights of one block as two vectors (weights 0-15, 16-31), exactly the reference's fp32 values ---- */
static inline v16 bytes_u8(__m128i q) { /* 16 unsigned bytes -> 16 floats */
    return v_make(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))));
}
static inline v16 v_i8(const uint8_t *p) { /* 16 signed bytes -> 16 floats */
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return v_make(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
}
/* the 32 nibbles of 16 bytes as floats: low nibbles (weights 0-15), high nibbles (16-31) */
static inline void nibbles(const uint8_t *qs, v16 *lo, v16 *hi) {
    const __m128i low = _mm_set1_epi8(0x0F);
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    *lo = bytes_u8(_mm_and_si128(raw, low));
    *hi = bytes_u8(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
}
static inline v16 halves16(const uint8_t *p) {
    return v_make(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16))));
}
static inline void dec_f16(const uint8_t *b, v16 *lo, v16 *hi) { *lo = halves16(b); *hi = halves16(b + 32); }
static inline v16 bf16x16(const uint8_t *p) {
    __m256i a = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    __m256i c = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16))), 16);
    return v_make(_mm256_castsi256_ps(a), _mm256_castsi256_ps(c));
}
static inline void dec_bf16(const uint8_t *b, v16 *lo, v16 *hi) { *lo = bf16x16(b); *hi = bf16x16(b + 32); }
