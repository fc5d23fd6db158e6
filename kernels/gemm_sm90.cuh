// gemm_sm90.cuh: the device core of our sm_90a matrix product C = A B^T (A: M x K, B: N x K,
// both K-contiguous, 2-byte: bfloat16 or float16; C: M x N in the same dtype, float32 sums).
//
// Warpgroup 0 is the producer (one thread issues every bulk tensor copy: A's and B's boxes of a
// K block of 64 into a shared-memory stage), warpgroups 1 and 2 the consumers (wgmma, both
// operands from shared memory, float32 sums in registers, then the epilogue: store C, or each
// row's statistics). Persistent: one block a multiprocessor walks tiles blockIdx.x, + gridDim.x,
// ... in a grouped order (GemmTiles), the same for every run; each output tile has one owner and
// a fixed K order: the same bits every run, whatever the grid.
//
// Pingpong: each consumer owns whole 128 x 192 tiles, alternately (consumer 0 the block's tiles 0,
// 2, 4, ..., consumer 1 tiles 1, 3, ...), and an ordered barrier makes their main loops take turns
// on the tensor cores, so each one's epilogue runs under the other's main loop.
// Why this schedule alone: for row_stats, all the losses use, a cooperative schedule (128 x 256
// tiles) was slower and clusters of 2 sharing B by multicast gained under the 3% a variant must
// earn (notes, v55; branch gemm-sm90 holds both).
// Napkin for Llama 3's head, 8192 x 128256 x 4096 (H100 SXM: 132 SMs, 989 TFLOP/s):
// - Registers: 2 x m64n192k16 a k16 step, 2 x 96 = 192 float32 sums a thread of the 232 that
//   setmaxnreg gives a consumer (40 x 128 + 2 x 232 x 128 = 64512, the block's 384 x 168 at
//   launch): 40 for addresses, counters and the epilogue, which works on one 16-row block (96
//   sums) at a time, in place. ptxas must spill nothing.
// - Shared memory: a stage is (128 + 192) x 64 x 2 B = 40 KB; 5 stages 200 KB, staging 8 warps x 16
//   rows x 64 columns x 2 B = 16 KB, 12 barriers, 1 KB of alignment slack: 222304 of 232448 B.
// - L2 -> shared bytes: 40 KB a K block for 2 x 128 x 192 x 64 = 3.15 MFLOP, 77 FLOP/B: 8.8 TB/s
//   across 132 SMs at 674 TFLOP/s, which L2 serves only because the grouped order keeps A's and
//   B's live tiles resident.
// - Tiles: N = 128256 = 668 x 192 exactly; 64 x 668 = 42752 tiles, 323.9 a block on 132 SMs. A
//   ragged N's last tile is masked (zeros copied in, columns >= N skipped).
// - Overlap: a tile's main loop is 2 x 128 x 192 x 4096 = 201 MFLOP, ~49k clocks of an SM's 4096
//   FLOP a clock (~25 us); its statistics, 24576 values, ~9 us (1.5 x the ~6 us an H200 took for
//   a consumer's 16384 of a 128 x 256 tile): hidden while shorter than the other consumer's main loop.
//
// Barriers (mbarriers, parity waits; a fresh barrier counts the phase before its first as done):
// - step: the block's K blocks counted across its tiles in order, both consumers' tiles: its
//   j-th tile's k-th block is step j x k_blocks + k; stage = step % stages, parity (step / stages) & 1.
// - full[stage]: 1 arrival (the producer's expect_tx) + the stage's 40 KB (a box partly past the
//   operand lands whole, zeros filled in); a consumer waits parity (step / stages) & 1.
// - empty[stage]: 4 arrivals, one from each warp of the consumer that read the stage; the
//   producer waits parity ((step / stages) & 1) ^ 1, so the first round passes at once.
// - turn[c]: 4 arrivals, one from each warp of consumer 1 - c when it has issued the
//   last wgmma of a tile. Consumer c's i-th tile (the block's tile 2i + c) waits parity
//   (i & 1) ^ (c == 0): consumer 0 for consumer 1's first i arrivals (none before its first tile:
//   parity 1 passes a fresh barrier), consumer 1 for consumer 0's first i + 1. Parity is enough: a
//   consumer arrives once a tile and starts its next tile only after the other has passed the
//   wait that its arrival completed, so no turn barrier gets two phases ahead of its waiter. The
//   turns also keep full's parities sound when k_blocks < stages: all waits on full run in step
//   order, so step - stages's wait has passed when step's begins.
// - The epilogues need no order between consumers: each warp stages in its own buffer.
//
// Build: wgmma and setmaxnreg exist only for sm_90a (-gencode arch=compute_90a,code=sm_90a;
// loader arch "9.0a"). Everywhere else (sm_80, plain sm_90, CUDA 11.8) the kernel body is a
// __trap() and the launchers (linear_ce_gemm.cu) refuse with an error before launching.
#pragma once

#include <cstdint>
#include <cstdio>
#include <type_traits>

#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 12
#include <cuda.h>  // CUtensorMap (header only: no libcuda link)
#endif

#include "device.cuh"
#include "row_stats_combine.cuh"  // TileStatsPart, add_part_at: the epilogue folds as the combine does
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
// Tile shapes and shared-memory layouts (host and device).

