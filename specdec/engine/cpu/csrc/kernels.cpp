// specdec's CPU kernels: the llama decoder stack, batch-invariant by construction.
//
// Every value a row produces is computed by the same instructions in the same order whatever M (rows in
// the forward) is, whatever else shares the batch and whichever slot the row sits in:
//   - a product y[m, n] = sum_k x[m, k] W[n, k] keeps one vector accumulator per (m, n), walks k in
//     the same chunks, reduces the lanes with one fixed tree (vsum) and adds the tail in order. Tiles of
//     up to MT rows x NT weight rows only decide how many (m, n) pairs share a weight load, never the
//     arithmetic of one pair; threads split the weight rows (n), never k (no split-K).
//   - attention walks a row's visible keys in cache order (the cached prefix, then the new tokens its
//     mask allows), so a tree path and the same tokens decoded one by one see the same list of keys;
//     the softmax is max, exp and a sequential sum over that list.
//   - norms, RoPE and SiLU are per row with fixed-order reductions; exp is our own polynomial.
// One kernel family serves one row and many: decode, verification (chain and tree), prefill chunks.
//
// Weights are [N, K] row-major (torch's [out, in]) in fp32, bf16 or fp16; activations, the KV cache and
// outputs are fp32. On a CPU with AVX512_BF16 the bf16 product rounds x to bf16 and uses vdpbf16ps
// (32 MACs per instruction, fp32 accumulate); elsewhere bf16/fp16 weights are widened to fp32 in registers.
//
// Built three ways by build.py (AVX512+BF16, AVX2+FMA+F16C, generic); OpenMP shares the libgomp that
// torch loaded, so these loops run on torch's own thread pool (no second pool spinning beside it).
// This file knows nothing about Python, torch, requests or speculation.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
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
#endif

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// ---- products: y[M, N] (=|+=) x[M, K] . W[N, K]^T + bias ------------------------------------------------
// Tiles of up to MT rows x NT weight rows; rows in blocks of MC so a block's activations stay in L2.
//
// Weights are read from a *packed* copy made once at load: [ceil(N/NT)][K/KC][NT][KC], rows past N zero.
// A tile then reads one sequential stream instead of NT streams 4*K bytes apart: on the Zen 5 box
// (2026-11-23) one thread read a [49152, 576] fp32 matrix at 12-16 GB/s through NT=2..8 row streams and at
// 24 GB/s packed, 2 threads at 31-33 GB/s packed for 1 to 4 rows (W.sum(): 34 GB/s). KC is one load's
// worth of elements (two for vdpbf16ps); a K that is not a multiple of KC stays unpacked.
enum { MT = 4, NT = 4, MC = 64 };

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
static inline int64_t chunk(int32_t dtype) { return (dtype == 1 && kDp) ? 32 : VL; }

static inline void finish(float s, const float* bias, int n, float* o, int acc) {
  if (bias) s += bias[n];
  *o = acc ? *o + s : s;
}

// rows x [mt, K] against one packed block of NT weight rows (the first nt are real)
template <int mt, class W>
static inline void tile_packed(const float* x, int64_t K, const W* w, int nt, const float* bias, float* y, int64_t ldy,
                               int acc) {
  vf a[mt][NT];
  for (int m = 0; m < mt; m++)
    for (int n = 0; n < NT; n++) a[m][n] = vzero();
  for (int64_t k = 0; k < K; k += VL) {
    vf wv[NT];
    for (int n = 0; n < NT; n++) wv[n] = vload_w(w + (k * NT + n * VL));
    for (int m = 0; m < mt; m++) {
      vf xv = vload(x + m * K + k);
      for (int n = 0; n < NT; n++) a[m][n] = vfma(xv, wv[n], a[m][n]);
    }
  }
  for (int m = 0; m < mt; m++)
    for (int n = 0; n < nt; n++) finish(vsum(a[m][n]), bias, n, y + m * ldy + n, acc);
}

