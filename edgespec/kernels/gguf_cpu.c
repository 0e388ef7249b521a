/* Products of GGUF Q4_0 / Q4_1 / Q8_0 (and K-quant Q4_K / Q5_K / Q6_K, below) weights with fp32 activations, read
 * straight from the GGUF blocks.
 *
 * Built by edgespec.kernels.gguf_native (gcc -O3 -march=native -fopenmp) and called through ctypes.
 * The weight is the file's own bytes: row n of an [N, K] matrix is K/32 consecutive blocks
 *   Q4_0: fp16 d, 16 bytes of nibbles          w = d * (q - 8)
 *   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
 *   Q8_0: fp16 d, 32 int8                      w = d * q
 * (byte j of the nibbles holds weight j in its low and weight j + 16 in its high nibble).
 *
 * Every output y[m, n] is computed by the same sequence of fp32 operations whatever the number of rows M and
 * threads: a verify row rounds exactly like a plain decode step of the same token (speculative == plain). The
 * scales are widened fp16 -> fp32 exactly; the only difference from the dequantize-then-dot oracle is the order
 * of the fp32 sums (per block: dot(q, x) then times d).
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 weights of one block as 4 x 8 fp32 lanes (Q4_1: q, its m term is added separately); returns d. */
static inline __attribute__((always_inline)) float decode(int kind, const uint8_t *blk, __m256 w[4]) {
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256i a, b, c, d;
    if (kind == 8) {
        __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        a = _mm256_cvtepi8_epi32(q0);
        b = _mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8));
        c = _mm256_cvtepi8_epi32(q1);
        d = _mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8));
    } else if (kind == 2) {
        const __m128i eight = _mm_set1_epi8(8);
        __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 2));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, low), eight);
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), low), eight);
        a = _mm256_cvtepi8_epi32(lo);
        b = _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8));
        c = _mm256_cvtepi8_epi32(hi);
        d = _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8));
    } else {
        __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
        __m128i lo = _mm_and_si128(raw, low);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        a = _mm256_cvtepu8_epi32(lo);
        b = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
        c = _mm256_cvtepu8_epi32(hi);
        d = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
    }
    w[0] = _mm256_cvtepi32_ps(a);
    w[1] = _mm256_cvtepi32_ps(b);
    w[2] = _mm256_cvtepi32_ps(c);
    w[3] = _mm256_cvtepi32_ps(d);
    return half_at(blk);
}

/* One weight row against R activation rows (R = 1..4, a constant after inlining): each block is decoded once
 * and used R times. Row r's sums are the same fp32 operations in the same order for every R, so its result
 * does not depend on how many rows share the call. */
static inline __attribute__((always_inline)) void
rows(int kind, const uint8_t *row, size_t bpb, int nb, const float *x, size_t K, const float *xsum, float *y,
     size_t N, const int R) {
    __m256 acc[4];
    float macc[4];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        macc[r] = 0.0f;
    }
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + bpb * b;
        __m256 w[4];
        const __m256 d = _mm256_set1_ps(decode(kind, blk, w));
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * K + 32 * b;
            __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
            s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), s);
            s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), s);
            s = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), s);
            acc[r] = _mm256_fmadd_ps(s, d, acc[r]);
            if (kind == 3)
                macc[r] += half_at(blk + 2) * xsum[r * nb + b];
        }
    }
    for (int r = 0; r < R; r++)
        y[r * N] = hsum8(acc[r]) + macc[r];
}

#define ROWS_FOR(KIND)                                                                                       \
    switch (R) {                                                                                             \
    case 1: rows(KIND, row, bpb, nb, x, K, xsum, y, N, 1); break;                                            \
    case 2: rows(KIND, row, bpb, nb, x, K, xsum, y, N, 2); break;                                            \
    case 3: rows(KIND, row, bpb, nb, x, K, xsum, y, N, 3); break;                                            \
    default: rows(KIND, row, bpb, nb, x, K, xsum, y, N, 4); break;                                           \
    }

