// cross_entropy_launch.cuh: the cross-entropy launch policy: which kernel takes a call
// and with what launch shape, and the launch itself (launch_cross_entropy).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "cross_entropy_pipelined.cuh"
#include "cross_entropy_row.cuh"
#include "cross_entropy_rows.cuh"
#include "device.cuh"
#include "finish.cuh"
#include "launch.cuh"

namespace fused_losses {

// The tensors of one call, checked and made contiguous. losses.py checks everything
// first with friendlier messages; these checks guard direct calls of the ops.
struct CrossEntropyInputs {
  at::Tensor logits, target, weight;  // weight: in the accumulation type, or undefined
  bool probs;                         // target holds class probabilities
  int64_t ignore_index;
  double label_smoothing, z_loss;

  CrossEntropyInputs(const at::Tensor& logits_arg, const at::Tensor& target_arg,
                     const c10::optional<at::Tensor>& weight_arg,
                     int64_t ignore_index, double label_smoothing, double z_loss)
      : ignore_index(ignore_index), label_smoothing(label_smoothing), z_loss(z_loss) {
    TORCH_CHECK(logits_arg.is_cuda() && logits_arg.dim() == 2, "cross_entropy: input must be 2-D (N, C) on CUDA");
    TORCH_CHECK(target_arg.device() == logits_arg.device(), "cross_entropy: target must be on input's device");
    probs = target_arg.is_floating_point();
    if (probs) {
      TORCH_CHECK(target_arg.sizes() == logits_arg.sizes() && target_arg.scalar_type() == logits_arg.scalar_type(),
                  "cross_entropy: probability targets must have input's shape and dtype");
    } else {
      TORCH_CHECK(target_arg.dim() == 1 && target_arg.size(0) == logits_arg.size(0),
                  "cross_entropy: class-index target must have shape (N,)");
      TORCH_CHECK(target_arg.scalar_type() == at::kLong || target_arg.scalar_type() == at::kInt,
                  "cross_entropy: class-index target must be int64 or int32");
    }
    TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, "cross_entropy: label_smoothing must be in [0, 1]");
    logits = logits_arg.contiguous();
    target = target_arg.contiguous();
    // Probabilities are read in the same 16-byte packs as the logits (RowEdges): at the
    // logits' offset from 16 bytes, copied there in the rare case they are not.
    if (probs) target = at_offset(target, offset());
    if (weight_arg.has_value() && weight_arg->defined()) {
      TORCH_CHECK(weight_arg->dim() == 1 && weight_arg->size(0) == logits.size(1) &&
                      weight_arg->device() == logits.device(),
                  "cross_entropy: weight must have shape (C,) on input's device");
      weight = weight_arg->to(accumulation_dtype()).contiguous();
    }
  }

  uintptr_t offset() const { return offset_from_16_bytes(logits.data_ptr()); }

  // A fresh tensor of the logits' shape and dtype that rows are written to (a gradient):
  // at their offset from 16 bytes, so that both are read and written in the same packs.
  at::Tensor empty_row_tensor() const { return empty_at_offset(logits, offset()); }

  // The lse and the weights are kept in the accumulation type (float, or double for float64).
  at::ScalarType accumulation_dtype() const {
    return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  }
};

// The kernel's types, passed to a generic lambda as a tag.
template <typename T, bool kEdges, bool kProbs, bool kClassSums>
struct Config {
  using scalar = T;
  static constexpr int vec = vec16<T>();
  static constexpr bool edges = kEdges;
  static constexpr bool probs = kProbs;
  static constexpr bool class_sums = kClassSums;
};

