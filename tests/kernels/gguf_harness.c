/* Test harness of the compiled CPU path: runs one kernel (or a whole greedy generation) on inputs read from a file
 * and writes the outputs to another, so the same inputs can go through the x86 build and, cross-compiled for
 * AArch64, the NEON build under qemu-user (tests/kernels/test_cpu_isa.py). Linked statically with the same sources
 * as the library (edgespec/kernels/cpu/gguf_cpu.c, gguf_kernels.c per ISA).
 *
 *   harness isa                                          prints the kernels in use
 *   harness matmul IN OUT kind N K M                     IN: W bytes, x [M, K] -> OUT: y [M, N]
 *   harness rows IN OUT kind N K n                       IN: W bytes, idx [n] int64 -> OUT: [n, K]
 *   harness norm IN OUT T D eps                          IN: x, r [T, D], w [D] -> OUT: s, y
 *   harness silu IN OUT T I                              IN: gate_up [T, 2I] -> OUT: [T, I]
 *   harness attn IN OUT T H Hkv hd rd start len scale eps norms causal bias
 *        IN: qkv [T, (H+2Hkv)hd], cos, sin [T, rd], (norms: q_norm, k_norm [hd]), (bias: [T, start+T]),
 *        kc, vc [len, Hkv, hd] -> OUT: out [T, H hd], kc, vc
 *   harness greedy MODEL OUT n_new threads               MODEL: a stack dump (write_stack_dump in the test) ->
 *        OUT: n_new int32 greedy tokens after the dump's prompt
 * Every command accepts an ISA name as a last argument (else the best one).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_cpu.h"
#include "gguf_isa.h"

static void *slurp(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        perror(path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    *size = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = malloc(*size + 64);
    if (buf == NULL || fread(buf, 1, *size, f) != *size) {
        fprintf(stderr, "%s: read failed\n", path);
        exit(2);
    }
    fclose(f);
    return buf;
}

static void spill(const char *path, const void *a, size_t na, const void *b, size_t nb, const void *c, size_t nc) {
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(a, 1, na, f) != na || (nb && fwrite(b, 1, nb, f) != nb) ||
        (nc && fwrite(c, 1, nc, f) != nc)) {
        perror(path);
        exit(2);
    }
    fclose(f);
}

static size_t row_bytes(int kind, int K) { return gguf_block_bytes(kind) * (size_t)(K / gguf_block_weights(kind)); }

/* A reader over the stack dump: little-endian int32 / float32 fields and raw arrays, in the order written. */
typedef struct {
    const uint8_t *p;
} cursor;
static int take_int(cursor *c) { int v; memcpy(&v, c->p, 4); c->p += 4; return v; }
static float take_float(cursor *c) { float v; memcpy(&v, c->p, 4); c->p += 4; return v; }
static const void *take(cursor *c, size_t bytes) { const void *r = c->p; c->p += bytes; return r; }
static gguf_weight_t take_weight(cursor *c) {
    gguf_weight_t w;
    w.kind = take_int(c);
    w.N = take_int(c);
    w.K = take_int(c);
    w.bias = take_int(c) ? take(c, sizeof(float) * (size_t)w.N) : NULL;
    w.data = take(c, row_bytes(w.kind, w.K) * (size_t)w.N);
    return w;
}

