// gemm_sm90.cuh: the device core of our sm_90a matrix product C = A B^T (A: M x K, B: N x K,
// both K-contiguous, 2-byte: bfloat16 or float16; C: M x N in the same dtype, float32 sums).
//
// Stage 1 of scratch/gemm_plan.md: a 128 x 256 output tile a block, K walked in blocks of 64
// through 4 shared-memory stages of (128 + 256) x 64 x 2 B = 48 KB each. Warpgroup 0 is the
// producer (one thread issues every bulk tensor copy), warpgroups 1 and 2 the consumers: each
// multiplies its 64 rows of A's stage by B's 256 rows with wgmma m64n256k16 (128 float32 sums
// a thread) and writes its 64 x 256 of C. Persistent: one block a multiprocessor walks tiles
// blockIdx.x, + gridDim.x, ... in a grouped order (GemmTiles), the same for every run, and
// each output tile's K order is fixed: the same bits every run, whatever the grid.
//
// Napkin (H100 SXM, 132 SMs, 989 TFLOP/s dense bf16): a tile's K block is 2 x 128 x 256 x 64
// = 4.2 MFLOP, 550 ns of one SM's tensor cores, against 48 KB from L2: 89 GB/s a SM, 11.7
// TB/s for the GPU, which L2 serves only because the grouped order keeps A's and B's live
// tiles (~16 + 16 MB at M = 8192) resident.
//
// Build: wgmma and setmaxnreg exist only for sm_90a (-gencode arch=compute_90a,code=sm_90a;
// loader arch "9.0a"). Everywhere else (sm_80, plain sm_90, CUDA 11.8) the kernel body is a
// __trap() and gemm_nt_launch (linear_ce_gemm.cu) refuses with an error before launching.
#pragma once

#include <cstdint>
#include <cstdio>
#include <type_traits>

#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 12
#include <cuda.h>  // CUtensorMap (header only: no libcuda link)
#endif

#include "device.cuh"
#include "sm90.cuh"

// The arch-specific instructions (wgmma, setmaxnreg) are in this build only for compute_90a;
// the bulk tensor copies and mbarriers need plain sm_90 and CUDA 12 (FUSED_LOSSES_SM90).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && FUSED_LOSSES_SM90
#define FUSED_LOSSES_GEMM_SM90A 1
#else
#define FUSED_LOSSES_GEMM_SM90A 0
#endif

// -DFUSED_LOSSES_GEMM_DEBUG=1 (loader: FUSED_LOSSES_NVCC_FLAGS): a barrier wait that has
// spun for ~2^32 clocks (2-3 s) prints the barrier and traps, so a protocol bug fails the
// test that hit it instead of hanging the GPU.
#ifndef FUSED_LOSSES_GEMM_DEBUG
#define FUSED_LOSSES_GEMM_DEBUG 0
#endif

