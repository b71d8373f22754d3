// specdec's CPU kernels: the llama decoder stack, batch-invariant by construction.
//
// Every value a row produces is computed by the same instructions in the same order whatever M (rows in
// the forward) is, whatever else shares the batch and whichever slot the row sits in:
//   - a product y[m, n] = sum_k x[m, k] W[n, k] is one fused multiply-add chain over k = 0..K-1 in one
//     vector lane (outer-product tiles, see "products" below). Tiles of up to MT rows only decide how
//     many rows share a weight load, never the arithmetic of one output; threads split the outputs (n),
//     never k (no split-K).
//   - attention walks a row's visible keys in cache order (the cached prefix, then the new tokens its
//     mask allows), so a tree path and the same tokens decoded one by one see the same list of keys;
//     the softmax is max, exp and a sum over that list whose order depends only on the list
//     (visible_sum).
//   - norms, RoPE and SiLU are per row with fixed-order reductions; exp is our own polynomial.
// One kernel family serves one row and many: decode, verification (chain and tree), prefill chunks.
//
// Weights are [N, K] row-major (torch's [out, in]) in fp32, bf16 or fp16; activations, the KV cache and
// outputs are fp32. On a CPU with AVX512_BF16 the bf16 product rounds x to bf16 and uses vdpbf16ps
// (32 MACs per instruction, fp32 accumulate), or with AMX the tiles (TDPBF16PS, 8192 MACs per instruction: the amx
// build, for every M); elsewhere bf16/fp16 weights are widened to fp32 in registers.
// There, a bf16 model's attention reads bf16 copies of K and V (SdCache.kt and vh: made once per key from the
// fp32 cache): the scores are vdpbf16ps chains against the query rounded to bf16, the values fp32 chains over the
// widened bf16 values; a key's score and a value's product still depend on nothing but that key and that query.
//
// Built four ways by build.py (AMX + AVX512_BF16, AVX512+BF16, AVX2+FMA+F16C, generic); OpenMP shares the libgomp that
// torch loaded, so these loops run on torch's own thread pool (no second pool spinning beside it).
// This file knows nothing about Python, torch, requests or speculation.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <array>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef uint16_t u16;
struct bf16_t { u16 v; };
struct f16_t { u16 v; };

