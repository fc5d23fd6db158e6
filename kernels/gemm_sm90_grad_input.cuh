// gemm_sm90_grad_input.cuh: linear cross-entropy's d input from row_stats' training form (issue 55
// stage 3), on sm_90a, with no pass over the logits' gradient:
//
//   out[i, :] = f_i sum_{c != t_i} 2^(k[c / 64, i] - K_i) E[i, c] W[c, :]  +  g_t(i) W[t_i, :]
//
// over the classes of E, or (a vocabulary in parts, one launch a part, GemmGradInput) over each part's with the
// float32 sum carried between the launches, K_i then the parts' so far, the sum moved by 2^(K before - K_i).
// E (m, k) = 2^(u log2 e - k) dz'/dz with k the piece's exponent (piece_max), 0 at the target (gemm_sm90.cuh's
// training form); K_i = ceil(max_i log2 e), the row's largest k; f_i = a_i 2^(K_i - lse_i log2 e), a_i = r_i (1 +
// 2 z_loss lse_i) / T, r_i the row's scale; g_t(i) the target's gradient from -others / sum (row_passes.cu's
// formula; no label smoothing, no entropy term). W (k, n) is the linear weight, n (H) contiguous.
//
// A product of its own because its A is scaled a row and 64 columns at a time: each consumer warp loads its A
// fragments from the stage (ldmatrix), multiplies them by their rows' powers of two (exact: one bfloat16x2
// multiply a pair) and hands them to wgmma from registers; B is read N-major (wgmma's transposed B) straight
// from W's rows; f_i multiplies the sums. Cooperative: each tile is 128 x 256, consumer c its rows 64c..,
// both reading every stage; the epilogue is a store, short beside a main loop over K = the vocabulary.
// Where the tiles fill less than a wave (Llama 3: 768 x 4096 is 96 tiles; Gemma 2: 384 x 2304 is 27), K is
// cut into `splits` parts, each a unit of work; a tile's parts add into one float32 buffer in order (flags),
// the last part scales, adds the target's term and rounds to T: the same bits every run.
//
// Barriers (parity waits as gemm_sm90.cuh's): full[stage] 1 arrival + the stage's 48 KB; empty[stage] 8
// arrivals, a lane of each consumer warp.
#pragma once

#include "gemm_sm90.cuh"

