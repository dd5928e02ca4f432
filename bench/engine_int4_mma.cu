// A prototype int4 GEMV on the tensor cores' 8-bit integer products (mma.sync m16n8k32, s8 x s8
// -> s32), for floorline's int4 layout (bench/engine_int4_mma.py builds, checks and times it).
//
// out[n] += sum_k W[n, k] x[k], W[n, k] = (q - z[n, g]) s[n, g], groups of 128 along K.
//
// The weights are the product's B operand (32 x 8, one column per row of W) as loaded: a lane's
// 16-byte load holds the words of rows 4b..4b+3 at one word position, and a word's low nibbles
// (one AND) and high nibbles (a shift and an AND) are the lane's two B registers for one mma, in
// four mmas, one per row of the block (so a warp's mma covers 8 row blocks, one row of each).
// The order of the summed dimension is free as long as x follows it: B's k = 4 tid + t of the
// low (high) register is nibble 2t (2t + 1) of the word at position 4 s + tid of slice s.
//
// x is the A operand (16 x 32): a group's x scaled by the power of two that puts its largest
// |x| in [2^13, 2^14) and rounded, as the engine's integer kernel does per chunk; the integer i
// split as 128 a + b (a in -128..127, b in 0..127); group g of a tile of eight puts a in row g
// and b in row 8 + g, zero in every other row. Lane (gid, tid) holds A's rows gid and gid + 8,
// so it needs the A registers of group gid alone (prepared once a tile by the block's threads
// together, in shared memory), and the accumulator's rows gid and gid + 8 come back to the same
// lane: 128 a-sum + b-sum is group gid's exact sum of q i for the lane's two columns, without a
// shuffle. Per tile, per group and row: s unscale (sum q i - z sum i).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace floorline_int4_mma {

__device__ __forceinline__ void mma_s8(int (&c)[4], const unsigned (&a)[4], unsigned b0,
                                       unsigned b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The block's warps share x's preparation: per tile of 8 groups, each thread turns 1024 /
// threads consecutive values of x into A's bytes in shared memory, and each lane then reads its
// group's 16 registers. [group][4 slices x 4 lanes x 4 registers], rows padded to 80 words so that
// the two groups a quarter-warp reads lie in different banks.
constexpr int kRow = 80;

template <int WARPS>
__device__ __forceinline__ void prepare_x(const __nv_bfloat16* __restrict__ x, int t0, int tile,
                                          unsigned* sa, int* s_sum, float* s_unscale) {
  constexpr int kValues = 1024 / (WARPS * 32);  // per thread, within one run of one group
  constexpr int kLanes = 128 / kValues;         // per group, consecutive
  const int t = threadIdx.x;
  const int gg = t / kLanes;
  const int first = (t % kLanes) * kValues;     // within the group: nibble j = first / 16
  const int j = first / 16;
  static_assert(kValues <= 16 && kLanes <= 32, "a thread's values in one run, a group in a warp");
  float v[kValues];
  float big = 0.f;
  if (gg < tile) {
    // 16 bytes a load, 8 bytes where a thread takes 4 values
    using Chunk = typename std::conditional<kValues >= 8, uint4, uint2>::type;
    constexpr int kChunk = sizeof(Chunk) / 2;
#pragma unroll
    for (int i = 0; i < kValues; i += kChunk) {
      const Chunk raw = *reinterpret_cast<const Chunk*>(x + (t0 + gg) * 128 + first + i);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int k = 0; k < kChunk / 2; ++k) {
        const float2 f = __bfloat1622float2(h[k]);
        v[i + 2 * k] = f.x;
        v[i + 2 * k + 1] = f.y;
      }
    }
#pragma unroll
    for (int i = 0; i < kValues; ++i) big = fmaxf(big, fabsf(v[i]));
  }
#pragma unroll
  for (int m = 1; m < kLanes; m *= 2) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, m));
  const int e = max(__float_as_int(big) & 0x7F800000, 27 << 23);
  // 2^(13 - exponent), from its bits (267 << 23 exceeds an int)
  const float scale = __uint_as_float((267u << 23) - (unsigned)e);
  int sum = 0;
  if (gg < tile) {
    unsigned char* bytes = reinterpret_cast<unsigned char*>(sa + gg * kRow);
#pragma unroll
    for (int i = 0; i < kValues; ++i) {
      // 2^14 (the largest |x| just under it, rounded up) does not split into int8
      const int q = min(__float2int_rn(v[i] * scale), 16383);
      sum += q;
      const int pos = (first + i) % 16;  // word position: slice pos / 4, lane pos % 4
      const int reg = (j & 1) * 2;       // even nibbles: registers 0 (a) and 1 (b); odd: 2, 3
      const int at = ((pos / 4) * 4 + pos % 4) * 16 + reg * 4 + j / 2;
      bytes[at] = (unsigned char)(q >> 7);
      bytes[at + 4] = (unsigned char)(q & 127);
    }
  }