constexpr int kGemmTileM = 128;      // rows of A (and C) a tile
constexpr int kGemmTileK = 64;       // 64 x 2 B = 128 B: one swizzle span, one TMA box row
constexpr int kGemmConsumers = 2;    // consumer warpgroups
constexpr int kGemmThreads = 128 * (1 + kGemmConsumers);
constexpr int kGemmConsumerWarps = 4 * kGemmConsumers;
// 128 B swizzle repeats every 8 rows x 128 B: every stage starts at a 1024 B boundary, so the
// wgmma descriptors' base offset is 0 and the TMA's swizzle and the descriptors' agree.
constexpr int kGemmSmemAlign = 1024;

// The tile and its pipeline (the header): everything here follows from the 128 x 192 tile a
// consumer and the 5 stages.
constexpr int kGemmTileN = 192;  // rows of B (columns of C) a tile
static_assert(kGemmTileN == kGemmRowStatsTileColumns, "row_stats' partials: a tile of classes each (ops.h)");
constexpr int kGemmStages = 5;   // 5 x 40 KB in flight
constexpr int kGemmRowBlocks = kGemmTileM / 64;  // m64 wgmmas a k16 step: a consumer owns all 128 rows
constexpr int kGemmSums = kGemmTileN / 2;        // float32 sums a thread, per 64-row block
// Warps that read a stage, each of which frees it once: the owning consumer's 4.
constexpr int kGemmReleaseArrivals = kGemmConsumerWarps / kGemmConsumers;
// The epilogue stages a warp's 16 rows x kGemmStagingColumns at a time: apart from the pipeline's
// stages, which the producer is already filling with the next tiles' K blocks.
constexpr int kGemmStagingColumns = 64;
constexpr int kGemmStagingWarpBytes = 16 * kGemmStagingColumns * 2;
constexpr int kGemmStageBytesA = kGemmTileM * kGemmTileK * 2;  // 16 KB
constexpr int kGemmStageBytesB = kGemmTileN * kGemmTileK * 2;  // 24 KB
constexpr int kGemmStageBytes = kGemmStageBytesA + kGemmStageBytesB;  // what lands in a stage
constexpr int kGemmOffsetB = kGemmStages * kGemmStageBytesA;
constexpr int kGemmOffsetStaging = kGemmOffsetB + kGemmStages * kGemmStageBytesB;
constexpr int kGemmOffsetBarriers = kGemmOffsetStaging + kGemmConsumerWarps * kGemmStagingWarpBytes;
constexpr int kGemmBarriers = 2 * kGemmStages + kGemmConsumers;  // full, empty, turn
constexpr int kGemmSmemBytes = kGemmSmemAlign + kGemmOffsetBarriers + kGemmBarriers * 8;  // 222304 B
static_assert(kGemmSmemBytes <= 232448, "more than an H100 block's 227 KB of shared memory");
static_assert(kGemmStageBytesA % kGemmSmemAlign == 0 && kGemmStageBytesB % kGemmSmemAlign == 0, "stage alignment");
static_assert(kGemmTileN % kGemmStagingColumns == 0, "whole staging pieces");

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

// Why: the mbarrier's arrival without a transaction: a consumer warp frees a stage with it, or
// hands the tensor cores to the other consumer.
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

// Why: the producer needs few registers and the consumers many (192 sums + addresses): moving
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
// Why: waits until at most kPending committed groups are still running: the K blocks just issued
// keep the tensor cores busy while an older block's stage is released.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Why: the wgmma's asm names the sums as outputs where it is issued, not where wgmma_wait
// finishes it; this marks them written here, so no read of them moves above the wait.
template <int kSums>
__device__ __forceinline__ void accumulators_ready(float (&d)[kSums]) {
#pragma unroll
  for (int i = 0; i < kSums; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define FUSED_LOSSES_WGMMA_D8(i)                                                            \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define FUSED_LOSSES_WGMMA_D96                                                                              \
  FUSED_LOSSES_WGMMA_D8(0), FUSED_LOSSES_WGMMA_D8(8), FUSED_LOSSES_WGMMA_D8(16), FUSED_LOSSES_WGMMA_D8(24),   \
      FUSED_LOSSES_WGMMA_D8(32), FUSED_LOSSES_WGMMA_D8(40), FUSED_LOSSES_WGMMA_D8(48), FUSED_LOSSES_WGMMA_D8(56), \
      FUSED_LOSSES_WGMMA_D8(64), FUSED_LOSSES_WGMMA_D8(72), FUSED_LOSSES_WGMMA_D8(80), FUSED_LOSSES_WGMMA_D8(88)
#define FUSED_LOSSES_WGMMA_N192(types)                                                                          \
  asm volatile(                                                                                                 \
      "{\n .reg .pred accumulate;\n setp.ne.b32 accumulate, %98, 0;\n"                                          \
      " wgmma.mma_async.sync.aligned.m64n192k16.f32." types " {"                                                \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                        \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                        \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                        \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                        \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "                       \
      "%96, %97, accumulate, 1, 1, 0, 0;\n}"                                                                    \
      : FUSED_LOSSES_WGMMA_D96                                                                                  \
      : "l"(a), "l"(b), "r"(accumulate))

// Why: the tensor cores' step for a 64-row block of the tile, 64 x 192 x 16, both operands read
// from shared memory (K-major, "SS"): d (64 x 192 float32, 96 a thread) += A B^T, or = A B^T when
// !accumulate. Asynchronous: d must not be touched until a wgmma_wait covers it.
template <typename T>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[kGemmSums], uint64_t a, uint64_t b, uint32_t accumulate) {
  static_assert(sizeof(T) == 2, "2-byte operands");
  static_assert(kGemmSums == 96, "m64n192k16");
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    FUSED_LOSSES_WGMMA_N192("bf16.bf16");
  } else {
    FUSED_LOSSES_WGMMA_N192("f16.f16");
  }
}

