// linear_ce_gemm.cu: our own sm_90a matrix products for linear_cross_entropy (notes/performance.md),
// as the ops gemm_nt(a, b) = a @ b.T and row_stats (the same product's rows' softmax statistics
// per tile of classes, no logits written; with row_stats_training also the logits' gradient form),
// both under the pingpong schedule (gemm_sm90.cuh), and grad_input, d input from that form
// (gemm_sm90_grad_input.cuh).
//
//   C[i, j] = sum_k A[i, k] B[j, k]   A (M, K), B (N, K), C (M, N); bfloat16 or float16, float32 sums
//
// Bytes: 2 (MK + NK + MN) at least; the tiles re-read A N/192 times and B M/128 times, from
// L2 when the grouped schedule works (gemm_sm90.cuh). FLOPs 2 MNK: Llama 3's head at 8192 rows,
// 8192 x 128256 x 4096, is 8.6 TFLOP, 11.7 ms at cuBLAS's 737 TFLOP/s on an H100.
//
// Built for arch "9.0a" only (loader.load("linear_ce_gemm", dtype, arch="9.0a")); a build for
// any other arch compiles (CI proves it) and its launcher refuses. No libcuda link: the
// driver's tensor-map encoder is looked up through the runtime at first use.

#include "gemm_sm90.cuh"
#include "gemm_sm90_grad_input.cuh"
#include "grad_output_guess.cuh"  // scale_by_grad_output_launch, which every build binds
#include "launch.cuh"
#include "row_stats_combine.cuh"

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000
#endif

namespace fused_losses {

// 1 in the device code of an sm_90a build, else 0: the host pass cannot tell which device
// arch it was built with, and a plain sm_90 build's kernel would trap on the GPU.
__device__ int gemm_built_for_sm90a = FUSED_LOSSES_GEMM_SM90A;

// ---------------------------------------------------------------------------------
// Host: preconditions, tensor maps, launch.

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000

namespace {

bool device_is_sm90(int device) {
  static Remembered<int, bool> answers;
  return answers.get(device, [&] {
    int major = 0, minor = 0;
    cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
    cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
    return major == 9 && minor == 0;
  });
}

bool build_is_sm90a(int device) {
  static Remembered<int, bool> answers;
  return answers.get(device, [&] {
    int built = 0;
    cuda_check(cudaMemcpyFromSymbol(&built, gemm_built_for_sm90a, sizeof(built)), "cudaMemcpyFromSymbol");
    return built == 1;
  });
}

// The driver's cuTensorMapEncodeTiled, found once through the runtime (the ByVersion lookup
// from CUDA 12.5; the older call is deprecated in 13).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    cuda_check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found),
               "cudaGetDriverEntryPointByVersion");
#else
    cuda_check(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &function, cudaEnableDefault, &found),
               "cudaGetDriverEntryPoint");
#endif
    check(found == cudaDriverEntryPointSuccess && function != nullptr,
          "the CUDA driver has no cuTensorMapEncodeTiled (gemm_nt needs a CUDA 12 driver or newer)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

// A 2-D operand (outer rows of `inner` elements, row stride ld) as boxes of box_inner x box_outer elements, 128 B
// swizzled (the layout the wgmma descriptors read), elements outside the tensor read as zeros.
CUtensorMap tensor_map(const void* base, int64_t outer, int64_t inner, int64_t ld, int box_outer, int box_inner,
                       DType dtype) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};  // bytes, of dims[1]
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_inner), static_cast<cuuint32_t>(box_outer)};
  const cuuint32_t element_strides[2] = {1, 1};
  CUtensorMap map;
  const CUresult result = tensor_map_encoder()(
      &map, dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    throw std::runtime_error("fused_losses: cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(result)) +
                             ") for a " + std::to_string(outer) + " x " + std::to_string(inner) + " operand, row " +
                             "stride " + std::to_string(ld));
  }
  return map;
}

// A (rows, k) operand, K inner, in boxes of box_rows x 64 (one K block).
CUtensorMap k_major_tensor_map(const void* base, int64_t rows, int64_t k, int64_t ld, int box_rows, DType dtype) {
  return tensor_map(base, rows, k, ld, box_rows, kGemmTileK, dtype);
}

// W (k rows, n) read N-major: boxes of 64 columns x 64 K rows (gemm_sm90_grad_input.cuh).
CUtensorMap n_major_tensor_map(const void* base, int64_t k, int64_t n, int64_t ld, DType dtype) {
  return tensor_map(base, k, n, ld, kGemmTileK, kGiBoxN, dtype);
}

