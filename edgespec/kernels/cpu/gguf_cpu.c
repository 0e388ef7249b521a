/* The compiled CPU path: products of GGUF-block (Q4_0 / Q4_1 / Q8_0, K-quant Q4_K / Q5_K / Q6_K) and dense
 * (F32 / F16 / BF16) weights with fp32 activations, the small per-layer steps, and the whole Llama/Qwen3 layer
 * stack of a forward in one call, on a thread pool of its own.
 *
 * Built by edgespec.kernels.cpu.gguf_native and called through ctypes. This file is the portable driver (compiled
 * without ISA flags, so it runs on any CPU of its architecture); the arithmetic lives in gguf_kernels.c, compiled
 * once per instruction set (AVX-512, AVX2, NEON, portable C). gguf_isa() picks the best one this CPU and OS
 * support at first use (gguf_use_isa overrides it, for tests and A/B runs), so a build never executes an
 * instruction the CPU lacks. Every ISA computes the same IEEE operations in the same order (gguf_kernels.c), so
 * outputs are identical across ISAs, row counts and thread counts: a verify row rounds exactly like a plain
 * decode step of the same token (speculative == plain), and an Arm run equals an x86 run.
 *
 * GGUF weights are the file's own bytes: row n of an [N, K] matrix is K/32 consecutive blocks
 *   Q4_0: fp16 d, 16 bytes of nibbles          w = d * (q - 8)
 *   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
 *   Q8_0: fp16 d, 32 int8                      w = d * q
 * (byte j of the nibbles holds weight j in its low and weight j + 16 in its high nibble); K-quants in
 * edgespec/weights/gguf_kquants.py.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_cpu.h"
#include "gguf_isa.h"

/* ---- instruction set ---------------------------------------------------------------------------------------- */
static const gguf_isa_t *isa_table;

static const gguf_isa_t *best_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    /* __builtin_cpu_supports reports AVX / AVX-512 only where the OS saves their registers too */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return &gguf_isa_avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return &gguf_isa_avx2;
#elif defined(__aarch64__)
    return &gguf_isa_neon; /* AdvSIMD is part of the AArch64 base architecture */
#endif
    return &gguf_isa_scalar;
}

static const gguf_isa_t *isa(void) {
    if (isa_table == NULL)
        isa_table = best_isa();
    return isa_table;
}

/* The name of the kernels in use: "avx512", "avx2", "neon" or "scalar". */
const char *gguf_isa(void) { return isa()->name; }

/* Use the kernels of `name` from now on; 0, or -1 when they are not built in or this CPU cannot run them. */
int gguf_use_isa(const char *name) {
    const gguf_isa_t *best = best_isa();
    const gguf_isa_t *all[] = {
        &gguf_isa_scalar,
#if defined(__x86_64__)
        &gguf_isa_avx2, &gguf_isa_avx512,
#elif defined(__aarch64__)
        &gguf_isa_neon,
#endif
    };
    int rank_best = 0, rank_want = -1;
    for (int i = 0; i < (int)(sizeof all / sizeof all[0]); i++) {
        if (all[i] == best)
            rank_best = i;
        if (strcmp(all[i]->name, name) == 0)
            rank_want = i;
    }
    if (rank_want < 0 || rank_want > rank_best) /* the list is ordered: each ISA needs the ones before it */
        return -1;
    isa_table = all[rank_want];
    return 0;
}

/* ---- threads ----------------------------------------------------------------------------------------------
 * A job is split into tasks (chunks of output rows, attention heads) that the calling thread and the pool's
 * workers take from a shared counter. The caller never waits for a worker to *arrive* (OpenMP's barrier did: on a
 * shared, oversubscribed machine every product then waited for a descheduled thread, one time slice each); it
 * waits only for tasks a worker has actually taken. Idle workers spin briefly (the next job follows within
 * microseconds during a forward), then sleep on a condition variable.
 *
 * The counter holds (generation << 32 | next task). A job's parameters live in jobs[generation & 1]; the caller
 * fills the other slot only after every task of the current job is done, and a worker uses a slot only after a
 * compare-and-swap on the counter proves the generation it read the slot under is still current.
 *
 * Pinning (gguf_set_pinning, on by default): worker i runs on the i-th CPU this process may use (i >= 1), so the
 * workers never share a core while another sits idle, and each keeps its caches. The caller is left free: a
 * thread's affinity is inherited by the threads and processes it starts (a server's, a benchmark's peer), which
 * would all be held to one core. */
