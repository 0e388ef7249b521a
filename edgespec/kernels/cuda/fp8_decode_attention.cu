// One-row (decode) GQA attention over an FP8 (e4m3) KV cache with per-(token, head) scales, in CUDA.
//
// Contract: edgespec.kernels.attention.attention_ref on the dequantised cache, for T = 1 query row per head, with
// the split-K output format of edgespec/kernels/triton_attention.py (normalised partials + log2-sum-exp per
// split, merged by its _attn_combine_kernel).
//
// Why a CUDA kernel next to the Triton one: the P.V product reduces over keys, and the cache stores V key-major
// (one row of head_dim bytes per key), so every mma fragment of V needs bytes from several key rows. Triton's
// code generation for that reads V from shared memory one byte at a time and spends ~80 warp instructions per
// key; the kernel was bound by that work, not by memory (2.2 TB/s). Here the fragments are laid out by hand:
//
// * Both products run "transposed" with the query heads of one KV head (group G <= 8) as the mma's N = 8
//   columns, so no tensor-core work is spent on padding rows and the output accumulator has no padding:
//     S^T [16 keys, 8 heads]  = K [16 keys, hd] . Q^T [hd, 8 heads]        (A = K rows, B = Q, kept in registers)
//     O^T [hd, 8 heads]      += V^T [hd, 16 keys] . P^T [16 keys, 8 heads] (A = V, B = P)
// * The reduction index of a product may be permuted freely as long as both operands agree. For Q.K^T the
//   head_dim order is chosen so that a thread's four bytes of every k-step are contiguous: a K fragment is one
//   16-byte shared-memory load converted by cvt.e4m3x2 -> f16x2, never a byte load. For P.V the output rows
//   (head_dim) are permuted so that a thread's head_dim bytes of one key are contiguous; the two keys an A
//   register pairs are interleaved with one byte permute (prmt), then converted.
// * P leaves the S^T accumulator as [keys, heads] but is needed as the B operand [keys, heads] with the other
//   thread mapping: one movmatrix.trans per 8x8 block moves it, instead of a round trip through shared memory.
// * Each warp streams its own 16-key blocks through a private cp.async ring (no block-wide barrier in the main
//   loop); the warps of a block interleave over one contiguous key range and merge in shared memory at the end,
//   so one block writes one partial like a Triton program does.
//
// Scales: K scales multiply the logits (s = q.k_n * ks_n * qk_scale), V scales the probabilities relative to the
// largest v scale the warp has seen (p_n * vs_n / c, in [0, 1]: fp16-safe), with c carried in the accumulator's
// factor like the Triton kernel's V_SCALE "tile" mode (which uses each tile's own largest scale).

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kKeys = 16;            // keys per block: the M of the Q.K^T mma, the K of the P.V one
constexpr float kNegBig = -1.0e30f;  // finite stand-in for -inf in the running max (exp2(-inf - m) = 0, no NaN)
#define NEG_INF __int_as_float(0xff800000)