static int argmax(const float *v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

/* Dump: magic, n_layers D H Hkv hd I rd vocab max_len n_prompt, eps scale, cos sin [max_len, rd], final_norm,
 * embed weight, head weight, per layer (in_norm post_norm has_qk [q_norm k_norm] qkv o gate_up down), prompt. */
static int greedy(const char *model, const char *out, int n_new, int threads) {
    size_t size;
    const uint8_t *buf = slurp(model, &size);
    cursor c = {buf};
    if (memcmp(take(&c, 4), "ESGS", 4) != 0) {
        fprintf(stderr, "%s: not a stack dump\n", model);
        return 2;
    }
    gguf_stack_t s;
    s.n_layers = take_int(&c);
    s.D = take_int(&c);
    s.H = take_int(&c);
    s.Hkv = take_int(&c);
    s.hd = take_int(&c);
    s.I = take_int(&c);
    s.rd = take_int(&c);
    const int vocab = take_int(&c), max_len = take_int(&c), n_prompt = take_int(&c);
    s.eps = take_float(&c);
    s.scale = take_float(&c);
    const float *cos = take(&c, sizeof(float) * (size_t)max_len * s.rd);
    const float *sin = take(&c, sizeof(float) * (size_t)max_len * s.rd);
    s.final_norm = take(&c, sizeof(float) * (size_t)s.D);
    const gguf_weight_t embed = take_weight(&c), head = take_weight(&c);
    gguf_layer_t *layers = calloc((size_t)s.n_layers, sizeof *layers);
    for (int i = 0; i < s.n_layers; i++) {
        layers[i].in_norm = take(&c, sizeof(float) * (size_t)s.D);
        layers[i].post_norm = take(&c, sizeof(float) * (size_t)s.D);
        if (take_int(&c)) {
            layers[i].q_norm = take(&c, sizeof(float) * (size_t)s.hd);
            layers[i].k_norm = take(&c, sizeof(float) * (size_t)s.hd);
        }
        layers[i].qkv = take_weight(&c);
        layers[i].o = take_weight(&c);
        layers[i].gate_up = take_weight(&c);
        layers[i].down = take_weight(&c);
        layers[i].causal = 1;
    }
    s.layers = layers;
    const int *prompt = take(&c, sizeof(int) * (size_t)n_prompt);
    if ((size_t)(c.p - buf) != size || n_prompt + n_new > max_len || gguf_stack_check(&s) != 0) {
        fprintf(stderr, "%s: inconsistent dump\n", model);
        return 2;
    }
    const size_t kv = (size_t)max_len * s.Hkv * s.hd;
    float **kc = malloc(sizeof(float *) * s.n_layers), **vc = malloc(sizeof(float *) * s.n_layers);
    for (int i = 0; i < s.n_layers; i++) {
        kc[i] = calloc(kv, sizeof(float));
        vc[i] = calloc(kv, sizeof(float));
    }
    float *h = malloc(sizeof(float) * (size_t)n_prompt * s.D), *hidden = malloc(sizeof(float) * (size_t)n_prompt * s.D);
    float *logits = malloc(sizeof(float) * (size_t)vocab);
    int *tokens = malloc(sizeof(int) * (size_t)n_new);
    int start = 0, T = n_prompt;
    int64_t idx[4096];
    for (int t = 0; t < T; t++)
        idx[t] = prompt[t];
    for (int step = 0; step < n_new; step++) {
        if (gguf_rows(embed.kind, embed.data, embed.N, embed.K, idx, T, h) != 0 ||
            gguf_stack_forward(&s, kc, vc, start, T, cos + (size_t)start * s.rd, sin + (size_t)start * s.rd, NULL, h,
                               NULL, 0, NULL, hidden, threads) != 0 ||
            gguf_matmul(head.kind, head.data, head.N, head.K, hidden + (size_t)(T - 1) * s.D, 1, logits, threads) != 0) {
            fprintf(stderr, "forward failed at step %d\n", step);
            return 2;
        }
        tokens[step] = argmax(logits, vocab);
        start += T;
        T = 1;
        idx[0] = tokens[step];
    }
    spill(out, tokens, sizeof(int) * (size_t)n_new, NULL, 0, NULL, 0);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: harness isa | matmul | rows | norm | silu | attn | greedy ...\n");
        return 2;
    }
    const char *cmd = argv[1];
    const int want[] = {['i'] = 2, ['m'] = 8, ['r'] = 8, ['n'] = 7, ['s'] = 6, ['a'] = 16, ['g'] = 6};
    const int n = want[(unsigned char)cmd[0]];
    if (n == 0 || argc < n) {
        fprintf(stderr, "%s: wrong arguments\n", cmd);
        return 2;
    }
    if (argc > n && gguf_use_isa(argv[n]) != 0) {
        fprintf(stderr, "ISA %s not available here\n", argv[n]);
        return 3;
    }
    if (strcmp(cmd, "isa") == 0) {
        printf("%s\n", gguf_isa());
        return 0;
    }
    if (strcmp(cmd, "greedy") == 0)
        return greedy(argv[2], argv[3], atoi(argv[4]), atoi(argv[5]));
    size_t size;
    const uint8_t *in = slurp(argv[2], &size);
    const char *out = argv[3];
    if (strcmp(cmd, "matmul") == 0 || strcmp(cmd, "rows") == 0) {
        const int kind = atoi(argv[4]), N = atoi(argv[5]), K = atoi(argv[6]), M = atoi(argv[7]);
        const size_t wb = row_bytes(kind, K) * (size_t)N;
        const int rows = cmd[0] == 'r';
        float *y = malloc(sizeof(float) * (size_t)M * (rows ? K : N));
        const int rc = rows ? gguf_rows(kind, in, N, K, (const int64_t *)(in + wb), M, y)
                            : gguf_matmul(kind, in, N, K, (const float *)(in + wb), M, y, 2);
        if (rc != 0)
            return 4;
        spill(out, y, sizeof(float) * (size_t)M * (rows ? K : N), NULL, 0, NULL, 0);
    } else if (strcmp(cmd, "norm") == 0) {
        const int T = atoi(argv[4]), D = atoi(argv[5]);
        const float *x = (const float *)in, *r = x + (size_t)T * D, *w = r + (size_t)T * D;
        float *s = malloc(sizeof(float) * (size_t)T * D), *y = malloc(sizeof(float) * (size_t)T * D);
        add_rms_norm_f32(x, r, w, (float)atof(argv[6]), T, D, s, y);
        spill(out, s, sizeof(float) * (size_t)T * D, y, sizeof(float) * (size_t)T * D, NULL, 0);
    } else if (strcmp(cmd, "silu") == 0) {
        const int T = atoi(argv[4]), I = atoi(argv[5]);
        float *o = malloc(sizeof(float) * (size_t)T * I);
        silu_mul_f32((const float *)in, T, I, o);
        spill(out, o, sizeof(float) * (size_t)T * I, NULL, 0, NULL, 0);
    } else if (strcmp(cmd, "attn") == 0) {
        const int T = atoi(argv[4]), H = atoi(argv[5]), Hkv = atoi(argv[6]), hd = atoi(argv[7]), rd = atoi(argv[8]);
        const int start = atoi(argv[9]), len = atoi(argv[10]), norms = atoi(argv[13]), causal = atoi(argv[14]);
        const float *qkv = (const float *)in, *cos = qkv + (size_t)T * (H + 2 * Hkv) * hd, *sin = cos + (size_t)T * rd;
        const float *qn = norms ? sin + (size_t)T * rd : NULL, *kn = norms ? qn + hd : NULL;
        const float *bias = atoi(argv[15]) ? sin + (size_t)T * rd + (norms ? 2 * hd : 0) : NULL;
        const float *cache = sin + (size_t)T * rd + (norms ? 2 * hd : 0) + (bias ? (size_t)T * (start + T) : 0);
        const size_t kv = (size_t)len * Hkv * hd;
        float *kc = malloc(sizeof(float) * kv), *vc = malloc(sizeof(float) * kv);
        memcpy(kc, cache, sizeof(float) * kv);
        memcpy(vc, cache + kv, sizeof(float) * kv);
        float *o = malloc(sizeof(float) * (size_t)T * H * hd);
        if (block_attention_f32(qkv, T, H, Hkv, hd, cos, sin, rd, qn, kn, (float)atof(argv[12]), kc, vc, start,
                                causal, bias, (float)atof(argv[11]), o, 2) != 0)
            return 4;
        spill(out, o, sizeof(float) * (size_t)T * H * hd, kc, sizeof(float) * kv, vc, sizeof(float) * kv);
    } else {
        fprintf(stderr, "unknown command %s\n", cmd);
        return 2;
    }
    return 0;
}