namespace fused_losses {

// ---------------------------------------------------------------------------------
// Tile shape and shared-memory layout (host and device).

constexpr int kGemmTileM = 128;      // rows of A (and C) a block
constexpr int kGemmTileN = 256;      // rows of B (columns of C) a block
constexpr int kGemmTileK = 64;       // 64 x 2 B = 128 B: one swizzle span, one TMA box row
constexpr int kGemmStages = 4;       // 4 x 48 KB in flight
constexpr int kGemmConsumers = 2;    // consumer warpgroups, 64 rows of the tile each
constexpr int kGemmThreads = 128 * (1 + kGemmConsumers);
constexpr int kGemmConsumerWarps = 4 * kGemmConsumers;

constexpr int kGemmStageBytesA = kGemmTileM * kGemmTileK * 2;  // 16 KB
constexpr int kGemmStageBytesB = kGemmTileN * kGemmTileK * 2;  // 32 KB
constexpr int kGemmStageBytes = kGemmStageBytesA + kGemmStageBytesB;
// The epilogue stages a warp's 16 rows x 128 columns at a time (4 KB a warp, 32 KB): apart from
// the pipeline's stages, which the producer is already filling with the next tile's K blocks.
constexpr int kGemmStagingRowBytes = 128 * 2;
constexpr int kGemmStagingWarpBytes = 16 * kGemmStagingRowBytes;
// 128 B swizzle repeats every 8 rows x 128 B: every stage starts at a 1024 B boundary, so the
// wgmma descriptors' base offset is 0 and the TMA's swizzle and the descriptors' agree.
constexpr int kGemmSmemAlign = 1024;
constexpr int kGemmOffsetB = kGemmStages * kGemmStageBytesA;
constexpr int kGemmOffsetStaging = kGemmOffsetB + kGemmStages * kGemmStageBytesB;
constexpr int kGemmOffsetBarriers = kGemmOffsetStaging + kGemmConsumerWarps * kGemmStagingWarpBytes;
constexpr int kGemmSmemBytes = kGemmSmemAlign + kGemmOffsetBarriers + 2 * kGemmStages * 8;  // 230464 B
static_assert(kGemmSmemBytes <= 232448, "more than an H100 block's 227 KB of shared memory");
static_assert(kGemmStageBytesA % kGemmSmemAlign == 0 && kGemmStageBytesB % kGemmSmemAlign == 0, "stage alignment");

// The persistent schedule: tile t (0 <= t < count) in groups of `group` M tiles, M fastest
// inside a group, so the blocks running at once (t, t + 1, ... t + grid - 1) share each B tile
// among `group` of them and each A tile among grid / group: both stay in L2.
struct GemmTiles {
  int tiles_m, tiles_n, group, k_blocks;
  int64_t count;  // tiles_m * tiles_n
  int m, n;       // C's rows and columns, for the epilogue's masks
  int64_t ldc;    // C's row stride, in elements
};

struct TileCoord {
  int m, n;  // tile indices
};

__host__ __device__ inline TileCoord gemm_tile_coord(const GemmTiles& tiles, int64_t t) {
  const int64_t per_group = int64_t(tiles.group) * tiles.tiles_n;
  const int first_m = static_cast<int>(t / per_group) * tiles.group;
  const int rows = tiles.tiles_m - first_m < tiles.group ? tiles.tiles_m - first_m : tiles.group;
  const int64_t within = t % per_group;
  return {first_m + static_cast<int>(within % rows), static_cast<int>(within / rows)};
}

// ---------------------------------------------------------------------------------
// Device helpers: PTX wrappers (sm_90a unless marked).

#if FUSED_LOSSES_GEMM_SM90A

// Why: the mbarrier's arrival without a transaction; a consumer warp frees a stage with it.
__device__ __forceinline__ void gemm_mbarrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(barrier)) : "memory");
}

// Why: sm90.cuh's mbarrier_wait spins forever; this one traps under FUSED_LOSSES_GEMM_DEBUG,
// so a broken phase protocol fails a test rather than hanging the GPU.
__device__ __forceinline__ void gemm_mbarrier_wait(uint64_t* barrier, uint32_t phase) {
  const uint32_t address = shared_address(barrier);
  uint32_t done = 0;
#if FUSED_LOSSES_GEMM_DEBUG
  const long long start = clock64();
#endif
  while (true) {
    asm volatile(
        "{\n .reg .pred complete;\n mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        " selp.u32 %0, 1, 0, complete;\n}"
        : "=r"(done)
        : "r"(address), "r"(phase)
        : "memory");
    if (done) return;
#if FUSED_LOSSES_GEMM_DEBUG
    if (clock64() - start > (1ll << 32)) {
      printf("gemm_nt: block %d thread %d stuck on barrier 0x%x phase %u\n", blockIdx.x, threadIdx.x, address, phase);
      __trap();
    }
#endif
  }
}

// Why: the tensor map lives in kernel-parameter space; fetching its 128 B descriptor into the
// TMA unit's cache before the first copy hides that latency from the first K block.
__device__ __forceinline__ void prefetch_tensor_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Why: one instruction moves a whole swizzled box (rows x 64 elements) from global memory and
// completes `barrier`'s transaction; out-of-bounds elements land as zeros, so ragged M, N and K
// add exact zeros to the sums. inner: the K coordinate, outer: the row.
__device__ __forceinline__ void tma_load_2d(void* dst, const void* map, int inner, int outer, uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(shared_address(barrier))
      : "memory");
}