// Calls body(Config<...>{}) for the inputs' types, whether rows have edge elements
// (RowEdges), and whether the class sums are needed (label smoothing, or probability
// targets). Every row tensor must sit at the logits' offset from 16 bytes.
template <typename Body>
void dispatch_cross_entropy(const CrossEntropyInputs& in, std::initializer_list<const void*> row_pointers, Body body) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.logits.scalar_type(), "cross_entropy", [&] {
    const uintptr_t offset = in.offset();
    TORCH_CHECK(offset % sizeof(scalar_t) == 0, "cross_entropy: input's data must start on a whole element");
    for (const void* ptr : row_pointers) {
      TORCH_CHECK(ptr == nullptr || offset_from_16_bytes(ptr) == offset,
                  "cross_entropy: internal error: a row tensor is not at the logits' offset from 16 bytes");
    }
    const bool edges = offset != 0 || in.logits.size(1) % vec16<scalar_t>() != 0;
    auto with_edges = [&](auto probs, auto class_sums) {
      if (edges) {
        body(Config<scalar_t, true, decltype(probs)::value, decltype(class_sums)::value>{});
      } else {
        body(Config<scalar_t, false, decltype(probs)::value, decltype(class_sums)::value>{});
      }
    };
    using yes = std::true_type;
    using no = std::false_type;
    if (in.probs) {
      with_edges(yes{}, yes{});
    } else {
      in.label_smoothing != 0.0 ? with_edges(no{}, yes{}) : with_edges(no{}, no{});
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
    threads = 32;
    while (int64_t(threads) * cached_packs < num_packs) threads *= 2;
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
template <typename Kernel>
RowLaunch pipelined_launch(Kernel kernel, int64_t rows, int64_t num_packs, size_t pack_bytes, int device) {
  const size_t budget = max_dynamic_smem(kernel, device);
  for (int cluster_blocks = 1; cluster_blocks <= kMaxClusterBlocks; cluster_blocks *= 2) {
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
// The path: which kernel takes a call.

// One value per kernel path. Their names (cross_entropy_path_name) are what the bindings'
// cross_entropy_path returns and force_cross_entropy_path takes.
enum class CrossEntropyPath {
  kRegisterRows,     // cross_entropy_kernel: a block per row, the row in registers
  kWarpRows,         // cross_entropy_kernel (kWarpRows): a scalar loss alone, a warp streams each row
  kStreamedSumRows,  // cross_entropy_kernel (kStreamed, kSumOnly): a scalar loss alone, a block streams each row
  kStashedRows,      // cross_entropy_kernel (kStreamed): outputs too, the row's front stashed for the gradient
  kPipelinedRows,    // cross_entropy_pipelined_kernel (sm_90): gradients, rows through the copy engine
};

constexpr const char* kCrossEntropyPathNames[] = {
    "register_rows", "warp_rows", "streamed_sum_rows", "stashed_rows", "pipelined_rows"};
constexpr int kCrossEntropyPaths = sizeof(kCrossEntropyPathNames) / sizeof(kCrossEntropyPathNames[0]);

inline const char* cross_entropy_path_name(CrossEntropyPath path) {
  return kCrossEntropyPathNames[static_cast<int>(path)];
}

// What of a call decides its path, besides the types (Config).
struct CrossEntropyCall {
  int64_t rows;
  int64_t num_packs;  // a row's classes / Config::vec
  bool sum_only;      // a scalar loss and nothing else: no gradient, lse or per-row loss
  bool want_grad;     // a gradient is written
  int device;
};

// Rows too long for the register cache are streamed.
template <typename Cfg>
bool is_long_row(const CrossEntropyCall& call) {
  return call.num_packs > int64_t(cache_packs<Cfg::probs>()) * kMaxThreads;
}

// Class-index targets without label smoothing, in 2- or 4-byte logits: what the sm_90
// kernels take.
template <typename Cfg>
constexpr bool sm90_kernels_take() {
  return !Cfg::probs && !Cfg::class_sums && sizeof(typename Cfg::scalar) <= 4;
}

// The pipelined kernel's launch (sm_90), or blocks == 0 where the call does not fit it.
template <typename Cfg>
RowLaunch sm90_launch(const CrossEntropyCall& call) {
  if constexpr (sm90_kernels_take<Cfg>()) {
    using T = typename Cfg::scalar;
    return pipelined_launch(cross_entropy_pipelined_kernel<T, Cfg::vec, Cfg::edges>, call.rows, call.num_packs,
                            sizeof(Pack<T, Cfg::vec>), call.device);
  }
  return {0, 0, 0, 0};
}

// Why `path` cannot run a call, or nullptr where it can.
template <typename Cfg>
const char* why_path_cannot_run(CrossEntropyPath path, const CrossEntropyCall& call) {
  constexpr bool plain_indices = !Cfg::probs && !Cfg::class_sums;
  const char* const not_sum_only = "it computes a scalar loss alone (no gradient, lse or per-row loss)";
  switch (path) {
    case CrossEntropyPath::kRegisterRows:
      return is_long_row<Cfg>(call) ? "the row is longer than the register cache holds" : nullptr;
    case CrossEntropyPath::kWarpRows:
      if (!plain_indices) return "it takes class-index targets without label smoothing";
      return call.sum_only ? nullptr : not_sum_only;
    case CrossEntropyPath::kStreamedSumRows:
      return call.sum_only ? nullptr : not_sum_only;
    case CrossEntropyPath::kStashedRows:
      return nullptr;
    case CrossEntropyPath::kPipelinedRows:
      if (!sm90_supported(call.device)) return "it needs sm_90";
      if (!sm90_kernels_take<Cfg>()) return "it takes class-index targets without label smoothing, 2- or 4-byte logits";
      if (!call.want_grad) return "it writes a gradient";
      if (sm90_launch<Cfg>(call).blocks == 0) return "a row's segments do not fit in shared memory";
      return nullptr;
  }
  return "it is no path";
}

// The path of a call: the first rule that holds, top to bottom.
template <typename Cfg>
CrossEntropyPath choose_cross_entropy_path(const CrossEntropyCall& call) {
  using Path = CrossEntropyPath;
  const bool long_row = is_long_row<Cfg>(call);
  // sm_90, a long row's gradient (class indices without label smoothing, 2- or 4-byte
  // logits): through the copy engine, read once, where a row's segments fit.
  if (long_row && call.want_grad && why_path_cannot_run<Cfg>(Path::kPipelinedRows, call) == nullptr) {
    return Path::kPipelinedRows;
  }
  // A long row with outputs (gradient, lse, per-row loss): streamed by a block, its front
  // stashed in shared memory for the gradient pass (an A100's long rows with a gradient).
  if (long_row && !call.sum_only) return Path::kStashedRows;
  // A long row's scalar loss alone: streamed by a block.
  if (long_row) return Path::kStreamedSumRows;
  // A scalar loss alone over many rows (use_warp_rows), class indices without label
  // smoothing: a warp streams each row.
  if (!Cfg::probs && !Cfg::class_sums && call.sum_only &&
      use_warp_rows(call.rows, call.num_packs, sizeof(typename Cfg::scalar), call.device)) {
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
CrossEntropyPath cross_entropy_path_of(const CrossEntropyCall& call) {
  const int forced = forced_cross_entropy_path().load(std::memory_order_relaxed);
  if (forced < 0) return choose_cross_entropy_path<Cfg>(call);
  const auto path = static_cast<CrossEntropyPath>(forced);
  const char* why = why_path_cannot_run<Cfg>(path, call);
  TORCH_CHECK_VALUE(why == nullptr, "cross_entropy: the forced path ", cross_entropy_path_name(path),
                    " cannot run this call: ", why);
  return path;
}

// What a launch writes; undefined tensors are not written. `loss` is a scalar
// reduction's (0-dim), `loss_per_row` reduction 'none''s.
struct CrossEntropyOutputs {
  at::Tensor loss, loss_per_row, lse, grad_logits, grad_target;
};

// The facts of a call, with packs of `vec` elements: whether it computes a scalar loss,
// writes a gradient, and writes the lse.
inline CrossEntropyCall cross_entropy_call(const CrossEntropyInputs& in, bool scalar_loss, bool want_grad,
                                           bool want_lse, int vec) {
  return {in.logits.size(0), in.logits.size(1) / vec, scalar_loss && !want_grad && !want_lse, want_grad,
          static_cast<int>(in.logits.get_device())};
}

// The kernel of a path and its launch shape.
template <typename Cfg>
std::pair<void (*)(CrossEntropyParams<typename Cfg::scalar>), RowLaunch> path_kernel(CrossEntropyPath path,
                                                                                     const CrossEntropyCall& call) {
  using T = typename Cfg::scalar;
  constexpr int VEC = Cfg::vec;
  using Path = CrossEntropyPath;
  void (*kernel)(CrossEntropyParams<T>) = nullptr;
  switch (path) {
    case Path::kRegisterRows:
      kernel = call.sum_only ? cross_entropy_kernel<T, VEC, Cfg::edges, Cfg::probs, Cfg::class_sums, false, true>
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
      if constexpr (sm90_kernels_take<Cfg>()) kernel = cross_entropy_pipelined_kernel<T, VEC, Cfg::edges>;
      break;
  }
  TORCH_CHECK(kernel != nullptr, "cross_entropy: internal error: no kernel for ", cross_entropy_path_name(path));
  if (path == Path::kPipelinedRows) return {kernel, sm90_launch<Cfg>(call)};
  const RowLaunch launch =
      row_launch(kernel, path != Path::kRegisterRows, path == Path::kWarpRows, call.rows, call.num_packs,
                 cache_packs<Cfg::probs>(), sizeof(Pack<T, VEC>), call.want_grad, stream_threads<T>(),
                 stash_threads<T>(Cfg::probs, Cfg::class_sums), call.device);
  return {kernel, launch};
}

// Runs the kernel for a scalar reduction (`reduction`), reduction 'none' (forward), or
// the backward of 'none' (grad_output defined).
inline void launch_cross_entropy(const CrossEntropyInputs& in, int64_t reduction, const at::Tensor& grad_output,
                                 CrossEntropyOutputs& out) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int device = in.logits.get_device();
  const int64_t rows = in.logits.size(0);
  const bool scalar_loss = reduction != kNone && !grad_output.defined();
  dispatch_cross_entropy(in, {in.logits.data_ptr(), in.probs ? in.target.data_ptr() : nullptr,
                              out.grad_logits.defined() ? out.grad_logits.data_ptr() : nullptr,
                              out.grad_target.defined() ? out.grad_target.data_ptr() : nullptr},
                         [&](auto config) {
    using Cfg = decltype(config);
    using T = typename Cfg::scalar;
    using acc_t = at::opmath_type<T>;
    const bool want_grad = out.grad_logits.defined() || out.grad_target.defined();
    const CrossEntropyCall call = cross_entropy_call(in, scalar_loss, want_grad, out.lse.defined(), Cfg::vec);
    // Not a structured binding: C++17 (torch 2.0's builds) cannot capture one in the lambda below.
    const auto kernel_and_launch = path_kernel<Cfg>(cross_entropy_path_of<Cfg>(call), call);
    const auto kernel = kernel_and_launch.first;
    const RowLaunch launch = kernel_and_launch.second;
    CrossEntropyParams<T> params{};
    params.logits = in.logits.data_ptr<T>();
    params.target = {in.target.data_ptr(), !in.probs && in.target.scalar_type() == at::kInt};
    params.weight = data_or_null<acc_t>(in.weight);
    params.rows = rows;
    params.num_classes = in.logits.size(1);
    params.ignore_index = in.ignore_index;
    params.label_smoothing = in.label_smoothing;
    params.z_loss = in.z_loss;
    params.ce_scale = reduction == kMean && in.probs ? 1.0 / double(rows) : 1.0;
    params.grad_output = data_or_null<T>(grad_output);
    params.loss_per_row = data_or_null<T>(out.loss_per_row);
    params.lse = data_or_null<acc_t>(out.lse);
    params.grad_logits = data_or_null<T>(out.grad_logits);
    params.grad_target = data_or_null<T>(out.grad_target);
    params.stash_packs = launch.stash_packs;
    params.stages = launch.stages;
    auto run_loss_kernel = [&] {
      launch_kernel(kernel, launch.blocks, launch.threads, launch.dynamic_smem, launch.cluster_blocks, stream,
                    params);
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
    const bool divided = reduction == kMean && !Cfg::probs;
    const bool counted_by_blocks = divided && !want_grad;
    const bool counted_here = divided && want_grad && rows <= kRowsCountedPerBlock;
    const int64_t num_partials = launch.blocks;
    const int64_t num_divisors = !divided            ? 0
                                 : counted_by_blocks ? launch.blocks
                                 : counted_here       ? 1
                                                      : grid_for(count_kernel, rows, count_threads, device);
    // One allocation (launch-bound calls feel each one): per block, the ce and z sums
    // (2, num_partials), and for 'mean' with class indices the divisors (2, num_divisors).
    const at::Tensor workspace = at::empty({2 * (num_partials + num_divisors)}, in.logits.options().dtype(at::kDouble));
    sum_t* partials = workspace.data_ptr<sum_t>();
    sum_t* divisors = divided ? partials + 2 * num_partials : nullptr;
    if (counted_by_blocks) {
      params.divisors_by_blocks = divisors;
    } else if (counted_here) {
      params.counted_divisors = divisors;
    } else if (divided) {
      launch_kernel(count_kernel, num_divisors, count_threads, 0, 1, stream, params.target, rows,
                    params.num_classes, in.ignore_index, params.weight, divisors);
      params.divisors = divisors;
      params.num_divisors = num_divisors;
    }
    // The z term only with z_loss: without, the finish adds one term, as torch's loss has.
    params.finish = make_finish(partials, in.z_loss != 0 ? 2 : 1, num_partials, params.ce_scale, divisors,
                                num_divisors, out.loss, stream);
    run_loss_kernel();
    finish_without_ticket(params.finish, stream);
  });
}

}  // namespace fused_losses