// one row against one unpacked weight row (K not a multiple of the chunk): the same per-pair arithmetic
template <class W>
static inline float dot_w(const float* x, const W* w, int64_t K) {
  if (kDp && std::is_same<W, bf16_t>::value) {  // as vdpbf16ps would: x rounded to bf16
    float s = 0.0f;
    for (int64_t k = 0; k < K; k++) s = std::fma(bf16_to_f32(f32_to_bf16(x[k])), w_scalar(w + k), s);
    return s;
  }
  const int64_t Kv = K - K % VL;
  vf a = vzero();
  for (int64_t k = 0; k < Kv; k += VL) a = vfma(vload(x + k), vload_w(w + k), a);
  float s = vsum(a);
  for (int64_t k = Kv; k < K; k++) s = std::fma(x[k], w_scalar(w + k), s);
  return s;
}

#if defined(__AVX512BF16__)
// bf16 weights on a CPU with vdpbf16ps: x rounded to bf16 (xb), 32 products per instruction per pair
template <int mt>
static inline void tile_dp(const u16* xb, int64_t K, const u16* w, int nt, const float* bias, float* y, int64_t ldy,
                           int acc) {
  __m512 a[mt][NT];
  for (int m = 0; m < mt; m++)
    for (int n = 0; n < NT; n++) a[m][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512i wv[NT];
    for (int n = 0; n < NT; n++) wv[n] = _mm512_loadu_si512((const void*)(w + (k * NT + n * 32)));
    for (int m = 0; m < mt; m++) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(xb + m * K + k));
      for (int n = 0; n < NT; n++) a[m][n] = _mm512_dpbf16_ps(a[m][n], xv, (__m512bh)wv[n]);
    }
  }
  for (int m = 0; m < mt; m++)
    for (int n = 0; n < nt; n++) finish(vsum(a[m][n]), bias, n, y + m * ldy + n, acc);
}
#endif