typedef void (*task_fn)(const void *ctx, int task, int worker);
typedef struct {
    task_fn fn;
    const void *ctx;
    int tasks;
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
static int pinning = 1;
#define SPIN 20000

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Pin the calling thread to the slot-th CPU of the process's affinity mask (modulo its size). */
static void pin_to(int slot) {
    cpu_set_t allowed, one;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
        return;
    const int n = CPU_COUNT(&allowed);
    if (n <= 1)
        return;
    for (int cpu = 0, seen = 0; cpu < CPU_SETSIZE; cpu++) {
        if (!CPU_ISSET(cpu, &allowed))
            continue;
        if (seen++ == slot % n) {
            CPU_ZERO(&one);
            CPU_SET(cpu, &one);
            pthread_setaffinity_np(pthread_self(), sizeof one, &one);
            return;
        }
    }
}

/* Take and run tasks of generation g until none is left (or a newer job replaced it). */
static void take_tasks(uint32_t g, int worker) {
    for (;;) {
        uint64_t v = atomic_load(&counter);
        if ((uint32_t)(v >> 32) != g)
            return;
        const job_t *j = &jobs[g & 1];
        const int t = (int)(uint32_t)v, tasks = j->tasks;
        const task_fn fn = j->fn;
        const void *ctx = j->ctx;
        if (t >= tasks)
            return;
        if (!atomic_compare_exchange_weak(&counter, &v, v + 1))
            continue;
        fn(ctx, t, worker);
        atomic_fetch_add(&done, 1);
    }
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    if (pinning)
        pin_to(id);
    uint32_t seen = atomic_load(&published);
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = atomic_load(&published)) == seen) {
            if (++spins < SPIN) {
                cpu_relax();
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
        take_tasks(g, id);
    }
    return NULL;
}

static void start_workers(int want) {
    for (; workers < want; workers++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
    }
}

/* Pin the pool's workers (on = 1, the default) or leave them to the scheduler; applies to workers started later. */
void gguf_set_pinning(int on) { pinning = on != 0; }

/* Run fn(ctx, task, worker) for tasks 0 .. tasks-1 on `threads` threads (the caller is worker 0; worker ids stay
 * below gguf_pool_slots()). Not reentrant: one job at a time (the model runs one forward at a time). */
static void run_tasks(task_fn fn, const void *ctx, int tasks, int threads) {
    if (threads <= 1 || tasks < 2) {
        for (int t = 0; t < tasks; t++)
            fn(ctx, t, 0);
        return;
    }
    start_workers(threads - 1);
    job_t *j = &jobs[(generation + 1) & 1];
    *j = (job_t){fn, ctx, tasks};
    const uint32_t g = ++generation;
    atomic_store(&done, 0);
    atomic_store(&counter, (uint64_t)g << 32);
    atomic_store(&published, g);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&mu);
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
    }
    take_tasks(g, 0);
    while (atomic_load(&done) < tasks)
        cpu_relax();
}

/* Worker ids a job of `threads` threads may see: per-worker scratch is sized by this. */
static int pool_slots(int threads) { return (threads > workers + 1 ? threads : workers + 1); }

/* ---- products ----------------------------------------------------------------------------------------------- */
/* A product's output rows are split into TASKS_PER_THREAD tasks per thread (of at least MIN_ROWS rows, a multiple of
 * 16): few enough that taking a task (an atomic on a shared line) stays far below its work even on the demo's
 * 576-row matrices (16-row tasks spent more time in the counter than in the product), enough that a thread the
 * scheduler holds back leaves its share to the others. */
#ifndef TASKS_PER_THREAD
#define TASKS_PER_THREAD 2
#endif
#define MIN_ROWS 16

typedef struct {
    int kind, N, K, M, rows;
    size_t row_bytes;
    const uint8_t *w;
    const float *x;
    float *y;
} product_job;

