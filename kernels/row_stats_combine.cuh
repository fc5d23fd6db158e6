// row_stats_combine.cuh: the fused product's per-tile statistics (gemm_sm90.cuh's row_stats:
// (tiles, stat_rows, rows) float32) combined into each row's (stat_rows, rows), as the row passes'
// shards are (row_passes.sums_at): the max over the tiles, each tile's exp sums moved onto it, the
// entropy's sum shifted with it, the target's u and the sum of u added. row_passes.combine_tiles is
// its torch twin. A block takes 32 rows (a warp's lanes, coalesced) and its 8 warps every 8th tile of its
// range; warp 0 then adds the 8 parts in warp order: a fixed order, the same bits every run.
#pragma once

#include <cstdint>

#include "device.cuh"
#include "launch.cuh"

namespace fused_losses {

constexpr int kCombineRows = 32;
constexpr int kCombineParts = 8;

struct TileStatsPart {
  float max, sum, target, logit_sum, others, spread;
};

// `part` moved onto `max` (>= part.max, or NaN) and added to `into`.
__device__ __forceinline__ void add_part_at(TileStatsPart& into, const TileStatsPart& part, float max, bool spread) {
  const float to_max = part.max == max ? 1.f : expf(part.max - max);
  into.sum += part.sum * to_max;
  into.others += part.others * to_max;
  into.target += part.target;
  into.logit_sum += part.logit_sum;
  if (spread) into.spread += (part.spread + (part.sum == 0.f ? 0.f : (part.max - max) * part.sum)) * to_max;
}

// Block b combines, for its 32 rows (row block b % row blocks), tiles [g tiles / groups, (g + 1) tiles / groups),
// g = b / row blocks, into stats' plane g.
__global__ void __launch_bounds__(kCombineRows * kCombineParts)
    combine_row_stats_kernel(const float* partials, float* stats, int64_t tiles, int64_t groups, int stat_rows,
                             int64_t rows) {
  __shared__ TileStatsPart parts[kCombineParts][kCombineRows];
  wait_for_previous_kernel();
  const int lane = threadIdx.x % kCombineRows, group = threadIdx.x / kCombineRows;
  const int64_t row_blocks = (rows + kCombineRows - 1) / kCombineRows;
  const int64_t row = int64_t(blockIdx.x) % row_blocks * kCombineRows + lane, g = blockIdx.x / row_blocks;
  const int64_t plane = int64_t(stat_rows) * rows;  // one tile's partials
  const int64_t first = tiles * g / groups, end = tiles * (g + 1) / groups;
  stats += g * plane;
  const bool spread = stat_rows == 6;
  TileStatsPart mine{-infinity<float>(), 0.f, 0.f, 0.f, 0.f, 0.f};
  if (row < rows) {
    // NaN wins (max_nan_wins): a tile whose row was all NaN makes the row NaN.
    for (int64_t t = first + group; t < end; t += kCombineParts) {
      mine.max = max_nan_wins(mine.max, partials[t * plane + row]);
    }
    for (int64_t t = first + group; t < end; t += kCombineParts) {
      const float* p = partials + t * plane + row;
      const TileStatsPart part{p[0], p[rows], p[2 * rows], p[3 * rows], p[4 * rows], spread ? p[5 * rows] : 0.f};
      add_part_at(mine, part, mine.max, spread);
    }
  }
  parts[group][lane] = mine;
  __syncthreads();
  if (group != 0 || row >= rows) return;
  float max = parts[0][lane].max;
  for (int g = 1; g < kCombineParts; ++g) max = max_nan_wins(max, parts[g][lane].max);
  TileStatsPart total{max, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int g = 0; g < kCombineParts; ++g) add_part_at(total, parts[g][lane], max, spread);
  stats[row] = total.max;
  stats[rows + row] = total.sum;
  stats[2 * rows + row] = total.target;
  stats[3 * rows + row] = total.logit_sum;
  stats[4 * rows + row] = total.others;
  if (spread) stats[5 * rows + row] = total.spread;
}

// ops.h declares it: this header is in linear_ce_gemm.cu's build alone (directly and through gemm_sm90.cuh).
// Few rows (a chunk of a frozen head's, 384-896) are few blocks: the tiles are then combined in groups first,
// a block a group and 32 rows, into a scratch buffer, then the groups (Gemma 2's 384 rows: 12 blocks took 113 us
// over 1334 tiles; notes v61). The grouping follows the rows and tiles alone: the same bits every run.
void combine_row_stats_launch(const float* partials, float* stats, int64_t tiles, int stat_rows, int64_t rows,
                              const LaunchContext& context) {
  if (rows == 0) return;
  const int64_t row_blocks = (rows + kCombineRows - 1) / kCombineRows;
  const int64_t blocks = multiprocessor_count(context.device);
  const int64_t groups = row_blocks >= blocks ? 1 : std::min((2 * blocks + row_blocks - 1) / row_blocks, tiles / 16);
  if (groups > 1) {
    float* grouped = static_cast<float*>(context.allocate(context.owner, size_t(groups) * stat_rows * rows * 4));
    launch_kernel(&combine_row_stats_kernel, row_blocks * groups, kCombineRows * kCombineParts, 0, 1, context.device,
                  context.stream, partials, grouped, tiles, groups, stat_rows, rows);
    partials = grouped;
    tiles = groups;
  }
  launch_kernel(&combine_row_stats_kernel, row_blocks, kCombineRows * kCombineParts, 0, 1, context.device,
                context.stream, partials, stats, tiles, int64_t(1), stat_rows, rows);
}

}  // namespace fused_losses