#undef FUSED_LOSSES_WGMMA_N192
#undef FUSED_LOSSES_WGMMA_D96
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
  unsigned char* a;         // stages x 128 rows x 128 B
  unsigned char* b;         // stages x 192 rows x 128 B
  unsigned char* staging;   // kGemmConsumerWarps x 16 rows x 64 columns x 2 B
  uint64_t* full;           // [stage]: the copies landed (1 arrival + the stage's bytes)
  uint64_t* empty;          // [stage]: every warp that reads it is done
  uint64_t* turn;           // [consumer]: the other consumer has issued its tile's wgmmas
};

// K blocks are counted across the block's tiles (`step`), so stage = step % stages and the
// barrier's phase parity = (step / stages) & 1 run on from tile to tile, in every role.
__device__ __forceinline__ uint32_t stage_of(uint32_t step) { return step % kGemmStages; }
__device__ __forceinline__ uint32_t parity_of(uint32_t step) { return (step / kGemmStages) & 1; }

// A consumer warp frees a stage it has read: lane 0 arrives for its warp (the header's empty[stage]).
__device__ __forceinline__ void gemm_release_stage(uint64_t* empty, int lane) {
  if (lane == 0) gemm_mbarrier_arrive(empty);
}

// One thread: for every K block of every tile, wait until the stage is free, then copy A's 128 x 64
// and B's 192 x 64 box into it. A fresh barrier counts as having completed the phase before its
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

// A consumer warp's 16 x kColumns sums of one tile go out through its staging buffer, a piece of
// kGemmStagingColumns at a time: a lane holds rows r = lane / 4 and r + 8, columns 8j + 2 (lane % 4)
// + {0, 1} for j < kColumns / 8 (the wgmma layout), which written straight to C would be 8-byte
// pieces. A piece's pairs are rounded to T into the buffer (16 B chunk index XOR row % 8: the 32
// lanes hit 32 banks); from there each row's 128 contiguous bytes are stored by 8 lanes, 16 B each,
// or read in order by the statistics.
constexpr int kGemmPieceChunks = kGemmStagingColumns / 8;  // 16 B chunks of a staged row
constexpr int kGemmPieceRowBytes = 2 * kGemmStagingColumns;
static_assert(kGemmPieceChunks % 8 == 0 && kGemmPieceChunks <= 32, "pieces of whole swizzle rows");

__device__ __forceinline__ int gemm_staged_offset(int r, int chunk) {
  return r * kGemmPieceRowBytes + ((chunk ^ (r % 8)) * 16);
}

template <typename T, int kColumns>
__device__ __forceinline__ void gemm_stage_piece(const float (&d)[kColumns / 2], unsigned char* staging, int piece) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int jj = 0; jj < kGemmPieceChunks; ++jj) {
    const int j = kGemmPieceChunks * piece + jj;
#pragma unroll
    for (int upper = 0; upper < 2; ++upper) {
      const int r = lane / 4 + 8 * upper;
      *reinterpret_cast<uint32_t*>(staging + gemm_staged_offset(r, jj) + 4 * (lane % 4)) =
          pack_pair<T>(d[4 * j + 2 * upper], d[4 * j + 2 * upper + 1]);
    }
  }
}

// The staged piece's 16 rows into C at (row0, col), within C's m rows and n columns.
template <typename T>
__device__ __forceinline__ void gemm_store_staged_piece(const unsigned char* staging, T* c, const GemmTiles& tiles,
                                                        int row0, int col) {
  constexpr int kRowsAtOnce = 32 / kGemmPieceChunks;
  const int lane = threadIdx.x % 32;
  const bool full_chunks = tiles.ldc % 8 == 0 && reinterpret_cast<uintptr_t>(c) % 16 == 0;
#pragma unroll
  for (int i = 0; i < 16 / kRowsAtOnce; ++i) {
    const int r = kRowsAtOnce * i + lane / kGemmPieceChunks;
    const int chunk = lane % kGemmPieceChunks;
    const uint4 value = *reinterpret_cast<const uint4*>(staging + gemm_staged_offset(r, chunk));
    const int row = row0 + r;
    const int chunk_col = col + 8 * chunk;
    if (row >= tiles.m || chunk_col >= tiles.n) continue;
    T* out = c + int64_t(row) * tiles.ldc + chunk_col;
    if (full_chunks && chunk_col + 8 <= tiles.n) {
      *reinterpret_cast<uint4*>(out) = value;
    } else {  // the ragged last columns, or a C whose rows are not 16 B-aligned: 2 B at a time
      const uint32_t words[4] = {value.x, value.y, value.z, value.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const uint16_t element = static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2)));
        if (chunk_col + e < tiles.n) reinterpret_cast<uint16_t*>(out)[e] = element;
      }
    }
  }
}