// Why: the producer needs few registers and the consumers many (128 sums + addresses): moving
// the register file's share from one to the other is what lets a 384-thread block hold them.
template <int kRegisters>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

// Why: a wgmma reads shared memory through a 64-bit descriptor, not an address. K-major with
// the 128 B swizzle: start >> 4 in bits 0-13, leading offset (unused by this layout; 16 B by
// convention) >> 4 in 16-29, stride offset 1024 B (one 8-row x 128 B swizzle atom to the next)
// >> 4 in 32-45, base offset 0 (1024 B-aligned stages) in 49-51, swizzle mode 1 (128 B) in 62-63.
__device__ __forceinline__ uint64_t smem_descriptor_k_major_sw128(const void* tile) {
  const uint64_t start = (shared_address(tile) & 0x3FFFF) >> 4;
  return start | (uint64_t(16 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Why: wgmma reads its accumulator registers asynchronously; this fence orders the
// registers' earlier writes (the zeroing, the previous tile) before the next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
// Why: groups the wgmmas issued since the last commit, so wgmma_wait can wait for them as one.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Why: waits until at most kPending committed groups are still running: with 1, the K block
// just issued keeps the tensor cores busy while the previous block's stage is released.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Why: the wgmma's asm names the sums as outputs where it is issued, not where wgmma_wait
// finishes it; this marks them written here, so no read of them moves above the wait.
__device__ __forceinline__ void accumulators_ready(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define FUSED_LOSSES_WGMMA_D8(i)                                                            \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define FUSED_LOSSES_WGMMA_D128                                                                             \
  FUSED_LOSSES_WGMMA_D8(0), FUSED_LOSSES_WGMMA_D8(8), FUSED_LOSSES_WGMMA_D8(16), FUSED_LOSSES_WGMMA_D8(24),   \
      FUSED_LOSSES_WGMMA_D8(32), FUSED_LOSSES_WGMMA_D8(40), FUSED_LOSSES_WGMMA_D8(48), FUSED_LOSSES_WGMMA_D8(56), \
      FUSED_LOSSES_WGMMA_D8(64), FUSED_LOSSES_WGMMA_D8(72), FUSED_LOSSES_WGMMA_D8(80), FUSED_LOSSES_WGMMA_D8(88), \
      FUSED_LOSSES_WGMMA_D8(96), FUSED_LOSSES_WGMMA_D8(104), FUSED_LOSSES_WGMMA_D8(112), FUSED_LOSSES_WGMMA_D8(120)
#define FUSED_LOSSES_WGMMA_N256(types)                                                                         \
  asm volatile(                                                                                                \
      "{\n .reg .pred accumulate;\n setp.ne.b32 accumulate, %130, 0;\n"                                         \
      " wgmma.mma_async.sync.aligned.m64n256k16.f32." types " {"                                              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                        \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                        \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                        \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                        \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                        \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "            \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "       \
      "%128, %129, accumulate, 1, 1, 0, 0;\n}"                                                                 \
      : FUSED_LOSSES_WGMMA_D128                                                                                \
      : "l"(a), "l"(b), "r"(accumulate))

// Why: the tensor cores' widest step, 64 x 256 x 16, both operands read from shared memory
// (K-major, "SS"): d (64 x 256 float32, 128 a thread) += A B^T, or = A B^T when !accumulate.
// Asynchronous: d must not be touched until a wgmma_wait covers it.
template <typename T>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t a, uint64_t b, uint32_t accumulate) {
  static_assert(sizeof(T) == 2, "2-byte operands");
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    FUSED_LOSSES_WGMMA_N256("bf16.bf16");
  } else {
    FUSED_LOSSES_WGMMA_N256("f16.f16");
  }
}

#undef FUSED_LOSSES_WGMMA_N256
#undef FUSED_LOSSES_WGMMA_D128
#undef FUSED_LOSSES_WGMMA_D8

// Why: two float32 sums rounded to nearest into one 4-byte pair of T (lo in the low half), one
// instruction, no dependence on cuda_bf16.h's conversion macros that load_inline turns off.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t pair;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(hi), "f"(lo));
  }
  return pair;
}