namespace fused_losses {

constexpr int kGiTileM = 128;                 // 64 rows a consumer
constexpr int kGiTileN = 256;                 // columns of d input a tile: m64n256k16
constexpr int kGiStages = 4;
constexpr int kGiSums = kGiTileN / 2;         // float32 sums a thread
constexpr int kGiBoxN = 64;                   // B's boxes: 64 columns (one 128 B swizzle span) x 64 K rows
constexpr int kGiBoxBytes = kGiBoxN * kGemmTileK * 2;
constexpr int kGiStageBytesA = kGiTileM * kGemmTileK * 2;  // 16 KB
constexpr int kGiStageBytesB = kGiTileN * kGemmTileK * 2;  // 32 KB
constexpr int kGiStageBytes = kGiStageBytesA + kGiStageBytesB;
constexpr int kGiOffsetB = kGiStages * kGiStageBytesA;
constexpr int kGiOffsetBarriers = kGiOffsetB + kGiStages * kGiStageBytesB;
constexpr int kGiBarriers = 2 * kGiStages;
constexpr int kGiSmemBytes = kGemmSmemAlign + kGiOffsetBarriers + kGiBarriers * 8;
static_assert(kGiSmemBytes <= 232448, "more than an H100 block's 227 KB of shared memory");
static_assert(kGemmStagingColumns == kGemmTileK, "a K block is one piece of the training form");

// Units of work: split-major (all tiles' first parts, then their second ...), so the units running at
// once read the same K blocks of E and W (from L2), and a tile's part s - 1 runs no later than part s.
struct GiTiles {
  int tiles_m, tiles_n, splits, k_blocks;
  int64_t tiles, units;
};

struct GiUnit {
  int tile_m, tile_n, split, kb_begin, kb_end;
  int64_t tile;
};

__host__ __device__ inline GiUnit gi_unit(const GiTiles& t, int64_t unit) {
  const int split = static_cast<int>(unit / t.tiles);
  const int64_t tile = unit % t.tiles;
  return {static_cast<int>(tile % t.tiles_m), static_cast<int>(tile / t.tiles_m), split,
          static_cast<int>(int64_t(split) * t.k_blocks / t.splits),
          static_cast<int>(int64_t(split + 1) * t.k_blocks / t.splits), tile};
}

#if FUSED_LOSSES_GEMM_SM90A

// Why: an N-major B (W's rows, H contiguous) in 64-column boxes of 64 K rows, 128 B swizzled: 8 K rows of
// 128 B form a swizzle atom (stride offset 1024 B to the next 8), the next 64 columns are the next box
// (leading offset kGiBoxBytes); wgmma reads it with imm-trans-b = 1.
__device__ __forceinline__ uint64_t smem_descriptor_mn_major_sw128(const void* tile) {
  const uint64_t start = (shared_address(tile) & 0x3FFFF) >> 4;
  return start | (uint64_t(kGiBoxBytes >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Why: four 8 x 8 matrices of 2-byte values from shared memory into the mma A fragment layout (lane l
// gives the address of row l % 8 of matrix l / 8).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

__device__ __forceinline__ int load_acquire(const int* flag) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ void store_release(int* flag, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

#define FUSED_LOSSES_GI_D8(i)                                                                                 \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define FUSED_LOSSES_GI_D64(i)                                                                                  \
  FUSED_LOSSES_GI_D8(i), FUSED_LOSSES_GI_D8(i + 8), FUSED_LOSSES_GI_D8(i + 16), FUSED_LOSSES_GI_D8(i + 24),       \
      FUSED_LOSSES_GI_D8(i + 32), FUSED_LOSSES_GI_D8(i + 40), FUSED_LOSSES_GI_D8(i + 48), FUSED_LOSSES_GI_D8(i + 56)
#define FUSED_LOSSES_GI_WGMMA(types)                                                                             \
  asm volatile(                                                                                                  \
      "{\n wgmma.mma_async.sync.aligned.m64n256k16.f32." types " {"                                             \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                   \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                         \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                         \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                         \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                         \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                         \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "             \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "        \
      "{%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n}"                                                          \
      : FUSED_LOSSES_GI_D64(0), FUSED_LOSSES_GI_D64(64)                                                          \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))

// Why: 64 x 256 x 16, A from registers (the scaled fragments), B N-major from shared memory: d += A B.
template <typename T>
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[kGiSums], const uint32_t (&a)[4], uint64_t b) {
  static_assert(sizeof(T) == 2 && kGiSums == 128, "m64n256k16, 2-byte operands");
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    FUSED_LOSSES_GI_WGMMA("bf16.bf16");
  } else {
    FUSED_LOSSES_GI_WGMMA("f16.f16");
  }
}

#undef FUSED_LOSSES_GI_WGMMA
#undef FUSED_LOSSES_GI_D64
#undef FUSED_LOSSES_GI_D8

struct GiShared {
  unsigned char* a;  // stages x 128 rows x 128 B
  unsigned char* b;  // stages x 4 boxes x 64 K rows x 128 B
  uint64_t* full;
  uint64_t* empty;
};

// A consumer warp frees a stage it read with ldmatrix: every lane's reads ordered before lane 0's arrival (the
// copy engine then overwrites the stage), not only lane 0's own.
__device__ __forceinline__ void gi_release_stage(uint64_t* empty, int lane) {
  __syncwarp();
  gemm_release_stage(empty, lane);
}

__device__ __forceinline__ void gi_produce(const void* e_map, const void* w_map, const GiTiles& tiles,
                                           const GiShared& shared) {
  uint32_t step = 0;
  for (int64_t u = blockIdx.x; u < tiles.units; u += gridDim.x) {
    const GiUnit unit = gi_unit(tiles, u);
    for (int kb = unit.kb_begin; kb < unit.kb_end; ++kb, ++step) {
      const uint32_t stage = step % kGiStages, parity = (step / kGiStages) & 1;
      gemm_mbarrier_wait(&shared.empty[stage], parity ^ 1);
      mbarrier_arrive_expect_tx(&shared.full[stage], kGiStageBytes);
      tma_load_2d(shared.a + stage * kGiStageBytesA, e_map, kb * kGemmTileK, unit.tile_m * kGiTileM,
                  &shared.full[stage]);
#pragma unroll
      for (int box = 0; box < kGiTileN / kGiBoxN; ++box) {
        tma_load_2d(shared.b + stage * kGiStageBytesB + box * kGiBoxBytes, w_map,
                    unit.tile_n * kGiTileN + box * kGiBoxN, kb * kGemmTileK, &shared.full[stage]);
      }
    }
  }
}

// E's factor over a K block (one piece): 2^(piece exponent - the row's), an exact power of two (0 for a piece of
// masked classes); the rest of p's factor, a_i 2^(the row's exponent - lse log2 e), is the row's (gi_row_factor).
__device__ __forceinline__ float gi_piece_scale(float piece_exponent, float row_exponent) {
  return piece_exponent == -infinity<float>() ? 0.f : exp2f(piece_exponent - row_exponent);
}

// A max u's exponent: ceil(max log2 e). The row's, from its stats' max, is the largest of its pieces' (ceil rises
// with the max); so is that of the parts so far (the stats they combine into) for a vocabulary in parts.
__device__ __forceinline__ float gi_exponent(float max) {
  return ceilf(max * kLog2e);
}

__device__ __forceinline__ float gi_row_exponent(const GemmGradInput& call, int64_t row) {
  return gi_exponent(call.stats[row]);
}

// The row's lse: its max plus log(sum exp(u - max)) (kept apart until here: a rounded lse of 60 is 4e-6 off).
__device__ __forceinline__ float gi_lse(const GemmGradInput& call, int64_t row) {
  return call.stats[row] + __logf(call.stats[call.m + row]);
}

__device__ __forceinline__ float gi_row_factor(const GemmGradInput& call, int64_t row, float lse, float row_exponent) {
  const float a = call.row_scale[row] * (1.f + 2.f * call.z_loss * lse) * call.inverse_temperature;
  return a == 0.f ? 0.f : a * exp2f(row_exponent - lse * kLog2e);
}

// A pair of T times a power of two (or 0), exactly: one bfloat16x2 multiply.
__device__ __forceinline__ uint32_t times_pair(uint32_t pair, uint32_t scale2) {
  uint32_t out;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(pair), "r"(scale2));
  return out;
}

// The target's gradient for a grad_output of 1: r ((p_t - 1) + 2 z_loss lse p_t) dz'/dz / T (row_passes.cu's
// at the target, without smoothing), from -others / sum; 0 for an ignored row.
__device__ __forceinline__ float gi_target_gradient(const GemmGradInput& call, int64_t row, float lse) {
  const float r = call.row_scale[row];
  if (r == 0.f) return 0.f;
  const float p_minus_1 = -call.stats[4 * call.m + row] / call.stats[call.m + row];  // -others / sum
  float slope = 1.f;
  if (call.softcap > 0) {
    const float y = call.stats[2 * call.m + row] / call.inverse_temperature * call.softcap_inverse;  // tanh(z / cap)
    slope = 1.f - y * y;
  }
  return r * (p_minus_1 + 2.f * call.z_loss * lse * (1.f + p_minus_1)) * slope * call.inverse_temperature;
}

template <typename T>
__device__ __forceinline__ void gi_consume(int consumer, const GemmGradInput& call, const GiTiles& tiles,
                                           const GiShared& shared) {
  const int warp = (threadIdx.x % 128) / 32;
  const int lane = threadIdx.x % 32;
  const int tid = threadIdx.x % 128;
  const uint64_t b_stage0 = smem_descriptor_mn_major_sw128(shared.b);
  // ldmatrix_x4's addresses: lane l gives row l % 8 of matrix l / 8 (rows 0-7, 8-15 x K 0-7, then 8-15: the
  // A fragment's order), 16 B chunk 2 kk + l / 16 of its 128 B row, swizzled as the copy engine wrote it.
  const int a_row = 64 * consumer + 16 * warp + (lane % 8) + 8 * ((lane / 8) % 2);
  const uint32_t a_row_address = shared_address(shared.a) + a_row * 128;
  float d[kGiSums];
  uint32_t step = 0;
  for (int64_t u = blockIdx.x; u < tiles.units; u += gridDim.x) {
    const GiUnit unit = gi_unit(tiles, u);
    const int64_t row0 = int64_t(unit.tile_m) * kGiTileM + 64 * consumer + 16 * warp + lane / 4;
    float row_exponent[2], next[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + 8 * h;
      row_exponent[h] = row < call.m ? gi_row_exponent(call, row) : 0.f;
      next[h] = row < call.m ? call.piece_max[int64_t(unit.kb_begin) * call.m + row] : -infinity<float>();
    }
#pragma unroll
    for (int i = 0; i < kGiSums; ++i) d[i] = 0.f;
    // The fragments of each k16 step are made (from the stage, each row's times its piece's power of two) while
    // the steps before are in the tensor cores, into a ring of 4, one a step: a wgmma group a step and at most 2
    // pending, so a fragment is rewritten only once the wgmma that read it is done (CUTLASS's RS main loop does
    // the same; A rewritten under a pending wgmma makes ptxas serialize them all).
    uint32_t scale2[2];
    auto load_scale = [&](int kb) {  // this block's powers of two; the next block's exponents fetched
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float scale = gi_piece_scale(next[h], row_exponent[h]);
        scale2[h] = pack_pair<T>(scale, scale);
        if (kb + 1 < unit.kb_end && row0 + 8 * h < call.m) {
          next[h] = call.piece_max[int64_t(kb + 1) * call.m + row0 + 8 * h];
        }
      }
    };
    auto load_fragment = [&](uint32_t at_step, int kk, uint32_t (&fragment)[4]) {
      ldmatrix_x4(fragment, a_row_address + (at_step % kGiStages) * kGiStageBytesA +
                                (((2 * kk + lane / 16) ^ (lane % 8)) * 16));
#pragma unroll
      for (int q = 0; q < 4; ++q) fragment[q] = times_pair(fragment[q], scale2[q % 2]);
    };
    uint32_t frag[kGemmTileK / 16][4];
    if (unit.kb_end > unit.kb_begin) {
      load_scale(unit.kb_begin);
      gemm_mbarrier_wait(&shared.full[step % kGiStages], (step / kGiStages) & 1);
      load_fragment(step, 0, frag[0]);
    }
    for (int kb = unit.kb_begin; kb < unit.kb_end; ++kb, ++step) {
      const uint64_t b = b_stage0 + (((step % kGiStages) * kGiStageBytesB) >> 4);
#pragma unroll
      for (int kk = 0; kk < kGemmTileK / 16; ++kk) {
        if (kk + 1 < kGemmTileK / 16) {
          load_fragment(step, kk + 1, frag[kk + 1]);
        } else if (kb + 1 < unit.kb_end) {  // the next block's first step
          load_scale(kb + 1);
          gemm_mbarrier_wait(&shared.full[(step + 1) % kGiStages], ((step + 1) / kGiStages) & 1);
          load_fragment(step + 1, 0, frag[0]);
        }
        wgmma_fence();
        wgmma_m64n256k16_rs<T>(d, frag[kk], b + ((kk * 16 * 128) >> 4));
        wgmma_commit();
        wgmma_wait<2>();
        // The block before's last step is done: its stage is free.
        if (kk == 1 && kb > unit.kb_begin) gi_release_stage(&shared.empty[(step - 1) % kGiStages], lane);
      }
    }
    wgmma_wait<0>();
    if (unit.kb_end > unit.kb_begin) gi_release_stage(&shared.empty[(step - 1) % kGiStages], lane);
    accumulators_ready(d);
    // The epilogue: this thread's rows row0, row0 + 8, columns col + 8j + {0, 1}.
    const int64_t col = int64_t(unit.tile_n) * kGiTileN + 2 * (lane % 4);
    const bool last = unit.split == tiles.splits - 1;
    int* flag = call.flags == nullptr ? nullptr : call.flags + 2 * unit.tile + consumer;
    // This thread's sums a pair at a time: rows row0 + 8h, columns col + 8j + {0, 1}, those in out.
    auto each_pair = [&](auto body) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = row0 + 8 * h;
        if (row >= call.m) continue;
#pragma unroll
        for (int j = 0; j < kGiSums / 4; ++j) {
          if (col + 8 * j < call.n) body(h, row, col + 8 * j, d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        }
      }
    };
    if (unit.split > 0 || call.previous_stats != nullptr) {  // the parts before have added theirs: add it in
      float carried[2] = {1.f, 1.f};  // an earlier launch's sum moved onto this part's row exponent
      if (unit.split > 0) {
        if (tid == 0) {
          while (load_acquire(flag) != unit.split) {
          }
        }
        named_barrier_sync(1 + consumer, 128);
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t row = row0 + 8 * h;
          if (row < call.m) carried[h] = gi_piece_scale(gi_exponent(call.previous_stats[row]), row_exponent[h]);
        }
      }
      each_pair([&](int h, int64_t row, int64_t c, float& lo, float& hi) {
        const float2 before = *reinterpret_cast<const float2*>(call.partial + row * call.n + c);
        lo = fmaf(before.x, carried[h], lo);
        hi = fmaf(before.y, carried[h], hi);
      });
    }
    if (!last || !call.finish) {  // the sum so far, for this tile's next part or the next launch's
      each_pair([&](int, int64_t row, int64_t c, float& lo, float& hi) {
        *reinterpret_cast<float2*>(call.partial + row * call.n + c) = make_float2(lo, hi);
      });
      if (!last) {
        __threadfence();
        named_barrier_sync(1 + consumer, 128);
        if (tid == 0) store_release(flag, unit.split + 1);
      }
      continue;
    }
    // The last part: each row's factor, and its target's term (g_t times the target's row of W).
    float factor[2] = {0.f, 0.f}, g_t[2] = {0.f, 0.f};
    const T* w_t[2] = {static_cast<const T*>(call.w), static_cast<const T*>(call.w)};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + 8 * h;
      if (row >= call.m) continue;
      const int64_t t = target_of(call.target, call.target_int32, row);
      const float lse = gi_lse(call, row);
      factor[h] = gi_row_factor(call, row, lse, row_exponent[h]);
      if (t >= 0 && t < call.classes) {
        g_t[h] = gi_target_gradient(call, row, lse);
        w_t[h] += t * call.ld_w;
      }
    }
    each_pair([&](int h, int64_t row, int64_t c, float& lo, float& hi) {
      float x = lo * factor[h], y = hi * factor[h];
      if (g_t[h] != 0.f) {
        float w_lo, w_hi;
        unpack_pair<T>(*reinterpret_cast<const uint32_t*>(w_t[h] + c), w_lo, w_hi);
        x = fmaf(g_t[h], w_lo, x);
        y = fmaf(g_t[h], w_hi, y);
      }
      *reinterpret_cast<uint32_t*>(static_cast<T*>(call.out) + row * call.ld_out + c) = pack_pair<T>(x, y);
    });
  }
}