template <typename T, int kColumns>
__device__ __forceinline__ void gemm_store_warp_rows(const float (&d)[kColumns / 2], unsigned char* staging, T* c,
                                                     const GemmTiles& tiles, int row0, int col0) {
  static_assert(kColumns % kGemmStagingColumns == 0, "whole pieces");
#pragma unroll
  for (int piece = 0; piece < kColumns / kGemmStagingColumns; ++piece) {
    gemm_stage_piece<T, kColumns>(d, staging, piece);
    __syncwarp();
    gemm_store_staged_piece<T>(staging, c, tiles, row0, col0 + kGemmStagingColumns * piece);
    __syncwarp();  // the buffer's reads are done before the next piece overwrites it
  }
}

#endif  // FUSED_LOSSES_GEMM_SM90A

// The fused product's epilogue (DESIGN.md, "The fused product"): instead of C, each row's
// statistics over the tile's 192 columns, in the row passes' form
// (row_passes.cu: max m, sum of exp(u - m), the target's u, the sum of u, the sum of exp over the
// classes other than the target; with 6 rows also sum exp(u - m) (u - m)) of
// u = softcap(round(acc + bias)) / T, the logit rounded to T first as a product's output is, so the
// statistics are those of eager's logits. partials: (tiles_n, stat_rows, m) float32, every entry
// written; combining the tiles is the caller's (a vocabulary shard's combine, across tiles).

#if FUSED_LOSSES_GEMM_SM90A

// The bias added to a warp's 16 x kColumns sums (the wgmma layout above) before they are rounded.
template <typename T, int kColumns>
__device__ __forceinline__ void gemm_add_bias_warp_rows(float (&d)[kColumns / 2], const T* bias,
                                                        const GemmTiles& tiles, int col0) {
  const int lane_col0 = col0 + 2 * (threadIdx.x % 32 % 4);
  const int in_c = tiles.n - lane_col0;  // column 8j + e of this lane's is in C while 8j + e < in_c
  bias += lane_col0;
#pragma unroll
  for (int j = 0; j < kColumns / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float b = 8 * j + e < in_c ? static_cast<float>(bias[8 * j + e]) : 0.f;
      d[4 * j + e] += b;
      d[4 * j + 2 + e] += b;
    }
  }
}

// A staged pair (T's bits) as two floats.
template <typename T>
__device__ __forceinline__ void unpack_pair(uint32_t pair, float& lo, float& hi) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    lo = __uint_as_float(pair << 16);
    hi = __uint_as_float(pair & 0xffff0000u);
  } else {
    asm("{\n .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi)
        : "r"(pair));
  }
}

// A chunk's 8 values u folded into a lane's statistics of its row (row_stats_combine.cuh's
// TileStatsPart, relative to its max): the max moves at most once a chunk, the sums moved onto it
// by add_part_at. Values from `valid` on are not classes (left out); t: the target's index in the
// chunk, if there.
template <typename T, bool kRagged>
__device__ __forceinline__ void fold_chunk(TileStatsPart& stats, const float (&u)[8], int valid, int t,
                                           bool entropy) {
  float max = stats.max;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if (!kRagged || e < valid) max = max_acc(max, u[e]);
  }
  if (max != stats.max) {
    TileStatsPart moved{max, 0.f, 0.f, 0.f, 0.f, 0.f};
    add_part_at(moved, stats, max, entropy);
    stats = moved;
  }
  const float base = max == -infinity<float>() ? 0.f : max;  // every value so far -inf: exp(-inf - 0) = 0
  float ex[8];
  float chunk_sum = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    ex[e] = !kRagged || e < valid ? exp_minus<T>(u[e], base) : 0.f;
    chunk_sum += ex[e];
    if (!kRagged || e < valid) stats.logit_sum += u[e];
  }
  stats.sum += chunk_sum;
  if (t >= 0 && t < (kRagged ? valid : 8)) {  // others without the target's term: nothing cancels
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (e == t) {
        stats.target = u[e];
      } else {
        stats.others += ex[e];
      }
    }
  } else {
    stats.others += chunk_sum;
  }
  if (entropy) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (ex[e] != 0.f) stats.spread += ex[e] * (u[e] - base);
    }
  }
}

// A row's two lanes (lane % 2) add their parts of a tile (every lane shuffles); where `writes` (the even lane of a
// row in C), the row's partials of tile tile_n.
__device__ __forceinline__ void gemm_write_row_partials(const TileStatsPart& stats, const GemmRowStats& out,
                                                        const GemmTiles& tiles, int row, bool writes, int tile_n,
                                                        bool entropy) {
  const TileStatsPart other{__shfl_xor_sync(0xffffffffu, stats.max, 1), __shfl_xor_sync(0xffffffffu, stats.sum, 1),
                            __shfl_xor_sync(0xffffffffu, stats.target, 1),
                            __shfl_xor_sync(0xffffffffu, stats.logit_sum, 1),
                            __shfl_xor_sync(0xffffffffu, stats.others, 1),
                            __shfl_xor_sync(0xffffffffu, stats.spread, 1)};
  if (!writes) return;
  const float max = max_acc(stats.max, other.max);
  TileStatsPart total{max, 0.f, 0.f, 0.f, 0.f, 0.f};
  add_part_at(total, stats, max, entropy);
  add_part_at(total, other, max, entropy);
  float* partial = out.partials + int64_t(tile_n) * out.stat_rows * tiles.m + row;
  partial[0] = total.max;
  partial[int64_t(tiles.m)] = total.sum;
  partial[2 * int64_t(tiles.m)] = total.target;
  partial[3 * int64_t(tiles.m)] = total.logit_sum;
  partial[4 * int64_t(tiles.m)] = total.others;
  if (entropy) partial[5 * int64_t(tiles.m)] = total.spread;
}

