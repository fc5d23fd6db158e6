// ops.h: what each kernels/<kernel>.cu exports to its bindings, in plain C++: raw
// pointers, sizes, a dtype code, a stream. No torch header, so that nvcc parses no ATen:
// the .cu files build in a fraction of the time (notes, v38). entry_points.h, compiled by
// the host compiler in the build's main.cpp, turns tensors into these calls.
//
// A build holds one dtype's kernels (loader.py passes FUSED_LOSSES_DTYPE); a call in
// another dtype throws.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fused_losses {

// The floating dtypes; loader.py's DTYPES holds the same codes.
enum class DType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Reduction codes; loss_helpers.py holds the same table (REDUCTION_CODES).
enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2, kBatchMean = 3 };

// Host and device: the bindings, launchers and kernels find a pointer's offset the same way.
__host__ __device__ inline uintptr_t offset_from_16_bytes(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16;
}

// Where a launch runs, and its scratch memory: allocate(owner, bytes) gives device memory
// that stays valid until the call returns (torch's caching allocator, on `stream`).
struct LaunchContext {
  int device;
  cudaStream_t stream;
  void* (*allocate)(void* owner, size_t bytes);
  void* owner;
};

// A loss's 0-dim result, of `dtype`.
struct ScalarOut {
  void* data = nullptr;  // nullptr: no scalar reduction
  DType dtype = DType::kFloat32;
};

// The forward's guess at grad_output, or backward's recompute (the protocol: grad_output_guess.cuh).
struct GradOutputGuess {
  // Forward: one element where the factor used is recorded, for backward; nullptr: no guess.
  // Recompute: the factor the saved gradients carry (nullptr: 1), read only.
  ScalarOut applied;
  ScalarOut exact;  // recompute only: grad_output, the factor to write the gradients with
};

// A pointwise loss over n elements of `dtype` (MSE, KL). Forward of a scalar reduction:
// `loss` (and the gradients asked for, times `scale`); forward of 'none': loss_out;
// backward of 'none': grad_output in, gradients out. Unused pointers are nullptr.
struct PointwiseCall {
  DType dtype;
  int64_t n;
  double scale;
  const void* input;
  const void* target;
  const void* grad_output;
  void* loss_out;
  void* grad_input;
  void* grad_target;
  ScalarOut loss;
  GradOutputGuess guess;
};

void mse_launch(const PointwiseCall& call, const LaunchContext& context);
void kl_div_launch(const PointwiseCall& call, bool log_input, bool log_target, const LaunchContext& context);

// In place: grad[0:n] *= *grad_output / applied (one element each, read on the GPU; applied
// is the forward's GradOutputGuess::applied, 1 where its data is nullptr). The guess's
// backward (grad_output_guess.cuh).
void scale_by_grad_output_launch(DType dtype, void* grad, int64_t n, ScalarOut grad_output, ScalarOut applied,
                                 const LaunchContext& context);

// One cross-entropy launch over (rows, classes) logits: a scalar reduction (`loss` set),
// reduction 'none' (loss_per_row), or the backward of 'none' (grad_output set). Row
// tensors (logits, probability targets, gradients) share one offset from 16 bytes.
struct CrossEntropyCall {
  DType dtype;
  int64_t rows, classes;
  const void* logits;
  const void* target;   // class indices (int64, or int32 with target_int32), or probabilities
  bool probs;
  bool target_int32;
  const void* weight;   // (classes) in the accumulation type, or nullptr
  int64_t ignore_index;
  double label_smoothing, z_loss;
  double temperature;  // u = x / temperature (> 0; 1: none)
  int64_t reduction;
  const void* grad_output;  // (rows): the backward of 'none'
  ScalarOut loss;
  void* loss_per_row;
  void* lse;                // (rows) in the accumulation type
  void* grad_logits;
  void* grad_target;
  GradOutputGuess guess;
};

void cross_entropy_launch(const CrossEntropyCall& call, const LaunchContext& context);
// The path (by name) the call takes on its device and stream; launches nothing. For the tests.
const char* cross_entropy_call_path(const CrossEntropyCall& call, const LaunchContext& context);
// Test-only: every call takes the path named `path` (cross_entropy_call_path's names), or
// throws std::invalid_argument where that path cannot run it; "" gives the choice back.
// Throws std::invalid_argument for a name that is no path.
void set_forced_cross_entropy_path(const char* path);