#endif  // FUSED_LOSSES_GEMM_SM90A

#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 12
template <typename T>
__global__ void __launch_bounds__(kGemmThreads, 1)
    gemm_grad_input_kernel(const __grid_constant__ CUtensorMap e_map, const __grid_constant__ CUtensorMap w_map,
                           const GiTiles tiles, const GemmGradInput call) {
#if FUSED_LOSSES_GEMM_SM90A
  extern __shared__ unsigned char shared_raw[];
  unsigned char* base = align_shared<kGemmSmemAlign>(shared_raw);
  uint64_t* barriers = reinterpret_cast<uint64_t*>(base + kGiOffsetBarriers);
  const GiShared shared{base, base + kGiOffsetB, barriers, barriers + kGiStages};
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&e_map);
    prefetch_tensor_map(&w_map);
    for (int s = 0; s < kGiStages; ++s) {
      mbarrier_init(&shared.full[s], 1);
      mbarrier_init(&shared.empty[s], kGemmConsumerWarps);
    }
  }
  __syncthreads();
  wait_for_previous_kernel();
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (warpgroup == 0) {
    registers_decrease<kGemmProducerRegisters>();
    if (threadIdx.x == 0) gi_produce(&e_map, &w_map, tiles, shared);
  } else {
    registers_increase<kGemmConsumerRegisters>();
    gi_consume<T>(warpgroup - 1, call, tiles, shared);
  }
#else
  __trap();
#endif
}
#endif

}  // namespace fused_losses