// A consumer warp's 16 rows of one tile into partials[tile_n], from the staged pieces (the logits
// rounded to T, as a product's output is: the statistics are those of eager's logits): a lane takes
// row lane / 2 and the half (lane % 2) of each piece's 64 columns; the two lanes of a row are added
// at the end and lane % 2 == 0 writes. (Folded in the wgmma layout, from registers, the epilogue was
// twice the code, ~30 instructions a value, and longer than a short main loop: notes v59.)
template <typename T, int kColumns>
__device__ __forceinline__ void gemm_row_stats_warp_rows(const float (&d)[kColumns / 2], unsigned char* staging,
                                                         const GemmRowStats& out, const GemmTiles& tiles, int row0,
                                                         int col0, int tile_n) {
  constexpr int kHalf = kGemmStagingColumns / 2;
  const int lane = threadIdx.x % 32;
  const int r = lane / 2, half = lane % 2;
  const int row = row0 + r;
  const bool row_ok = row < tiles.m;
  const bool entropy = out.stat_rows == 6;
  const Softcap<T> softcap(out.softcap, out.softcap_inverse);
  const float s = out.inverse_temperature;
  // The target's column from the tile's first, or -1 (a class elsewhere, or none: e.g. -100).
  const int64_t target_col = row_ok ? target_of(out.target, out.target_int32, row) - col0 : -1;
  const int target = target_col >= 0 && target_col < kColumns ? static_cast<int>(target_col) : -1;
  TileStatsPart stats{-infinity<float>(), 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int piece = 0; piece < kColumns / kGemmStagingColumns; ++piece) {
    const int piece_col = kGemmStagingColumns * piece;
    gemm_stage_piece<T, kColumns>(d, staging, piece);
    __syncwarp();
#pragma unroll 1
    for (int i = 0; i < kHalf / 8; ++i) {
      const int chunk = (kHalf / 8) * half + i;
      const int first = piece_col + 8 * chunk;  // the chunk's first column in the tile
      const uint4 value = *reinterpret_cast<const uint4*>(staging + gemm_staged_offset(r, chunk));
      const uint32_t words[4] = {value.x, value.y, value.z, value.w};
      float u[8];
#pragma unroll
      for (int w = 0; w < 4; ++w) unpack_pair<T>(words[w], u[2 * w], u[2 * w + 1]);
#pragma unroll
      for (int e = 0; e < 8; ++e) u[e] = softcap.apply(u[e]) * s;
      const int valid = tiles.n - (col0 + first);
      if (valid >= 8) {
        fold_chunk<T, false>(stats, u, valid, target - first, entropy);
      } else if (valid > 0) {
        fold_chunk<T, true>(stats, u, valid, target - first, entropy);
      }
    }
    __syncwarp();  // the buffer's reads are done before the next piece overwrites it
  }
  gemm_write_row_partials(stats, out, tiles, row, row_ok && half == 0, tile_n, entropy);
}

// The training form of the same rows (issue 55 stage 3): beside the statistics, each 64-column piece
// is written as E = 2^(u log2 e - k) dz'/dz, k = ceil(the row's max u over the piece x log2 e) (piece_max
// holds k), 0 at the target (its gradient, -others / sum, is added apart: p - 1 would cancel), so that d
// input's product needs only an exact power of two a row and piece (gemm_grad_input). The piece's max comes
// first, from the rounded logits (u rises with them), so each value's exp is taken once, relative to 2^k.
// At Gemma 2's K = 2304 this epilogue must fit under the other consumer's main loop: a value costs ~5
// instructions (~14 with a softcap) on the common chunk (all columns classes, not the target's), and the sums
// are taken relative to 2^k' and moved onto the max once a piece (notes v62).

// A lane's sums over its values of one piece, f = 2^(u log2 e - k'): k' = k, or k - 2 with a softcap, whose
// slope 4 q (1 - q) then makes E = f q (1 - q). x is z, or tanh(z / cap) with a softcap.
struct FormPieceSums {
  float others = 0.f;    // f over the classes but the target
  float target_f = 0.f;  // the target's f
  float target_x = 0.f;  // the target's x
  float x_sum = 0.f;     // x over the classes
  float spread = 0.f;    // with the entropy: f (x - the piece's max x) over the classes, the target's too
};