/* ---- K-quants: super-blocks of 256 weights (layouts in edgespec/weights/gguf_kquants.py) ----------------------
 * A super-block is decoded to 256 fp32 weights with the reference's operations in its order (d * sc first, then
 * times the code, minus dmin * m), so the weights are the oracle's bit for bit; the product then sums w * x in
 * 8 lanes. Decoded once per weight row and used for every activation row of the call. */
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
    if (kind == 14) { /* Q6_K: ql[128], qh[64], int8 scales[16], fp16 d */
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
    const uint8_t *qh = b + 16, *qs = b + (kind == 13 ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, b + 4, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> shift) & 0xF;
            if (kind == 13)
                v += ((qh[l] >> j) & 1) << 4;
            w[32 * j + l] = d1 * (float)v - m1;
        }
    }
}

static void rows_k(int kind, const uint8_t *row, size_t bpb, int nb, const float *x, size_t K, float *y, size_t N,
                   int R) {
    __m256 acc[4];
    float w[256] __attribute__((aligned(32)));
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        decode_k(kind, row + bpb * b, w);
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * K + 256 * (size_t)b;
            __m256 a = acc[r];
            for (int i = 0; i < 256; i += 8)
                a = _mm256_fmadd_ps(_mm256_load_ps(w + i), _mm256_loadu_ps(xb + i), a);
            acc[r] = a;
        }
    }
    for (int r = 0; r < R; r++)
        y[r * N] = hsum8(acc[r]);
}

static void rows_kind(int kind, const uint8_t *row, size_t bpb, int nb, const float *x, size_t K,
                      const float *xsum, float *y, size_t N, int R) {
    if (kind >= 12) {
        rows_k(kind, row, bpb, nb, x, K, y, N, R);
    } else if (kind == 2) {
        ROWS_FOR(2)
    } else if (kind == 3) {
        ROWS_FOR(3)
    } else {
        ROWS_FOR(8)
    }
}

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 }; /* ggml type ids */

/* Output rows handed to a thread at a time: small enough to balance 2-16 threads on the demo's 192-row
 * matrices, large enough that the per-chunk overhead stays negligible. */
#define CHUNK 16

/* ---- threads ----------------------------------------------------------------------------------------------
 * A product is split into chunks of CHUNK output rows that the calling thread and the pool's workers take from
 * a shared counter. The caller never waits for a worker to *arrive* (OpenMP's barrier did: on a shared,
 * oversubscribed machine every product then waited for a descheduled thread, one time slice each, and a decode
 * step of 211 products took a second); it waits only for chunks a worker has actually taken. Idle workers spin
 * briefly (the next product follows within microseconds during a forward), then sleep on a condition variable.
 *
 * The counter holds (generation << 32 | next chunk). A job's parameters live in jobs[generation & 1]; the
 * caller fills the other slot only after every chunk of the current job is done, and a worker uses a slot only
 * after a compare-and-swap on the counter proves the generation it read the slot under is still current. */
typedef struct {
    int kind, N, M, nb, chunks;
    size_t K, bpb, row_bytes;
    const uint8_t *w;
    const float *x, *xsum;
    float *y;
} job_t;

static job_t jobs[2];
static _Atomic uint64_t counter;
static _Atomic int done;
static _Atomic uint32_t published;
static _Atomic int sleepers;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int workers;
static uint32_t generation;
#define SPIN 20000

static void run_chunk(const job_t *j, int c) {
    const int n1 = (c + 1) * CHUNK < j->N ? (c + 1) * CHUNK : j->N;
    for (int m = 0; m < j->M; m += 4) {
        const int R = j->M - m < 4 ? j->M - m : 4;
        for (int n = c * CHUNK; n < n1; n++)
            rows_kind(j->kind, j->w + (size_t)n * j->row_bytes, j->bpb, j->nb, j->x + (size_t)m * j->K, j->K,
                      j->kind == Q4_1 ? j->xsum + (size_t)m * j->nb : NULL, j->y + (size_t)m * j->N + n,
                      (size_t)j->N, R);
    }
}