#pragma unroll
  for (int m = 1; m < kLanes; m *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  if (t % kLanes == 0 && gg < tile) {
    s_sum[gg] = sum;
    s_unscale[gg] = __int_as_float(e - (13 << 23));
  }
}

// SETS: sets of 8 row blocks (32 rows) a warp covers; WARPS: warps a block, each its own rows;
// AHEAD: a group's weights are loaded while the group before it is multiplied (registers for
// one more group's loads), else at the top of its own iteration.
// w: the int4 words as 16-byte units [N / 4][K / 8]; grid: (N / (32 SETS WARPS), K-splits), each
// split `groups_per_split` groups; out is added into (atomics: splits and calls accumulate).
template <int SETS, int WARPS, int AHEAD>
__global__ void __launch_bounds__(WARPS * 32)
    int4_mma_gemv(const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ w,
                  const __half* __restrict__ scales, const uint8_t* __restrict__ zeros,
                  float* __restrict__ out, int K, int groups_per_split) {
  __shared__ __align__(16) unsigned sa[2][8 * kRow];  // two tiles: one barrier a tile
  __shared__ int s_sum[2][8];
  __shared__ float s_unscale[2][8];
  const int lane = threadIdx.x & 31;
  const int gid = lane >> 2, tid = lane & 3;
  const int n_groups = K / 128;
  const int units = K / 8;  // 16-byte units per row block
  const int b_warp = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * 8 * SETS;
  const int g_lo = blockIdx.y * groups_per_split;
  const int g_hi = min(g_lo + groups_per_split, n_groups);
  // [set][r][e]: group gid's share of rows 4 (b_warp + 8 set + 2 tid + e) + r
  float acc[SETS][4][2] = {};
  int buffer = 0;
  for (int t0 = g_lo; t0 < g_hi; t0 += 8, buffer ^= 1) {
    const int tile = min(8, g_hi - t0);
    prepare_x<WARPS>(x, t0, tile, sa[buffer], s_sum[buffer], s_unscale[buffer]);
    __syncthreads();
    // A's registers for group t0 + gid: [slice][a0..a3]
    uint4 own[4];
#pragma unroll
    for (int s = 0; s < 4; ++s)
      own[s] = *reinterpret_cast<const uint4*>(sa[buffer] + gid * kRow + (s * 4 + tid) * 4);
    int c[SETS][4][4] = {};
    // this lane's 16-byte units of group gg: [slice][set], at positions 4 s + tid
    auto load = [&](int gg, uint4 (&u)[4][SETS]) {
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int set = 0; set < SETS; ++set)
          u[s][set] = w[(size_t)(b_warp + 8 * set + gid) * units + (t0 + gg) * 16 + 4 * s + tid];
    };
    auto multiply = [&](int gg, const uint4 (&u)[4][SETS]) {
      const bool mine = gid == gg;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const unsigned a[4] = {mine ? own[s].x : 0u, mine ? own[s].y : 0u,
                               mine ? own[s].z : 0u, mine ? own[s].w : 0u};
#pragma unroll
        for (int set = 0; set < SETS; ++set) {
          const unsigned words[4] = {u[s][set].x, u[s][set].y, u[s][set].z, u[s][set].w};
#pragma unroll
          for (int r = 0; r < 4; ++r)
            mma_s8(c[set][r], a, words[r] & 0x0F0F0F0Fu, (words[r] >> 4) & 0x0F0F0F0Fu);
        }
      }
    };
    uint4 even[4][SETS], odd[4][SETS];
    if (!AHEAD) {
      for (int gg = 0; gg < tile; ++gg) {
        load(gg, even);
        multiply(gg, even);
      }
    } else {  // two buffers in turn: two groups' loads in flight where one would be
      load(0, even);
      for (int gg = 0; gg < tile; gg += 2) {
        if (gg + 1 < tile) load(gg + 1, odd);
        multiply(gg, even);
        if (gg + 2 < tile) load(gg + 2, even);
        if (gg + 1 < tile) multiply(gg + 1, odd);
      }
    }
    if (gid < tile) {
      const int g = t0 + gid;
      const int i_sum = s_sum[buffer][gid];
      const float unscale = s_unscale[buffer][gid];
#pragma unroll
      for (int set = 0; set < SETS; ++set)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const size_t at = (size_t)(b_warp + 8 * set + 2 * tid + e) * (n_groups * 4) + 4 * g;
          const __half2 s01 = reinterpret_cast<const __half2*>(scales + at)[0];
          const __half2 s23 = reinterpret_cast<const __half2*>(scales + at)[1];
          const unsigned z4 = *reinterpret_cast<const unsigned*>(zeros + at);
          const float s[4] = {__low2float(s01), __high2float(s01), __low2float(s23),
                              __high2float(s23)};
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int z = (z4 >> (8 * r)) & 0xFF;
            const int exact = c[set][r][e] * 128 + c[set][r][2 + e] - z * i_sum;
            acc[set][r][e] += s[r] * unscale * (float)exact;
          }
        }
    }
  }
  // the eight groups' shares (lanes gid 0..7) of each row, summed