// One chunk of 8 staged values in place: E's pairs written over the logits'. kChecked: some columns may be past
// the classes (from `valid` on: E 0, left out) or the target's (t: E 0, its f and x apart). kEntropy: the
// entropy's sum too (x_max: the piece's max x).
template <typename T, bool kCapped, bool kChecked, bool kEntropy>
__device__ __forceinline__ void form_chunk(uint32_t (&words)[4], const Softcap<T>& softcap, float x_to_log2,
                                           float minus_k, float x_max, int valid, int t, FormPieceSums& sums) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    float z[2], e[2];
    unpack_pair<T>(words[w], z[0], z[1]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = 2 * w + h;
      float x = z[h], slope_4 = 1.f;  // a softcap's slope / 4
      if constexpr (kCapped) {
        const float y = softcap.y_of(x);
        const float q = softcap.q_of(y);
        x = softcap.tanh_of(y, q);
        slope_4 = fmaf(-q, q, q);
      }
      float f = exp2_flush_subnormal(fmaf(x, x_to_log2, minus_k));
      float distance = x - x_max;  // past the classes, x_max may be -inf
      if (kChecked && col >= valid) f = x = distance = 0.f;
      // A masked class (x = -inf, f = 0) adds 0, not 0 x -inf: the distance is held finite.
      if constexpr (kEntropy) sums.spread = fmaf(f, fmaxf(distance, -3e38f), sums.spread);
      if (kChecked && col == t) {
        sums.target_f = f;
        sums.target_x = x;
        f = 0.f;
      }
      sums.others += f;
      sums.x_sum += x;
      e[h] = kCapped ? f * slope_4 : f;
    }
    words[w] = pack_pair<T>(e[0], e[1]);
  }
}

// form_chunk's copy for a softcap or none, checked or not.
template <typename T, bool kEntropy>
__device__ __forceinline__ void form_chunk_of(bool capped, bool checked, uint32_t (&words)[4],
                                              const Softcap<T>& softcap, float x_to_log2, float minus_k, float x_max,
                                              int valid, int t, FormPieceSums& sums) {
  if (capped) {
    if (checked) {
      form_chunk<T, true, true, kEntropy>(words, softcap, x_to_log2, minus_k, x_max, valid, t, sums);
    } else {
      form_chunk<T, true, false, kEntropy>(words, softcap, x_to_log2, minus_k, x_max, valid, t, sums);
    }
  } else if (checked) {
    form_chunk<T, false, true, kEntropy>(words, softcap, x_to_log2, minus_k, x_max, valid, t, sums);
  } else {
    form_chunk<T, false, false, kEntropy>(words, softcap, x_to_log2, minus_k, x_max, valid, t, sums);
  }
}

// The larger of each half of two staged pairs (NaN loses, as max_acc).
template <typename T>
__device__ __forceinline__ uint32_t max_pairs(uint32_t a, uint32_t b) {
  uint32_t larger;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    asm("max.bf16x2 %0, %1, %2;" : "=r"(larger) : "r"(a), "r"(b));
  } else {
    asm("max.f16x2 %0, %1, %2;" : "=r"(larger) : "r"(a), "r"(b));
  }
  return larger;
}