/* Take and run chunks of generation g until none is left (or a newer job replaced it). */
static void take_chunks(uint32_t g) {
    for (;;) {
        uint64_t v = atomic_load(&counter);
        if ((uint32_t)(v >> 32) != g)
            return;
        const job_t *j = &jobs[g & 1];
        const int c = (int)(uint32_t)v, chunks = j->chunks;
        if (c >= chunks)
            return;
        if (!atomic_compare_exchange_weak(&counter, &v, v + 1))
            continue;
        run_chunk(j, c);
        atomic_fetch_add(&done, 1);
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint32_t seen = atomic_load(&published);
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = atomic_load(&published)) == seen) {
            if (++spins < SPIN) {
                _mm_pause();
                if (spins % 256 == 0)
                    sched_yield();
                continue;
            }
            pthread_mutex_lock(&mu);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&published) == seen)
                pthread_cond_wait(&cv, &mu);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&mu);
            spins = 0;
        }
        seen = g;
        take_chunks(g);
    }
    return NULL;
}

static void start_workers(int want) {
    for (; workers < want; workers++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
    }
}

/* y[M, N] = x[M, K] @ W[N, K]^T with W in ggml type `kind` (K a multiple of 32, of 256 for K-quants), on `threads` threads (the
 * caller plus a pool kept for the process). Not reentrant: one product at a time (the model runs one forward
 * at a time). Returns 0, -1 for an unknown kind, -2 when out of memory. */
int gguf_matmul(int kind, const uint8_t *w, int N, int K, const float *x, int M, float *y, int threads) {
    const int nb = K / (kind >= Q4_K ? 256 : 32); /* blocks per row: K-quant super-blocks hold 256 */
    size_t bpb;
    switch (kind) {
    case Q4_0: bpb = 18; break;
    case Q4_1: bpb = 20; break;
    case Q8_0: bpb = 34; break;
    case Q4_K: bpb = 144; break;
    case Q5_K: bpb = 176; break;
    case Q6_K: bpb = 210; break;
    default: return -1;
    }
    float *xsum = NULL;
    if (kind == Q4_1) {
        /* the m term of Q4_1: m * (sum of x over the block), one scalar sum per row and block */
        xsum = malloc(sizeof(float) * (size_t)M * nb + 1);
        if (xsum == NULL)
            return -2;
        for (size_t i = 0; i < (size_t)M * nb; i++) {
            float s = 0.0f;
            for (int j = 0; j < 32; j++)
                s += x[32 * i + j];
            xsum[i] = s;
        }
    }
    const int chunks = (N + CHUNK - 1) / CHUNK;
    job_t *j = &jobs[(generation + 1) & 1];
    *j = (job_t){kind, N, M, nb, chunks, (size_t)K, bpb, bpb * (size_t)nb, w, x, xsum, y};
    if (threads <= 1 || chunks < 2) {
        for (int c = 0; c < chunks; c++)
            run_chunk(j, c);
    } else {
        start_workers(threads - 1);
        const uint32_t g = ++generation;
        atomic_store(&done, 0);
        atomic_store(&counter, (uint64_t)g << 32);
        atomic_store(&published, g);
        if (atomic_load(&sleepers) > 0) {
            pthread_mutex_lock(&mu);
            pthread_cond_broadcast(&cv);
            pthread_mutex_unlock(&mu);
        }
        take_chunks(g);
        while (atomic_load(&done) < chunks)
            _mm_pause();
    }
    free(xsum);
    return 0;
}

/* ---- step helpers of the fp32 CPU decode ------------------------------------------------------------------
 * One call each for work that costs a dozen small torch operations per layer (each a few microseconds of
 * dispatch on a small CPU, more than the arithmetic): the residual add + RMSNorm, and a Llama attention layer
 * (RoPE of q and k, K/V cache write, causal GQA attention). Each output row is computed by the same operations
 * whatever the number of rows in the call, like the products above. */

static inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* sum = residual + x (when x is not NULL; else sum = residual); norm = w * (sum * 1/sqrt(mean(sum^2) + eps)),
 * rows of D. */
void add_rms_norm_f32(const float *x, const float *residual, const float *w, float eps, int T, int D, float *sum,
                      float *norm) {
    for (int t = 0; t < T; t++) {
        const float *r = residual + (size_t)t * D;
        float *s = sum + (size_t)t * D;
        if (x != NULL) {
            const float *xt = x + (size_t)t * D;
            for (int i = 0; i < D; i++)
                s[i] = r[i] + xt[i];
        } else if (s != r) {
            memcpy(s, r, sizeof(float) * D);
        }
        const float inv = 1.0f / sqrtf(dot(s, s, D) / (float)D + eps);
        float *y = norm + (size_t)t * D;
        for (int i = 0; i < D; i++)
            y[i] = w[i] * (s[i] * inv);
    }
}

/* NeoX (rotate-half) RoPE of one head over its first rd channels (the rest copied). */
static void rope_head(const float *x, float *dst, const float *c, const float *s, int rd, int hd) {
    const int half = rd / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        dst[i] = a * c[i] - b * s[i];
        dst[i + half] = b * c[i + half] + a * s[i + half];
    }
    for (int i = rd; i < hd; i++)
        dst[i] = x[i];
}

/* qkv [T, (H + 2 Hkv) hd] (merged projection rows of positions start..start+T-1), cos/sin [T, rd];
 * kc/vc [max_len, Hkv, hd] (rows start.. are written); out [T, H hd]. scratch: start + T floats.
 * Row t attends to keys 0..start+t; query head h reads KV head h / (H / Hkv). */
void llama_attention_f32(const float *qkv, int T, int H, int Hkv, int hd, const float *cos, const float *sin,
                         int rd, float *kc, float *vc, int start, float scale, float *out, float *scratch) {
    const int qo = H * hd, row = qo + 2 * Hkv * hd, rep = H / Hkv;
    float q[512];
    for (int t = 0; t < T; t++) {
        const float *src = qkv + (size_t)t * row;
        for (int h = 0; h < Hkv; h++) {
            float *kd = kc + ((size_t)(start + t) * Hkv + h) * hd;
            rope_head(src + qo + h * hd, kd, cos + (size_t)t * rd, sin + (size_t)t * rd, rd, hd);
            memcpy(vc + ((size_t)(start + t) * Hkv + h) * hd, src + qo + Hkv * hd + h * hd, sizeof(float) * hd);
        }
    }
    for (int t = 0; t < T; t++) {
        const int L = start + t + 1;
        for (int h = 0; h < H; h++) {
            const int g = h / rep;
            rope_head(qkv + (size_t)t * row + h * hd, q, cos + (size_t)t * rd, sin + (size_t)t * rd, rd, hd);
            float m = -INFINITY;
            for (int j = 0; j < L; j++) {
                const float s = dot(q, kc + ((size_t)j * Hkv + g) * hd, hd) * scale;
                scratch[j] = s;
                m = s > m ? s : m;
            }
            float total = 0.0f;
            for (int j = 0; j < L; j++) {
                scratch[j] = expf(scratch[j] - m);
                total += scratch[j];
            }
            float *o = out + (size_t)t * qo + h * hd;
            memset(o, 0, sizeof(float) * hd);
            for (int j = 0; j < L; j++) {
                const float p = scratch[j];
                const float *v = vc + ((size_t)j * Hkv + g) * hd;
                for (int i = 0; i < hd; i++)
                    o[i] += p * v[i];
            }
            const float inv = 1.0f / total;
            for (int i = 0; i < hd; i++)
                o[i] *= inv;
        }
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i] (SwiGLU of the merged gate/up projection rows). */
void silu_mul_f32(const float *gate_up, int T, int I, float *out) {
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + (size_t)t * 2 * I, *u = g + I;
        float *o = out + (size_t)t * I;
        for (int i = 0; i < I; i++)
            o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