#endif  // FUSED_LOSSES_GEMM_SM90A

// ---------------------------------------------------------------------------------
// The kernel's roles.

#if FUSED_LOSSES_GEMM_SM90A

struct GemmShared {
  unsigned char* a;         // kGemmStages x 128 rows x 128 B
  unsigned char* b;         // kGemmStages x 256 rows x 128 B
  unsigned char* staging;   // kGemmConsumerWarps x 16 rows x 256 B
  uint64_t* full;           // [stage]: the copies landed (1 arrival + 48 KB)
  uint64_t* empty;          // [stage]: every consumer warp is done reading it
};

// K blocks are counted across the block's tiles (`step`), so stage = step % kGemmStages and the
// barrier's phase parity = (step / kGemmStages) & 1 run on from tile to tile, in both roles.
__device__ __forceinline__ uint32_t stage_of(uint32_t step) { return step % kGemmStages; }
__device__ __forceinline__ uint32_t parity_of(uint32_t step) { return (step / kGemmStages) & 1; }

// One thread: for every K block of every tile, wait until the stage is free, then copy A's 128 x 64
// and B's 256 x 64 box into it. A fresh barrier counts as having completed the phase before its
// first, so the first round's waits (parity 1) pass at once.
__device__ __forceinline__ void gemm_produce(const void* a_map, const void* b_map, const GemmTiles& tiles,
                                             const GemmShared& shared) {
  uint32_t step = 0;
  for (int64_t t = blockIdx.x; t < tiles.count; t += gridDim.x) {
    const TileCoord tile = gemm_tile_coord(tiles, t);
    for (int k_block = 0; k_block < tiles.k_blocks; ++k_block, ++step) {
      const uint32_t stage = stage_of(step);
      gemm_mbarrier_wait(&shared.empty[stage], parity_of(step) ^ 1);
      mbarrier_arrive_expect_tx(&shared.full[stage], kGemmStageBytes);
      tma_load_2d(shared.a + stage * kGemmStageBytesA, a_map, k_block * kGemmTileK, tile.m * kGemmTileM,
                  &shared.full[stage]);
      tma_load_2d(shared.b + stage * kGemmStageBytesB, b_map, k_block * kGemmTileK, tile.n * kGemmTileN,
                  &shared.full[stage]);
    }
  }
}

// A consumer warp's 16 x 256 sums of one tile into C, through its staging buffer: a lane holds
// rows r = lane / 4 and r + 8, columns 8j + 2 (lane % 4) + {0, 1} for j < 32 (the wgmma
// layout), which written straight to C would be 8-byte pieces. In two halves of 128 columns:
// pairs into the buffer (16 B chunk index XOR row % 8: the 32 lanes hit 32 banks), then each
// half-warp stores a row's 256 contiguous bytes, 16 a lane.
template <typename T>
__device__ __forceinline__ void gemm_store_warp_rows(const float (&d)[128], unsigned char* staging, T* c,
                                                     const GemmTiles& tiles, int row0, int col0) {
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;
  const bool full_chunks = tiles.ldc % 8 == 0 && reinterpret_cast<uintptr_t>(c) % 16 == 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      const int j = 16 * half + jj;
#pragma unroll
      for (int upper = 0; upper < 2; ++upper) {
        const int r = quad_row + 8 * upper;
        const int offset = r * kGemmStagingRowBytes + ((jj ^ (r % 8)) * 16) + 4 * (lane % 4);
        *reinterpret_cast<uint32_t*>(staging + offset) = pack_pair<T>(d[4 * j + 2 * upper], d[4 * j + 2 * upper + 1]);
      }
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = 2 * i + lane / 16;
      const int chunk = lane % 16;
      const int offset = r * kGemmStagingRowBytes + ((chunk ^ (r % 8)) * 16);
      const uint4 value = *reinterpret_cast<const uint4*>(staging + offset);
      const int row = row0 + r;
      const int col = col0 + 128 * half + 8 * chunk;
      if (row >= tiles.m || col >= tiles.n) continue;
      T* out = c + int64_t(row) * tiles.ldc + col;
      if (full_chunks && col + 8 <= tiles.n) {
        *reinterpret_cast<uint4*>(out) = value;
      } else {  // the ragged last columns, or a C whose rows are not 16 B-aligned: 2 B at a time
        const uint32_t words[4] = {value.x, value.y, value.z, value.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const uint16_t element = static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2)));
          if (col + e < tiles.n) reinterpret_cast<uint16_t*>(out)[e] = element;
        }
      }
    }
    __syncwarp();  // the buffer's reads are done before the next half overwrites it
  }
}