template <typename T, int kColumns>
__device__ __forceinline__ void gemm_row_stats_e_warp_rows(const float (&d)[kColumns / 2], unsigned char* staging,
                                                           const GemmRowStats& out, const GemmTiles& tiles,
                                                           int row0, int col0, int tile_n) {
  constexpr int kChunks = kGemmStagingColumns / 2 / 8;  // 16 B chunks of a row a lane reads a piece
  const int lane = threadIdx.x % 32;
  const int r = lane / 2, half = lane % 2;
  const int row = row0 + r;
  const bool row_ok = row < tiles.m;
  const Softcap<T> softcap(out.softcap, out.softcap_inverse);
  const bool capped = out.softcap != 0.f;
  const bool entropy = out.stat_rows == 6;
  const float s = out.inverse_temperature;
  const float x_to_u = capped ? out.softcap * s : s;  // u = x_to_u x (as Softcap::apply, then s, up to a rounding)
  const float x_to_log2 = x_to_u * kLog2e;
  const int64_t target_col = row_ok ? target_of(out.target, out.target_int32, row) - col0 : -1;
  const int target = target_col >= 0 && target_col < kColumns ? static_cast<int>(target_col) : -1;
  GemmTiles e_tiles = tiles;
  e_tiles.ldc = out.ld_e;
  TileStatsPart stats{-infinity<float>(), 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll  // d is indexed by piece: a rolled loop would put it in local memory
  for (int piece = 0; piece < kColumns / kGemmStagingColumns; ++piece) {
    const int piece_col = kGemmStagingColumns * piece;
    const int lane_col = piece_col + 8 * kChunks * half;       // the lane's first column in the tile
    const int lane_valid = tiles.n - (col0 + lane_col);         // its columns that are classes, if < 8 kChunks
    gemm_stage_piece<T, kColumns>(d, staging, piece);
    __syncwarp();
    float raw_max = -infinity<float>();
    if (lane_valid >= 8 * kChunks) {
      uint32_t pairs = 0xff80ff80u;  // -inf twice, as bf16; float16's -inf is 0xfc00
      if constexpr (!std::is_same_v<T, c10::BFloat16>) pairs = 0xfc00fc00u;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const uint4 value = *reinterpret_cast<const uint4*>(staging + gemm_staged_offset(r, kChunks * half + i));
        pairs = max_pairs<T>(pairs, max_pairs<T>(max_pairs<T>(value.x, value.y), max_pairs<T>(value.z, value.w)));
      }
      float lo, hi;
      unpack_pair<T>(pairs, lo, hi);
      raw_max = max_acc(lo, hi);
    } else {
#pragma unroll 1
      for (int i = 0; i < kChunks; ++i) {
        const uint4 value = *reinterpret_cast<const uint4*>(staging + gemm_staged_offset(r, kChunks * half + i));
        const uint32_t words[4] = {value.x, value.y, value.z, value.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          float lo, hi;
          unpack_pair<T>(words[w], lo, hi);
          if (8 * i + 2 * w < lane_valid) raw_max = max_acc(raw_max, lo);
          if (8 * i + 2 * w + 1 < lane_valid) raw_max = max_acc(raw_max, hi);
        }
      }
    }
    raw_max = max_acc(raw_max, __shfl_xor_sync(0xffffffffu, raw_max, 1));
    // With a softcap even masked classes (-inf) have u = -cap / T, as row_stats and torch count them.
    const float piece_max = softcap.apply(raw_max) * s;
    float x_max = raw_max;  // the entropy's reference: x of the piece's max (its softcap's MUFUs only if wanted)
    if (entropy && capped) {
      const float y_max = softcap.y_of(raw_max);
      x_max = softcap.tanh_of(y_max, softcap.q_of(y_max));
    }
    // E is written relative to 2^exponent, exponent = ceil(max log2 e): d input's product then scales a piece by
    // an exact power of two (gemm_sm90_grad_input.cuh). A piece of masked classes only (no softcap): exponent
    // -inf, E 0.
    const float exponent = piece_max == -infinity<float>() ? piece_max : ceilf(piece_max * kLog2e);
    const float k_f = piece_max == -infinity<float>() ? 0.f : exponent - (capped ? 2.f : 0.f);  // k'
    FormPieceSums sums;
#pragma unroll 1
    for (int i = 0; i < kChunks; ++i) {
      const int t = target - (lane_col + 8 * i);
      uint4& value = *reinterpret_cast<uint4*>(staging + gemm_staged_offset(r, kChunks * half + i));
      uint32_t words[4] = {value.x, value.y, value.z, value.w};
      const int valid = lane_valid - 8 * i;
      const bool checked = valid < 8 || (t >= 0 && t < 8);
      if (entropy) {
        form_chunk_of<T, true>(capped, checked, words, softcap, x_to_log2, -k_f, x_max, valid, t, sums);
      } else {
        form_chunk_of<T, false>(capped, checked, words, softcap, x_to_log2, -k_f, x_max, valid, t, sums);
      }
      value = make_uint4(words[0], words[1], words[2], words[3]);
    }
    // The piece's sums moved from 2^k' onto its max, as row_stats holds them.
    const float to_max = piece_max == -infinity<float>() ? 1.f : exp2f(k_f - piece_max * kLog2e);
    const bool has_target = target >= lane_col && target < lane_col + 8 * kChunks;
    const float target_u = capped ? static_cast<float>(out.softcap * sums.target_x) * s : sums.target_x * s;
    TileStatsPart part{piece_max, (sums.others + sums.target_f) * to_max, has_target ? target_u : 0.f,
                       sums.x_sum * x_to_u, sums.others * to_max, sums.spread * x_to_u * to_max};
    const float max = max_acc(stats.max, piece_max);
    TileStatsPart total{max, 0.f, 0.f, 0.f, 0.f, 0.f};
    add_part_at(total, stats, max, entropy);
    add_part_at(total, part, max, entropy);
    stats = total;
    __syncwarp();
    gemm_store_staged_piece<T>(staging, static_cast<T*>(out.e), e_tiles, row0, col0 + piece_col);
    if (half == 0 && row_ok && col0 + piece_col < tiles.n) {
      out.piece_max[int64_t((col0 + piece_col) / kGemmStagingColumns) * tiles.m + row] = exponent;
    }
    __syncwarp();  // the buffer's reads are done before the next piece overwrites it
  }
  gemm_write_row_partials(stats, out, tiles, row, row_ok && half == 0, tile_n, entropy);
}

#endif  // FUSED_LOSSES_GEMM_SM90A

// What a consumer warp does with its 16 x 192 sums of a tile: store them into C, or fold them into
// the rows' statistics.
template <typename T>
struct GemmStoreTile {
  T* c;
#if FUSED_LOSSES_GEMM_SM90A
  __device__ __forceinline__ void operator()(float (&d)[kGemmSums], unsigned char* staging, const GemmTiles& tiles,
                                             int row0, int col0, int) const {
    gemm_store_warp_rows<T, kGemmTileN>(d, staging, c, tiles, row0, col0);
  }
#endif
};

// kTrainingForm: also E and the pieces' maxima (gemm_row_stats_e_warp_rows).
template <typename T, bool kTrainingForm = false>
struct GemmRowStatsTile {
  GemmRowStats out;
#if FUSED_LOSSES_GEMM_SM90A
  __device__ __forceinline__ void operator()(float (&d)[kGemmSums], unsigned char* staging, const GemmTiles& tiles,
                                             int row0, int col0, int tile_n) const {
    if (out.bias != nullptr) gemm_add_bias_warp_rows<T, kGemmTileN>(d, static_cast<const T*>(out.bias), tiles, col0);
    if constexpr (kTrainingForm) {
      gemm_row_stats_e_warp_rows<T, kGemmTileN>(d, staging, out, tiles, row0, col0, tile_n);
    } else {
      gemm_row_stats_warp_rows<T, kGemmTileN>(d, staging, out, tiles, row0, col0, tile_n);
    }
  }
#endif
};

#if FUSED_LOSSES_GEMM_SM90A

