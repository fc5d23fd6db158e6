// Prototype (notes, "Open"): the sum-only pointwise forward with warps claiming chunks that the
// copy engine brings into shared memory (sm_90), exact sums. Built by ab_pointwise_claimed.py.
#include "kl_div.cu"
#include "mse.cu"

namespace fused_losses {

constexpr int kMaxClaimWarps = 16;

template <typename T, int VEC, typename Op, int kStages>
__global__ void __launch_bounds__(32 * kMaxClaimWarps) pointwise_claimed_kernel(PointwisePointers<T> ptr, int64_t n,
                                                                                int chunk_packs, Op op, Finish finish) {
  using acc_t = at::opmath_type<T>;
  using P = Pack<T, VEC>;
  static_assert(std::is_same<acc_t, float>::value, "exact sums of float losses");
  __shared__ uint64_t stage_full[kMaxClaimWarps][kStages];
  __shared__ int64_t stage_chunk[kMaxClaimWarps][kStages];
  __shared__ unsigned long long block_sums[kExactWords];
  __shared__ sum_t scratch[32];
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  const int64_t num_packs = n / VEC;
  const int64_t num_chunks = (num_packs + chunk_packs - 1) / chunk_packs;
  const int64_t stage_packs = bulk_stage_packs<T, VEC>(chunk_packs);
  P* base = reinterpret_cast<P*>(align_shared<kBulkCopyAlign>(dynamic_smem)) + int64_t(warp) * kStages * 2 * stage_packs;
  unsigned int* counter = finish.ticket + 1;
  const int64_t total_warps = int64_t(gridDim.x) * warps;
  const int64_t first_round = total_warps * kStages;
  auto fetch = [&](int s, int64_t chunk) {  // lane 0
    stage_chunk[warp][s] = chunk;
    if (chunk < num_chunks) {
      const int64_t first = chunk * chunk_packs;
      const int64_t packs = min(int64_t(chunk_packs), num_packs - first);
      P* stage = base + s * 2 * stage_packs;
      const T* x = ptr.input + first * VEC;
      const T* y = ptr.target + first * VEC;
      bulk_copy_to_shared(stage + bulk_copy_offset<T, VEC>(x), x, uint32_t(packs * sizeof(P)), &stage_full[warp][s]);
      bulk_copy_to_shared(stage + stage_packs + bulk_copy_offset<T, VEC>(y), y, uint32_t(packs * sizeof(P)),
                          &stage_full[warp][s]);
    }
  };
  wait_for_previous_kernel();
  const int64_t warp_id = int64_t(blockIdx.x) * warps + warp;
  if (lane == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(&stage_full[warp][s], 2);
    for (int s = 0; s < kStages; ++s) fetch(s, warp_id + s * total_warps);
  }
  if (threadIdx.x < kExactWords) block_sums[threadIdx.x] = 0;
  __syncthreads();
  float kept = 0;
  int num_kept = 0;
  if (warp_id == 0) {  // the last n % VEC elements
    const int64_t i = num_packs * VEC + lane;
    acc_t tail = 0;
    if (i < n) tail = pointwise_pack<1, true>(ptr, i, load_pointwise<1, true>(ptr, i), acc_t(0), true, op);
    tail = warp_allreduce(tail, SumOp<acc_t>());
    if (lane == 0) kept = tail;
    num_kept = 1;
  }
  uint32_t phases = 0;
  for (int s = 0;; s = s + 1 == kStages ? 0 : s + 1) {
    __syncwarp();
    const int64_t chunk = stage_chunk[warp][s];
    if (chunk >= num_chunks) break;
    const int64_t first = chunk * chunk_packs;
    const int packs = static_cast<int>(min(int64_t(chunk_packs), num_packs - first));
    const P* xs = base + s * 2 * stage_packs + bulk_copy_offset<T, VEC>(ptr.input + first * VEC);
    const P* ys = base + s * 2 * stage_packs + stage_packs + bulk_copy_offset<T, VEC>(ptr.target + first * VEC);
    mbarrier_wait(&stage_full[warp][s], (phases >> s) & 1u);
    phases ^= 1u << s;
    acc_t sum = 0;
#pragma unroll 4
    for (int p = lane; p < packs; p += 32) {
      PointwiseInputs<T, VEC> v;
      v.input = load_pack<T, VEC>(xs[p].val);
      v.target = load_pack<T, VEC>(ys[p].val);
      sum += pointwise_pack<VEC, true>(ptr, 0, v, acc_t(0), true, op);
    }
    __syncwarp();
    if (lane == 0) fetch(s, first_round + atomicAdd(counter, 1u));
    const float chunk_sum = warp_allreduce(sum, SumOp<float>());
    if (lane == num_kept) kept = chunk_sum;
    if (++num_kept == 32) {
      warp_exact_add(block_sums, kept, true);
      num_kept = 0;
    }
  }
  warp_exact_add(block_sums, kept, lane < num_kept);
  __syncthreads();
  if (threadIdx.x < kExactWords) {
    const unsigned long long word = block_sums[threadIdx.x];
    unsigned long long* sum = finish.exact_sums + threadIdx.x;
    if (word != 0) threadIdx.x == kExactLimbs ? atomicOr(sum, word) : atomicAdd(sum, word);
    __threadfence();
  }
  __syncthreads();
  finish_if_last_block<true>(finish, scratch);
}

template <typename T, typename Op, int kStages>
void launch_claimed(const at::Tensor& input, const at::Tensor& target, const Op& op, int64_t chunk_bytes,
                    int64_t warps, int64_t max_blocks, double scale, const at::Tensor& loss) {
  constexpr int VEC = vec16<T>();
  const int device = input.get_device();
  auto kernel = pointwise_claimed_kernel<T, VEC, Op, kStages>;
  const int64_t chunk_packs = chunk_bytes / 16;
  const size_t smem = warps * kStages * 2 * bulk_stage_bytes(chunk_bytes) + kBulkCopyAlign;
  TORCH_CHECK(smem <= max_dynamic_smem(kernel, device), "smem ", smem);
  const int threads = static_cast<int>(warps * 32);
  const int64_t per_sm = std::min<int64_t>(max_blocks, resident_blocks_per_sm(kernel, threads, device, smem));
  const int64_t blocks = multiprocessor_count(device) * per_sm;
  auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor partials = at::empty({1}, input.options().dtype(at::kDouble));
  Finish finish = make_finish(partials.data_ptr<sum_t>(), 1, 0, scale, nullptr, 0, loss, stream);
  TORCH_CHECK(finish.ticket != nullptr, "no ticket");
  PointwisePointers<T> ptr{static_cast<const T*>(input.data_ptr()), static_cast<const T*>(target.data_ptr()),
                           nullptr, nullptr, nullptr, nullptr};
  launch_kernel(kernel, blocks, threads, smem, 1, stream, ptr, input.numel(), static_cast<int>(chunk_packs), op,
                finish);
}

at::Tensor claimed_loss(at::Tensor input, at::Tensor target, int64_t which, int64_t chunk_bytes, int64_t warps,
                        int64_t stages, int64_t max_blocks, double scale) {
  at::Tensor loss = at::empty({}, input.options());
  auto by_type = [&](auto zero) {
    using scalar_t = decltype(zero);
    auto go = [&](auto op) {
      if (stages == 1) launch_claimed<scalar_t, decltype(op), 1>(input, target, op, chunk_bytes, warps, max_blocks, scale, loss);
      else if (stages == 2) launch_claimed<scalar_t, decltype(op), 2>(input, target, op, chunk_bytes, warps, max_blocks, scale, loss);
      else launch_claimed<scalar_t, decltype(op), 3>(input, target, op, chunk_bytes, warps, max_blocks, scale, loss);
    };
    if (which == 0) go(SquaredErrorOp{});
    else go(KlDivOp{false, false});
  };
  switch (input.scalar_type()) {
    case at::kFloat: by_type(float{}); break;
    case at::kHalf: by_type(at::Half{}); break;
    case at::kBFloat16: by_type(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "dtype");
  }
  return loss;
}

}  // namespace fused_losses