static inline float bf16_to_f32(u16 h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline u16 f32_to_bf16(float f) {  // round to nearest even (NaN stays NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}
static inline float f16_to_f32(u16 h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) { man <<= 1; exp--; }
      u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline float w_scalar(const float* p) { return *p; }
static inline float w_scalar(const bf16_t* p) { return bf16_to_f32(p->v); }
static inline float w_scalar(const f16_t* p) { return f16_to_f32(p->v); }

// ---- one vector of fp32 lanes: VL lanes, load, fma, and the fixed lane reduction ----------------------
#if defined(__AVX512F__)
enum { VL = 16 };
typedef __m512 vf;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vload_w(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vload_w(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline vf vload_w(const f16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf a) {  // fixed tree: 16 -> 8 -> 4 -> 2 -> 1
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
static inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }  // a > b ? a : b per lane
#elif defined(__AVX2__)
enum { VL = 8 };
typedef __m256 vf;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vload_w(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vload_w(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vf vload_w(const f16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf a) {  // fixed tree: 8 -> 4 -> 2 -> 1
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
static inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }  // a > b ? a : b per lane
#else
enum { VL = 8 };
struct vf { float l[VL]; };
static inline vf vzero() { vf r; for (int i = 0; i < VL; i++) r.l[i] = 0.f; return r; }
static inline vf vload(const float* p) { vf r; for (int i = 0; i < VL; i++) r.l[i] = p[i]; return r; }
template <class W> static inline vf vload_w(const W* p) { vf r; for (int i = 0; i < VL; i++) r.l[i] = w_scalar(p + i); return r; }
static inline vf vfma(vf a, vf b, vf c) { vf r; for (int i = 0; i < VL; i++) r.l[i] = std::fma(a.l[i], b.l[i], c.l[i]); return r; }
static inline float vsum(vf a) {  // the same tree as the AVX2 build: pairs (i, i+4), then (i, i+2), then (0, 1)
  float s4[4], s2[2];
  for (int i = 0; i < 4; i++) s4[i] = a.l[i] + a.l[i + 4];
  for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}
static inline void vstore(float* p, vf a) { for (int i = 0; i < VL; i++) p[i] = a.l[i]; }
static inline vf vset1(float x) { vf r; for (int i = 0; i < VL; i++) r.l[i] = x; return r; }
static inline vf vmul(vf a, vf b) { vf r; for (int i = 0; i < VL; i++) r.l[i] = a.l[i] * b.l[i]; return r; }
static inline vf vadd(vf a, vf b) { vf r; for (int i = 0; i < VL; i++) r.l[i] = a.l[i] + b.l[i]; return r; }
static inline vf vmax(vf a, vf b) { vf r; for (int i = 0; i < VL; i++) r.l[i] = a.l[i] > b.l[i] ? a.l[i] : b.l[i]; return r; }
#endif

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// ---- products: y[M, N] (=|+=) x[M, K] . W[N, K]^T + bias ------------------------------------------------
// Outer-product tiles, as BLAS micro-kernels do: a tile holds MT rows x NB vectors of VL outputs, and for
// each k adds x[m, k] (broadcast) times W[k, n..n+VL) into them. So an output (m, n) is one fused
// multiply-add chain over k = 0, 1, ..., K-1 in one vector lane: no horizontal reduction, no split of K,
// the same chain whatever M is or which tile holds the row. (bf16 with vdpbf16ps: the chain goes over
// pairs k, k+1.)
//
// Weights are read from a copy packed once at load into panels of P = NB * VL output rows, k-major:
// [ceil(N/P)][K][P] (bf16 for vdpbf16ps: [ceil(N/P)][K/2][P][2]), rows past N zero. A tile then streams
// one panel front to back. Measured on the Zen 5 box (2026-11-23), [49152, 576] fp32 at one row, 1 thread:
// NT = 2..8 separate row streams 12-16 GB/s, one packed stream 24 GB/s (2 threads 31-33, W.sum() 34).
// An unpackable weight (bf16 with odd K on the vdpbf16ps build) takes dot_w below, one output at a time.
#if defined(__AVX512F__)
enum { NB = 2, MT = 12 };  // 24 accumulators + 2 weight vectors + 1 broadcast of 32 zmm registers
#elif defined(__AVX2__)
enum { NB = 2, MT = 6 };   // 12 accumulators + 2 weight vectors + 1 broadcast of 16 ymm registers (BLIS's 6 x 16)
// and one tile of 7 rows when a block has exactly 7 (the default EAGLE tree and its root): 14 accumulators and
// the broadcast in registers, the weights as FMA memory operands. Measured 2026-11-26 (Zen 3, 2 threads, fp32
// [49152, 576]): 7 rows 1.05-1.11x one row's time, against 1.17-1.22x as 4 + 3; more rows keep 6-row tiles
// (33 rows in 7-row tiles took 1.33x the 6-row tiles' time: compute-bound, the memory operands cost there)
#define SD_TILE7 1
#else
enum { NB = 2, MT = 4 };   // portable C++: the compiler's vectors, a smaller tile
#endif
// P: outputs per panel; MC: rows per block of the parallel loop (a panel is streamed from memory once per
// block, so a verification of up to 48 tokens reads each weight once); PF_ROWS: blocks of at least this many
// rows prefetch the next panel while computing this one.
// - AVX2: measured 2026-11-25 on a 2-core Zen 3, fp32 SmolLM2 shapes: 8 rows 31.6 -> 27.0 ms, 17 rows 65 -> 39
//   ms; a one-row decode is memory-bound and only loses from it. From 2 rows (was 4), measured 2026-11-28 (1 thread,
//   interleaved builds, SmolLM2's EAGLE head shapes [4096|3072, 576], [960, 1152]): bf16 with tile_bf16_split, 2 rows
//   0.58 -> 0.44 ms, 3 rows 0.61 -> 0.56; fp32 3 rows 1.25 -> 1.09 ms, 0.97 -> 0.74 (a draft tree's k rows per depth).
// - AVX512: from 16 rows. Measured 2026-11-26 on a 2-core Zen 4 (experiments/LOG.md), interleaved in one process,
//   ctx 400: against prefetching every line of the next panel, none at all took M=5 17.2 -> 13.7 ms, M=7
//   16.7 -> 15.3, B=4 17.6 -> 13.7, and M=9..33, B=8, B=16 within 4% (fp32); the hardware prefetcher keeps up there.
//   bf16 rows compute twice as fast, so at 16+ rows the stream lags: 2026-11-29 (Zen 4, kernel_revs, ctx 256), from
//   16 rows against never, bf16 M=17 0.94, M=33 0.97, B=16 0.95, a 256-token prompt 0.98; fp32 0.98-0.99; M <= 9 and
//   B <= 8 within 1-2% (from 9 rows: M=9 1.02, worse).
#if defined(__AMX_BF16__)
// - AMX build (Intel Sapphire Rapids and later; bf16 products go through amx_panel, this is for fp32 / fp16 weights):
//   from 1 row. Measured 2026-12-05 (2-vCPU Emerald Rapids, kernel_revs fp32 against from 16 rows, two runs, ctx 256
//   and 512): M=1 0.94-0.97, M=2..9 0.65-0.86, B=4 0.80, B=8 0.70-0.74, M=17/33 and B=16 0.96-1.03 (unchanged: they
//   prefetched already), prompts 0.86-1.04. Zen 4 measured the opposite (above), so only this build changes.
enum { PF_ROWS = 1 };
#elif defined(__AVX512F__)
enum { PF_ROWS = 16 };
#elif defined(SD_PF_ROWS)
enum { PF_ROWS = SD_PF_ROWS };  // side-by-side builds
#else
enum { PF_ROWS = 2 };
#endif
enum { P = NB * VL, MC = 48 };

struct SdWeight {       // one projection
  const void* data;     // packed (see above) or [N, K] row-major
  const float* bias;    // [N] or NULL
  int64_t N, K;
  int32_t dtype;        // 0 fp32, 1 bf16, 2 fp16
  int32_t packed;
};

#if defined(__AVX512BF16__)
static const bool kDp = true;  // bf16 weights go through vdpbf16ps, x rounded to bf16
#else
static const bool kDp = false;
#endif

// y[m, n0 + j] (= or +=) acc lane j (+ bias), j < nvalid: the only place a product's output is written
static inline void store_out(vf a, const float* bias, float* y, int64_t nvalid, int acc) {
  if (nvalid >= VL) {  // a whole vector: the same two fp32 adds per lane as the loop below, VL at a time
    const vf s = bias ? vadd(a, vload(bias)) : a;
    vstore(y, acc ? vadd(vload(y), s) : s);
    return;
  }
  float t[VL];
  vstore(t, a);
  for (int64_t j = 0; j < nvalid && j < VL; j++) {
    float s = t[j];
    if (bias) s += bias[j];
    y[j] = acc ? y[j] + s : s;
  }
}

// Every 64-byte line of one k step of the next panel (a step is P * sizeof(W) bytes: 128 with AVX512's
// 32 fp32 outputs, 64 with AVX2's 16; one prefetch per step fetched only every other line on AVX512)
template <size_t bytes>
static inline void prefetch_step(const char* p) {
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

// rows x [mt, K] (row stride K) against one packed panel (P outputs starting at n0, nvalid of them real)
template <int mt, class W>
static inline void tile(const float* x, int64_t K, const W* panel, int64_t nvalid, const float* bias, float* y,
                        int64_t ldy, int acc, const char* pf) {
  vf a[mt][NB];
  for (int m = 0; m < mt; m++)
    for (int b = 0; b < NB; b++) a[m][b] = vzero();
  for (int64_t k = 0; k < K; k++) {
    if (pf) prefetch_step<P * sizeof(W)>(pf + k * P * sizeof(W));
    vf wv[NB];
    for (int b = 0; b < NB; b++) wv[b] = vload_w(panel + k * P + b * VL);
    for (int m = 0; m < mt; m++) {
      const vf xv = vset1(x[m * K + k]);
      for (int b = 0; b < NB; b++) a[m][b] = vfma(xv, wv[b], a[m][b]);
    }
  }
  for (int m = 0; m < mt; m++)
    for (int b = 0; b < NB; b++)
      store_out(a[m][b], bias ? bias + b * VL : nullptr, y + m * ldy + b * VL, nvalid - b * VL, acc);
}

#if defined(__AVX512BF16__)
// bf16 panel [K/2][P][2] against xb [mt, K] (bf16): vdpbf16ps adds x[k] w[k] + x[k+1] w[k+1] per lane
template <int mt>
static inline void tile_dp(const u16* xb, int64_t K, const u16* panel, int64_t nvalid, const float* bias, float* y,
                           int64_t ldy, int acc, const char* pf) {
  __m512 a[mt][NB];
  for (int m = 0; m < mt; m++)
    for (int b = 0; b < NB; b++) a[m][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    if (pf) prefetch_step<2 * P * 2>(pf + k * P * 2);
    __m512bh wv[NB];
    for (int b = 0; b < NB; b++) wv[b] = (__m512bh)_mm512_loadu_si512((const void*)(panel + k * P + b * 2 * VL));
    for (int m = 0; m < mt; m++) {
      uint32_t pair;
      std::memcpy(&pair, xb + m * K + k, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
      for (int b = 0; b < NB; b++) a[m][b] = _mm512_dpbf16_ps(a[m][b], xv, wv[b]);
    }
  }
  for (int m = 0; m < mt; m++)
    for (int b = 0; b < NB; b++)
      store_out(a[m][b], bias ? bias + b * VL : nullptr, y + m * ldy + b * VL, nvalid - b * VL, acc);
}
#endif

// one output from an unpacked weight row, x rounded like the packed path would
template <class W>
static inline float dot_w(const float* x, const W* w, int64_t K) {
  float s = 0.0f;
  const bool round_x = kDp && std::is_same<W, bf16_t>::value;
  for (int64_t k = 0; k < K; k++) s = std::fma(round_x ? bf16_to_f32(f32_to_bf16(x[k])) : x[k], w_scalar(w + k), s);
  return s;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// bf16 panel against fp32 x on AVX2, widening a k step's 16 weights with one load and two integer ops: the 32-bit
// word i holds outputs 2i (low half) and 2i + 1 (high half), so v << 16 is the even outputs in fp32 and
// v & 0xffff0000 the odd ones (vload_w's zero-extend + shift per 8 weights took 4 ops). Measured 2026-11-28 (2-core
// AVX2 box, 1 thread, interleaved, experiments/LOG.md): 0.77-0.90 of tile()'s time at 1-6 and 9-17 rows on SmolLM2's
// head and LM head shapes. Each output is the same FMA chain over k as tile()'s: the results are bit for bit tile()'s.
template <int mt>
static inline void tile_bf16_split(const float* x, int64_t K, const u16* panel, int64_t nvalid, const float* bias,
                                   float* y, int64_t ldy, int acc, const char* pf) {
  static_assert(P == 16, "one 256-bit load per k step");
  __m256 a[mt][2];
  for (int m = 0; m < mt; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
  for (int64_t k = 0; k < K; k++) {
    if (pf) prefetch_step<P * 2>(pf + k * P * 2);
    const __m256i v = _mm256_loadu_si256((const __m256i*)(panel + k * P));
    const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
    for (int m = 0; m < mt; m++) {
      const __m256 xv = _mm256_set1_ps(x[m * K + k]);
      a[m][0] = _mm256_fmadd_ps(xv, we, a[m][0]);
      a[m][1] = _mm256_fmadd_ps(xv, wo, a[m][1]);
    }
  }
  for (int m = 0; m < mt; m++) {
    float e[8], o[8];
    _mm256_storeu_ps(e, a[m][0]);
    _mm256_storeu_ps(o, a[m][1]);
    float* ym = y + m * ldy;
    for (int64_t j = 0; j < nvalid && j < P; j++) {
      float s = j % 2 ? o[j / 2] : e[j / 2];
      if (bias) s += bias[j];
      ym[j] = acc ? ym[j] + s : s;
    }
  }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(SD_NO_BF16_SPLIT)
static const bool kSplit = true;  // bf16 tiles of up to 6 rows go through tile_bf16_split
#else
static const bool kSplit = false;
#endif

#if defined(__AMX_BF16__)
// ---- AMX: bf16 products in tiles (the amx build; Sapphire Rapids and later) ------------------------------
// TDPBF16PS accumulates a row's 16 k pairs of one instruction in its own order (not vdpbf16ps's: the two differ in
// the last bits on 89% of outputs, measured 2026-12-05), so in this build EVERY bf16 product of a weight whose K is a
// multiple of 32 goes through the tiles, one row or 48: each output (m, n) is then the same sequence of
// instructions over k = 0, 32, 64, ... in one accumulator, whatever M is and whichever tile row holds m (a tile row's
// result depends only on that row of A). Weights with other K keep tile_dp for every M.
// The packed bf16 panel [K/2][P][2] is already the tiles' VNNI layout: B tile b (outputs b*16 .. b*16+15) of k step
// k is 16 rows (pairs) of 64 bytes at panel + k*P + b*32, stride P*4 bytes. So one packed copy serves both builds.
// Tiles: 0..3 C [rt][16] fp32 (row tile i, half b: 2i + b), 4 and 5 A [rt][32] bf16, 6 and 7 B [16][32] bf16.
struct TileCfg {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static thread_local int amx_rows = 0;  // rows of this thread's loaded configuration, 0 = none of ours
static inline void amx_config(int rt) {
  if (amx_rows == rt) return;
  TileCfg c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; t++) {
    c.colsb[t] = 64;
    c.rows[t] = t < 6 ? (uint8_t)rt : 16;
  }
  _tile_loadconfig(&c);
  amx_rows = rt;
}
// the end of a product on this thread: the tiles go back to their init state (the OS then saves no tile data,
// and torch's oneDNN, on the same threads, loads its own configuration)
static inline void amx_done() {
  if (amx_rows) _tile_release();
  amx_rows = 0;
}

// R <= 48 rows of xb [R, K] (row stride K) against one packed panel; K % 32 == 0. The rows go in ntl tiles of rt
// rows (rt = ceil(R / ntl): one configuration per block size); the last tile ends at row R, overlapping its
// predecessor, and writes only the rows past it (a recomputed row is the same bits).
// From AMX_PF_ROWS rows, the first row tiles' pass over a panel prefetches the weight stream AMX_PF bytes ahead (the
// rest of this panel, then the next one: under the static schedule a thread's panels are contiguous). Measured
// 2026-12-05 (SPR-class Xeon, 2 threads, kernel_revs, bf16, ctx 512) against none: M=17 0.89, M=33 0.95, M=3..9
// 0.93-0.97, M=1 1.03 (within the host's noise); 16 KB ahead against 8 KB: within 1-6%, either way.
enum { AMX_PF = 8192, AMX_PF_ROWS = 2 };
static void amx_panel(const u16* xb, int64_t R, int64_t K, const u16* panel, int64_t nvalid, const float* bias,
                      float* y, int64_t ldy, int acc, bool pf) {
  const int64_t ntl = (R + 15) / 16, rt = (R + ntl - 1) / ntl;
  amx_config((int)rt);
  alignas(64) float c[2][16][P];  // two row tiles' outputs, [tile][row][P]
  for (int64_t t0 = 0; t0 < ntl; t0 += 2) {
    const bool two = t0 + 1 < ntl;
    const int64_t o0 = imin(t0 * rt, R - rt), o1 = imin((t0 + 1) * rt, R - rt);
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += 32) {
      if (t0 == 0 && pf) prefetch_step<32 * P * 2>((const char*)(panel + k * P) + AMX_PF);
      _tile_loadd(4, xb + o0 * K + k, K * 2);
      _tile_loadd(6, panel + k * P, P * 4);
      _tile_loadd(7, panel + k * P + 32, P * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, xb + o1 * K + k, K * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, &c[0][0][0], P * 4);
    _tile_stored(1, &c[0][0][16], P * 4);
    if (two) {
      _tile_stored(2, &c[1][0][0], P * 4);
      _tile_stored(3, &c[1][0][16], P * 4);
    }
    for (int64_t i = 0; i < (two ? 2 : 1); i++) {
      const int64_t t = t0 + i, o = i ? o1 : o0;
      for (int64_t r = 0; r < rt; r++) {
        if (o + r < t * rt) continue;  // written by the tile before
        for (int b = 0; b < NB; b++)
          store_out(vload(&c[i][r][b * VL]), bias ? bias + b * VL : nullptr, y + (o + r) * ldy + b * VL,
                    nvalid - b * VL, acc);
      }
    }
  }
}
#endif

template <int mt, class W>
static inline void tile_any(const float* x, const u16* xb, int64_t K, const W* panel, int64_t nvalid,
                            const float* bias, float* y, int64_t ldy, int acc, const char* pf) {
#if defined(__AVX512BF16__)
  if (std::is_same<W, bf16_t>::value) {
    tile_dp<mt>(xb, K, (const u16*)panel, nvalid, bias, y, ldy, acc, pf);
    return;
  }
#elif defined(__AVX2__) && !defined(__AVX512F__) && !defined(SD_NO_BF16_SPLIT)
  if (std::is_same<W, bf16_t>::value && mt <= 6) {  // 7 rows: 14 accumulators leave no room for the split
    tile_bf16_split<mt>(x, K, (const u16*)panel, nvalid, bias, y, ldy, acc, pf);
    return;
  }
#endif
  (void)xb;
  tile<mt>(x, K, panel, nvalid, bias, y, ldy, acc, pf);
}

// The running facts about one output row over one group of panels (sd_linear_stats): the largest value and the
// first index holding it, sum(exp(y - mx)) over the values seen, and how many were not finite.
enum { STAT_GROUPS = 64 };
struct RowPart {
  float mx, s;
  int64_t am, bad;
};

static inline float exp_poly(float x);
static inline vf vexp(vf x);

// fold y[0, n), the outputs n0 .. n0 + n - 1 of one row, into r (called on outputs just written: hot in L1)
static inline void fold_row(const float* y, int64_t n, int64_t n0, RowPart* r) {
  const int64_t nv = n - n % VL;
  vf mxv = vset1(-INFINITY), nan = vzero();
  for (int64_t j = 0; j < nv; j += VL) {
    const vf v = vload(y + j);
    mxv = vmax(mxv, v);
    nan = vadd(nan, vmul(v, vzero()));  // 0 * v is NaN for NaN and +-inf, else 0
  }
  float t[VL];
  vstore(t, mxv);
  float bm = -INFINITY, z = vsum(nan);
  for (int l = 0; l < VL; l++) bm = t[l] > bm ? t[l] : bm;
  for (int64_t j = nv; j < n; j++) {
    bm = y[j] > bm ? y[j] : bm;
    z += y[j] * 0.0f;
  }
  if (!(z == 0.0f)) {  // a value is not finite: the row is refused, its other facts are never read
    r->bad++;
    return;
  }
  if (n == 0) return;
  if (bm > r->mx) {  // strictly: among equal values the first index stays
    int64_t bi = 0;
    while (y[bi] != bm) bi++;
    r->s = r->am < 0 ? 0.0f : r->s * exp_poly(r->mx - bm);
    r->mx = bm;
    r->am = n0 + bi;
  }
  const vf neg = vset1(-r->mx);
  vf acc = vzero();
  for (int64_t j = 0; j < nv; j += VL) acc = vadd(acc, vexp(vadd(vload(y + j), neg)));
  float s = vsum(acc);
  for (int64_t j = nv; j < n; j++) s += exp_poly(y[j] - r->mx);
  r->s += s;
}

template <class W>
static void linear_ws(const SdWeight* wt, const float* x, int64_t M, float* y, int acc, u16* xb,
                      RowPart* parts = nullptr) {
  const int64_t N = wt->N, K = wt->K;
  const W* w = (const W*)wt->data;
  if (!wt->packed) {
#pragma omp for schedule(static) collapse(2)
    for (int64_t n = 0; n < N; n++)
      for (int64_t m = 0; m < M; m++) {
        float s = dot_w(x + m * K, w + n * K, K);
        if (wt->bias) s += wt->bias[n];
        y[m * N + n] = acc ? y[m * N + n] + s : s;
      }
    return;
  }
#if defined(__AVX512BF16__)
  if (std::is_same<W, bf16_t>::value) {  // x -> bf16 once per call (K is even: packed)
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
      const float* xr = x + m * K;
      u16* br = xb + m * K;
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        _mm256_storeu_si256((__m256i*)(br + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
      for (; k < K; k++) br[k] = f32_to_bf16(xr[k]);
    }
  }
#endif
  // nc blocks of at most MC rows, of balanced size (256 rows: 6 x 43, not 5 x 48 + 16, which left one of 2 threads
  // 144 rows against 112; 64 rows: 2 x 32, not 48 + 16). A block's size only decides which rows share a weight
  // stream, never a row's arithmetic.
  const int64_t np = (N + P - 1) / P, nc = (M + MC - 1) / MC, mc = (M + nc - 1) / nc;
  // one panel of one block of rows: every output of the block's rows in panel p
  auto panel_rows = [&](int64_t c, int64_t p) {
    const int64_t n0 = p * P, nvalid = imin(P, N - n0);
    const W* panel = w + n0 * K;  // a panel holds P * K elements
    const float* bias = wt->bias ? wt->bias + n0 : nullptr;
    // the chunk's R rows in ceil(R / MT) tiles of balanced size (7 = 4 + 3, not 6 + 1: a one-row tile has
    // only NB accumulator chains and waits on the FMA latency)
    const int64_t c0 = c * mc, R = imin(M, c0 + mc) - c0;
#if defined(__AMX_BF16__)
    if (std::is_same<W, bf16_t>::value && K % 32 == 0) {
      amx_panel(xb + c0 * K, R, K, (const u16*)panel, nvalid, bias, y + c0 * N + n0, N, acc, R >= AMX_PF_ROWS);
      return;
    }
#endif
#if defined(SD_TILE7)  // (bf16 weights: tile_bf16_split as 4 + 3 rows, 0.88-0.97 of the 7-row tile's time, 2026-11-28)
    const int64_t nt = R == 7 && !(kSplit && std::is_same<W, bf16_t>::value) ? 1 : (R + MT - 1) / MT;
#else
    const int64_t nt = (R + MT - 1) / MT;
#endif
    // from PF_ROWS rows on, the next panel (this thread's next item under the static schedule) is
    // fetched while this one is computed, so the memory stream overlaps the arithmetic
    const char* pf = R >= PF_ROWS && p + 1 < np ? (const char*)(panel + P * K) : nullptr;
    for (int64_t t = 0, m0 = c0; t < nt; t++) {
      const int mt = (int)(R / nt + (t < R % nt));
      const float* xr = x + m0 * K;
      const u16* xbr = xb ? xb + m0 * K : nullptr;
      float* yo = y + m0 * N + n0;
      switch (mt) {
#define SD_MT(i) \
  case i: tile_any<i>(xr, xbr, K, panel, nvalid, bias, yo, N, acc, pf); break;
        SD_MT(1) SD_MT(2) SD_MT(3) SD_MT(4)
#if defined(__AVX512F__) || defined(__AVX2__)
        SD_MT(5) SD_MT(6) SD_MT(7)
#endif
#if defined(__AVX512F__)
        SD_MT(8) SD_MT(9) SD_MT(10) SD_MT(11) SD_MT(12)
#endif
#undef SD_MT
      }
      m0 += mt;
    }
  };
  if (!parts) {
#pragma omp for schedule(static) collapse(2)
    for (int64_t c = 0; c < nc; c++)
      for (int64_t p = 0; p < np; p++) panel_rows(c, p);
#if defined(__AMX_BF16__)
    amx_done();
#endif
    return;
  }
  // sd_linear_stats: the panels in STAT_GROUPS fixed groups, a group's panels folded in order into its own
  // partial while their outputs are in L1; the groups do not depend on the thread count, so neither do the stats
#pragma omp for schedule(static) collapse(2)
  for (int64_t c = 0; c < nc; c++)
    for (int64_t g = 0; g < STAT_GROUPS; g++)
      for (int64_t p = g * np / STAT_GROUPS; p < (g + 1) * np / STAT_GROUPS; p++) {
        panel_rows(c, p);
        const int64_t c0 = c * mc, n0 = p * P;
        for (int64_t m = c0; m < imin(M, c0 + mc); m++) fold_row(y + m * N + n0, imin(P, N - n0), n0, parts + g * M + m);
      }
#if defined(__AMX_BF16__)
  amx_done();
#endif
}

static void linear_any(const SdWeight* w, const float* x, int64_t M, float* y, int acc, u16* xb,
                       RowPart* parts = nullptr) {
  if (w->dtype == 0) linear_ws<float>(w, x, M, y, acc, xb, parts);
  else if (w->dtype == 1) linear_ws<bf16_t>(w, x, M, y, acc, xb, parts);
  else linear_ws<f16_t>(w, x, M, y, acc, xb, parts);
}

// where element (n, k) of w [N, K] sits in its packed copy: fp32/f16/widened bf16 [p][k][j], vdpbf16ps
// [p][k/2][j][k%2] (p = n / P, j = n % P)
static inline int64_t packed_at(bool dp, int64_t n, int64_t k, int64_t K) {
  const int64_t p = n / P, j = n % P;
  return dp ? (p * K + (k / 2) * 2) * P + j * 2 + k % 2 : (p * K + k) * P + j;
}

// packed copy of w [N, K] into out (when not NULL); returns its element count, 0 = keep w unpacked
static int64_t pack(int32_t dtype, const void* w, int64_t N, int64_t K, void* out) {
  const bool dp = dtype == 1 && kDp;
  const int64_t es = dtype == 0 ? 4 : 2, np = (N + P - 1) / P;
  if (dp && K % 2) return 0;
  if (out) {
    const char* src = (const char*)w;
    char* dst = (char*)out;
    std::memset(dst, 0, np * P * K * es);
    for (int64_t n = 0; n < N; n++)
      for (int64_t k = 0; k < K; k++) std::memcpy(dst + packed_at(dp, n, k, K) * es, src + (n * K + k) * es, es);
  }
  return np * P * K;
}

// rows ids[0..R) of w [N, K] out of its packed copy into out [R, K] (ids NULL: every row, R = N): the inverse of
// pack, so the packed copy can be the only one (an embedding lookup of a tied LM head, the torch reference path)
static void unpack(int32_t dtype, const void* packed, int64_t N, int64_t K, const int64_t* ids, int64_t R, void* out) {
  const bool dp = dtype == 1 && kDp;
  const int64_t es = dtype == 0 ? 4 : 2;
  const char* src = (const char*)packed;
  char* dst = (char*)out;
  (void)N;
  for (int64_t r = 0; r < R; r++) {
    const int64_t n = ids ? ids[r] : r;
    for (int64_t k = 0; k < K; k++) std::memcpy(dst + (r * K + k) * es, src + packed_at(dp, n, k, K) * es, es);
  }
}

// ---- elementwise and per-row pieces -----------------------------------------------------------------
// exp(x) as a Cephes-style polynomial (~1 ulp on [-87, 88]); our own so every build rounds alike.
static inline float exp_poly(float x) {
  if (x < -87.0f) return 0.0f;
  if (x > 88.0f) x = 88.0f;
  const float fx = (std::fma(x, 1.44269504088896341f, 12582912.0f)) - 12582912.0f;  // round(x / ln 2)
  float r = std::fma(fx, -0.693359375f, x);
  r = std::fma(fx, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;
  const int32_t e = (int32_t)fx + 127;
  uint32_t bits = (uint32_t)e << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// exp_poly on VL lanes: the same operations in the same order, so every lane equals exp_poly of it
#if defined(__AVX512F__)
static inline vf vexp(vf x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const vf fx = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(12582912.0f)),
                              _mm512_set1_ps(12582912.0f));
  vf r = _mm512_fmadd_ps(fx, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f), r);
  vf p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(~under, p, _mm512_castsi512_ps(e));
}
#elif defined(__AVX2__)
static inline vf vexp(vf x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  const vf fx = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(12582912.0f)),
                              _mm256_set1_ps(12582912.0f));
  vf r = _mm256_fmadd_ps(fx, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), r);
  vf p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#else
static inline vf vexp(vf x) {
  vf r;
  for (int i = 0; i < VL; i++) r.l[i] = exp_poly(x.l[i]);
  return r;
}
#endif

// y[i] = exp(x[i] - mx) for i < n; x and y padded to a multiple of VL (pads read, results past n unused)
static inline void exp_shifted(const float* x, float* y, int64_t n, float mx) {
  const vf m = vset1(mx);
  for (int64_t i = 0; i < n; i += VL) {
#if defined(__AVX512F__)
    vstore(y + i, vexp(_mm512_sub_ps(vload(x + i), m)));
#elif defined(__AVX2__)
    vstore(y + i, vexp(_mm256_sub_ps(vload(x + i), m)));
#else
    vf d = vload(x + i);
    for (int l = 0; l < VL; l++) d.l[l] -= mx;
    vstore(y + i, vexp(d));
#endif
  }
}

static inline float dot(const float* a, const float* b, int64_t n) {
  vf acc = vzero();
  const int64_t nv = n - n % VL;
  for (int64_t i = 0; i < nv; i += VL) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (int64_t i = nv; i < n; i++) s = std::fma(a[i], b[i], s);
  return s;
}

// The softmax denominator: the sum of s over the keys a query sees, the r-th of them (r counted in cache order
// over visible keys only) added into lane r % VL in order, then vsum's fixed tree. The r-th visible key is
// the same key for a row of a tree (its ancestors sit among masked siblings) and for the same token decoded
// alone after its path (packed right after the prefix), so both get the same sum. Keys [0, st) are all
// visible (their full vectors go VL lanes at a time); keys [st, nk) count where ``sees``.
template <class Sees>
static inline float visible_sum(const float* s, int64_t st, int64_t nk, Sees sees) {
  const int64_t nv = st - st % VL;
  vf acc = vzero();
  for (int64_t j = 0; j < nv; j += VL) acc = vadd(acc, vload(s + j));
  float lane[VL];
  vstore(lane, acc);
  int64_t r = nv;
  for (int64_t j = nv; j < st; j++) lane[r++ % VL] += s[j];
  for (int64_t j = st; j < nk; j++)
    if (sees(j)) lane[r++ % VL] += s[j];
  return vsum(vload(lane));
}

// o_u = sum_j p_u[j] v_j / l_u over nk keys for QB queries, accumulators in registers: per query and element
// one chain over the keys in cache order, exactly as the one-query loop in attention_ws. The keys go in
// blocks of JB rows; within a block, VNC vectors of the head dimension at a time (AVX2's 16 registers hold
// 4 x 2 accumulators, not the 4 x 8 of hd = 64), the accumulators spilled to acc [QB, hd] between blocks
// (a float stored and loaded is unchanged, so the chains are those of one pass). The block's value rows
// stay in L1 across the chunks, and the first chunk fetches the next block's whole rows, so memory is read
// once and in order (chunks over the whole cache made a 16-sequence decode 1.25x slower).
#if defined(__AVX512F__)
enum { VNC = 4 };
#else
enum { VNC = 2 };
#endif
enum { JB = 32 };
template <int QB, class W>
static inline void values_q(const float* p0, int64_t nkp, const W* vb, int64_t nk, int64_t hd,
                            float* const* o, const float* l, float* acc) {
  for (int64_t j0 = 0; j0 < nk; j0 += JB) {
    const int64_t j1 = imin(nk, j0 + JB);
    for (int64_t d0 = 0; d0 < hd; d0 += VNC * VL) {
      vf a[QB][VNC];
      for (int u = 0; u < QB; u++)
        for (int c = 0; c < VNC; c++) a[u][c] = j0 ? vload(acc + u * hd + d0 + c * VL) : vzero();
      for (int64_t j = j0; j < j1; j++) {
        const W* vr = vb + j * hd + d0;
        if (d0 == 0 && j + JB < nk)
          for (int64_t e = 0; e < hd; e += 64 / (int64_t)sizeof(W)) __builtin_prefetch(vr + JB * hd + e, 0, 3);
        vf vv[VNC];
        for (int c = 0; c < VNC; c++) vv[c] = vload_w(vr + c * VL);
        for (int u = 0; u < QB; u++) {
          const vf pv = vset1(p0[u * nkp + j]);
          for (int c = 0; c < VNC; c++) a[u][c] = vfma(pv, vv[c], a[u][c]);
        }
      }
      if (j1 < nk) {
        for (int u = 0; u < QB; u++)
          for (int c = 0; c < VNC; c++) vstore(acc + u * hd + d0 + c * VL, a[u][c]);
      } else {
        for (int u = 0; u < QB; u++) {
          const vf inv = vset1(1.0f / l[u]);
          for (int c = 0; c < VNC; c++) vstore(o[u] + d0 + c * VL, vmul(a[u][c], inv));
        }
      }
    }
  }
}

// s_u[b VL .. (b + 1) VL) = scale * q_u . k over KB blocks of VL keys (SdCache.kt layout) for QN queries: each
// score one FMA chain over d = 0..hd-1 in its key's lane, whatever QN and KB are
template <int QN, int KB>
static inline void scores_q(const float* blk, int64_t hd, const float* const* q, float* s, int64_t nkp, vf vscale) {
  vf a[QN][KB];
  for (int u = 0; u < QN; u++)
    for (int b = 0; b < KB; b++) a[u][b] = vzero();
  for (int64_t d = 0; d < hd; d++) {
    vf kd[KB];
    for (int b = 0; b < KB; b++) kd[b] = vload(blk + (b * hd + d) * VL);
    for (int u = 0; u < QN; u++) {
      const vf qv = vset1(q[u][d]);
      for (int b = 0; b < KB; b++) a[u][b] = vfma(qv, kd[b], a[u][b]);
    }
  }
  for (int u = 0; u < QN; u++)
    for (int b = 0; b < KB; b++) vstore(s + u * nkp + b * VL, vmul(a[u][b], vscale));
}

// Register blocks of the attention: scores of SQN queries x SKB blocks of VL keys at a time (AVX-512's 32 registers:
// 24 accumulators, 4 key vectors, a broadcast; AVX2's 16: 8 + 2 + 1), values of VQB queries at a time (VQB x VNC
// accumulators). The blocks only group independent chains: no value depends on them.
#if defined(__AVX512F__)
enum { SQN = 6, SKB = 4, VQB = 6 };
#else
enum { SQN = 4, SKB = 2, VQB = 4 };
#endif

// scores_q for kb (SKB, 2 or 1) blocks of VL keys
template <int QN>
static inline void scores_kb(int kb, const float* blk, int64_t hd, const float* const* q, float* s, int64_t nkp, vf vscale) {
  if (kb == SKB) scores_q<QN, SKB>(blk, hd, q, s, nkp, vscale);
  else if (kb == 2) scores_q<QN, 2>(blk, hd, q, s, nkp, vscale);
  else scores_q<QN, 1>(blk, hd, q, s, nkp, vscale);
}

#if defined(__AVX512BF16__)
// scores_q against bf16 keys (SdCache.kt with vh: [hd / 2][VL][2] per block) and bf16 queries: each score one
// vdpbf16ps chain over the pairs d = (0, 1), (2, 3), ... in its key's lane, whatever QN and KB are
template <int QN, int KB>
static inline void scores_q_dp(const u16* blk, int64_t hd, const u16* const* q, float* s, int64_t nkp, vf vscale) {
  __m512 a[QN][KB];
  for (int u = 0; u < QN; u++)
    for (int b = 0; b < KB; b++) a[u][b] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd; d += 2) {
    __m512bh kd[KB];
    for (int b = 0; b < KB; b++) kd[b] = (__m512bh)_mm512_loadu_si512((const void*)(blk + (b * hd + d) * VL));
    for (int u = 0; u < QN; u++) {
      uint32_t pair;
      std::memcpy(&pair, q[u] + d, 4);
      const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)pair);
      for (int b = 0; b < KB; b++) a[u][b] = _mm512_dpbf16_ps(a[u][b], qv, kd[b]);
    }
  }
  for (int u = 0; u < QN; u++)
    for (int b = 0; b < KB; b++) vstore(s + u * nkp + b * VL, vmul(a[u][b], vscale));
}

template <int QN>
static inline void scores_kb_dp(int kb, const u16* blk, int64_t hd, const u16* const* q, float* s, int64_t nkp, vf vscale) {
  if (kb == SKB) scores_q_dp<QN, SKB>(blk, hd, q, s, nkp, vscale);
  else if (kb == 2) scores_q_dp<QN, 2>(blk, hd, q, s, nkp, vscale);
  else scores_q_dp<QN, 1>(blk, hd, q, s, nkp, vscale);
}
#endif

// y = x * rsqrt(mean(x^2) + eps) * w, one row
static inline void rmsnorm_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  const float r = 1.0f / std::sqrt(dot(x, x, D) / (float)D + eps);
  for (int64_t d = 0; d < D; d++) y[d] = (x[d] * r) * w[d];
}

static void rmsnorm_ws(const float* x, const float* w, float* y, int64_t M, int64_t D, float eps) {
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; m++) rmsnorm_row(x + m * D, w, y + m * D, D, eps);
}

// out[m, i] = silu(gu[m, i]) * gu[m, I + i] = g / (1 + exp(-g)) * u; vexp's lanes equal exp_poly
static inline float silu_mul1(float g, float u) { return g / (1.0f + exp_poly(-g)) * u; }

static void silu_mul_ws(const float* gu, float* out, int64_t M, int64_t I) {
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; m++) {
    const float* g = gu + m * 2 * I;
    float* o = out + m * I;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + VL <= I; i += VL) {
      const vf gv = vload(g + i);
      const vf e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      vstore(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), vload(g + I + i)));
    }
#elif defined(__AVX2__)
    for (; i + VL <= I; i += VL) {
      const vf gv = vload(g + i);
      const vf e = vexp(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      vstore(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), vload(g + I + i)));
    }
#endif
    for (; i < I; i++) o[i] = silu_mul1(g[i], g[I + i]);
  }
}