// A consumer warpgroup: all 128 rows (two 64-row blocks) of the block's tiles consumer, consumer + 2,
// ..., its main loop after the other consumer's (turn[consumer], the header's parities), so that
// its epilogue runs under the other's main loop. Each K block: wait for its stage, issue the
// wgmmas (k = 0, 16, 32, 48: +32 B on the descriptors' start inside the 128 B swizzle span; each
// row block), commit, and wait until at most 2 groups are pending; the stage 2 blocks back is then
// read no more and each warp frees it. (1 pending, descriptors rebuilt each block: the plain
// product 4% slower on an H200, notes v57.) A consumer holds 3 of the 5 stages: the producer kept
// ahead (ncu: no wait on full spun), and a tile's first 3 K blocks sit in stages that the other
// consumer freed inside its loop.
template <typename T, typename Epilogue>
__device__ __forceinline__ void gemm_consume(int consumer, const GemmTiles& tiles, const GemmShared& shared,
                                             const Epilogue& epilogue) {
  const int warp = (threadIdx.x % 128) / 32;
  const int lane = threadIdx.x % 32;
  const bool signals = lane == 0;  // lane 0 arrives for its warp
  unsigned char* staging = shared.staging + (4 * consumer + warp) * kGemmStagingWarpBytes;
  const int64_t blocks = gridDim.x;
  float d[kGemmRowBlocks][kGemmSums];
  // Stage 0's descriptors, once: a stage's are these plus its offset >> 4 (start field, no carry:
  // shared addresses < 2^18).
  const uint64_t a_stage0 = smem_descriptor_k_major_sw128(shared.a);
  const uint64_t b_stage0 = smem_descriptor_k_major_sw128(shared.b);
  // The block's tile 2i + consumer starts at step (2i + consumer) k_blocks.
  uint32_t step = consumer * tiles.k_blocks;
  uint32_t turn_parity = consumer == 0 ? 1 : 0;  // (i & 1) ^ (consumer == 0) for its i-th tile
  for (int64_t t = blockIdx.x + consumer * blocks; t < tiles.count; t += 2 * blocks) {
    const TileCoord tile = gemm_tile_coord(tiles, t);
#pragma unroll
    for (int block = 0; block < kGemmRowBlocks; ++block) {
#pragma unroll
      for (int i = 0; i < kGemmSums; ++i) d[block][i] = 0.f;
    }
    gemm_mbarrier_wait(&shared.turn[consumer], turn_parity);
    turn_parity ^= 1;
    for (int k_block = 0; k_block < tiles.k_blocks; ++k_block, ++step) {
      const uint32_t stage = stage_of(step);
      gemm_mbarrier_wait(&shared.full[stage], parity_of(step));
      const uint64_t a_rows = a_stage0 + ((stage * kGemmStageBytesA) >> 4);
      const uint64_t b = b_stage0 + ((stage * kGemmStageBytesB) >> 4);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kGemmTileK / 16; ++k) {
#pragma unroll
        for (int block = 0; block < kGemmRowBlocks; ++block) {
          const uint64_t a = a_rows + ((block * 64 * 128) >> 4);
          wgmma_m64k16<T>(d[block], a + 2 * k, b + 2 * k, 1);
        }
      }
      wgmma_commit();
      // Every wgmma of the tile is issued: the other consumer's main loop may queue behind them.
      if (k_block == tiles.k_blocks - 1 && signals) gemm_mbarrier_arrive(&shared.turn[consumer ^ 1]);
      wgmma_wait<2>();
      if (k_block > 1) gemm_release_stage(&shared.empty[stage_of(step - 2)], lane);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int block = 0; block < kGemmRowBlocks; ++block) accumulators_ready(d[block]);
    if (tiles.k_blocks > 1) gemm_release_stage(&shared.empty[stage_of(step - 2)], lane);
    gemm_release_stage(&shared.empty[stage_of(step - 1)], lane);
    step += tiles.k_blocks;  // past the other consumer's next tile
#pragma unroll
    for (int block = 0; block < kGemmRowBlocks; ++block) {
      epilogue(d[block], staging, tiles, tile.m * kGemmTileM + 64 * block + 16 * warp, tile.n * kGemmTileN, tile.n);
    }
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

// Tensor maps: A's and B's {K, rows} views, boxes {64, 128} and {64, 192}, 128 B swizzle.
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
  uint64_t* barriers = reinterpret_cast<uint64_t*>(base + kGemmOffsetBarriers);
  const GemmShared shared{base,     base + kGemmOffsetB,     base + kGemmOffsetStaging,
                          barriers, barriers + kGemmStages, barriers + 2 * kGemmStages};
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&a_map);
    prefetch_tensor_map(&b_map);
    for (int s = 0; s < kGemmStages; ++s) {
      mbarrier_init(&shared.full[s], 1);
      mbarrier_init(&shared.empty[s], kGemmReleaseArrivals);
    }
    for (int c = 0; c < kGemmConsumers; ++c) mbarrier_init(&shared.turn[c], kGemmConsumerWarps / kGemmConsumers);
  }
  __syncthreads();  // the barriers are initialized before any thread uses them
  wait_for_previous_kernel();
  // Broadcast from lane 0: the compiler then knows it is warp-uniform and keeps the consumer's
  // stage and descriptor arithmetic in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
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