template <class W>
static void linear_ws(const SdWeight* wt, const float* x, int64_t M, float* y, int acc, u16* xb) {
  const int64_t N = wt->N, K = wt->K;
  const W* w = (const W*)wt->data;
  if (!wt->packed) {  // rare (K % chunk != 0): one dot per (m, n), in the same order for every M
#pragma omp for schedule(static) collapse(2)
    for (int64_t n = 0; n < N; n++)
      for (int64_t m = 0; m < M; m++) finish(dot_w(x + m * K, w + n * K, K), wt->bias, (int)n, y + m * N + n, acc);
    return;
  }
  const int64_t nb = (N + NT - 1) / NT, nc = (M + MC - 1) / MC;
  const bool dp = kDp && std::is_same<W, bf16_t>::value;
  (void)xb;
#if defined(__AVX512BF16__)
  if (dp) {  // x -> bf16 once per call
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
      const float* xr = x + m * K;
      u16* br = xb + m * K;
      for (int64_t k = 0; k < K; k += 16)  // packed: K % 32 == 0
        _mm256_storeu_si256((__m256i*)(br + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
    }
  }
#endif
#pragma omp for schedule(static) collapse(2)
  for (int64_t c = 0; c < nc; c++)
    for (int64_t b = 0; b < nb; b++) {
      const int64_t n0 = b * NT;
      const int nt = (int)imin(NT, N - n0);
      const W* wb = w + n0 * K;  // a packed block of NT rows holds NT * K elements
      const float* bias = wt->bias ? wt->bias + n0 : nullptr;
      for (int64_t m0 = c * MC; m0 < imin(M, (c + 1) * MC); m0 += MT) {
        const int mt = (int)imin(MT, M - m0);
        float* yo = y + m0 * N + n0;
#if defined(__AVX512BF16__)
        if (dp) {
          const u16* xr = xb + m0 * K;
          const u16* wr = (const u16*)wb;
          switch (mt) {
            case 1: tile_dp<1>(xr, K, wr, nt, bias, yo, N, acc); break;
            case 2: tile_dp<2>(xr, K, wr, nt, bias, yo, N, acc); break;
            case 3: tile_dp<3>(xr, K, wr, nt, bias, yo, N, acc); break;
            default: tile_dp<4>(xr, K, wr, nt, bias, yo, N, acc); break;
          }
          continue;
        }
#endif
        const float* xr = x + m0 * K;
        switch (mt) {
          case 1: tile_packed<1>(xr, K, wb, nt, bias, yo, N, acc); break;
          case 2: tile_packed<2>(xr, K, wb, nt, bias, yo, N, acc); break;
          case 3: tile_packed<3>(xr, K, wb, nt, bias, yo, N, acc); break;
          default: tile_packed<4>(xr, K, wb, nt, bias, yo, N, acc); break;
        }
      }
    }
}

static void linear_any(const SdWeight* w, const float* x, int64_t M, float* y, int acc, u16* xb) {
  if (w->dtype == 0) linear_ws<float>(w, x, M, y, acc, xb);
  else if (w->dtype == 1) linear_ws<bf16_t>(w, x, M, y, acc, xb);
  else linear_ws<f16_t>(w, x, M, y, acc, xb);
}

// packed copy of w [N, K] (element size es bytes) into out, or 0 when K is not a multiple of the chunk
static int64_t pack(int32_t dtype, const void* w, int64_t N, int64_t K, void* out) {
  const int64_t kc = chunk(dtype), es = dtype == 0 ? 4 : 2, nb = (N + NT - 1) / NT;
  if (K % kc) return 0;
  if (out) {
    const char* src = (const char*)w;
    char* dst = (char*)out;
    for (int64_t b = 0; b < nb; b++)
      for (int64_t k = 0; k < K; k += kc)
        for (int64_t n = 0; n < NT; n++) {
          char* d = dst + ((b * K + k) * NT + n * kc) * es;
          if (b * NT + n < N) std::memcpy(d, src + ((b * NT + n) * K + k) * es, kc * es);
          else std::memset(d, 0, kc * es);
        }
  }
  return nb * NT * K;
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

static inline float dot(const float* a, const float* b, int64_t n) {
  vf acc = vzero();
  const int64_t nv = n - n % VL;
  for (int64_t i = 0; i < nv; i += VL) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (int64_t i = nv; i < n; i++) s = std::fma(a[i], b[i], s);
  return s;
}

// y = x * rsqrt(mean(x^2) + eps) * w, one row
static inline void rmsnorm_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  const float r = 1.0f / std::sqrt(dot(x, x, D) / (float)D + eps);
  for (int64_t d = 0; d < D; d++) y[d] = (x[d] * r) * w[d];
}

static void rmsnorm_ws(const float* x, const float* w, float* y, int64_t M, int64_t D, float eps) {
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; m++) rmsnorm_row(x + m * D, w, y + m * D, D, eps);
}

// out[m, i] = silu(gu[m, i]) * gu[m, I + i]
static void silu_mul_ws(const float* gu, float* out, int64_t M, int64_t I) {
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; m++) {
    const float* g = gu + m * 2 * I;
    float* o = out + m * I;
    for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + exp_poly(-g[i])) * g[I + i];
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
};

struct SdCache {  // one layer's K and V: [S, nkv, L, hd] fp32 each
  float* k;
  float* v;
  int64_t S, nkv, L, hd;
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
      for (int64_t d = 0; d < hd; d++) x[d] = std::fma(tmp[(d + half) % hd], sn[d], tmp[d] * cs[d]);
    }
    const int64_t pos = r->start[t] + r->index[t];
    for (int64_t h = 0; h < nkv; h++) {
      const int64_t off = ((r->slot[t] * nkv + h) * c->L + pos) * hd;
      std::memcpy(c->k + off, row + (nh + h) * hd, hd * sizeof(float));
      std::memcpy(c->v + off, row + (nh + nkv + h) * hd, hd * sizeof(float));
    }
  }
}