#endif  // FUSED_LOSSES_GEMM_SM90A

// The fused product's epilogue (DESIGN.md, "The fused product"): instead of C, each row's
// statistics over the tile's 256 columns, in the row passes' form (row_passes.cu: max m, sum of
// exp(u - m), the target's u, the sum of u, the sum of exp over the classes other than the
// target; with 6 rows also sum exp(u - m) (u - m)) of u = softcap(round(acc + bias)) / T, the
// logit rounded to T first as a product's output is, so the statistics are those of eager's
// logits. partials: (tiles_n, stat_rows, m) float32, every entry written; combining the tiles is
// the caller's (a vocabulary shard's combine, across tiles).
static_assert(kGemmRowStatsTile == kGemmTileN, "ops.h's tile width is the kernel's");

#if FUSED_LOSSES_GEMM_SM90A

// Why: the epilogue's logits must be the product's output, rounded to T, not float32 sums.
template <typename T>
__device__ __forceinline__ void round_pair_to(float& lo, float& hi) {
  const uint32_t pair = pack_pair<T>(lo, hi);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    lo = __uint_as_float(pair << 16);
    hi = __uint_as_float(pair & 0xffff0000u);
  } else {
    asm("{\n .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi)
        : "r"(pair));
  }
}

// A consumer warp's 16 rows of one tile into partials[tile_n]: a lane holds rows r = lane / 4 and
// r + 8, 64 columns each (gemm_store_warp_rows' layout); its quad (4 lanes) holds a row's 256.
// Two passes over the registers: u written over the sums and the max, then the sums; each
// reduced over the quad (the same bits in its 4 lanes: max and + commute), written by lane % 4 == 0.
template <typename T>
__device__ __forceinline__ void gemm_row_stats_warp_rows(float (&d)[128], const GemmRowStats& out,
                                                         const GemmTiles& tiles, int row0, int col0, int tile_n) {
  const int lane = threadIdx.x % 32;
  const Softcap<T> softcap(out.softcap, out.softcap_inverse);
  const float s = out.inverse_temperature;
  // Columns from this lane's first, col0 + 2 (lane % 4): column 8j + e is in C while 8j + e < in_c,
  // so each mask compares with a constant (a register a column would not fit beside the sums).
  const int lane_col0 = col0 + 2 * (lane % 4);
  const int in_c = tiles.n - lane_col0;
  const T* bias = out.bias == nullptr ? nullptr : static_cast<const T*>(out.bias) + lane_col0;
#pragma unroll
  for (int upper = 0; upper < 2; ++upper) {
    const int row = row0 + lane / 4 + 8 * upper;
    const bool row_ok = row < tiles.m;
    // The target's column, from this lane's first, where this lane holds it; else -1.
    const int64_t target_col = row_ok ? target_of(out.target, out.target_int32, row) - lane_col0 : -1;
    const int t = target_col >= 0 && target_col < kGemmTileN ? static_cast<int>(target_col) : -1;
    float m = -infinity<float>();
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      float lo = d[4 * j + 2 * upper], hi = d[4 * j + 2 * upper + 1];
      if (bias != nullptr) {
        lo += 8 * j < in_c ? static_cast<float>(bias[8 * j]) : 0.f;
        hi += 8 * j + 1 < in_c ? static_cast<float>(bias[8 * j + 1]) : 0.f;
      }
      round_pair_to<T>(lo, hi);
      lo = softcap.apply(lo) * s;
      hi = softcap.apply(hi) * s;
      d[4 * j + 2 * upper] = lo;
      d[4 * j + 2 * upper + 1] = hi;
      if (8 * j < in_c) m = max_acc(m, lo);
      if (8 * j + 1 < in_c) m = max_acc(m, hi);
    }
    m = max_acc(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = max_acc(m, __shfl_xor_sync(0xffffffffu, m, 2));
    float sum = 0.f, others = 0.f, target_u = 0.f, logit_sum = 0.f, spread = 0.f;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (8 * j + e >= in_c) continue;
        const float u = d[4 * j + 2 * upper + e];
        const float ex = u == -infinity<float>() ? 0.f : exp_minus<T>(u, m);
        sum += ex;
        logit_sum += u;
        if (8 * j + e == t) {
          target_u = u;
        } else {
          others += ex;
        }
        if (ex != 0.f) spread += ex * (u - m);
      }
    }
