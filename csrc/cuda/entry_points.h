// Host entry points of the CUDA kernels. ATen-free: the binding layer fills
// the params structs; each launcher dispatches on dtype and returns the launch
// status for the binding to check. (Launch constants: ../plan/launch_shapes.h,
// shared with the planners; device-side launch helpers: device/launch.cuh.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "../core/params.h"

namespace msda::cuda {

// Elements per vector access: `want` when that divides D and every pointer in
// `ptrs` is aligned to want * elem_size bytes, else 1 (the kernels are
// instantiated for exactly these two widths).
inline int pick_vec(int64_t D, int64_t elem_size, int want, std::initializer_list<const void*> ptrs) {
  if (D % want != 0) return 1;
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % (want * elem_size) != 0) return 1;
  }
  return want;
}

// Forward backends: each launches p.plan (../plan/forward_plan.h), for
// problems its checks there admit; `persistent` takes plan.workspace bytes
// of zeroed scratch at p.workspace (its tile counters).
cudaError_t baseline_forward(const ForwardParams& p, cudaStream_t stream);
cudaError_t blocked_forward(const ForwardParams& p, cudaStream_t stream);
cudaError_t persistent_forward(const ForwardParams& p, cudaStream_t stream);
cudaError_t cluster_forward(const ForwardParams& p, cudaStream_t stream);
cudaError_t tma_forward(const ForwardParams& p, cudaStream_t stream);

// ---- the backward, by the plan in p.plan (../plan/backward_plan.h) -----
// The dots kernels: the location and weight gradients of every sample, and
// what its grad_value path needs of it (atomic: the atomics themselves into
// p.grad_value_acc, zeroed; sorted: cell keys and ids; local: block-local
// records). ffma_dots serves plan.dots == ffma (any dtype; p.vec = plan.vec),
// mma_dots the tensor-core forms (16-bit values).
cudaError_t ffma_dots(const BackwardParams& p, cudaStream_t stream);
cudaError_t mma_dots(const BackwardParams& p, cudaStream_t stream);

// The block-local grad_value (backward/local_grad_value.cu). Scratch: the
// samples' records (BackwardParams::local_cell, local_wts; 20 bytes a
// sample), grad_value_local_scratch_bytes() long and 16-byte aligned, which
// grad_value_local_records() points p at before the dots kernel runs, and
// `counter`, one unsigned zeroed before the call (the blocks take their work
// from it). grad_value_local then writes all of grad_value (value's shape,
// layout and dtype, 16-byte aligned), the same bits on every run. Its
// shared memory: kLocalSmemSmall / kLocalSmem bytes at most (the planner
// checks the device has them).
int64_t grad_value_local_scratch_bytes(const BackwardParams& p);
void grad_value_local_records(BackwardParams& p, void* scratch);
cudaError_t grad_value_local(const BackwardParams& p, void* grad_value, unsigned* counter,
                             cudaStream_t stream);

// Column sums of a row-major [rows, cols] matrix (column_sum.cu): the bias
// gradient of ms_deform_attn::_linear. The launch's shape comes from
// column_sum_shape(), which also sizes `partial` (chunks x cols of the
// accumulation type: float, double for double).
struct ColumnSumShape {
  int64_t col_blocks = 0;  // blocks across the columns, 32 vec columns each
  int64_t chunks = 0;      // blocks down the rows
  int64_t chunk_rows = 0;  // rows a chunk
};
ColumnSumShape column_sum_shape(int64_t rows, int64_t cols, int vec, int sms);
struct ColumnSumParams {
  DType dtype = DType::f32;  // of grad and out
  const void* grad = nullptr;
  int64_t rows = 0, cols = 0;
  int vec = 1;               // 16 bytes of grad a lane, or 1 element (pick_vec)
  ColumnSumShape shape;
  void* partial = nullptr;
  void* out = nullptr;       // cols elements
};
cudaError_t column_sum(const ColumnSumParams& p, cudaStream_t stream);

// The sorted grad_value path (backward/sorted_grad_value.cu), after the dots
// kernel wrote keys and ids. Sizes in elements; keys and ids are unsigned (wide: uint64).
struct SortedBuffers {
  int64_t items = 0;        // samples: N * Lq * M * L * P
  int64_t cells = 0;        // N * M * cell_stride; also the key of samples that touch nothing
  int end_bit = 0;          // bits the keys use (cells < 2^end_bit)
  bool wide = false;        // 64-bit keys and ids
  // The sort's double buffers (overwritten): the result lands in either.
  void* keys = nullptr;
  void* ids = nullptr;
  void* sorted_keys = nullptr;
  void* sorted_ids = nullptr;
  void* temp = nullptr;     // the sort's scratch, sorted_temp_bytes() long
  size_t temp_bytes = 0;
  void* cell_starts = nullptr;  // cells + 1 int64
  int64_t* big_weights = nullptr;  // one int64: pack_samples' flag (fp16 tiles), cleared by cell starts
  void* rows = nullptr;         // items, like ids: the keys buffer the sort leaves dead
  void* weights = nullptr;      // 4 * items in the accumulation type
  void* grad_value = nullptr;   // (N, S, M, D) in the value's dtype, written completely
  int vec = 1;              // plan.gather_vec: elements a vector access of the gather
};
// The sort's scratch size for b, in bytes.
cudaError_t sorted_temp_bytes(const SortedBuffers& b, size_t& bytes);
cudaError_t grad_value_sorted(const BackwardParams& p, const SortedBuffers& b,
                                     cudaStream_t stream);

}  // namespace msda::cuda
