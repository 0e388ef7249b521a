/* The 16-lane primitives of gguf_kernels.c on AVX-512F (one zmm register per vector). Compiled with
 * -mavx512f -mavx2 -mfma -mf16c; chosen at load time only where the CPU and OS support AVX-512F. */
#include "simd_x86.h"

typedef __m512 v16;
#define ROWS_MAX_ISA 8   /* activation rows per weight pass: 16 accumulators of 32 zmm registers */

static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_set1(float s) { return _mm512_set1_ps(s); }
static inline v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, v16 a) { _mm512_storeu_ps(p, a); }
static inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
static inline v16 v_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
static inline v16 v_min(v16 a, v16 b) { return _mm512_min_ps(a, b); }
static inline v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v_round(v16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* 2^n for integral n in [-126, 127] */
static inline v16 v_pow2i(v16 n) {
    __m512i i = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(i, 23));
}
/* a where x >= lim, else 0 */
static inline v16 v_keep_ge(v16 a, v16 x, float lim) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lim), _CMP_GE_OQ), a);
}
/* The canonical sum of 16 lanes: (i, i+8), then (i, i+4), (i, i+2), (0, 1). */
static inline float v_hsum(v16 a) {
    __m256 lo = _mm512_castps512_ps256(a);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return hsum8(_mm256_add_ps(lo, hi));
}

/* ---- 32 weights of one block as two vectors (weights 0-15, 16-31), exactly the reference's fp32 values ---- */
#define IOTA16 _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)

/* 16 signed bytes as 16 floats (the generic Q8_0 decoder of gguf_kernels.c) */
static inline v16 v_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

#define SIMD_OWN_Q4 /* Q4_0 / Q4_1 by a table, below (the generic decoders' nibbles are slower here) */
/* Q4_x: a 16-entry table of the block's 16 possible weights, indexed by the nibbles (vpermps reads the low 4 bits
 * of each index, so the low nibbles need no mask). */
static inline void dec_nibbles(const uint8_t *qs, v16 table, v16 *lo, v16 *hi) {
    __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    *lo = _mm512_permutexvar_ps(idx, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
}
static inline void dec_q4_0(const uint8_t *b, v16 *lo, v16 *hi) {
    dec_nibbles(b + 2, _mm512_mul_ps(_mm512_sub_ps(IOTA16, _mm512_set1_ps(8.0f)), _mm512_set1_ps(half_at(b))), lo,
                hi);
}
static inline void dec_q4_1(const uint8_t *b, v16 *lo, v16 *hi) {
    /* d and m widened together: every 128-bit lane holds (d, m, d, m) */
    int32_t dm_bits;
    memcpy(&dm_bits, b, 4);
    const __m512 dm = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_set1_epi32(dm_bits)));
    /* d * q is exact (11 x 4 bits), so the fused d * q + m rounds once, as the reference's d * q + m does */
    dec_nibbles(b + 4, _mm512_fmadd_ps(IOTA16, _mm512_permute_ps(dm, 0x00), _mm512_permute_ps(dm, 0x55)), lo, hi);
}
static inline void dec_f16(const uint8_t *b, v16 *lo, v16 *hi) {
    *lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
    *hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
}
static inline void dec_bf16(const uint8_t *b, v16 *lo, v16 *hi) {
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b)), 16));
    *hi = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 32))), 16));
}