// ---- one forward's rows and the attention over the slot cache ---------------------------------------
struct SdRows {  // what each of the T new tokens is; all [T] unless said
  int64_t T;
  const int64_t* slot;       // KV slot of the row's sequence
  const int64_t* start;      // cache length of that slot before this forward: keys [0, start) are visible
  const int64_t* index;      // the row's index among its sequence's new tokens (its key goes to start + index)
  const int64_t* nnew;       // new tokens of the row's sequence
  const uint8_t* mask;       // [T, mask_stride]: row t sees new token j iff mask[t, j]; NULL = causal (j <= index)
  int64_t mask_stride;
  const float* cos;          // [T, hd] RoPE tables at each row's position
  const float* sin;          // [T, hd] signed sin: rope(x) = x cos + swap_halves(x) sin
  int64_t* kt_valid;         // [S] per slot: keys [0, kt_valid) are already in every layer's kt (see SdCache)
};

struct SdCache {  // one layer's K and V: [S, nkv, L, hd] fp32 each
  float* k;
  float* v;
  int64_t S, nkv, L, hd;
  // K again, transposed in blocks of VL keys: [S, nkv, Lt / VL, hd, VL] fp32 (Lt = L rounded up to VL), so a query
  // scores VL keys with hd broadcast FMAs and no lane sums. Filled lazily from k by the attention (keys
  // [kt_valid, end) of each slot), so rollback and compaction only lower kt_valid.
  // With vh (AVX512_BF16 builds, a model whose weights are bf16), kt holds the keys rounded to bf16 in pairs of
  // dimensions, [S, nkv, Lt / VL, hd / 2, VL, 2] u16 (half the bytes), and the scores are vdpbf16ps chains against
  // the query rounded to bf16, as a bf16 model's attention scores (q k^T in bf16) are.
  void* kt;
  int64_t Lt;
  // NULL, or V rounded to bf16, [S, nkv, L, hd] (half the bytes the values read), filled with kt from v: the bf16 copies
  bf16_t* vh;
};