static void product_task(const void *ctx, int c, int worker) {
    (void)worker;
    const product_job *p = ctx;
    const int n0 = c * p->rows, n1 = n0 + p->rows < p->N ? n0 + p->rows : p->N;
    isa()->product(p->kind, p->w, p->row_bytes, p->K, p->x, p->M, p->y, (size_t)p->N, n0, n1);
}

static int product_shape_ok(int kind, int K) {
    return gguf_block_bytes(kind) != 0 && K > 0 && K % gguf_block_weights(kind) == 0;
}

static void product_run(int kind, const void *w, int N, int K, const float *x, int M, float *y, int threads) {
    const int parts = threads > 1 ? threads * TASKS_PER_THREAD : 1;
    int rows = (N + parts - 1) / parts;
    rows = rows < MIN_ROWS ? MIN_ROWS : (rows + 15) / 16 * 16;
    const product_job p = {kind, N, K, M, rows, gguf_block_bytes(kind) * (size_t)(K / gguf_block_weights(kind)), w,
                           x, y};
    run_tasks(product_task, &p, (N + rows - 1) / rows, threads);
}

/* y[M, N] = x[M, K] @ W[N, K]^T with W in ggml type `kind`, on `threads` threads. Returns 0, or -1 for a type
 * without a product or a K that is not a whole number of its blocks. */
int gguf_matmul(int kind, const uint8_t *w, int N, int K, const float *x, int M, float *y, int threads) {
    if (!product_shape_ok(kind, K))
        return -1;
    product_run(kind, w, N, K, x, M, y, threads);
    return 0;
}

/* out[r, :] = row idx[r] of W [N, K] decoded to fp32 (an embedding lookup); 0, or -1 for a type without a
 * decoder, a K that is not a whole number of its blocks, or an index outside 0 .. N-1. */
int gguf_rows(int kind, const uint8_t *w, int N, int K, const int64_t *idx, int n, float *out) {
    if (!product_shape_ok(kind, K))
        return -1;
    for (int r = 0; r < n; r++)
        if (idx[r] < 0 || idx[r] >= N)
            return -1;
    isa()->decode_rows(kind, w, gguf_block_bytes(kind) * (size_t)(K / gguf_block_weights(kind)), K, idx, n, out);
    return 0;
}

/* ---- step helpers ------------------------------------------------------------------------------------------- */
/* sum = residual + x (x NULL: sum = residual); norm = w * (sum / sqrt(mean(sum^2) + eps)), T rows of D. */
void add_rms_norm_f32(const float *x, const float *residual, const float *w, float eps, int T, int D, float *sum,
                      float *norm) {
    isa()->add_rms_norm(x, residual, w, eps, T, D, sum, norm);
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i] (SwiGLU of the merged gate/up projection rows). */
void silu_mul_f32(const float *gate_up, int T, int I, float *out) { isa()->silu_mul(gate_up, T, I, out); }

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

/* Attention of one layer: shapes and pointers shared by its tasks. */
typedef struct {
    const float *qkv, *cos, *sin, *q_norm, *k_norm, *bias;
    const float *kc, *vc;
    float *out, *scratch;
    int T, H, Hkv, hd, rd, kv_row, causal;
    size_t scratch_floats; /* per worker */
    float scale, eps;
} attn_job;

/* q/k norm (Qwen3: w * x̂ per head; NULL: none) then RoPE of one head, into dst. */
static void norm_rope_head(const float *x, const float *norm, float eps, const float *c, const float *s, int rd,
                           int hd, float *dst, float *tmp) {
    if (norm != NULL) {
        isa()->add_rms_norm(NULL, x, norm, eps, 1, hd, tmp, tmp);
        x = tmp;
    }
    rope_head(x, dst, c, s, rd, hd);
}

