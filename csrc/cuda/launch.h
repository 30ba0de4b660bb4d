// Host entry points of the CUDA kernels. ATen-free: the binding layer fills
// the params structs; each launcher dispatches on dtype and returns the launch
// status for the binding to check.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "../params.h"

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

// Forward backends.
cudaError_t baseline_forward(const ForwardParams& p, cudaStream_t stream);
cudaError_t persistent_forward(const ForwardParams& p, cudaStream_t stream);
int64_t persistent_workspace_bytes(const Problem& pb);  // its zeroed tile counters
cudaError_t cluster_forward(const ForwardParams& p, cudaStream_t stream);  // sm_90+
// sm_90+; needs p.host_shapes, 16-bit or fp32 values, D * element size a
// multiple of 16 bytes and at most 512, value 16-byte aligned.
cudaError_t tma_forward(const ForwardParams& p, cudaStream_t stream);

// Backward shared by every forward backend. grad_value_acc must be zeroed;
// with grad_value_acc null it leaves grad_value out and (cell_keys set) writes
// the sample keys for the deterministic path instead. p.vec: 16 bytes of the
// accumulator with grad_value_acc, 32 without (or 1). With p.ref set (the
// fused operator) only the deterministic path where dots_mma_ok() runs;
// otherwise it returns cudaErrorInvalidValue.
cudaError_t backward(const BackwardParams& p, cudaStream_t stream);

// Whether the deterministic path's dots run on tensor cores for p (16-bit
// values and the deterministic path are the caller's to ensure): D a
// multiple of 32, at most 32 samples a (query, head) once each level's
// points are padded to 4, value rows numbered in 32 bits, groups below
// 2^31, 16-byte aligned value and grad_output. The fused backward
// (p.ref set) runs only where this holds.
bool dots_mma_ok(const BackwardParams& p);

// Whether they do: 16-bit values where dots_mma_ok. Then dots_mma_kernel also
// writes the fused operator's block-local records; otherwise local_footprints
// writes them before value_grad_local.
bool dots_on_tensor_cores(const BackwardParams& p);

// Whether the deterministic (sorted) backward is also the faster one for p
// (value, grad_out and pb set), as measured (benchmarks/NOTES.md): bf16
// values, whose dots and grad_value then run on tensor cores (D a multiple
// of 32, at most 32 samples a query once each level's points are padded to
// 4, 16-byte aligned value and grad_output), and between a third of a
// sample and D samples a value pixel (S / 3 <= Lq L P <= S D: the encoders;
// the upper bound keeps the sorted path's scratch within 8x the atomic
// path's accumulator); and 16-bit values wherever the block-local grad_value
// applies (local_value_grad_ok: the decoders, no sort).
bool sorted_backward_preferred(const BackwardParams& p);

// grad_value of the deterministic backward where the samples of one (n, m,
// level) fit one block (backward_local.cu): Lq P <= 8192, 16-bit or fp32
// values (locations in fp32 or their dtype) with D a multiple of 16 bytes,
// 16-byte aligned grad_output, N M S < 2^31, S < 2^30, fewer than 2^31
// samples, and a current device whose blocks may opt in to the kernel's
// shared memory.
// Scratch: the samples' records (BackwardParams::local_cell, local_wts; 20
// bytes a sample), local_value_grad_scratch_bytes() long and 16-byte aligned,
// which local_value_grad_records() points p at before backward() (cell_keys
// null): the dots kernels write them (the fused operator's FFMA kernel's are
// written by local_value_grad), and `counter`, one unsigned zeroed before the
// call (the blocks take their work from it). local_value_grad then writes all of
// grad_value (value's shape, layout and dtype, 16-byte aligned), the same bits on
// every run.
bool local_value_grad_ok(const BackwardParams& p);
int64_t local_value_grad_scratch_bytes(const BackwardParams& p);
void local_value_grad_records(BackwardParams& p, void* scratch);
cudaError_t local_value_grad(const BackwardParams& p, void* grad_value, unsigned* counter,
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

// Deterministic grad_value (backward_deterministic.cu), after backward() wrote
// keys and ids. Sizes in elements; keys and ids are unsigned (wide: uint64).
struct DeterministicBuffers {
  int64_t items = 0;        // samples: N * Lq * M * L * P
  int64_t cells = 0;        // N * M * cell_stride; also the key of samples that touch nothing
  int end_bit = 0;          // bits the keys use (cells < 2^end_bit)
  bool wide = false;        // 64-bit keys and ids
  // The sort's double buffers (overwritten): the result lands in either.
  void* keys = nullptr;
  void* ids = nullptr;
  void* sorted_keys = nullptr;
  void* sorted_ids = nullptr;
  void* temp = nullptr;     // the sort's scratch, deterministic_temp_bytes() long
  size_t temp_bytes = 0;
  void* cell_starts = nullptr;  // cells + 1 int64
  void* rows = nullptr;         // items, like ids: the keys buffer the sort leaves dead
  void* weights = nullptr;      // 4 * items in the accumulation type
  void* grad_value = nullptr;   // (N, S, M, D) in the value's dtype, written completely
  int vec = 1;              // elements per vector access of the gather (16 / sizeof(T) or 1)
};
// The sort's scratch size for b, in bytes.
cudaError_t deterministic_temp_bytes(const DeterministicBuffers& b, size_t& bytes);
cudaError_t deterministic_value_grad(const BackwardParams& p, const DeterministicBuffers& b,
                                     cudaStream_t stream);

}  // namespace msda::cuda