#pragma unroll
  for (int set = 0; set < SETS; ++set)
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = acc[set][r][e];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (gid == 0) atomicAdd(out + 4 * (b_warp + 8 * set + 2 * tid + e) + r, v);
      }
}

}  // namespace floorline_int4_mma

// The launch, called through ctypes on the caller's stream (so that a CUDA graph captures it):
// 0, a CUDA error, or -1 for a shape or launch with no instance.
extern "C" int floorline_int4_mma_launch(const void* x, const void* w, const void* scales,
                                         const void* zeros, float* out, int n, int k, int sets,
                                         int warps, int ahead, int splits, void* stream) {
  using namespace floorline_int4_mma;
  if (splits < 1 || k < 128 || k % 128 || sets < 1 || warps < 1 || n % (32 * sets * warps))
    return -1;
  const int n_groups = k / 128, per_split = (n_groups + splits - 1) / splits;
  const dim3 grid(n / (32 * sets * warps), (n_groups + per_split - 1) / per_split);
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const auto* wu = static_cast<const uint4*>(w);
  const auto* s = static_cast<const __half*>(scales);
  const auto* z = static_cast<const uint8_t*>(zeros);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int block = 32 * warps;
#define FLOORLINE_INT4_MMA(SETS, WARPS, AHEAD)                                           \
  if (sets == SETS && warps == WARPS && ahead == AHEAD) {                                \
    int4_mma_gemv<SETS, WARPS, AHEAD><<<grid, block, 0, st>>>(xb, wu, s, z, out, k,      \
                                                             per_split);                 \
    return (int)cudaGetLastError();                                                      \
  }
  // the instances: engine_int4_mma.py's LAUNCHES
  FLOORLINE_INT4_MMA(1, 2, 0)
  FLOORLINE_INT4_MMA(1, 4, 0)
  FLOORLINE_INT4_MMA(2, 2, 0)
  FLOORLINE_INT4_MMA(2, 4, 0)
  FLOORLINE_INT4_MMA(2, 8, 0)
  FLOORLINE_INT4_MMA(1, 4, 1)
  FLOORLINE_INT4_MMA(2, 4, 1)
#undef FLOORLINE_INT4_MMA
  return -1;
}
