// cross_entropy/launch_policy.cuh: which kernel takes a cross-entropy call (its path,
// a table read top to bottom: choose_cross_entropy_path), with what launch shape, and the
// launch itself (launch_cross_entropy).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "cross_entropy/pipelined_kernel.cuh"
#include "cross_entropy/row_kernels.cuh"
#include "cross_entropy/row_math.cuh"
#include "device.cuh"
#include "finish.cuh"
#include "grad_output_guess.cuh"
#include "launch.cuh"

namespace fused_losses {

// The kernel's types, passed to a generic lambda as a tag.
template <typename T, bool kEdges, bool kProbs, bool kClassSums>
struct Config {
  using scalar = T;
  static constexpr int vec = vec16<T>();
  static constexpr bool edges = kEdges;
  static constexpr bool probs = kProbs;
  static constexpr bool class_sums = kClassSums;
};

// Calls body(Config<...>{}) for the call's types, whether rows have edge elements
// (RowEdges), and whether the class sums are needed (label smoothing, or probability
// targets). Every row pointer must sit at the logits' offset from 16 bytes.
template <typename Body>
void dispatch_cross_entropy(const CrossEntropyCall& call, Body body) {
  dispatch_dtype(call.dtype, [&](auto tag) {
    using T = decltype(tag);
    const uintptr_t offset = offset_from_16_bytes(call.logits);
    check(offset % sizeof(T) == 0, "cross_entropy: input's data must start on a whole element");
    for (const void* ptr : {call.probs ? call.target : nullptr, static_cast<const void*>(call.grad_logits),
                            static_cast<const void*>(call.grad_target)}) {
      check(ptr == nullptr || offset_from_16_bytes(ptr) == offset,
            "cross_entropy: internal error: a row tensor is not at the logits' offset from 16 bytes");
    }
    const bool edges = offset != 0 || call.classes % vec16<T>() != 0;
    auto with_edges = [&](auto probs, auto class_sums) {
      if (edges) {
        body(Config<T, true, decltype(probs)::value, decltype(class_sums)::value>{});
      } else {
        body(Config<T, false, decltype(probs)::value, decltype(class_sums)::value>{});
      }
    };
    using yes = std::true_type;
    using no = std::false_type;
    if (call.probs) {
      with_edges(yes{}, yes{});
    } else {
      call.label_smoothing != 0.0 ? with_edges(no{}, yes{}) : with_edges(no{}, no{});
    }
  });
}

// The sum-only forward (no gradient) streams each row through one warp (kWarpRows)
// where the register path would take it by a block of 64 to 512 threads, if the rows
// give every multiprocessor at least kWarpRowsPerMultiprocessor warps. The register path
// loads its row, then reduces it with the loads stopped, at a few blocks per
// multiprocessor; a warp per row reduces without a barrier, with 32 to 48 warps per
// multiprocessor hiding one another's reductions; longer rows and few rows stay a block's
// (notes, v23). So do float32 and float64 rows of more than 8 KB: a block per row was faster
// for 4096 float32 classes on the H200 (notes, v37).
constexpr int kWarpRowsThreads = 256;
constexpr int64_t kWarpRowsPerMultiprocessor = 8;
constexpr int64_t kWarpRowsMaxFloat32Bytes = 8 * 1024;  // and float64

// For rows (of 16-byte packs) the register path would take (not streamed) with class-index targets.
inline bool use_warp_rows(int64_t rows, int64_t num_packs, size_t element_bytes, int device) {
  return num_packs > 32 * int64_t(cache_packs<false>()) &&
         (element_bytes == 2 || num_packs * 16 <= kWarpRowsMaxFloat32Bytes) &&
         rows >= kWarpRowsPerMultiprocessor * multiprocessor_count(device);
}

// How a launch lays rows on the GPU.
struct RowLaunch {
  int threads;
  int64_t blocks;
  size_t dynamic_smem;  // bytes: the stash, or the pipelined kernel's stages
  int64_t stash_packs;  // packs: stashed, or a pipelined segment's
  int cluster_blocks = 1;
  int stages = 0;  // the pipelined kernel's
};

// Threads of a block that streams a row without a gradient: 256, so that several blocks
// share a multiprocessor and one's barriers hide behind the others' loads, but float32 rows
// by 512, faster for them alone (notes, v33).
template <typename T>
constexpr int stream_threads() {
  return sizeof(T) == 4 ? kMaxThreads : 256;
}

// The register path's threads for a row: the fewest (a power of two from a warp) whose
// register caches of `cached_packs` packs hold its `num_packs`.
inline int register_row_threads(int64_t num_packs, int cached_packs) {
  int threads = 32;
  while (int64_t(threads) * cached_packs < num_packs) threads *= 2;
  return threads;
}

// Threads per row: enough that the row fits the register cache, at most kMaxThreads. A
// row too long for it is streamed: without a gradient, by stream_block_threads. With a
// gradient, the row is kept in shared memory for the gradient pass: whole rows by two
// blocks per multiprocessor where they fit, else the row's front, as much as the
// multiprocessor holds, by stash_block_threads. As many blocks as fit on the GPU at once.
template <typename Kernel>
RowLaunch row_launch(Kernel kernel, bool streamed, bool warp_rows, int64_t rows, int64_t num_packs, int cached_packs,
                     size_t pack_bytes, bool want_grad, int stream_block_threads, int stash_block_threads,
                     int device) {
  if (warp_rows) {
    return {kWarpRowsThreads, grid_for(kernel, rows * 32, kWarpRowsThreads, device), 0, 0};
  }
  int threads = stream_block_threads;
  size_t smem = 0;
  int64_t stash_packs = 0;
  if (!streamed) {
    threads = register_row_threads(num_packs, cached_packs);
  } else if (want_grad) {
    const size_t budget = max_dynamic_smem(kernel, device);
    const size_t row_bytes = num_packs * pack_bytes;
    // Where two blocks, each with a whole row in shared memory, fit on a multiprocessor,
    // each stashes whole rows, so one's reductions and gradient pass overlap the other's
    // loads (50257-class bf16 training 1.31x -> 1.29x the floor with 256 threads), by
    // blocks of 512 threads where their registers fit (1.21x -> 1.20x: more loads in flight).
    threads = 0;
    for (const int whole_row_threads : {kMaxThreads, 256}) {
      if (row_bytes <= budget && resident_blocks_per_sm(kernel, whole_row_threads, device, row_bytes) >= 2) {
        threads = whole_row_threads;
        stash_packs = num_packs;
        break;
      }
    }
    if (threads == 0) {
      threads = stash_block_threads;
      stash_packs = std::min<int64_t>(num_packs, budget / pack_bytes);
    }
    smem = stash_packs * pack_bytes;
  }
  return {threads, grid_for(kernel, rows * threads, threads, device, smem), smem, stash_packs};
}

// The pipelined kernel's launch (sm_90), or blocks == 0 where it does not fit: the
// fewest blocks per cluster whose segments of a row fit twice in one block's shared
// memory (so, for the long rows, one block per multiprocessor), then as many stages as
// fit there, up to kMaxPipelineStages: three stages keep two rows on their way while the
// block works on a third; more and smaller blocks per row were slower, and so were
// clusters of 3 (a cluster's blocks share a GPC: notes, v21-v22).
template <typename KernelFor>
RowLaunch pipelined_launch(KernelFor kernel_for, int64_t rows, int64_t num_packs, size_t pack_bytes, int device) {
  for (int cluster_blocks = 1; cluster_blocks <= kMaxClusterBlocks; cluster_blocks *= 2) {
    const auto kernel = kernel_for(cluster_blocks);
    const size_t budget = max_dynamic_smem(kernel, device);
    const int64_t segment_packs = (num_packs + cluster_blocks - 1) / cluster_blocks;
    // Each stage with its slack (bulk_stage_bytes), and kBulkCopyAlign more to align the first.
    const size_t segment_bytes = bulk_stage_bytes(segment_packs * pack_bytes);
    if (2 * segment_bytes + kBulkCopyAlign > budget) continue;
    const int stages =
        static_cast<int>(std::min<size_t>(kMaxPipelineStages, (budget - kBulkCopyAlign) / segment_bytes));
    const size_t smem = stages * segment_bytes + kBulkCopyAlign;
    int64_t resident_clusters = 0;
    if (cluster_blocks == 1) {
      resident_clusters =
          int64_t(multiprocessor_count(device)) * resident_blocks_per_sm(kernel, kPipelineThreads, device, smem);
    } else {
      resident_clusters = resident_clusters_of(kernel, cluster_blocks, kPipelineThreads, device, smem);
    }
    if (resident_clusters == 0) continue;
    const int64_t clusters = std::min(resident_clusters, rows);
    RowLaunch launch{kPipelineThreads, clusters * cluster_blocks, smem, segment_packs};
    launch.cluster_blocks = cluster_blocks;
    launch.stages = stages;
    return launch;
  }
  return {0, 0, 0, 0};
}

// ---------------------------------------------------------------------------------
// The path: which kernel takes a shape.

// One value per kernel path. Their names (cross_entropy_path_name) are what the bindings'
// cross_entropy_path returns and force_cross_entropy_path takes.
enum class CrossEntropyPath {
  kRegisterRows,     // cross_entropy_kernel: a block per row, the row in registers
  kWarpRows,         // cross_entropy_kernel (kWarpRows): a scalar loss alone, a warp streams each row
  kStreamedSumRows,  // cross_entropy_kernel (kStreamed, kSumOnly): a scalar loss alone, a block streams each row
  kStashedRows,      // cross_entropy_kernel (kStreamed): outputs too, the row's front stashed for the gradient
  kPipelinedRows,    // cross_entropy_pipelined_kernel (sm_90): gradients, rows through the copy engine
  // Both at once, a share of the rows each: cross_entropy_pipelined_kernel on its clusters, and
  // cross_entropy_kernel (kStreamed) on the multiprocessors the clusters leave (rows_beside_clusters).
  kPipelinedAndStashedRows,
};

constexpr const char* kCrossEntropyPathNames[] = {
    "register_rows", "warp_rows", "streamed_sum_rows", "stashed_rows", "pipelined_rows", "pipelined_and_stashed_rows"};
constexpr int kCrossEntropyPaths = sizeof(kCrossEntropyPathNames) / sizeof(kCrossEntropyPathNames[0]);

inline const char* cross_entropy_path_name(CrossEntropyPath path) {
  return kCrossEntropyPathNames[static_cast<int>(path)];
}

// What of a call decides its path, besides the types (Config).
struct CrossEntropyShape {
  int64_t rows;
  int64_t num_packs;  // a row's classes / Config::vec
  bool sum_only;      // a scalar loss and nothing else: no gradient, lse or per-row loss
  bool want_grad;     // a gradient is written
  int device;
  cudaStream_t stream;  // being captured into a CUDA graph, its launches are not dependent (launch_kernel)
};

// Rows too long for the register cache are streamed.
template <typename Cfg>
bool is_long_row(const CrossEntropyShape& shape) {
  return shape.num_packs > int64_t(cache_packs<Cfg::probs>()) * kMaxThreads;
}

// Class-index targets without label smoothing, in 2- or 4-byte logits: what the sm_90
// kernels take.
template <typename Cfg>
constexpr bool sm90_kernels_take() {
  return !Cfg::probs && !Cfg::class_sums && sizeof(typename Cfg::scalar) <= 4;
}

// The pipelined kernel for clusters of `cluster_blocks` blocks.
template <typename Cfg>
auto pipelined_kernel(int cluster_blocks) {
  using T = typename Cfg::scalar;
  return cluster_blocks > 1 ? cross_entropy_pipelined_kernel<T, Cfg::vec, Cfg::edges, true>
                            : cross_entropy_pipelined_kernel<T, Cfg::vec, Cfg::edges, false>;
}

// The pipelined kernel's launch (sm_90), or blocks == 0 where the call does not fit it.
template <typename Cfg>
RowLaunch sm90_launch(const CrossEntropyShape& shape) {
  if constexpr (sm90_kernels_take<Cfg>()) {
    return pipelined_launch(pipelined_kernel<Cfg>, shape.rows, shape.num_packs,
                            sizeof(Pack<typename Cfg::scalar, Cfg::vec>), shape.device);
  }
  return {0, 0, 0, 0};
}

// The multiprocessors the pipelined kernel's clusters leave: a cluster's blocks share a GPC, and
// where a GPC's multiprocessors do not divide into clusters some are left over (the H200 holds 30
// clusters of 4 blocks on its 132; an H100 holds 33). A clustered block fills its multiprocessor
// (two stages of a segment too long for one block's shared memory alone).
inline int64_t multiprocessors_beside(const RowLaunch& pipelined, int device) {
  return pipelined.cluster_blocks > 1 ? std::max<int64_t>(0, multiprocessor_count(device) - pipelined.blocks) : 0;
}

// kPipelinedAndStashedRows: the rows the stashed kernel (kStashedRows') takes beside the pipelined kernel's
// clusters, the call's last ones, on a block a multiprocessor the clusters leave: rows in proportion to
// its blocks, each weighing kBesidePacePercent of a clustered block (the stashed block's pace against a
// clustered one's, measured on the H200: notes, v66, v68); rows == 0 where that gives a block fewer
// than kRowsBesideABlock rows (fewer lost: 256 rows of 128256 classes on the H200 5% slower, 1024 3.6%
// faster). Forced (on a GPU whose clusters leave none): a block, a row.
constexpr int64_t kRowsBesideABlock = 4;
constexpr int64_t kBesidePacePercent = 95;

// The rows beside the clusters and the blocks they run on (0 rows: none).
struct RowsBeside {
  int64_t rows = 0, blocks = 0;
};

template <typename Cfg>
RowsBeside rows_beside_clusters(const CrossEntropyShape& shape, bool forced) {
  if constexpr (sm90_kernels_take<Cfg>()) {
    const RowLaunch pipelined = sm90_launch<Cfg>(shape);
    const int64_t blocks = std::max<int64_t>(multiprocessors_beside(pipelined, shape.device), forced ? 1 : 0);
    const int64_t weighed = blocks * kBesidePacePercent;
    const int64_t rows = std::max<int64_t>(shape.rows * weighed / (pipelined.blocks * 100 + weighed), forced ? 1 : 0);
    if (blocks == 0 || rows < (forced ? 1 : kRowsBesideABlock * blocks)) return {};
    return {rows, blocks};
  }
  return {};
}

// Why `path` cannot run a call, or nullptr where it can.
template <typename Cfg>
const char* why_path_cannot_run(CrossEntropyPath path, const CrossEntropyShape& shape) {
  constexpr bool plain_indices = !Cfg::probs && !Cfg::class_sums;
  const char* const not_sum_only = "it computes a scalar loss alone (no gradient, lse or per-row loss)";
  switch (path) {
    case CrossEntropyPath::kRegisterRows:
      return is_long_row<Cfg>(shape) ? "the row is longer than the register cache holds" : nullptr;
    case CrossEntropyPath::kWarpRows:
      if (!plain_indices) return "it takes class-index targets without label smoothing";
      return shape.sum_only ? nullptr : not_sum_only;
    case CrossEntropyPath::kStreamedSumRows:
      return shape.sum_only ? nullptr : not_sum_only;
    case CrossEntropyPath::kStashedRows:
      return nullptr;
    case CrossEntropyPath::kPipelinedRows:
      if (!sm90_supported(shape.device)) return "it needs sm_90";
      if (!sm90_kernels_take<Cfg>()) return "it takes class-index targets without label smoothing, 2- or 4-byte logits";
      if (!shape.want_grad) return "it writes a gradient";
      if (sm90_launch<Cfg>(shape).blocks == 0) return "a row's segments do not fit in shared memory";
      return nullptr;
    case CrossEntropyPath::kPipelinedAndStashedRows:
      if (const char* why = why_path_cannot_run<Cfg>(CrossEntropyPath::kPipelinedRows, shape)) return why;
      if (shape.rows < 2) return "it shares the rows between two kernels: 2 rows at least";
      return nullptr;
  }
  return "it is no path";
}

// 2-byte rows whose gradient the register path would take by a block alone on its
// multiprocessor (512 threads, more than 64 registers each): its loads stop for each row's
// reductions and no other block's cover them; the pipelined kernel keeps rows on their way
// (notes, v64; float32 rows there gained at 2049 packs but lost from 3072).
template <typename Cfg>
bool pipelines_register_rows(const CrossEntropyShape& shape) {
  using T = typename Cfg::scalar;
  if (sizeof(T) != 2) return false;
  const auto kernel = cross_entropy_kernel<T, Cfg::vec, Cfg::edges, Cfg::probs, Cfg::class_sums, false, false>;
  const int threads = register_row_threads(shape.num_packs, cache_packs<Cfg::probs>());
  return resident_blocks_per_sm(kernel, threads, shape.device, 0) == 1;
}

// The path of a call: the first rule that holds, top to bottom.
template <typename Cfg>
CrossEntropyPath choose_cross_entropy_path(const CrossEntropyShape& shape) {
  using Path = CrossEntropyPath;
  const bool long_row = is_long_row<Cfg>(shape);
  // sm_90, a gradient (class indices without label smoothing, 2- or 4-byte logits) of a
  // long row, or of a 2-byte row whose register block would be alone on its multiprocessor
  // (pipelines_register_rows): through the copy engine, read once, where a row's segments fit.
  // Where its clusters leave multiprocessors, the stashed kernel takes a share of the rows there, at
  // the same time: dependent launches (not under CUDA graph capture) let both run.
  if (shape.want_grad && (long_row || pipelines_register_rows<Cfg>(shape)) &&
      why_path_cannot_run<Cfg>(Path::kPipelinedRows, shape) == nullptr) {
    const bool beside = rows_beside_clusters<Cfg>(shape, false).rows > 0 && !is_capturing(shape.stream);
    return beside ? Path::kPipelinedAndStashedRows : Path::kPipelinedRows;
  }
  // A long row with outputs (gradient, lse, per-row loss): streamed by a block, its front
  // stashed in shared memory for the gradient pass (an A100's long rows with a gradient).
  if (long_row && !shape.sum_only) return Path::kStashedRows;
  // A long row's scalar loss alone: streamed by a block.
  if (long_row) return Path::kStreamedSumRows;
  // A scalar loss alone over many rows (use_warp_rows), class indices without label
  // smoothing: a warp streams each row.
  if (!Cfg::probs && !Cfg::class_sums && shape.sum_only &&
      use_warp_rows(shape.rows, shape.num_packs, sizeof(typename Cfg::scalar), shape.device)) {
    return Path::kWarpRows;
  }
  // Every other row: a block per row, the row in registers.
  return Path::kRegisterRows;
}

// The test-only switch (force_cross_entropy_path): the path every call takes, or raises
// where that path cannot run it; -1 for none.
inline std::atomic<int>& forced_cross_entropy_path() {
  static std::atomic<int> forced{-1};
  return forced;
}

// The path a call takes: the forced one (checked), else the chosen one.
template <typename Cfg>
CrossEntropyPath cross_entropy_path_of(const CrossEntropyShape& shape) {
  const int forced = forced_cross_entropy_path().load(std::memory_order_relaxed);
  if (forced < 0) return choose_cross_entropy_path<Cfg>(shape);
  const auto path = static_cast<CrossEntropyPath>(forced);
  const char* why = why_path_cannot_run<Cfg>(path, shape);
  if (why != nullptr) {
    throw std::invalid_argument(std::string("cross_entropy: the forced path ") + cross_entropy_path_name(path) +
                                " cannot run this call: " + why);
  }
  return path;
}

// The facts of a call on `stream` that decide its path, with packs of `vec` elements.
inline CrossEntropyShape cross_entropy_shape(const CrossEntropyCall& call, int vec, int device, cudaStream_t stream) {
  const bool scalar_loss = call.loss.data != nullptr;
  const bool want_grad = call.grad_logits != nullptr || call.grad_target != nullptr;
  const bool sum_only = scalar_loss && !want_grad && call.lse == nullptr;
  return {call.rows, call.classes / vec, sum_only, want_grad, device, stream};
}

// The kernel of a path and its launch shape.
template <typename Cfg>
std::pair<void (*)(CrossEntropyParams<typename Cfg::scalar>), RowLaunch> path_kernel(CrossEntropyPath path,
                                                                                     const CrossEntropyShape& shape) {
  using T = typename Cfg::scalar;
  constexpr int VEC = Cfg::vec;
  using Path = CrossEntropyPath;
  void (*kernel)(CrossEntropyParams<T>) = nullptr;
  switch (path) {
    case Path::kRegisterRows:
      kernel = shape.sum_only ? cross_entropy_kernel<T, VEC, Cfg::edges, Cfg::probs, Cfg::class_sums, false, true>
                             : cross_entropy_kernel<T, VEC, Cfg::edges, Cfg::probs, Cfg::class_sums, false, false>;
      break;
    case Path::kStreamedSumRows:
      kernel = cross_entropy_kernel<T, VEC, Cfg::edges, Cfg::probs, Cfg::class_sums, true, true>;
      break;
    case Path::kStashedRows:
      kernel = cross_entropy_kernel<T, VEC, Cfg::edges, Cfg::probs, Cfg::class_sums, true, false>;
      break;
    case Path::kWarpRows:
      if constexpr (!Cfg::probs && !Cfg::class_sums) {
        kernel = cross_entropy_kernel<T, VEC, Cfg::edges, false, false, true, true, true>;
      }
      break;
    case Path::kPipelinedRows:
    case Path::kPipelinedAndStashedRows:  // its rows beside the clusters: kStashedRows' kernel
      if constexpr (sm90_kernels_take<Cfg>()) {
        const RowLaunch launch = sm90_launch<Cfg>(shape);
        return {pipelined_kernel<Cfg>(launch.cluster_blocks), launch};
      }
      break;
  }
  check(kernel != nullptr, "cross_entropy: internal error: no kernel for the path");
  const RowLaunch launch =
      row_launch(kernel, path != Path::kRegisterRows, path == Path::kWarpRows, shape.rows, shape.num_packs,
                 cache_packs<Cfg::probs>(), sizeof(Pack<T, VEC>), shape.want_grad, stream_threads<T>(),
                 stash_threads<T>(Cfg::probs, Cfg::class_sums), shape.device);
  return {kernel, launch};
}

// Runs the kernel for a scalar reduction (call.loss set), reduction 'none' (forward), or
// the backward of 'none' (call.grad_output set).
inline void launch_cross_entropy(const CrossEntropyCall& call, const LaunchContext& context) {
  const int64_t rows = call.rows;
  const bool scalar_loss = call.loss.data != nullptr;
  dispatch_cross_entropy(call, [&](auto config) {
    using Cfg = decltype(config);
    using T = typename Cfg::scalar;
    using acc_t = acc_type<T>;
    const CrossEntropyShape shape = cross_entropy_shape(call, Cfg::vec, context.device, context.stream);
    const CrossEntropyPath path = cross_entropy_path_of<Cfg>(shape);
    // Not a structured binding: C++17 (torch 2.0's builds) cannot capture one in the lambda below.
    const auto kernel_and_launch = path_kernel<Cfg>(path, shape);
    const auto kernel = kernel_and_launch.first;
    const RowLaunch launch = kernel_and_launch.second;
    // The stashed kernel's rows beside the pipelined kernel's (kPipelinedAndStashedRows), the last ones;
    // `true`: where the path was forced, a block and a row at least (where chosen there are more).
    const RowsBeside beside = path == CrossEntropyPath::kPipelinedAndStashedRows
                                  ? rows_beside_clusters<Cfg>(shape, true)
                                  : RowsBeside{};
    // Their kernel and launch: kStashedRows' for those rows, a block a multiprocessor beside at most.
    std::pair<void (*)(CrossEntropyParams<T>), RowLaunch> stashed_beside{};
    if (beside.rows > 0) {
      CrossEntropyShape beside_shape = shape;
      beside_shape.rows = beside.rows;
      stashed_beside = path_kernel<Cfg>(CrossEntropyPath::kStashedRows, beside_shape);
      stashed_beside.second.blocks = std::min(stashed_beside.second.blocks, beside.blocks);
    }
    CrossEntropyParams<T> params{};
    params.logits = static_cast<const T*>(call.logits);
    params.target = {call.target, !call.probs && call.target_int32};
    params.weight = static_cast<const acc_t*>(call.weight);
    params.rows = rows;
    params.num_classes = call.classes;
    params.ignore_index = call.ignore_index;
    params.label_smoothing = call.label_smoothing;
    params.z_loss = call.z_loss;
    params.inverse_temperature = static_cast<acc_t>(1.0 / call.temperature);
    params.exp_c = exp_constant<T>(params.inverse_temperature);
    params.ce_scale = scalar_loss && call.reduction == kMean && call.probs ? 1.0 / double(rows) : 1.0;
    params.grad_output = static_cast<const T*>(call.grad_output);
    params.guess_source = grad_output_guess_source(call.guess, context);
    params.guess = call.guess;
    params.loss_per_row = static_cast<T*>(call.loss_per_row);
    params.lse = static_cast<acc_t*>(call.lse);
    params.grad_logits = static_cast<T*>(call.grad_logits);
    params.grad_target = static_cast<T*>(call.grad_target);
    params.stash_packs = launch.stash_packs;
    params.stages = launch.stages;
    auto run_loss_kernel = [&] {
      if (beside.rows == 0) {
        launch_kernel(kernel, launch.blocks, launch.threads, launch.dynamic_smem, launch.cluster_blocks,
                      context.device, context.stream, params);
        return;
      }
      // The pipelined kernel's rows first, then the stashed kernel's, from `first` on; the latter finishes
      // the scalar loss.
      const int64_t first = rows - beside.rows;
      CrossEntropyParams<T> pipelined = params, stashed = params;
      pipelined.rows = first;
      pipelined.finish.ticket = nullptr;
      pipelined.starts_next_kernel = true;
      stashed.logits += first * call.classes;
      stashed.target.data = static_cast<const unsigned char*>(call.target) + first * (params.target.int32 ? 4 : 8);
      stashed.rows = beside.rows;
      if (stashed.grad_output != nullptr) stashed.grad_output += first;
      if (stashed.loss_per_row != nullptr) stashed.loss_per_row += first;
      if (stashed.lse != nullptr) stashed.lse += first;
      if (stashed.grad_logits != nullptr) stashed.grad_logits += first * call.classes;
      if (stashed.grad_target != nullptr) stashed.grad_target += first * call.classes;
      stashed.stash_packs = stashed_beside.second.stash_packs;
      stashed.first_partial = launch.blocks;
      stashed.beside_previous_kernel = true;
      launch_kernel(kernel, launch.blocks, launch.threads, launch.dynamic_smem, launch.cluster_blocks,
                    context.device, context.stream, pipelined);
      const RowLaunch& beside_launch = stashed_beside.second;
      launch_kernel(stashed_beside.first, beside_launch.blocks, beside_launch.threads, beside_launch.dynamic_smem, 1,
                    context.device, context.stream, stashed);
    };
    if (!scalar_loss) {
      run_loss_kernel();
      return;
    }
    // 'mean' with class indices divides by what count_targets finds. A gradient needs it
    // before its first row: counted by every block of the loss kernel up to
    // kRowsCountedPerBlock rows, else by its own kernel first. Without a gradient the loss
    // kernel's blocks count after their rows (one launch fewer: 2 us, and a 1 us gap).
    auto count_kernel = count_targets_kernel<acc_t>;
    const int count_threads = 256;
    const bool divided = call.reduction == kMean && !Cfg::probs;
    const bool counted_by_blocks = divided && !shape.want_grad;
    // (Not beside another kernel: each would count its own rows.)
    const bool counted_here = divided && shape.want_grad && rows <= kRowsCountedPerBlock && beside.rows == 0;
    const int64_t num_partials = launch.blocks + (beside.rows > 0 ? stashed_beside.second.blocks : 0);
    const int64_t num_divisors = !divided            ? 0
                                 : counted_by_blocks ? launch.blocks
                                 : counted_here       ? 1
                                                      : grid_for(count_kernel, rows, count_threads, context.device);
    // One allocation (launch-bound calls feel each one): per block, the ce and z sums
    // (2, num_partials), and for 'mean' with class indices the divisors (2, num_divisors).
    auto* partials =
        static_cast<sum_t*>(context.allocate(context.owner, 2 * (num_partials + num_divisors) * sizeof(sum_t)));
    sum_t* divisors = divided ? partials + 2 * num_partials : nullptr;
    if (counted_by_blocks) {
      params.divisors_by_blocks = divisors;
    } else if (counted_here) {
      params.counted_divisors = divisors;
    } else if (divided) {
      launch_kernel(count_kernel, num_divisors, count_threads, 0, 1, context.device, context.stream, params.target,
                    rows, params.num_classes, call.ignore_index, params.weight, divisors);
      params.divisors = divisors;
      params.num_divisors = num_divisors;
    }
    // The z term only with z_loss: without, the finish adds one term, as torch's loss has.
    params.finish = make_finish(partials, call.z_loss != 0 ? 2 : 1, num_partials, params.ce_scale, divisors,
                                num_divisors, call.loss, context);
    run_loss_kernel();
    finish_without_ticket(params.finish, context);
  });
}

}  // namespace fused_losses