static void attn_task(const void *ctx, int task, int worker) {
    const attn_job *a = ctx;
    const int t = task / a->H, h = task % a->H, rep = a->H / a->Hkv;
    const int row = (a->H + 2 * a->Hkv) * a->hd, keys = a->kv_row + a->T;
    float *scratch = a->scratch + a->scratch_floats * (size_t)worker;
    float *q = scratch, *tmp = scratch + a->hd, *scores = scratch + 2 * a->hd;
    const size_t stride = (size_t)a->Hkv * a->hd;
    norm_rope_head(a->qkv + (size_t)t * row + (size_t)h * a->hd, a->q_norm, a->eps, a->cos + (size_t)t * a->rd,
                   a->sin + (size_t)t * a->rd, a->rd, a->hd, q, tmp);
    const int g = h / rep;
    isa()->attend(q, a->kc + (size_t)g * a->hd, a->vc + (size_t)g * a->hd, stride,
                  a->causal ? a->kv_row + t + 1 : keys, a->hd, a->scale,
                  a->bias == NULL ? NULL : a->bias + (size_t)t * keys, scores,
                  a->out + (size_t)t * a->H * a->hd + (size_t)h * a->hd);
}

int block_attention_f32(const float *qkv, int T, int H, int Hkv, int hd, const float *cos, const float *sin, int rd,
                        const float *q_norm, const float *k_norm, float eps, float *kc, float *vc, int kv_row,
                        int causal, const float *bias, float scale, float *out, int threads) {
    if (hd % 16 || hd > 512 || H % Hkv)
        return -1;
    const int row = (H + 2 * Hkv) * hd, qo = H * hd;
    float tmp[512];
    for (int t = 0; t < T; t++) {
        const float *src = qkv + (size_t)t * row;
        for (int h = 0; h < Hkv; h++) {
            float *kd = kc + ((size_t)(kv_row + t) * Hkv + h) * hd;
            norm_rope_head(src + qo + h * hd, k_norm, eps, cos + (size_t)t * rd, sin + (size_t)t * rd, rd, hd, kd,
                           tmp);
            memcpy(vc + ((size_t)(kv_row + t) * Hkv + h) * hd, src + qo + Hkv * hd + h * hd, sizeof(float) * hd);
        }
    }
    const int slots = pool_slots(threads);
    const size_t per = 2 * (size_t)hd + (size_t)(kv_row + T) + 16;
    float *scratch = malloc(sizeof(float) * per * (size_t)slots);
    if (scratch == NULL)
        return -2;
    const attn_job a = {qkv, cos, sin, q_norm, k_norm, bias, kc, vc, out, scratch, T, H, Hkv, hd, rd, kv_row,
                        causal, per, scale, eps};
    /* a short context's heads cost less than waking the pool */
    run_tasks(attn_task, &a, T * H, T * H * (kv_row + T) >= 1024 ? threads : 1);
    free(scratch);
    return 0;
}

/* RoPE (after the q/k norms when given) of the merged projection rows qkv [T, (H + 2 Hkv) hd] of positions
 * start .. start+T-1, their K/V written to kc/vc [max_len, Hkv, hd], and causal GQA attention: row t attends to
 * keys 0 .. start+t, query head h reads KV head h / (H / Hkv). cos/sin [T, rd]; out [T, H hd]. Returns 0, -1 for a
 * head size that is not a multiple of 16, -2 when out of memory. */
int llama_attention_f32(const float *qkv, int T, int H, int Hkv, int hd, const float *cos, const float *sin, int rd,
                        const float *q_norm, const float *k_norm, float eps, float *kc, float *vc, int start,
                        float scale, float *out, int threads) {
    return block_attention_f32(qkv, T, H, Hkv, hd, cos, sin, rd, q_norm, k_norm, eps, kc, vc, start, 1, NULL, scale,
                               out, threads);
}

/* ---- the layer stack ---------------------------------------------------------------------------------------
 * A Llama / Qwen3 decoder stack (pre-norm attention + SwiGLU MLP per layer) for T rows in one call: the products,
 * norms and attention above, in the order and with the residual bookkeeping of edgespec.models.decoder
 * (DecoderLayer: each residual add fused into the next norm), so its outputs equal the per-layer path's bit for
 * bit. Python describes the model once (gguf_weight_t / gguf_layer_t / gguf_stack_t, edgespec.models.cpu_stack). */
/* (gguf_weight_t, gguf_layer_t, gguf_stack_t: gguf_cpu.h) */
static void linear_rows(const gguf_weight_t *w, const float *x, int T, float *y, int threads) {
    product_run(w->kind, w->data, w->N, w->K, x, T, y, threads);
    if (w->bias != NULL)
        for (int t = 0; t < T; t++)
            isa()->add(y + (size_t)t * w->N, w->bias, w->N, y + (size_t)t * w->N);
}