// rope q and k heads of every row in place inside qkv [T, (nh + 2 nkv) hd], then write k, v to the cache
static void rope_store_ws(const SdRows* r, float* qkv, int64_t nh, const SdCache* c) {
  const int64_t hd = c->hd, half = hd / 2, nkv = c->nkv, width = (nh + 2 * nkv) * hd;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < r->T; t++) {
    float* row = qkv + t * width;
    const float* cs = r->cos + t * hd;
    const float* sn = r->sin + t * hd;
    float tmp[1024];
    for (int64_t h = 0; h < nh + nkv; h++) {
      float* x = row + h * hd;
      for (int64_t d = 0; d < hd; d++) tmp[d] = x[d];
      int64_t d = 0;
      if (half % VL == 0)  // the same fma per element, VL at a time (the scalar loop was 2% of a 17-row forward)
        for (; d < hd; d += VL) {
          const int64_t o = d < half ? d + half : d - half;
          vstore(x + d, vfma(vload(tmp + o), vload(sn + d), vmul(vload(tmp + d), vload(cs + d))));
        }
      for (; d < hd; d++) x[d] = std::fma(tmp[(d + half) % hd], sn[d], tmp[d] * cs[d]);
    }
    const int64_t pos = r->start[t] + r->index[t];
    for (int64_t h = 0; h < nkv; h++) {
      const int64_t off = ((r->slot[t] * nkv + h) * c->L + pos) * hd;
      std::memcpy(c->k + off, row + (nh + h) * hd, hd * sizeof(float));
      std::memcpy(c->v + off, row + (nh + nkv + h) * hd, hd * sizeof(float));
    }
  }
}