// Group size of the grouped raster: 8 or 16 M tiles, whichever keeps fewer rows of A and B
// live across the tiles running at once (group x 128 rows of A, tiles / group x 192 of B; two
// tiles a block, one a consumer).
int group_for(int64_t grid, int tiles_m) {
  const int64_t at_once = 2 * grid;
  auto live_rows = [&](int group) { return group * kGemmTileM + (at_once + group - 1) / group * kGemmTileN; };
  const int group = live_rows(16) < live_rows(8) ? 16 : 8;
  return group < tiles_m ? group : tiles_m;
}

void check_sm90a(const LaunchContext& context) {
  check(device_is_sm90(context.device),
        "linear_ce_gemm's products run on compute capability 9.0 only (H100, H200): their wgmma code is sm_90a");
  check(build_is_sm90a(context.device),
        "linear_ce_gemm was built without sm_90a (load it with loader.load('linear_ce_gemm', dtype, arch='9.0a'))");
}

// The checks every product's launch makes, then the persistent launch of gemm_nt_kernel<T, Epilogue>
// over call's tiles; make_epilogue(T tag) gives the epilogue.
template <typename MakeEpilogue>
void launch_gemm(const GemmCall& call, const LaunchContext& context, MakeEpilogue make_epilogue) {
  check_sm90a(context);
  if (call.m == 0 || call.n == 0) return;
  // gemm_call (entry_points.h) checked the operands' dtype, strides and alignment; the tile counts are ints.
  if (call.k <= 0 || call.m >= (int64_t(1) << 31) || call.n >= (int64_t(1) << 31)) {
    throw std::invalid_argument("fused_losses: linear_ce_gemm's products need K > 0 and fewer than 2^31 rows");
  }
  dispatch_dtype(call.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      const auto epilogue = make_epilogue(tag);
      auto kernel = &gemm_nt_kernel<T, std::decay_t<decltype(epilogue)>>;
      check(max_dynamic_smem(kernel, context.device) >= size_t(kGemmSmemBytes),
            "linear_ce_gemm's products need 217 KB of shared memory a block, more than this GPU gives");
      GemmTiles tiles;
      tiles.tiles_m = static_cast<int>((call.m + kGemmTileM - 1) / kGemmTileM);
      tiles.tiles_n = static_cast<int>((call.n + kGemmTileN - 1) / kGemmTileN);
      tiles.k_blocks = static_cast<int>((call.k + kGemmTileK - 1) / kGemmTileK);
      tiles.count = int64_t(tiles.tiles_m) * tiles.tiles_n;
      tiles.m = static_cast<int>(call.m);
      tiles.n = static_cast<int>(call.n);
      tiles.ldc = call.ldc;
      // Persistent: a block a multiprocessor, no more than there are tiles, nor than max_blocks when given.
      int64_t grid = std::min<int64_t>(multiprocessor_count(context.device), tiles.count);
      if (call.max_blocks > 0) grid = std::min(grid, call.max_blocks);
      tiles.group = group_for(grid, tiles.tiles_m);
      const CUtensorMap a_map = k_major_tensor_map(call.a, call.m, call.k, call.lda, kGemmTileM, call.dtype);
      const CUtensorMap b_map = k_major_tensor_map(call.b, call.n, call.k, call.ldb, kGemmTileN, call.dtype);
      launch_kernel(kernel, grid, kGemmThreads, kGemmSmemBytes, 1, context.device, context.stream, a_map, b_map,
                    tiles, epilogue);
    } else {
      throw std::invalid_argument("fused_losses: linear_ce_gemm's products take bfloat16 or float16 operands");
    }
  });
}

// K parts for grad_input's tiles: the fewest that fill the waves of `blocks` to within 5% of the best, each part
// at least 32 K blocks (the same for every run and grid on a GPU: the bits follow the parts).
int grad_input_splits(int64_t tiles, int k_blocks, int64_t blocks) {
  auto filled = [&](int64_t splits) {  // the share of the waves' units that are work
    const int64_t units = tiles * splits;
    return double(units) / double((units + blocks - 1) / blocks * blocks);
  };
  int best = 1;
  for (int splits = 2; splits <= 16 && k_blocks / splits >= 32; ++splits) {
    if (filled(splits) > filled(best) + 0.05) best = splits;
  }
  return best;
}

}  // namespace

