/* floorline's one- and two-row products of a 16-bit matrix on x86-64 with AVX2, FMA and F16C
 * (floorline.engine.cpu_kernel builds and loads this file).
 *
 * y[i][o] = x[i] . w[o], for i < m (1 or 2) and o < n: w is n x k, row-major, bf16 or fp16;
 * x and y are m rows of the same type. x is widened to fp32 once, every product is summed in
 * fp32 and each output is rounded once to the 16-bit type (to nearest, ties to even), as
 * PyTorch's own products round: only the order of the sums differs.
 *
 * A processor without AVX-512 BF16 has no bf16 dot product, and PyTorch's one-row bf16 product
 * then converts every weight in scalar steps. Here a bf16 weight becomes an fp32 one by moving
 * its 16 bits into the high half of a 32-bit lane: one unpack against zero turns 16 weights into
 * two vectors of 8, in the order (0-3, 8-11) and (4-7, 12-15). x is widened in that same order,
 * so the products pair up. fp16 weights take F16C's conversion, in order.
 *
 * Rows of w are shared out over the threads of the OpenMP runtime PyTorch uses (this file is
 * linked against it), BLOCK at a time so that each x vector loaded serves them all, and each
 * row is prefetched AHEAD weights before it is read: on 2 cores of an Intel Xeon, SmolLM2-135M's
 * one-row products took 12.8-13.0 ms a step this way against 17.6 ms two rows at a time without
 * prefetching (medians of 15, two passes each, held to AVX2 or not alike: the kernel's code is
 * the same). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define BLOCK 4
#define AHEAD 256

INLINE float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

INLINE uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

INLINE float to_f32(int bf16, uint16_t h) { return bf16 ? bf16_to_f32(h) : _cvtsh_ss(h); }

INLINE uint16_t from_f32(int bf16, float f) {
  return bf16 ? f32_to_bf16(f) : (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

/* 16 weights from p as two vectors of 8 fp32 (for bf16 in the unpack's order, above) */
INLINE void load16(int bf16, const uint16_t *p, __m256 *lo, __m256 *hi) {
  if (bf16) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
  } else {
    *lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    *hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
  }
}

INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Outputs o .. o + r - 1 (r = 1 or BLOCK) of the m rows; x is widened (and, for bf16,
 * reordered in its whole blocks of 16). */
INLINE void rows(int bf16, int m, int r, const uint16_t *w, const float *x, uint16_t *y,
                 long n, long k, long o) {
  __m256 acc[BLOCK][2][2];
  for (int a = 0; a < r; a++)
    for (int i = 0; i < m; i++) acc[a][i][0] = acc[a][i][1] = _mm256_setzero_ps();
  const long whole = k & ~15L;
  for (long j = 0; j < whole; j += 16) {
    __m256 xlo[2], xhi[2];
    for (int i = 0; i < m; i++) {
      xlo[i] = _mm256_loadu_ps(x + i * k + j);
      xhi[i] = _mm256_loadu_ps(x + i * k + j + 8);
    }
    for (int a = 0; a < r; a++) /* past a row's end: the next rows', read next */
      _mm_prefetch((const char *)(w + (o + a) * k + j + AHEAD), _MM_HINT_T0);
    for (int a = 0; a < r; a++) {
      __m256 lo, hi;
      load16(bf16, w + (o + a) * k + j, &lo, &hi);
      for (int i = 0; i < m; i++) {
        acc[a][i][0] = _mm256_fmadd_ps(lo, xlo[i], acc[a][i][0]);
        acc[a][i][1] = _mm256_fmadd_ps(hi, xhi[i], acc[a][i][1]);
      }
    }
  }
  for (int a = 0; a < r; a++)
    for (int i = 0; i < m; i++) {
      float s = hsum(_mm256_add_ps(acc[a][i][0], acc[a][i][1]));
      for (long j = whole; j < k; j++) s += to_f32(bf16, w[(o + a) * k + j]) * x[i * k + j];
      y[i * n + o + a] = from_f32(bf16, s);
    }
}

/* Returns 0, or -1 where m is not 1 or 2, -2 where memory for widened x could not be had. */
static int product(int bf16, const uint16_t *w, const uint16_t *x16, uint16_t *y, long m, long n,
                   long k, int threads) {
  if (m < 1 || m > 2) return -1;
  float *x = malloc((size_t)(m * k) * sizeof(float));
  if (!x) return -2;
  const long whole = k & ~15L;
  for (long i = 0; i < m; i++)
    for (long j = 0; j < k; j++) {
      long from = j; /* position q of a bf16 block holds value (q&3) | (q&4)<<1 | (q&8)>>1 */
      if (bf16 && j < whole) from = (j & ~15L) | (j & 3) | ((j & 4) << 1) | ((j & 8) >> 1);
      x[i * k + j] = to_f32(bf16, x16[i * k + from]);
    }
  const long blocks = n / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long b = 0; b < blocks; b++) {
    if (bf16) {
      if (m == 1) rows(1, 1, BLOCK, w, x, y, n, k, BLOCK * b);
      else rows(1, 2, BLOCK, w, x, y, n, k, BLOCK * b);
    } else {
      if (m == 1) rows(0, 1, BLOCK, w, x, y, n, k, BLOCK * b);
      else rows(0, 2, BLOCK, w, x, y, n, k, BLOCK * b);
    }
  }
  for (long o = blocks * BLOCK; o < n; o++) {
    if (m == 1) rows(bf16, 1, 1, w, x, y, n, k, o);
    else rows(bf16, 2, 1, w, x, y, n, k, o);
  }
  free(x);
  return 0;
}