// out[t, h*hd:(h+1)*hd] = softmax(q k^T / sqrt(hd)) v over row t's visible keys, in cache order.
// Tasks are (sequence, KV head, block of queries), a query being (row, head sharing that KV head); each
// key and value row is loaded once for the block. A query's score for a key is one FMA chain over d in
// the key's lane of a K block (SdCache.kt), and its output one chain over the keys in cache order,
// whatever else the task holds; a key a query
// does not see gets p = 0, and fma(0, v, acc) leaves acc bit-identical (acc starts at +0 and adding
// +-0 to it never changes it), so masked keys cost time but never change a value.
static void attention_ws(const SdRows* r, const float* qkv, int64_t nh, const SdCache* c, float* out) {
  const int64_t hd = c->hd, nkv = c->nkv, group = nh / nkv, width = (nh + 2 * nkv) * hd, T = r->T;
  const float scale = 1.0f / std::sqrt((float)hd);
  static thread_local std::vector<float> sc;     // [Q, nk] scores, then probabilities
  static thread_local std::vector<float> accs;   // [VQB, hd] output accumulators of up to VQB queries
  static thread_local std::vector<float> ls;     // [Q] softmax denominators
  static thread_local std::vector<const float*> qp;  // [Q] each query's q vector
  static thread_local std::vector<u16> qb16;     // [Q, hd] the queries rounded to bf16 (bf16 copies)
  static thread_local std::vector<const u16*> qp16;  // [Q] into qb16
  static thread_local std::vector<int64_t> seqs; // first row of each sequence, then T (each thread its own)
  static thread_local std::vector<std::array<int64_t, 4>> tasks;  // (sequence, KV head, first query, queries)
  // sequences are runs of rows with the same slot and start (the batch lays them out one after another)
  int64_t nseq = 0;
  for (int64_t t = 0; t < T; t++)
    if (t == 0 || r->slot[t] != r->slot[t - 1] || r->start[t] != r->start[t - 1]) nseq++;
  if ((int64_t)seqs.size() < nseq + 1) seqs.resize(nseq + 1);
  {
    int64_t i = 0;
    for (int64_t t = 0; t < T; t++)
      if (t == 0 || r->slot[t] != r->slot[t - 1] || r->start[t] != r->start[t - 1]) seqs[i++] = t;
    seqs[nseq] = T;
  }
  // keys not yet in kt (new this forward, or since a rollback/compaction): transpose them in
#pragma omp for schedule(static) collapse(2)
  for (int64_t b = 0; b < nseq; b++)
    for (int64_t g = 0; g < nkv; g++) {
      const int64_t t0 = seqs[b], nk = r->start[t0] + r->nnew[t0], slot = r->slot[t0];
      const float* kb = c->k + (slot * nkv + g) * c->L * hd;
      if (c->vh) {  // pairs of dimensions: element (j, d) at block j / VL, pair d / 2, lane j % VL, d % 2
        u16* kt = (u16*)c->kt + (slot * nkv + g) * c->Lt * hd;
        const float* vs = c->v + (slot * nkv + g) * c->L * hd;
        bf16_t* vh = c->vh + (slot * nkv + g) * c->L * hd;
        for (int64_t j = r->kt_valid[slot]; j < nk; j++)
          for (int64_t d = 0; d < hd; d++) {
            kt[((j / VL) * hd + (d & ~(int64_t)1)) * VL + (j % VL) * 2 + (d & 1)] = f32_to_bf16(kb[j * hd + d]);
            vh[j * hd + d].v = f32_to_bf16(vs[j * hd + d]);
          }
      } else {
        float* kt = (float*)c->kt + (slot * nkv + g) * c->Lt * hd;
        for (int64_t j = r->kt_valid[slot]; j < nk; j++)
          for (int64_t d = 0; d < hd; d++) kt[((j / VL) * hd + d) * VL + j % VL] = kb[j * hd + d];
      }
    }
  // tasks: (sequence, KV head, block of up to QB queries), so a one-sequence forward still feeds every
  // thread (3 tasks of a 9-head, 3-KV-head model kept one of 2 threads idle a third of the time)
  // Blocks of balanced size, and for one sequence with more than one block per KV head as many blocks as make the
  // task count a multiple of the threads' (17 rows x 3 queries per KV head: 3 x 5 blocks of <= 12 left a thread
  // idle for the 15th; now 3 x 6 of 8-9). The blocks only group queries: no value depends on them.
  enum { QB = 12 };
  const int64_t nthr = omp_get_num_threads();
  tasks.clear();
  for (int64_t b = 0; b < nseq; b++) {
    const int64_t Q = (seqs[b + 1] - seqs[b]) * group;
    int64_t nb = (Q + QB - 1) / QB;
    if (nseq == 1 && nb > 1)
      for (const int64_t nb0 = nb; (nkv * nb) % nthr && nb < Q && nb < nb0 + nthr;) nb++;
    for (int64_t g = 0; g < nkv; g++)
      for (int64_t i = 0, q0 = 0; i < nb; i++) {
        const int64_t n = Q / nb + (i < Q % nb);
        tasks.push_back({b, g, q0, n});
        q0 += n;
      }
  }
  const int64_t ntasks = (int64_t)tasks.size();
  auto task = [&](int64_t ti) {
      const int64_t b = tasks[ti][0], g = tasks[ti][1], qo = tasks[ti][2], Q = tasks[ti][3];
      const int64_t t0 = seqs[b], st = r->start[t0], nn = r->nnew[t0], nk = st + nn;
      const int64_t nkp = (nk + VL - 1) / VL * VL;
      const int64_t base = (r->slot[t0] * nkv + g) * c->L;
      const float* vb = c->v + base * hd;
      if ((int64_t)sc.size() < Q * nkp) sc.resize(Q * nkp);
      if ((int64_t)qp.size() < Q) qp.resize(Q);
      if ((int64_t)accs.size() < VQB * hd) accs.resize(VQB * hd);
      if ((int64_t)ls.size() < Q) ls.resize(Q);
      auto sees = [&](int64_t t, int64_t j) {  // row t sees cache index j
        if (j < st) return true;
        const int64_t jn = j - st;
        return r->mask ? r->mask[t * r->mask_stride + jn] != 0 : jn <= r->index[t];
      };
      const int64_t kt0 = (r->slot[t0] * nkv + g) * c->Lt * hd;  // this slot and KV head's first element of kt
      // lim: one past the last key any of the task's queries sees (a prompt's causal rows see only keys up to their
      // own). Keys from lim on are neither scored nor read for the values: a query's score for them would be set to
      // -inf and its p = 0 leaves every value chain unchanged, so skipping them changes no bit.
      int64_t lim = st;
      for (int64_t t = t0 + qo / group; t <= t0 + (qo + Q - 1) / group; t++) {
        int64_t last = r->index[t];  // causal: new keys [0, index]
        if (r->mask)
          for (last = nn - 1; last >= 0 && !r->mask[t * r->mask_stride + last];) last--;
        lim = st + last + 1 > lim ? st + last + 1 : lim;
      }
      const int64_t nkl = (lim + VL - 1) / VL * VL;  // the keys scored: whole blocks up to lim
      // scores: query qi = (row t0 + qi / group, head g * group + qi % group). A key's score is one FMA
      // chain over d = 0..hd-1 in its lane of a block, whichever block and whatever else is in it.
      for (int64_t qi = 0; qi < Q; qi++) qp[qi] = qkv + (t0 + (qo + qi) / group) * width + (g * group + (qo + qi) % group) * hd;
      if (c->vh) {  // each query rounded once, element by element (the same rounding as the keys')
        if ((int64_t)qb16.size() < Q * hd) qb16.resize(Q * hd);
        if ((int64_t)qp16.size() < Q) qp16.resize(Q);
        for (int64_t qi = 0; qi < Q; qi++) {
          for (int64_t d = 0; d < hd; d++) qb16[qi * hd + d] = f32_to_bf16(qp[qi][d]);
          qp16[qi] = qb16.data() + qi * hd;
        }
      }
      const vf vscale = vset1(scale);
      // SKB blocks of keys at a time while there are that many (then 2, then 1); for each, the task's queries in
      // groups of balanced size (11 = 6 + 5, not 6 + 4 + 1), so the blocks' keys are read from L1 by every group
      const int64_t ngs = (Q + SQN - 1) / SQN;
      for (int64_t j0 = 0; j0 < nkl;) {
        const int kb = j0 + SKB * VL <= nkl ? SKB : j0 + 2 * VL <= nkl ? 2 : 1;
        const int64_t boff = kt0 + (j0 / VL) * hd * VL;  // the block's first element (of either kt layout)
        for (int64_t gi = 0, qi = 0; gi < ngs; gi++) {
          const int qb = (int)(Q / ngs + (gi < Q % ngs));
          float* so = sc.data() + qi * nkp + j0;
          const float* const* qq = qp.data() + qi;
#if defined(__AVX512BF16__)
          if (c->vh) {
            const u16* blk16 = (const u16*)c->kt + boff;
            const u16* const* q16 = qp16.data() + qi;
            switch (qb) {
              case 1: scores_kb_dp<1>(kb, blk16, hd, q16, so, nkp, vscale); break;
              case 2: scores_kb_dp<2>(kb, blk16, hd, q16, so, nkp, vscale); break;
              case 3: scores_kb_dp<3>(kb, blk16, hd, q16, so, nkp, vscale); break;
              case 4: scores_kb_dp<4>(kb, blk16, hd, q16, so, nkp, vscale); break;
              case 5: scores_kb_dp<5>(kb, blk16, hd, q16, so, nkp, vscale); break;
              default: scores_kb_dp<6>(kb, blk16, hd, q16, so, nkp, vscale); break;
            }
            qi += qb;
            continue;
          }
#endif
          const float* blk = (const float*)c->kt + boff;
          switch (qb) {
            case 1: scores_kb<1>(kb, blk, hd, qq, so, nkp, vscale); break;
            case 2: scores_kb<2>(kb, blk, hd, qq, so, nkp, vscale); break;
            case 3: scores_kb<3>(kb, blk, hd, qq, so, nkp, vscale); break;
#if defined(__AVX512F__)
            case 4: scores_kb<4>(kb, blk, hd, qq, so, nkp, vscale); break;
            case 5: scores_kb<5>(kb, blk, hd, qq, so, nkp, vscale); break;
            default: scores_kb<6>(kb, blk, hd, qq, so, nkp, vscale); break;
#else
            default: scores_kb<4>(kb, blk, hd, qq, so, nkp, vscale); break;
#endif
          }
          qi += qb;
        }
        j0 += kb * VL;
      }
      for (int64_t qi = 0; qi < Q; qi++)  // keys a query does not see
        if (r->mask) {
          for (int64_t j = st; j < lim; j++)
            if (!sees(t0 + (qo + qi) / group, j)) sc[qi * nkp + j] = -INFINITY;
        } else {  // causal: the keys past the row's own, a range
          for (int64_t j = st + r->index[t0 + (qo + qi) / group] + 1; j < lim; j++) sc[qi * nkp + j] = -INFINITY;
        }
      for (int64_t qi = 0; qi < Q; qi++) {
        float* s = sc.data() + qi * nkp;
        for (int64_t j = lim; j < nkl; j++) s[j] = -INFINITY;
        vf vm = vset1(-INFINITY);  // the max is exact in any order (a NaN score never wins, as in a > m ? a : m)
        for (int64_t j = 0; j < nkl; j += VL) vm = vmax(vload(s + j), vm);
        float mx = -INFINITY, lane[VL];
        vstore(lane, vm);
        for (int i = 0; i < VL; i++) mx = lane[i] > mx ? lane[i] : mx;
        exp_shifted(s, s, nkl, mx);  // a key the query does not see: exp(-inf) = 0
        const int64_t t = t0 + (qo + qi) / group;  // causal: the keys [0, st + index + 1) exactly
        ls[qi] = r->mask ? visible_sum(s, st, nk, [&](int64_t j) { return sees(t, j); })
                         : visible_sum(s, st + r->index[t] + 1, 0, [](int64_t) { return false; });
      }
      // values: per query one chain over the keys in cache order, up to four queries at a time with their
      // accumulators in registers, VNC vectors of the head at a time (hd a multiple of VNC VL; else one
      // query at a time from memory, same chains)
      // values from V as fp32 (v) or rounded to bf16 (vh): the same chains, each element widened exactly
      auto values = [&](const auto* vw) {
        using W = std::remove_cv_t<std::remove_pointer_t<decltype(vw)>>;
        int64_t qi = 0;
        if (hd % (VNC * VL) == 0) {
          const int64_t ngv = (Q + VQB - 1) / VQB;  // groups of balanced size, as the scores'
          for (int64_t gi = 0; gi < ngv; gi++) {
            const int qb = (int)(Q / ngv + (gi < Q % ngv));
            float* os[VQB];
            for (int u = 0; u < qb; u++)
              os[u] = out + (t0 + (qo + qi + u) / group) * nh * hd + (g * group + (qo + qi + u) % group) * hd;
            const float* p0 = sc.data() + qi * nkp;
            switch (qb) {
              case 1: values_q<1, W>(p0, nkp, vw, lim, hd, os, ls.data() + qi, accs.data()); break;
              case 2: values_q<2, W>(p0, nkp, vw, lim, hd, os, ls.data() + qi, accs.data()); break;
              case 3: values_q<3, W>(p0, nkp, vw, lim, hd, os, ls.data() + qi, accs.data()); break;
  #if defined(__AVX512F__)
              case 4: values_q<4, W>(p0, nkp, vw, lim, hd, os, ls.data() + qi, accs.data()); break;
              case 5: values_q<5, W>(p0, nkp, vw, lim, hd, os, ls.data() + qi, accs.data()); break;
              default: values_q<6, W>(p0, nkp, vw, lim, hd, os, ls.data() + qi, accs.data()); break;
  #else
              default: values_q<4, W>(p0, nkp, vw, lim, hd, os, ls.data() + qi, accs.data()); break;
  #endif
            }
            qi += qb;
          }
        }
        for (; qi < Q; qi++) {
          float* a = accs.data();
          for (int64_t d = 0; d < hd; d++) a[d] = 0.0f;
          const float* p0 = sc.data() + qi * nkp;
          for (int64_t j = 0; j < lim; j++) {
            const auto* vr = vw + j * hd;
            const vf pv = vset1(p0[j]);
            int64_t d = 0;
            for (; d + VL <= hd; d += VL) vstore(a + d, vfma(pv, vload_w(vr + d), vload(a + d)));
            for (; d < hd; d++) a[d] = std::fma(p0[j], w_scalar(vr + d), a[d]);
          }
          float* o = out + (t0 + (qo + qi) / group) * nh * hd + (g * group + (qo + qi) % group) * hd;
          const float inv = 1.0f / ls[qi];
          for (int64_t d = 0; d < hd; d++) o[d] = a[d] * inv;
        }
      };
      if (c->vh) values(c->vh + base * hd);
      else values(vb);
  };
  // one sequence: each thread a run of consecutive tasks (a KV head's query blocks one after another on one core,
  // its keys and values then read from that core's L2 after the first block), the runs of equal work: a causal
  // prompt's later blocks read more keys, and equal counts of tasks (3 KV heads on 2 threads) gave one thread
  // 0.875 of the work of a head and a half, the other 0.625. Every thread computes the same split; where a task
  // runs changes no value. A batch: tasks as threads come free.
  if (nseq == 1) {
    static thread_local std::vector<double> work;  // [ntasks + 1] prefix sums of queries x keys read
    if ((int64_t)work.size() < ntasks + 1) work.resize(ntasks + 1);
    work[0] = 0;
    for (int64_t ti = 0; ti < ntasks; ti++) {
      const int64_t t0 = seqs[tasks[ti][0]], last = t0 + (tasks[ti][2] + tasks[ti][3] - 1) / group;
      const int64_t keys = r->mask ? r->start[t0] + r->nnew[t0] : r->start[t0] + r->index[last] + 1;
      work[ti + 1] = work[ti] + (double)tasks[ti][3] * (double)keys;
    }
    const int64_t me = omp_get_thread_num();
    auto first = [&](int64_t k) {  // the first task of thread k: the first whose work starts at or past k / nthr
      int64_t ti = 0;
      while (ti < ntasks && work[ti] < work[ntasks] * (double)k / (double)nthr) ti++;
      return k >= nthr ? ntasks : ti;
    };
    for (int64_t ti = first(me), end = first(me + 1); ti < end; ti++) task(ti);
#pragma omp barrier
  } else {
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < ntasks; ti++) task(ti);
  }
}

