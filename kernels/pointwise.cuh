// pointwise.cuh: the pointwise loss engine (MSE, KL): one kernel for every pass, and
// the launcher an Op plugs into (launch_pointwise_loss).
#pragma once

#include "device.cuh"
#include "finish.cuh"
#include "grad_output_guess.cuh"
#include "launch.cuh"

namespace fused_losses {

// ---------------------------------------------------------------------------------
// Pointwise losses (MSE, KL): loss = reduce(f(input, target)) over n elements.
//
// One kernel serves every pass, chosen by which pointers are set (each in an
// instantiation of its own where that was faster: PointwisePass):
//   forward, reduction 'none':   loss_out (per element)
//   forward, scalar reduction:   partials (+ grad_input / grad_target when grad is
//                                needed: written here, scaled by grad_scale, so backward
//                                never reads the inputs again)
//   backward, reduction 'none':  grad_output (per element) + grad_input / grad_target
// `Op` computes, in acc_t, what `need` asks of one element of storage type T (the rest
// is left alone, so a no-grad forward spends no time on derivatives):
//   op.template compute<T>(input, target, need, &loss, &d_input, &d_target).
// An Op with kFastPath also has a cheaper formula for ordinary values, which says whether
// it held (bool op.template fast<T>(same arguments)): a pack is computed by it, and again
// by compute() when any of its elements was not ordinary. One branch per pack rather than
// one per element keeps the common case free of the special cases' instructions.

struct Needs {
  bool loss;
  bool d_input;
  bool d_target;
};

struct PointwiseArgs {
  int64_t n;
  double grad_scale;  // multiplies every gradient (1/n for 'mean', 1/batch for 'batchmean')
  double* guess_source;  // and so does this guess at grad_output, when set (grad_output_guess.cuh)
  GradOutputGuess guess;
};

template <typename T>
struct PointwisePointers {
  const T* __restrict__ input;
  const T* __restrict__ target;
  const T* __restrict__ grad_output;  // per element, or nullptr: scale by grad_scale
  T* __restrict__ loss_out;           // per element, or nullptr
  T* __restrict__ grad_input;         // or nullptr
  T* __restrict__ grad_target;        // or nullptr
};

// How a thread walks its packs, set by each Op: batches of Op::batch<T>() packs, every load
// of a batch issued before its math (4 x 16 B x 2-3 inputs per thread covers memory
// latency). With Op::kPrefetch, the next batch's loads go out before this batch's math
// too, at the cost of registers for two batches: for math heavy enough to leave memory
// idle while it runs (KL's log and division).

template <typename T, int VEC>
struct PointwiseInputs {
  Pack<T, VEC> input, target, grad_output;
};

template <int VEC, bool kSumOnly, typename T>
__device__ __forceinline__ PointwiseInputs<T, VEC> load_pointwise(const PointwisePointers<T>& ptr, int64_t offset) {
  PointwiseInputs<T, VEC> v;
  v.input = load_pack<T, VEC>(ptr.input + offset);
  v.target = load_pack<T, VEC>(ptr.target + offset);
  if (!kSumOnly && ptr.grad_output != nullptr) v.grad_output = load_pack<T, VEC>(ptr.grad_output + offset);
  return v;
}

// The VEC elements at `offset`: computes and stores what is asked; returns their loss sum.
template <int VEC, bool kSumOnly, typename T, typename Op>
__device__ __forceinline__ acc_type<T> pointwise_pack(const PointwisePointers<T>& ptr, int64_t offset,
                                                             const PointwiseInputs<T, VEC>& v,
                                                             acc_type<T> grad_scale, bool need_loss,
                                                             const Op& op) {
  using acc_t = acc_type<T>;
  const Needs need{need_loss, !kSumOnly && ptr.grad_input != nullptr, !kSumOnly && ptr.grad_target != nullptr};
  Pack<T, VEC> loss_pack, d_input_pack, d_target_pack;
  acc_t pack_sum = 0;
  // With a fast path, pairs of elements share a branch: a whole pack's values held before
  // the branch cost KL occupancy (77 registers instead of 59 for float16; 16384^2
  // forward 1.10x the floor against 1.07x by pairs, 1.12x by fours).
  constexpr int kGroup = Op::kFastPath && VEC > 2 ? 2 : VEC;
#pragma unroll
  for (int first = 0; first < VEC; first += kGroup) {
    acc_t loss[kGroup], d_input[kGroup], d_target[kGroup];
    bool done = false;
    if constexpr (Op::kFastPath) {
      done = true;
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        const bool held = op.template fast<T>(static_cast<acc_t>(v.input.val[first + k]),
                                              static_cast<acc_t>(v.target.val[first + k]), need, loss[k],
                                              d_input[k], d_target[k]);
        done = done && held;
      }
    }
    if (!done) {
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        loss[k] = d_input[k] = d_target[k] = 0;  // what `need` does not ask for is not set
        op.template compute<T>(static_cast<acc_t>(v.input.val[first + k]), static_cast<acc_t>(v.target.val[first + k]),
                               need, loss[k], d_input[k], d_target[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      pack_sum += loss[k];
      if constexpr (kSumOnly) continue;
      const acc_t scale = ptr.grad_output != nullptr ? static_cast<acc_t>(v.grad_output.val[first + k]) : grad_scale;
      loss_pack.val[first + k] = static_cast<T>(loss[k]);
      d_input_pack.val[first + k] = static_cast<T>(d_input[k] * scale);
      d_target_pack.val[first + k] = static_cast<T>(d_target[k] * scale);
    }
  }
  if constexpr (kSumOnly) return pack_sum;
  if (ptr.loss_out != nullptr) store_pack<T, VEC>(ptr.loss_out + offset, loss_pack);
  if (ptr.grad_input != nullptr) store_pack<T, VEC>(ptr.grad_input + offset, d_input_pack);
  if (ptr.grad_target != nullptr) store_pack<T, VEC>(ptr.grad_target + offset, d_target_pack);
  return pack_sum;
}

// The passes of pointwise_loss_kernel, each an instantiation of its own so that what one
// never touches takes none of its registers (they go to blocks per multiprocessor, and so
// to bytes in flight):
//   kSumOnly: a scalar loss without grad, the sum and nothing stored (16384^2 KL fp16
//     forward 1.07x -> 0.99x the floor, 8192^2 MSE bf16 1.07x -> 1.02x);
//   kScalarGrad: a scalar loss and its gradients, the training step's forward: no
//     grad_output read, no per-element loss stored. For an Op with kOwnScalarGradPass
//     (the Ops say what it gained them); the others run this pass as kPerElement;
//   kPerElement: reduction 'none', its forward (loss_out) and backward (grad_output).
enum class PointwisePass { kSumOnly, kScalarGrad, kPerElement };

// `finish.partials` (one per block) is set for scalar reductions, nullptr otherwise. At
// least two blocks per multiprocessor: a batch of 2-byte packs must fit in 128 registers.
template <typename T, int VEC, typename Op, PointwisePass kPass>
__global__ void __launch_bounds__(256, 2) pointwise_loss_kernel(PointwisePointers<T> pointers, PointwiseArgs args,
                                                             Op op, Finish finish) {
  using acc_t = acc_type<T>;
  constexpr bool kSumOnly = kPass == PointwisePass::kSumOnly;
  __shared__ sum_t scratch[32];
  // Null where the pass never uses them, as constants: their loads and stores compile out.
  PointwisePointers<T> ptr = pointers;
  if constexpr (kPass != PointwisePass::kPerElement) {
    ptr.grad_output = nullptr;
    ptr.loss_out = nullptr;
  }
  wait_for_previous_kernel();
  if (recompute_is_needless(args.guess_source, args.guess)) return;
  const acc_t grad_scale = static_cast<acc_t>(args.grad_scale * grad_output_factor<T>(args.guess_source, args.guess));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t num_packs = args.n / VEC;
  const bool need_loss = finish.partials != nullptr || ptr.loss_out != nullptr;
  constexpr int batch = Op::template batch<T>();
  sum_t thread_sum = 0;
  // The packs of a thread's batch lie batch_gap apart. The sum-only forward reads a
  // block's batch as one run of batch x blockDim packs (the grid strides over such runs):
  // MSE 32768^2 fp32 forward 2.776 -> 2.745 ms. The passes that write keep a batch's packs
  // a grid apart (that way the 8192^2 bf16 training kernel is 0.1406 ms, against 0.1423).
  const int64_t batch_gap = kSumOnly ? blockDim.x : stride;
  PointwiseInputs<T, VEC> loaded[batch];
  auto load_batch = [&](int64_t first_pack) {
#pragma unroll
    for (int u = 0; u < batch; ++u) {
      if (first_pack + u * batch_gap < num_packs) {
        loaded[u] = load_pointwise<VEC, kSumOnly>(ptr, (first_pack + u * batch_gap) * VEC);
      }
    }
  };
  int64_t p = int64_t(blockIdx.x) * (kSumOnly ? batch * blockDim.x : blockDim.x) + threadIdx.x;
  if constexpr (Op::kPrefetch) load_batch(p);
  for (; p < num_packs; p += batch * stride) {
    if constexpr (!Op::kPrefetch) load_batch(p);
    PointwiseInputs<T, VEC> v[batch];
#pragma unroll
    for (int u = 0; u < batch; ++u) v[u] = loaded[u];
    if constexpr (Op::kPrefetch) load_batch(p + batch * stride);
#pragma unroll
    for (int u = 0; u < batch; ++u) {
      if (p + u * batch_gap < num_packs) {
        thread_sum += pointwise_pack<VEC, kSumOnly>(ptr, (p + u * batch_gap) * VEC, v[u], grad_scale, need_loss, op);
      }
    }
  }
  // The last n % VEC elements: the same code, one element at a time.
  for (int64_t i = num_packs * VEC + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < args.n; i += stride) {
    thread_sum += pointwise_pack<1, kSumOnly>(ptr, i, load_pointwise<1, kSumOnly>(ptr, i), grad_scale, need_loss, op);
  }
  if (finish.partials != nullptr) {
    const sum_t block_total = block_sum(thread_sum, scratch);
    if (threadIdx.x == 0) finish.partials[blockIdx.x] = block_total;
    finish_if_last_block(finish, scratch);
  }
}

// Launches pointwise_loss_kernel for `call` (ops.h) with 16-byte packs when every pointer
// allows it (and its kSumOnly form when only a scalar loss is asked for). With a scalar
// loss, the elements' sum times call.scale is written there.
template <typename Op>
void launch_pointwise_loss(const PointwiseCall& call, const Op& op, const LaunchContext& context) {
  if (call.n == 0) return;  // Python sends empty tensors to torch
  dispatch_dtype(call.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int VEC = vec16<T>();
    const int threads = 256;
    const PointwisePointers<T> ptr{static_cast<const T*>(call.input), static_cast<const T*>(call.target),
                                   static_cast<const T*>(call.grad_output), static_cast<T*>(call.loss_out),
                                   static_cast<T*>(call.grad_input), static_cast<T*>(call.grad_target)};
    const PointwiseArgs args{call.n, call.scale, grad_output_guess_source(call.guess, context), call.guess};
    const bool scalar_loss = call.loss.data != nullptr;
    const bool vector_ok = is_aligned16(ptr.input) && is_aligned16(ptr.target) && is_aligned16(ptr.grad_output) &&
                           is_aligned16(ptr.loss_out) && is_aligned16(ptr.grad_input) &&
                           is_aligned16(ptr.grad_target);
    const bool scalar_only = scalar_loss && ptr.grad_output == nullptr && ptr.loss_out == nullptr;
    const bool sum_only = scalar_only && ptr.grad_input == nullptr && ptr.grad_target == nullptr;
    auto run = [&](auto kernel, int64_t items) {
      const int64_t grid = grid_for(kernel, items, threads, context.device);
      Finish finish;
      if (scalar_loss) {
        auto* partials = static_cast<sum_t*>(context.allocate(context.owner, grid * sizeof(sum_t)));
        finish = make_finish(partials, 1, grid, args.grad_scale, nullptr, 0, call.loss, context);
      }
      launch_kernel(kernel, grid, threads, 0, 1, context.device, context.stream, ptr, args, op, finish);
      finish_without_ticket(finish, context);
    };
    if (vector_ok && sum_only) {
      run(pointwise_loss_kernel<T, VEC, Op, PointwisePass::kSumOnly>, args.n / VEC + 1);
    } else if (vector_ok && scalar_only) {
      constexpr PointwisePass kPass = Op::kOwnScalarGradPass ? PointwisePass::kScalarGrad : PointwisePass::kPerElement;
      run(pointwise_loss_kernel<T, VEC, Op, kPass>, args.n / VEC + 1);
    } else if (vector_ok) {
      run(pointwise_loss_kernel<T, VEC, Op, PointwisePass::kPerElement>, args.n / VEC + 1);
    } else {
      run(pointwise_loss_kernel<T, 1, Op, PointwisePass::kPerElement>, args.n);
    }
  });
}

}  // namespace fused_losses