int gemv_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, long m, long n, long k,
              int threads) {
  return product(1, w, x, y, m, n, k, threads);
}

int gemv_f16(const uint16_t *w, const uint16_t *x, uint16_t *y, long m, long n, long k,
             int threads) {
  return product(0, w, x, y, m, n, k, threads);
}

/* ---- GGUF blocks and the engine's int4, as stored (floorline.engine.quant), one row of x ----
 *
 * y[o] = sum_k W[o][k] x[k] in fp32, x and y fp32, W never widened in memory:
 * - the int4 layout (Int4Weight, and Q4_1Weight with `mins`): int32 words [N / 4, K / 8 * 4],
 *   rows interleaved by four, word i of a group holding the values at k = i, i + P, ..,
 *   i + 7P (P = group / 8 words a group) in nibbles 0..7; fp16 scales and uint8 zeros (or fp16
 *   minimums) [N / 4, G * 4]. W = d (q - z), or d q + m.
 * - q8_0 (Q8_0Weight): int8 [N, K] and fp16 scales [N, K / 32]. W = d q.
 * A group's products are summed over its integers first and scaled once: d sum (q - z) x, or
 * d sum q x + m sum x (q4_1's minimum is no whole number of steps: it joins through x's sum). */

/* x laid out for the int4 words: for each pair of word positions along K and each nibble j,
 * the 8 lanes of one 256-bit load of words (two positions x four rows) meet x at (position,
 * nibble) four times over. */
static void spread_x(const float *x, float *xe, long k, long group) {
  const long per = group / 8;
  for (long p = 0; p < k / 8; p += 2)
    for (int j = 0; j < 8; j++)
      for (int lane = 0; lane < 8; lane++) {
        const long pos = p + lane / 4, g = pos / per, i = pos % per;
        xe[(p / 2 * 8 + j) * 8 + lane] = x[g * group + i + j * per];
      }
}

int gemv_int4(const int32_t *qw, const uint16_t *scales, const uint8_t *zeros,
              const uint16_t *mins, const float *x, float *y, long n, long k, long group,
              int threads) {
  if (group % 16 || k % group || n % 4) return -1;
  const long groups = k / group, per = group / 8;
  float *xe = malloc((size_t)(4 * k) * sizeof(float));
  float *sums = malloc((size_t)groups * sizeof(float));
  if (!xe || !sums) { free(xe); free(sums); return -2; }
  spread_x(x, xe, k, group);
  for (long g = 0; g < groups; g++) {
    float s = 0.0f;
    for (long t = 0; t < group; t++) s += x[g * group + t];
    sums[g] = s;
  }
  const __m256i nibble = _mm256_set1_epi32(0xF);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long b = 0; b < n / 4; b++) {
    const int32_t *words = qw + b * (k / 8 * 4);
    __m256 acc = _mm256_setzero_ps();
    __m128 off = _mm_setzero_ps();
    for (long g = 0; g < groups; g++) {
      const long at = b * groups * 4 + g * 4;
      __m256i z = _mm256_setzero_si256(); /* q - z in integers: no fp32 cancellation */
      if (!mins) {
        uint32_t z4;
        memcpy(&z4, zeros + at, 4);
        const __m128i z32 = _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)z4));
        z = _mm256_set_m128i(z32, z32);
      }
      __m256 dot = _mm256_setzero_ps();
      for (long i = 0; i < per; i += 2) {
        const long p = g * per + i;
        _mm_prefetch((const char *)(words + p * 4 + AHEAD), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(words + p * 4));
        const float *xp = xe + p / 2 * 64;
        for (int j = 0; j < 8; j++) {
          const __m256i q = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 4 * j),
                                                              nibble), z);
          dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(xp + 8 * j), dot);
        }
      }
      const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(scales + at)));
      acc = _mm256_fmadd_ps(dot, _mm256_set_m128(d, d), acc);
      if (mins)
        off = _mm_fmadd_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(mins + at))),
                           _mm_set1_ps(sums[g]), off);
    }
    const __m128 rows4 = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(acc),
                                               _mm256_extractf128_ps(acc, 1)), off);
    _mm_storeu_ps(y + 4 * b, rows4);
  }
  free(xe);
  free(sums);
  return 0;
}

int gemv_q8_0(const int8_t *qw, const uint16_t *scales, const float *x, float *y, long n, long k,
              int threads) {
  if (k % 32) return -1;
  const long blocks = k / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long o = 0; o < n; o++) {
    const int8_t *row = qw + o * k;
    __m256 acc = _mm256_setzero_ps();
    for (long c = 0; c < blocks; c++) {
      const int8_t *p = row + c * 32;
      _mm_prefetch((const char *)(p + 2 * AHEAD), _MM_HINT_T0);
      __m256 dot = _mm256_setzero_ps();
      for (int part = 0; part < 4; part++) {
        const __m128i q8 = _mm_loadl_epi64((const __m128i *)(p + 8 * part));
        dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)),
                              _mm256_loadu_ps(x + c * 32 + 8 * part), dot);
      }
      acc = _mm256_fmadd_ps(dot, _mm256_set1_ps(_cvtsh_ss(scales[o * blocks + c])), acc);
    }
    y[o] = hsum(acc);
  }
  return 0;
}
