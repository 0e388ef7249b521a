/* What the AVX2 and AVX-512 primitives share: fp16 widening (F16C) and the canonical sum of 8 lanes. */
#include <immintrin.h>
#include <string.h>

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* (i, i+4), (i, i+2), (0, 1): the last three steps of the canonical 16-lane sum */
static inline float hsum8(__m256 t8) {
    __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}