static int weight_ok(const gguf_weight_t *w, int N, int K) {
    return w->N == N && w->K == K && product_shape_ok(w->kind, K) && w->data != NULL;
}

/* Check a stack description; 0 when every weight has the shape and a format the products read. */
int gguf_stack_check(const gguf_stack_t *s) {
    if (s->hd % 16 || s->hd > 512 || s->H % s->Hkv || s->rd % 2 || s->rd > s->hd)
        return -1;
    const int q = (s->H + 2 * s->Hkv) * s->hd;
    for (int i = 0; i < s->n_layers; i++) {
        const gguf_layer_t *l = &s->layers[i];
        if (!weight_ok(&l->qkv, q, s->D) || !weight_ok(&l->o, s->D, s->H * s->hd) ||
            !weight_ok(&l->gate_up, 2 * s->I, s->D) || !weight_ok(&l->down, s->D, s->I))
            return -1 - i;
    }
    return 0;
}

/* h [T, D]: the rows' embeddings (overwritten: the residual stream). kc[i] / vc[i]: layer i's keys/values
 * [rows, Hkv, hd]; rows kv_row .. kv_row+T-1 are written with this call's (a decoder's KV cache: kv_row = the
 * position of row 0; a DFlash block: the window's scratch rows after its kv_row keys). cos/sin [T, rd]. bias: NULL,
 * or per layer NULL or [T, kv_row + T] added to the scores (masks). taps [T, n_taps, D]: the output of layer
 * tap_ids[j] goes to taps[:, j] (tap_ids ascending). hidden [T, D]: the final-normed rows. Returns 0, -1 for a
 * description gguf_stack_check refuses, -2 when out of memory. */
int gguf_stack_forward(const gguf_stack_t *s, float *const *kc, float *const *vc, int kv_row, int T,
                       const float *cos, const float *sin, const float *const *bias, float *h, const int *tap_ids,
                       int n_taps, float *taps, float *hidden, int threads) {
    if (gguf_stack_check(s) != 0)
        return -1;
    const int D = s->D, q = (s->H + 2 * s->Hkv) * s->hd, ao = s->H * s->hd, I = s->I;
    const size_t rows = (size_t)T;
    const size_t floats = rows * (2 * (size_t)D + q + ao + 3 * (size_t)I + D);
    float *buf = malloc(sizeof(float) * floats);
    if (buf == NULL)
        return -2;
    float *x = buf, *delta = x + rows * D, *qkv = delta + rows * D, *att = qkv + rows * q, *gu = att + rows * ao,
          *act = gu + rows * 2 * I;
    int next_tap = 0, rc = 0;
    for (int i = 0; i < s->n_layers && rc == 0; i++) {
        const gguf_layer_t *l = &s->layers[i];
        isa()->add_rms_norm(i == 0 ? NULL : delta, h, l->in_norm, s->eps, T, D, h, x);
        linear_rows(&l->qkv, x, T, qkv, threads);
        rc = block_attention_f32(qkv, T, s->H, s->Hkv, s->hd, cos, sin, s->rd, l->q_norm, l->k_norm, s->eps, kc[i],
                                 vc[i], kv_row, l->causal, bias == NULL ? NULL : bias[i], s->scale, att, threads);
        linear_rows(&l->o, att, T, delta, threads);
        isa()->add_rms_norm(delta, h, l->post_norm, s->eps, T, D, h, x);
        linear_rows(&l->gate_up, x, T, gu, threads);
        isa()->silu_mul(gu, T, I, act);
        linear_rows(&l->down, act, T, delta, threads);
        for (; next_tap < n_taps && tap_ids[next_tap] == i; next_tap++)
            for (int t = 0; t < T; t++)
                isa()->add(h + (size_t)t * D, delta + (size_t)t * D, D, taps + ((size_t)t * n_taps + next_tap) * D);
    }
    if (rc == 0)
        isa()->add_rms_norm(s->n_layers > 0 ? delta : NULL, h, s->final_norm, s->eps, T, D, h, hidden);
    free(buf);
    return rc;
}