// out[t, h*hd:(h+1)*hd] = softmax(q k^T / sqrt(hd)) v over row t's visible keys, in cache order
static void attention_ws(const SdRows* r, const float* qkv, int64_t nh, const SdCache* c, float* out) {
  const int64_t hd = c->hd, nkv = c->nkv, group = nh / nkv, width = (nh + 2 * nkv) * hd, T = r->T;
  const float scale = 1.0f / std::sqrt((float)hd);
  static thread_local std::vector<float> sc;
  static thread_local std::vector<int64_t> keys;
#pragma omp for schedule(static) collapse(2)
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < nh; h++) {
      const int64_t st = r->start[t], nn = r->nnew[t], ix = r->index[t];
      const float* q = qkv + t * width + h * hd;
      const int64_t base = (r->slot[t] * nkv + h / group) * c->L;
      const float* kb = c->k + base * hd;
      const float* vb = c->v + base * hd;
      if ((int64_t)sc.size() < st + nn) { sc.resize(st + nn); keys.resize(st + nn); }
      int64_t n = 0;
      for (int64_t j = 0; j < st; j++) keys[n++] = j;
      for (int64_t j = 0; j < nn; j++)
        if (r->mask ? r->mask[t * r->mask_stride + j] != 0 : j <= ix) keys[n++] = st + j;
      float mx = -INFINITY;
      for (int64_t i = 0; i < n; i++) {
        const float s = dot(q, kb + keys[i] * hd, hd) * scale;
        sc[i] = s;
        mx = s > mx ? s : mx;
      }
      float l = 0.0f;
      for (int64_t i = 0; i < n; i++) {
        sc[i] = exp_poly(sc[i] - mx);
        l += sc[i];
      }
      float* o = out + t * nh * hd + h * hd;
      const int64_t hv = hd - hd % VL;
      for (int64_t d0 = 0; d0 < hv; d0 += VL) {
        vf acc = vzero();
        for (int64_t i = 0; i < n; i++) acc = vfma(vset1(sc[i]), vload(vb + keys[i] * hd + d0), acc);
        vstore(o + d0, vmul(acc, vset1(1.0f / l)));
      }
      for (int64_t d = hv; d < hd; d++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < n; i++) acc = std::fma(sc[i], vb[keys[i] * hd + d], acc);
        o[d] = acc * (1.0f / l);
      }
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

static void layer_ws(const SdModel* m, const SdLayer* L, const SdRows* r, float* x, const SdScratch* s) {
  const int64_t T = r->T, D = m->D, I = m->I;
  rmsnorm_ws(x, L->attn_norm, s->h, T, D, m->eps);
  linear_any(&L->wqkv, s->h, T, s->qkv, 0, s->xb);
  rope_store_ws(r, s->qkv, m->nh, &L->cache);
  attention_ws(r, s->qkv, m->nh, &L->cache, s->att);
  linear_any(&L->wo, s->att, T, x, 1, s->xb);
  rmsnorm_ws(x, L->ffn_norm, s->h, T, D, m->eps);
  linear_any(&L->w13, s->h, T, s->gu, 0, s->xb);
  silu_mul_ws(s->gu, s->act, T, I);
  linear_any(&L->w2, s->act, T, x, 1, s->xb);
}

extern "C" {

// Which build this is: 2 = AVX512 + AVX512_BF16, 1 = AVX2 + FMA + F16C, 0 = generic.
int sd_isa() {
#if defined(__AVX512BF16__)
  return 2;
#elif defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

// Elements of w's packed copy (written to out unless NULL); 0 = K does not pack, keep w as it is.
int64_t sd_pack(int32_t dtype, const void* w, int64_t N, int64_t K, void* out) { return pack(dtype, w, N, K, out); }

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

// y [M, N] (=, or += when acc) x [M, K] . W^T (+ bias); xb: [M, K] u16 scratch (bf16 path)
void sd_linear(const SdWeight* w, const float* x, int64_t M, float* y, int acc, u16* xb) {
#pragma omp parallel
  linear_any(w, x, M, y, acc, xb);
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