// ---- the decoder stack ------------------------------------------------------------------------------
struct SdLayer {
  const float* attn_norm;  // [D]
  SdWeight wqkv;           // [(nh + 2 nkv) hd, D] (+ bias)
  SdWeight wo;             // [D, nh hd] (+ bias)
  const float* ffn_norm;   // [D]
  SdWeight w13;            // [2I, D]: gate then up
  SdWeight w2;             // [D, I]
  SdCache cache;
};

struct SdModel {
  int64_t D, I, nh, nkv, hd;
  float eps;
};

struct SdScratch {  // all fp32 [T, width] unless said
  float* h;    // [T, D]
  float* qkv;  // [T, (nh + 2 nkv) hd]
  float* att;  // [T, nh hd]
  float* gu;   // [T, 2I]
  float* act;  // [T, I]
  u16* xb;     // [T, max(D, nh hd, I)] bf16
};

// the layer after its attention input a [T, wqkv.K]: attention into the residual stream x [T, D], then the MLP
static void layer_from_ws(const SdModel* m, const SdLayer* L, const SdRows* r, float* x, const float* a,
                          const SdScratch* s) {
  const int64_t T = r->T, D = m->D, I = m->I;
  linear_any(&L->wqkv, a, T, s->qkv, 0, s->xb);
  rope_store_ws(r, s->qkv, m->nh, &L->cache);
  attention_ws(r, s->qkv, m->nh, &L->cache, s->att);
  linear_any(&L->wo, s->att, T, x, 1, s->xb);
  rmsnorm_ws(x, L->ffn_norm, s->h, T, D, m->eps);
  linear_any(&L->w13, s->h, T, s->gu, 0, s->xb);
  silu_mul_ws(s->gu, s->act, T, I);
  linear_any(&L->w2, s->act, T, x, 1, s->xb);
}