void gemm_nt_launch(const GemmCall& call, const LaunchContext& context) {
  launch_gemm(call, context,
              [&](auto tag) { return GemmStoreTile<decltype(tag)>{static_cast<decltype(tag)*>(call.c)}; });
}

void gemm_row_stats_launch(const GemmCall& call, const GemmRowStats& stats, const LaunchContext& context) {
  if (stats.e == nullptr) {
    launch_gemm(call, context, [&](auto tag) { return GemmRowStatsTile<decltype(tag)>{stats}; });
    return;
  }
  // The training form: bfloat16 only (float16 gradients take the row passes: issue 55, item 5).
  if constexpr (static_cast<DType>(FUSED_LOSSES_DTYPE) == DType::kBFloat16) {
    launch_gemm(call, context, [&](auto tag) { return GemmRowStatsTile<decltype(tag), true>{stats}; });
  } else {
    check(false, "gemm_row_stats' training form takes bfloat16 operands");
  }
}

void gemm_grad_input_launch(const GemmGradInput& call, const LaunchContext& context) {
  check_sm90a(context);
  if (call.m == 0 || call.n == 0) return;
  if constexpr (static_cast<DType>(FUSED_LOSSES_DTYPE) == DType::kBFloat16) {
    using T = c10::BFloat16;
    auto kernel = &gemm_grad_input_kernel<T>;
    check(max_dynamic_smem(kernel, context.device) >= size_t(kGiSmemBytes),
          "gemm_grad_input needs 197 KB of shared memory a block, more than this GPU gives");
    const int64_t blocks = multiprocessor_count(context.device);
    GiTiles tiles;
    tiles.tiles_m = static_cast<int>((call.m + kGiTileM - 1) / kGiTileM);
    tiles.tiles_n = static_cast<int>((call.n + kGiTileN - 1) / kGiTileN);
    tiles.k_blocks = static_cast<int>((call.k + kGemmTileK - 1) / kGemmTileK);
    tiles.tiles = int64_t(tiles.tiles_m) * tiles.tiles_n;
    tiles.splits = grad_input_splits(tiles.tiles, tiles.k_blocks, blocks);
    tiles.units = tiles.tiles * tiles.splits;
    GemmGradInput launched = call;
    if (tiles.splits > 1) {  // the parts' float32 sum and each tile's two flags (a consumer's rows each), zeroed
      if (launched.partial == nullptr) {
        launched.partial =
            static_cast<float*>(context.allocate(context.owner, size_t(call.m) * call.n * sizeof(float)));
      }
      const size_t flag_bytes = size_t(2 * tiles.tiles) * sizeof(int);
      launched.flags = static_cast<int*>(context.allocate(context.owner, flag_bytes));
      cuda_check(cudaMemsetAsync(launched.flags, 0, flag_bytes, context.stream), "cudaMemsetAsync");
    }
    int64_t grid = std::min<int64_t>(blocks, tiles.units);
    if (call.max_blocks > 0) grid = std::min(grid, call.max_blocks);
    const CUtensorMap e_map = k_major_tensor_map(call.e, call.m, call.k, call.ld_e, kGiTileM, call.dtype);
    const void* w_part = static_cast<const T*>(call.w) + call.first_class * call.ld_w;
    const CUtensorMap w_map = n_major_tensor_map(w_part, call.k, call.n, call.ld_w, call.dtype);
    launch_kernel(kernel, grid, kGemmThreads, kGiSmemBytes, 1, context.device, context.stream, e_map, w_map, tiles,
                  launched);
  } else {
    check(false, "gemm_grad_input takes bfloat16 operands");
  }
}

#else  // CUDA 11.8: no tensor maps, no sm_90a

void gemm_nt_launch(const GemmCall&, const LaunchContext&) {
  check(false, "gemm_nt needs a CUDA 12 build (this one is older) on compute capability 9.0");
}

void gemm_row_stats_launch(const GemmCall&, const GemmRowStats&, const LaunchContext&) {
  check(false, "gemm_row_stats needs a CUDA 12 build (this one is older) on compute capability 9.0");
}

void gemm_grad_input_launch(const GemmGradInput&, const LaunchContext&) {
  check(false, "gemm_grad_input needs a CUDA 12 build (this one is older) on compute capability 9.0");
}

#endif

}  // namespace fused_losses