struct Params {
  const __nv_bfloat16* q;            // [1, Hq, hd]
  const uint8_t* k;                  // [N, Hkv, hd] e4m3 bytes
  const uint8_t* v;
  const float* ks;                   // [N, Hkv]
  const float* vs;
  const void* start_ptr;             // one int32/int64 on the device, or null: use start
  float* o_part;                     // [splits, 1, Hq, hd], normalised
  float* lse_part;                   // [splits, 1, Hq], log2-sum-exp (kNegBig: no key seen)
  long long stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_sn, stride_sh;
  long long stride_ps, stride_ph, stride_ls;
  float qk_scale;                    // softmax scale * log2(e)
  int start, start_is_64, n_splits, group;
};

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair16) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair16 & 0xFFFFu), __NV_E4M3);
  return (static_cast<uint32_t>(h.y) << 16) | h.x;   // low byte -> low half
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// D = A.B + D, m16n8k16, fp16 in, fp32 accumulate.
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_max_over_rows(float x) {   // over lanes that differ in bits 2..4 (row r)
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

__device__ __forceinline__ float warp_sum_over_rows(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int bytes, int src_bytes) {
  uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(gmem), "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(dst), "l"(gmem), "r"(src_bytes));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// 16-byte chunk swizzle of a key row in shared memory: the K reads (rows r, r+8; chunks 4c + t) and the V reads
// (rows 2t.., chunk r) of a quarter warp then hit eight different bank groups.
__device__ __forceinline__ int swizzle(int row) { return (((row >> 1) & 3) << 1) ^ ((row & 1) << 2); }

template <int HD>
struct Slot {                        // one 16-key block of one warp's ring
  uint8_t k[kKeys * HD];
  uint8_t v[kKeys * HD];
  float ks[kKeys];
  float vs[kKeys];
};

// LOADS_ONLY (a measuring aid, tools/attn_overhead_probe.py): stream the cache through the ring and skip all
// arithmetic, which times the memory side of the kernel alone (its output is zeros).
template <int HD, int NW, int STAGES, bool LOADS_ONLY>
__global__ void __launch_bounds__(NW * 32)
fp8_decode_attention_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");   // PDL: the predecessor's writes are visible
#endif
  constexpr int CH = HD / 16;        // 16-byte chunks per key row
  constexpr int KSTEPS = HD / 16;    // k-steps of Q.K^T, and output tiles of P.V
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Slot<HD>* ring = reinterpret_cast<Slot<HD>*>(smem_raw);

  const int split = blockIdx.x, kvh = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 2, t = lane & 3;          // mma fragment row group / thread in group
  Slot<HD>* my_ring = ring + warp * STAGES;

  int start = p.start;
  if (p.start_ptr != nullptr) {
    start = p.start_is_64 ? static_cast<int>(*static_cast<const long long*>(p.start_ptr))
                          : *static_cast<const int*>(p.start_ptr);
  }
  const int L = start + 1;
  // Same chunking as the Triton kernel: keys per split rounded up to whole 16-key blocks.
  const int per_split = (L + p.n_splits - 1) / p.n_splits;
  const int chunk = (per_split + kKeys - 1) / kKeys * kKeys;
  const int lo = split * chunk;
  const int hi = min(lo + chunk, L);
  const int n_blocks = hi > lo ? (hi - lo + kKeys - 1) / kKeys : 0;
  const int my_blocks = n_blocks > warp ? (n_blocks - warp + NW - 1) / NW : 0;

  const uint8_t* kbase = p.k + kvh * p.stride_kh;
  const uint8_t* vbase = p.v + kvh * p.stride_vh;
  const float* ksbase = p.ks + kvh * p.stride_sh;
  const float* vsbase = p.vs + kvh * p.stride_sh;

  auto issue = [&](int i, int slot) {              // my i-th block -> ring slot (zero-filled past hi)
    const int key0 = lo + (warp + i * NW) * kKeys;
    Slot<HD>& s = my_ring[slot];
#pragma unroll
    for (int it = 0; it < kKeys * CH / 32; ++it) {
      const int idx = lane + 32 * it;
      const int row = idx / CH, ch = idx % CH;
      const int key = key0 + row;
      const bool ok = key < hi;
      const long long src_key = ok ? key : lo;
      const int dst = row * HD + ((ch ^ swizzle(row)) << 4);
      cp_async(s.k + dst, kbase + src_key * p.stride_kn + (ch << 4), 16, ok ? 16 : 0);
      cp_async(s.v + dst, vbase + src_key * p.stride_vn + (ch << 4), 16, ok ? 16 : 0);
    }
    const int row = lane & 15;
    const int key = key0 + row;
    const bool ok = key < hi;
    const long long src_key = ok ? key : lo;
    if (lane < 16) cp_async(&s.ks[row], ksbase + src_key * p.stride_sn, 4, ok ? 4 : 0);
    else cp_async(&s.vs[row], vsbase + src_key * p.stride_sn, 4, ok ? 4 : 0);
  };

  // The first blocks' copies go out before anything else: the query loads below then overlap their latency.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < my_blocks) issue(s, s);
    cp_async_commit();
  }

  // Query fragments (B of Q.K^T): k-step s, thread t holds head_dim 64*(s/4) + 16t + 4*(s%4) + {0,1} (b0) and
  // {2,3} (b1) of head r of this KV head (zero beyond the group). bf16 -> fp16, clamped to fp16's range.
  uint32_t qb0[KSTEPS], qb1[KSTEPS];
  {
    // A lane's 16 values of chunk c (head_dim 64c + 16t ..) are contiguous: two 16-byte loads per chunk.
    const bool head_ok = r < p.group;
    const __nv_bfloat16* qrow = p.q + (kvh * p.group + (head_ok ? r : 0)) * p.stride_qh;
#pragma unroll
    for (int c = 0; c < HD / 64; ++c) {
      uint4 raw[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
      if (head_ok) {
        raw[0] = *reinterpret_cast<const uint4*>(qrow + 64 * c + 16 * t);
        raw[1] = *reinterpret_cast<const uint4*>(qrow + 64 * c + 16 * t + 8);
      }
      const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float f[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = fminf(fmaxf(__bfloat162float(x[4 * j + i]), -65504.f), 65504.f);
        qb0[4 * c + j] = pack_f16x2(f[0], f[1]);
        qb1[4 * c + j] = pack_f16x2(f[2], f[3]);
      }
    }
  }

  float acc[KSTEPS][4];              // O^T / c_i: tile i, rows (HD/16)*r + i and (HD/16)*(r+8) + i, heads 2t, 2t+1
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m0 = kNegBig, m1 = kNegBig;  // running max of heads 2t, 2t+1 (same in all lanes of one t)
  float l0 = 0.f, l1 = 0.f;          // this lane's share of the running sums
  float c_i = 0.f;                   // acc holds the true accumulator divided by c_i (largest v scale so far)

  for (int i = 0; i < my_blocks; ++i) {
    cp_async_wait<STAGES - 2>();
    __syncwarp();                    // every lane's copies of block i landed; every lane is done with block i-1
    if (i + STAGES - 1 < my_blocks) issue(i + STAGES - 1, (i + STAGES - 1) % STAGES);
    cp_async_commit();
    if constexpr (LOADS_ONLY) continue;

    const Slot<HD>& s = my_ring[i % STAGES];
    const int key0 = lo + (warp + i * NW) * kKeys;

    // ---- S^T = K . Q^T: rows r and r+8 of the block, two accumulators to halve the dependent chain.
    float sq[4][4] = {};             // four accumulators (k-step % 4): a dependent chain of HD/64 mma each
#pragma unroll
    for (int c = 0; c < HD / 64; ++c) {
      const int ch = 4 * c + t;
      const uint4 w0 = *reinterpret_cast<const uint4*>(s.k + r * HD + ((ch ^ swizzle(r)) << 4));
      const uint4 w8 = *reinterpret_cast<const uint4*>(s.k + (r + 8) * HD + ((ch ^ swizzle(r + 8)) << 4));
      const uint32_t x0[4] = {w0.x, w0.y, w0.z, w0.w}, x8[4] = {w8.x, w8.y, w8.z, w8.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t a0 = e4m3x2_to_f16x2(x0[j]), a1 = e4m3x2_to_f16x2(x8[j]);
        const uint32_t a2 = e4m3x2_to_f16x2(x0[j] >> 16), a3 = e4m3x2_to_f16x2(x8[j] >> 16);
        mma16816(sq[j], a0, a1, a2, a3, qb0[4 * c + j], qb1[4 * c + j]);
      }
    }

    // ---- Online softmax. Lane holds keys r, r+8 for heads 2t, 2t+1.
    const float kr = s.ks[r] * p.qk_scale, kr8 = s.ks[r + 8] * p.qk_scale;
    const bool ok_r = key0 + r < hi, ok_r8 = key0 + r + 8 < hi;
    float qk[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) qk[e] = (sq[0][e] + sq[1][e]) + (sq[2][e] + sq[3][e]);
    const float s0 = ok_r ? qk[0] * kr : NEG_INF;
    const float s1 = ok_r ? qk[1] * kr : NEG_INF;
    const float s2 = ok_r8 ? qk[2] * kr8 : NEG_INF;
    const float s3 = ok_r8 ? qk[3] * kr8 : NEG_INF;
    const float mn0 = fmaxf(m0, warp_max_over_rows(fmaxf(s0, s2)));
    const float mn1 = fmaxf(m1, warp_max_over_rows(fmaxf(s1, s3)));
    const float alpha0 = fast_exp2(m0 - mn0), alpha1 = fast_exp2(m1 - mn1);
    const float p0 = fast_exp2(s0 - mn0), p1 = fast_exp2(s1 - mn1);
    const float p2 = fast_exp2(s2 - mn0), p3 = fast_exp2(s3 - mn1);
    l0 = l0 * alpha0 + p0 + p2;
    l1 = l1 * alpha1 + p1 + p3;
    m0 = mn0;
    m1 = mn1;
    const float vr = s.vs[r], vr8 = s.vs[r + 8];
    // c_i is the largest v scale seen so far: p * vs / c_i stays in [0, 1] (fp16-safe) and, unlike a per-block
    // factor, changes rarely, so the accumulator is rescaled only when the running max or c_i moved.
    const float c_new = fmaxf(c_i, warp_max_over_rows(fmaxf(vr, vr8)));
    const float inv = 1.f / c_new;
    const float f0 = alpha0 * c_i * inv, f1 = alpha1 * c_i * inv;
    c_i = c_new;
    // P^T as the B operand: this lane holds P[keys r | r+8][heads 2t, 2t+1]; movmatrix.trans gives it
    // P[keys 2t, 2t+1 | 2t+8, 2t+9][head r], the B fragment of a 16-key k-step.
    const uint32_t pb0 = movmatrix_trans(pack_f16x2(p0 * vr * inv, p1 * vr * inv));
    const uint32_t pb1 = movmatrix_trans(pack_f16x2(p2 * vr8 * inv, p3 * vr8 * inv));
    if (__any_sync(0xffffffffu, f0 != 1.f || f1 != 1.f)) {
#pragma unroll
      for (int i = 0; i < KSTEPS; ++i) {
        acc[i][0] *= f0;
        acc[i][1] *= f1;
        acc[i][2] *= f0;
        acc[i][3] *= f1;
      }
    }

    // ---- O^T += V^T . P^T. A fragment of tile i: V[keys 2t, 2t+1 | 2t+8, 2t+9][head_dim (HD/16)*row + i] for
    // rows r (a0, a2) and r+8 (a1, a3); a lane's head_dim bytes of one key are one contiguous run.
    constexpr int RUN = HD / 16;     // bytes per run: 16 (hd 256) or 8 (hd 128)
    constexpr int WORDS = RUN / 4;
    uint32_t xv[4][2][WORDS];        // [key 2t, 2t+1, 2t+8, 2t+9][row r, r+8][word]
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int key = 2 * t + (kk & 1) + 8 * (kk >> 1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row_byte = RUN * (r + 8 * h);
        const uint8_t* src = s.v + key * HD + (((row_byte >> 4) ^ swizzle(key)) << 4) + (row_byte & 15);
        if constexpr (WORDS == 4) {
          const uint4 w = *reinterpret_cast<const uint4*>(src);
          xv[kk][h][0] = w.x; xv[kk][h][1] = w.y; xv[kk][h][2] = w.z; xv[kk][h][3] = w.w;
        } else {
          const uint2 w = *reinterpret_cast<const uint2*>(src);
          xv[kk][h][0] = w.x; xv[kk][h][1] = w.y;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < WORDS; ++j) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {       // bytes 0,1 (0x5140) or 2,3 (0x7362) of the word
        const uint32_t sel = half ? 0x7362u : 0x5140u;
        const uint32_t a0 = __byte_perm(xv[0][0][j], xv[1][0][j], sel);   // keys 2t, 2t+1; row r
        const uint32_t a1 = __byte_perm(xv[0][1][j], xv[1][1][j], sel);   // keys 2t, 2t+1; row r+8
        const uint32_t a2 = __byte_perm(xv[2][0][j], xv[3][0][j], sel);   // keys 2t+8, 2t+9; row r
        const uint32_t a3 = __byte_perm(xv[2][1][j], xv[3][1][j], sel);
        const int i0 = 4 * j + 2 * half;
        mma16816(acc[i0], e4m3x2_to_f16x2(a0), e4m3x2_to_f16x2(a1), e4m3x2_to_f16x2(a2), e4m3x2_to_f16x2(a3),
                 pb0, pb1);
        mma16816(acc[i0 + 1], e4m3x2_to_f16x2(a0 >> 16), e4m3x2_to_f16x2(a1 >> 16), e4m3x2_to_f16x2(a2 >> 16),
                 e4m3x2_to_f16x2(a3 >> 16), pb0, pb1);
      }
    }
  }
  cp_async_wait<0>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif

  // ---- Merge the warps of the block in shared memory (the ring is free now), write one partial.
  l0 = warp_sum_over_rows(l0);
  l1 = warp_sum_over_rows(l1);
  __syncthreads();
  float* macc = reinterpret_cast<float*>(smem_raw);        // [NW][8 heads][HD]
  float* mm = macc + NW * 8 * HD;                          // [NW][8]
  float* ll = mm + NW * 8;                                 // [NW][8]
  float* cc = ll + NW * 8;                                 // [NW]
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) {
    const int d0 = (HD / 16) * r + i, d8 = (HD / 16) * (r + 8) + i;
    float* w = macc + (warp * 8 + 2 * t) * HD;
    w[d0] = acc[i][0];
    w[HD + d0] = acc[i][1];
    w[d8] = acc[i][2];
    w[HD + d8] = acc[i][3];
  }
  if (r == 0) {
    mm[warp * 8 + 2 * t] = m0;
    mm[warp * 8 + 2 * t + 1] = m1;
    ll[warp * 8 + 2 * t] = l0;
    ll[warp * 8 + 2 * t + 1] = l1;
    if (t == 0) cc[warp] = c_i;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < p.group * HD; idx += NW * 32) {
    const int g = idx / HD, d = idx % HD;
    float m_all = kNegBig;
#pragma unroll
    for (int w = 0; w < NW; ++w) m_all = fmaxf(m_all, mm[w * 8 + g]);
    float l_all = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float e = fast_exp2(mm[w * 8 + g] - m_all);
      l_all += e * ll[w * 8 + g];
      o += e * cc[w] * macc[(w * 8 + g) * HD + d];
    }
    const bool has = l_all > 0.f;
    const int head = kvh * p.group + g;
    p.o_part[split * p.stride_ps + head * p.stride_ph + d] = has ? o / l_all : 0.f;
    if (d == 0) p.lse_part[split * p.stride_ls + head] = has ? m_all + __log2f(l_all) : kNegBig;
  }
}