#pragma unroll
    for (int mask = 1; mask <= 2; mask *= 2) {
      sum += __shfl_xor_sync(0xffffffffu, sum, mask);
      others += __shfl_xor_sync(0xffffffffu, others, mask);
      target_u += __shfl_xor_sync(0xffffffffu, target_u, mask);
      logit_sum += __shfl_xor_sync(0xffffffffu, logit_sum, mask);
      spread += __shfl_xor_sync(0xffffffffu, spread, mask);
    }
    if (lane % 4 != 0 || !row_ok) continue;
    float* partial = out.partials + int64_t(tile_n) * out.stat_rows * tiles.m + row;
    partial[0] = m;
    partial[int64_t(tiles.m)] = sum;
    partial[2 * int64_t(tiles.m)] = target_u;
    partial[3 * int64_t(tiles.m)] = logit_sum;
    partial[4 * int64_t(tiles.m)] = others;
    if (out.stat_rows == 6) partial[5 * int64_t(tiles.m)] = spread;
  }
}

#endif  // FUSED_LOSSES_GEMM_SM90A

// What a consumer warp does with its 16 x 256 sums of a tile: store them into C, or fold them
// into the rows' statistics.
template <typename T>
struct GemmStoreTile {
  T* c;
#if FUSED_LOSSES_GEMM_SM90A
  __device__ __forceinline__ void operator()(float (&d)[128], unsigned char* staging, const GemmTiles& tiles, int row0,
                                             int col0, int) const {
    gemm_store_warp_rows<T>(d, staging, c, tiles, row0, col0);
  }
#endif
};

template <typename T>
struct GemmRowStatsTile {
  GemmRowStats out;
#if FUSED_LOSSES_GEMM_SM90A
  __device__ __forceinline__ void operator()(float (&d)[128], unsigned char*, const GemmTiles& tiles, int row0,
                                             int col0, int tile_n) const {
    gemm_row_stats_warp_rows<T>(d, out, tiles, row0, col0, tile_n);
  }
#endif
};

#if FUSED_LOSSES_GEMM_SM90A