static void layer_ws(const SdModel* m, const SdLayer* L, const SdRows* r, float* x, const SdScratch* s) {
  rmsnorm_ws(x, L->attn_norm, s->h, r->T, m->D, m->eps);
  layer_from_ws(m, L, r, x, s->h, s);
}

extern "C" {

// Which build this is: 3 = AMX (+ AVX512_BF16), 2 = AVX512 + AVX512_BF16, 1 = AVX2 + FMA + F16C, 0 = generic.
int sd_isa() {
#if defined(__AMX_BF16__)
  return 3;
#elif defined(__AVX512BF16__)
  return 2;
#elif defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

// 1 when this build's products can run: the amx build asks Linux for the tile state once per process (arch_prctl
// ARCH_REQ_XCOMP_PERM); without it a tile instruction would fault. Other builds: always 1.
int sd_ready() {
#if defined(__AMX_BF16__)
  static const int ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
#else
  return 1;
#endif
}

// Lanes per vector of this build (the block of keys in SdCache.kt).
int64_t sd_vl() { return VL; }

// Elements of w's packed copy (written to out unless NULL); 0 = K does not pack, keep w as it is.
int64_t sd_pack(int32_t dtype, const void* w, int64_t N, int64_t K, void* out) { return pack(dtype, w, N, K, out); }

// Rows ids[0..R) (NULL: all N) of a packed [N, K] weight into out [R, K] row-major; ids must lie in [0, N).
void sd_unpack(int32_t dtype, const void* packed, int64_t N, int64_t K, const int64_t* ids, int64_t R, void* out) {
  unpack(dtype, packed, N, K, ids, R, out);
}

// x [T, D] residual stream in place through layers [0, n); aux[i] (or NULL): copy of x after layer i.
void sd_forward(const SdModel* m, const SdLayer* layers, int64_t n, const SdRows* r, float* x, const SdScratch* s,
                float* const* aux) {
#pragma omp parallel
  {
    for (int64_t i = 0; i < n; i++) {
      layer_ws(m, layers + i, r, x, s);
      if (aux && aux[i]) {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < r->T; t++) std::memcpy(aux[i] + t * m->D, x + t * m->D, m->D * sizeof(float));
      }
    }
  }
}

// One layer from a given attention input a [T, wqkv.K] (a draft head's: EAGLE-1 feeds x itself, EAGLE-3 a
// 2D-wide concatenation of norms), x [T, D] the residual stream in place; layer->attn_norm is not read.
// s->xb must hold [T, max(wqkv.K, nh hd, I)].
void sd_layer_from(const SdModel* m, const SdLayer* layer, const SdRows* r, float* x, const float* a, const SdScratch* s) {
#pragma omp parallel
  layer_from_ws(m, layer, r, x, a, s);
}

// An EAGLE-3 head's draft step in one call (heads/native.py): its fuse, its layer and its draft LM head, one
// parallel region instead of ~10 small ops (the head runs three times per speculative step).
//   x [T, D]: fc != NULL: = feat [T, fc.K] . fc^T (the target's fused layers); NULL: holds the head's own outputs;
//   a [T, 2D] = cat(rmsnorm(emb, w_in), rmsnorm(x, w_hid)) row by row; the layer on a, x in place;
//   logits [nl, lm.N] = rmsnorm(x[out_rows[i]], w_out) . lm^T for the nl rows asked for.
// s->h must hold [T, D] and s->xb [T, max(fc.K, 2D, nh hd, I)]; nl <= T.
void sd_eagle3_step(const SdModel* m, const SdLayer* layer, const SdRows* r, const SdWeight* fc, const float* feat,
                    const float* emb, const float* w_in, const float* w_hid, float* a, float* x,
                    const int64_t* out_rows, int64_t nl, const float* w_out, const SdWeight* lm, float* logits,
                    const SdScratch* s) {
#pragma omp parallel
  {
    const int64_t T = r->T, D = m->D;
    if (fc) linear_any(fc, feat, T, x, 0, s->xb);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      rmsnorm_row(emb + t * D, w_in, a + t * 2 * D, D, m->eps);
      rmsnorm_row(x + t * D, w_hid, a + t * 2 * D + D, D, m->eps);
    }
    layer_from_ws(m, layer, r, x, a, s);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < nl; i++) rmsnorm_row(x + out_rows[i] * D, w_out, s->h + i * D, D, m->eps);
    linear_any(lm, s->h, nl, logits, 0, s->xb);
  }
}

