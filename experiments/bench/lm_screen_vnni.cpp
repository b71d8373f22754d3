// A prototype for experiments/bench/lm_screen_speed.py, not used by the engine: the int8 screen of an LM head with
// AVX512-VNNI (vpdpbusd: uint8 x int8 -> int32, 4 products per lane per instruction).
// q [V/16][K/4][16][4] int8 (4 consecutive k per lane), corr [V/16][K/G][16] int32 = 128 x the group's weight sum (the
// zero point of x), sc [V/16][K/G][16] fp32 = the group's weight scale; xq [M][K] uint8 = round(x / sx) + 128, xs [M]
// = sx; scr [M][V] = sx x sum over groups of scale x (int32 sum - corr).
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
extern "C" void screen_vnni(const int8_t* q, const int32_t* corr, const float* sc, int64_t V, int64_t K, int64_t G,
                            const uint8_t* xq, const float* xs, int64_t M, float* scr) {
  const int64_t np = V / 16, ng = K / G;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < np; p++) {
    const int8_t* qp = q + p * K * 16;
    const float* sp = sc + p * ng * 16;
    const int32_t* cp = corr + p * ng * 16;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int mm = (int)(M - m0 < 8 ? M - m0 : 8);
      __m512 s[8];
      for (int m = 0; m < 8; m++) s[m] = _mm512_setzero_ps();
      for (int64_t g = 0; g < ng; g++) {
        __m512i a[8];
        for (int m = 0; m < 8; m++) a[m] = _mm512_setzero_si512();
        for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
          const __m512i w = _mm512_loadu_si512((const void*)(qp + k * 16));  // 16 lanes x 4 k
          for (int m = 0; m < mm; m++) {
            int32_t xv; __builtin_memcpy(&xv, xq + (m0 + m) * K + k, 4);
            a[m] = _mm512_dpbusd_epi32(a[m], _mm512_set1_epi32(xv), w);
          }
        }
        const __m512 sv = _mm512_loadu_ps(sp + g * 16);
        const __m512i cv = _mm512_loadu_si512((const void*)(cp + g * 16));
        for (int m = 0; m < mm; m++)
          s[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[m], cv)), sv, s[m]);
      }
      for (int m = 0; m < mm; m++) _mm512_storeu_ps(scr + (m0 + m) * V + p * 16, _mm512_mul_ps(s[m], _mm512_set1_ps(xs[m0 + m])));
    }
  }
}