// A consumer warpgroup: rows [64 consumer, 64 consumer + 64) of every tile. Each K block: wait
// for its stage, issue 4 wgmmas (k = 0, 16, 32, 48: +32 B on the descriptors' start inside the
// 128 B swizzle span), commit, and wait until only this group runs; the previous block's stage
// is then read no more and each warp frees it (8 arrivals a stage).
template <typename T, typename Epilogue>
__device__ __forceinline__ void gemm_consume(int consumer, const GemmTiles& tiles, const GemmShared& shared,
                                             const Epilogue& epilogue) {
  const int warp = (threadIdx.x % 128) / 32;
  const bool releases = threadIdx.x % 32 == 0;
  unsigned char* staging = shared.staging + (4 * consumer + warp) * kGemmStagingWarpBytes;
  float d[128];
  uint32_t step = 0;
  for (int64_t t = blockIdx.x; t < tiles.count; t += gridDim.x) {
    const TileCoord tile = gemm_tile_coord(tiles, t);
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.f;
    for (int k_block = 0; k_block < tiles.k_blocks; ++k_block, ++step) {
      const uint32_t stage = stage_of(step);
      gemm_mbarrier_wait(&shared.full[stage], parity_of(step));
      const uint64_t a = smem_descriptor_k_major_sw128(shared.a + stage * kGemmStageBytesA + consumer * 64 * 128);
      const uint64_t b = smem_descriptor_k_major_sw128(shared.b + stage * kGemmStageBytesB);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kGemmTileK / 16; ++k) wgmma_m64n256k16<T>(d, a + 2 * k, b + 2 * k, 1);
      wgmma_commit();
      wgmma_wait<1>();
      if (k_block > 0 && releases) gemm_mbarrier_arrive(&shared.empty[stage_of(step - 1)]);
    }
    wgmma_wait<0>();
    accumulators_ready(d);
    if (releases) gemm_mbarrier_arrive(&shared.empty[stage_of(step - 1)]);
    epilogue(d, staging, tiles, tile.m * kGemmTileM + 64 * consumer + 16 * warp, tile.n * kGemmTileN, tile.n);
  }
}

#endif  // FUSED_LOSSES_GEMM_SM90A

// Registers a thread after setmaxnreg: 128 x 40 + 256 x 232 = 64512, all that the block got at launch
// (384 threads x 168, ptxas's count for __launch_bounds__(384, 1)); more and setmaxnreg.inc waits forever.
constexpr int kGemmProducerRegisters = 40;
constexpr int kGemmConsumerRegisters = 232;
constexpr int kGemmLaunchRegisters = 168;
static_assert(128 * kGemmProducerRegisters + 128 * kGemmConsumers * kGemmConsumerRegisters <=
                  kGemmThreads * kGemmLaunchRegisters,
              "setmaxnreg's split exceeds the block's registers at launch");

// Tensor maps: A's and B's {K, rows} views, boxes {64, 128} and {64, 256}, 128 B swizzle.
// CUtensorMap is a CUDA 12 type (cuda.h); CUDA 11.8 builds have no kernel (the launcher refuses).
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 12
// Epilogue: GemmStoreTile<T> (C = A B^T) or GemmRowStatsTile<T> (the rows' statistics).
template <typename T, typename Epilogue>
__global__ void __launch_bounds__(kGemmThreads, 1)
    gemm_nt_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                   const GemmTiles tiles, const Epilogue epilogue) {
#if FUSED_LOSSES_GEMM_SM90A
  extern __shared__ unsigned char shared_raw[];
  unsigned char* base = align_shared<kGemmSmemAlign>(shared_raw);
  const GemmShared shared{base, base + kGemmOffsetB, base + kGemmOffsetStaging,
                          reinterpret_cast<uint64_t*>(base + kGemmOffsetBarriers),
                          reinterpret_cast<uint64_t*>(base + kGemmOffsetBarriers) + kGemmStages};
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&a_map);
    prefetch_tensor_map(&b_map);
    for (int s = 0; s < kGemmStages; ++s) {
      mbarrier_init(&shared.full[s], 1);
      mbarrier_init(&shared.empty[s], kGemmConsumerWarps);
    }
  }
  __syncthreads();  // the barriers are initialized before any thread uses them
  wait_for_previous_kernel();
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    registers_decrease<kGemmProducerRegisters>();
    if (threadIdx.x == 0) gemm_produce(&a_map, &b_map, tiles, shared);
  } else {
    registers_increase<kGemmConsumerRegisters>();
    gemm_consume<T>(warpgroup - 1, tiles, shared, epilogue);
  }
#else
  __trap();
#endif
}
#endif

}  // namespace fused_losses