// An EAGLE-1 head's draft step in one call (heads/native.py), as sd_eagle3_step is EAGLE-3's:
//   a [T, 2D] = cat(emb, feat) row by row; x [T, D] = a . fc^T (+ bias);
//   the layer on x itself (the EAGLE-1 layer has no input norm), x in place;
//   logits [nl, lm.N] = x[out_rows[i]] . lm^T for the nl rows asked for (the head predicts the target's feature
//   after its final norm, so the target's LM head rows apply as they are).
// s->h must hold [T, D] and s->xb [T, max(2D, nh hd, I)]; nl <= T.
void sd_eagle1_step(const SdModel* m, const SdLayer* layer, const SdRows* r, const SdWeight* fc, const float* feat,
                    const float* emb, float* a, float* x, const int64_t* out_rows, int64_t nl, const SdWeight* lm,
                    float* logits, const SdScratch* s) {
#pragma omp parallel
  {
    const int64_t T = r->T, D = m->D;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      std::memcpy(a + t * 2 * D, emb + t * D, D * sizeof(float));
      std::memcpy(a + t * 2 * D + D, feat + t * D, D * sizeof(float));
    }
    linear_any(fc, a, T, x, 0, s->xb);
    layer_from_ws(m, layer, r, x, x, s);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < nl; i++) std::memcpy(s->h + i * D, x + out_rows[i] * D, D * sizeof(float));
    linear_any(lm, s->h, nl, logits, 0, s->xb);
  }
}

// y [M, N] (=, or += when acc) x [M, K] . W^T (+ bias); xb: [M, K] u16 scratch (bf16 path)
void sd_linear(const SdWeight* w, const float* x, int64_t M, float* y, int acc, u16* xb) {
#pragma omp parallel
  linear_any(w, x, M, y, acc, xb);
}

// sd_linear (no bias accumulation: y =) and, per row of y, what verification and logprobs read, taken as the
// outputs are written instead of read back afterwards (an LM head's rows are evicted by its own weight
// stream before it ends): amax[m] = the first index of the row's maximum, lse[m] = logsumexp of the row,
// finite[m] = every value finite (when 0, amax and lse are not set). The panels are folded in STAT_GROUPS fixed
// groups and the partials merged in group order, so a row's figures depend neither on the other rows nor on the
// thread count (engine/cpu/threads.py changes it while the machine is busy).
void sd_linear_stats(const SdWeight* w, const float* x, int64_t M, float* y, u16* xb, int64_t* amax, float* lse,
                     uint8_t* finite) {
  const int64_t ng = STAT_GROUPS;
  std::vector<RowPart> parts((size_t)(ng * M), RowPart{-INFINITY, 0.0f, -1, 0});
  RowPart* pp = parts.data();
  const bool packed = w->packed != 0;
#pragma omp parallel
  {
    linear_any(w, x, M, y, 0, xb, packed ? pp : nullptr);
    if (!packed) {  // outputs one at a time (linear_ws): fold each whole row afterwards into group 0
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; m++) fold_row(y + m * w->N, w->N, 0, pp + m);
    }
  }
  for (int64_t m = 0; m < M; m++) {
    float mx = -INFINITY;
    int64_t am = -1, bad = 0;
    for (int64_t t = 0; t < ng; t++) {
      const RowPart& r = pp[t * M + m];
      bad += r.bad;
      if (r.am >= 0 && (r.mx > mx || (r.mx == mx && r.am < am))) {
        mx = r.mx;
        am = r.am;
      }
    }
    finite[m] = bad == 0 && am >= 0;
    if (!finite[m]) continue;
    float s = 0.0f;
    for (int64_t t = 0; t < ng; t++) {
      const RowPart& r = pp[t * M + m];
      if (r.am >= 0) s += r.s * exp_poly(r.mx - mx);
    }
    amax[m] = am;
    lse[m] = mx + std::log(s);
  }
}

void sd_rmsnorm(const float* x, const float* w, float* y, int64_t M, int64_t D, float eps) {
#pragma omp parallel
  rmsnorm_ws(x, w, y, M, D, eps);
}

void sd_silu_mul(const float* gu, float* out, int64_t M, int64_t I) {
#pragma omp parallel
  silu_mul_ws(gu, out, M, I);
}

}  // extern "C"

// The EAGLE draft tree in one call (sd_eagle_tree): its own file, on this one's static pieces.
#include "draft_tree.h"