// A chunk of classes of every row: (rows, width) logits, contiguous, classes [class_start,
// class_start + width) of `classes` (row_passes.cu has the math).
struct LogitChunkCall {
  DType dtype;
  int64_t rows, width, class_start, classes;
  const void* logits;
  void* grad;           // gradient: (rows, width), may be `logits` itself
  const void* target;   // (rows) class indices, int64 or int32 with target_int32
  bool target_int32;
  double softcap;       // 0: none
  double temperature;   // u = z' / temperature; 1: none
  void* stats;          // forward: (5, rows) in the accumulation type, updated; (6, rows) with entropy
  bool entropy;         // forward: the sixth row, sum exp(u - m) (u - m); backward: entropy_scale given
  const void* softmax_stats;  // backward: (3, rows) in the accumulation type: each row's max m,
                              // log(sum exp(u - m)) and its target's p - 1; with entropy a fourth,
                              // sum_c p_c (u_c - m)
  const void* row_scale;  // backward: (rows) in the accumulation type
  const void* entropy_scale;  // backward with entropy: (rows), each row's factor on its entropy's gradient
  const void* class_count;  // backward: one value of the accumulation type in place of `classes`, or nullptr
  double label_smoothing, z_loss;
};

void logit_chunk_stats_launch(const LogitChunkCall& call, const LaunchContext& context);
void logit_chunk_gradient_launch(const LogitChunkCall& call, const LaunchContext& context);

// C = A B^T on sm_90a (linear_ce_gemm.cu): A (m, k) and B (n, k) with row strides lda, ldb
// (elements, K contiguous), C (m, n) with row stride ldc, all of `dtype` (float16 or bfloat16).
// max_blocks > 0 caps the persistent grid (tests: the bits must not depend on it).
struct GemmCall {
  DType dtype;
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* c;
  int64_t ldc;
  int64_t max_blocks;
};

void gemm_nt_launch(const GemmCall& call, const LaunchContext& context);

// The same product's rows' statistics over each tile of kGemmRowStatsTileColumns classes instead
// of C (gemm_sm90.cuh): partials (tiles, stat_rows, m) float32 of u = softcap(logit + bias) / T.
struct GemmRowStats {
  float* partials;
  const void* target;  // (m,) int64, or int32 where target_int32
  const void* bias;    // (n,) of the operands' dtype, or nullptr
  float softcap;       // 0: none
  float softcap_inverse;  // (float) (1 / (double) softcap), 0 for none: Softcap's own reciprocal
  float inverse_temperature;
  int stat_rows;       // 5, or 6 with the entropy's sum
  bool target_int32;
  // The training form, or nullptr: e (m, n) at row stride ld_e, E = 2^(u log2 e - k) times dz'/dz (0 at the
  // target), rounded to the operands' dtype, and piece_max (pieces, m): each row's k = ceil(max u log2 e) over
  // each 64 columns, -inf where all are masked (gemm_grad_input reads them).
  void* e;
  int64_t ld_e;
  float* piece_max;
};
// Classes a tile of row_stats' partials covers: the kernel's tile N (gemm_sm90.cuh's kGemmTileN).
constexpr int64_t kGemmRowStatsTileColumns = 192;
void gemm_row_stats_launch(const GemmCall& call, const GemmRowStats& stats, const LaunchContext& context);
// d input from row_stats' training form (gemm_sm90_grad_input.cuh): out (m, n) = g W, g the logits'
// gradient for a grad_output of 1 (row_passes' formula without smoothing or the entropy's term) from the
// combined statistics, w the linear weight's classes [first_class, first_class + k) (classes x n in all), n
// contiguous. The launcher sets flags, and partial where the caller gives none: where the tiles fill less than a
// wave, K in parts summed in order through partial ((m, n) float32) and flags (2 int32 zeros a tile), scratch
// from the LaunchContext. A vocabulary in parts (launches in order, one partial for all): each part's sum is
// carried in partial relative to its stats' row exponent; previous_stats (the stats before this part) moves the
// carried sum onto this part's; only the part with `finish` writes out.
struct GemmGradInput {
  DType dtype;
  int64_t m, n, k;
  const void* e;
  int64_t ld_e;
  const void* w;  // the whole weight: classes rows of ld_w
  int64_t ld_w, first_class, classes;
  const float* previous_stats;  // (5, m), or nullptr: the first part
  bool finish;
  const float* piece_max;      // (ceil(k / 64), m): E's exponents (GemmRowStats)
  const float* stats;          // (5, m): the rows' statistics (row_passes.cu's rows)
  const float* row_scale;      // (m)
  const void* target;
  bool target_int32;
  float z_loss, inverse_temperature, softcap, softcap_inverse;
  void* out;
  int64_t ld_out;
  float* partial;
  int* flags;
  int64_t max_blocks;
};
void gemm_grad_input_launch(const GemmGradInput& call, const LaunchContext& context);
// row_stats' partials (tiles, stat_rows, rows) combined into the rows' (stat_rows, rows), float32
// (row_stats_combine.cuh).
void combine_row_stats_launch(const float* partials, float* stats, int64_t tiles, int stat_rows, int64_t rows,
                              const LaunchContext& context);

}  // namespace fused_losses