template <int HD, int NW, int STAGES, bool LOADS_ONLY = false>
cudaError_t launch(const Params& p, int n_kv, int pdl, cudaStream_t stream) {
  auto kernel = fp8_decode_attention_kernel<HD, NW, STAGES, LOADS_ONLY>;
  const size_t ring = sizeof(Slot<HD>) * NW * STAGES;
  const size_t merge = sizeof(float) * (NW * 8 * HD + 2 * NW * 8 + NW);
  const size_t smem = ring > merge ? ring : merge;
  // Above 48 KB a kernel must opt in to its dynamic shared memory (per device: cheap enough to do every call).
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.n_splits, n_kv, 1);
  cfg.blockDim = dim3(NW * 32, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

template <int HD>
cudaError_t dispatch_warps(const Params& p, int n_kv, int num_warps, int stages, int pdl, cudaStream_t stream) {
  if (num_warps == 4 && stages == -3) return launch<HD, 4, 3, true>(p, n_kv, pdl, stream);   // loads only
  if (num_warps == 2 && stages == 3) return launch<HD, 2, 3>(p, n_kv, pdl, stream);
  if (num_warps == 2 && stages == 4) return launch<HD, 2, 4>(p, n_kv, pdl, stream);
  if (num_warps == 4 && stages == 2) return launch<HD, 4, 2>(p, n_kv, pdl, stream);
  if (num_warps == 4 && stages == 3) return launch<HD, 4, 3>(p, n_kv, pdl, stream);
  if (num_warps == 4 && stages == 4) return launch<HD, 4, 4>(p, n_kv, pdl, stream);
  if (num_warps == 8 && stages == 2) return launch<HD, 8, 2>(p, n_kv, pdl, stream);
  if (num_warps == 8 && stages == 3) return launch<HD, 8, 3>(p, n_kv, pdl, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

// The text of a cudaError_t returned by the launcher.
extern "C" const char* edgespec_cuda_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

// Launch into `stream` (a cudaStream_t). Strides are in elements. Returns a cudaError_t (0: launched).
extern "C" int edgespec_fp8_decode_attention(
    const void* q, const void* k, const void* v, const void* ks, const void* vs, const void* start_ptr,
    int start_is_64, int start, void* o_part, void* lse_part, int n_splits, int n_kv, int group, int head_dim,
    float qk_scale, long long stride_qh, long long stride_kn, long long stride_kh, long long stride_vn,
    long long stride_vh, long long stride_sn, long long stride_sh, long long stride_ps, long long stride_ph,
    long long stride_ls, int num_warps, int stages, int pdl, void* stream) {
  if (group < 1 || group > 8 || n_splits < 1) return static_cast<int>(cudaErrorInvalidValue);
  Params p;
  p.q = static_cast<const __nv_bfloat16*>(q);
  p.k = static_cast<const uint8_t*>(k);
  p.v = static_cast<const uint8_t*>(v);
  p.ks = static_cast<const float*>(ks);
  p.vs = static_cast<const float*>(vs);
  p.start_ptr = start_ptr;
  p.o_part = static_cast<float*>(o_part);
  p.lse_part = static_cast<float*>(lse_part);
  p.stride_qh = stride_qh; p.stride_kn = stride_kn; p.stride_kh = stride_kh;
  p.stride_vn = stride_vn; p.stride_vh = stride_vh; p.stride_sn = stride_sn; p.stride_sh = stride_sh;
  p.stride_ps = stride_ps; p.stride_ph = stride_ph; p.stride_ls = stride_ls;
  p.qk_scale = qk_scale;
  p.start = start;
  p.start_is_64 = start_is_64;
  p.n_splits = n_splits;
  p.group = group;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = head_dim == 256 ? dispatch_warps<256>(p, n_kv, num_warps, stages, pdl, s)
                  : head_dim == 128 ? dispatch_warps<128>(p, n_kv, num_warps, stages, pdl, s)
                                    : cudaErrorInvalidValue;
  return static_cast<int>(err);
}
