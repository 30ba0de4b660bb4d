// Host side of the deterministic backward: the scratch buffers of the
// sort-and-gather grad_value path (backward_deterministic.cu) and its
// launches, for the operator in msda_cuda.cpp.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "../output.h"
#include "../validation.h"
#include "deterministic.h"
#include "launch.h"

namespace msda::cuda {
namespace {

// Bits needed to write every value in [0, x].
int bits_for(int64_t x) {
  int bits = 0;
  while (bits < 63 && (int64_t(1) << bits) <= x) ++bits;
  return bits;
}

}  // namespace

GradValuePath grad_value_path() {
  const char* env = std::getenv("MS_DEFORM_ATTN_GRAD_VALUE");
  if (env == nullptr) return GradValuePath::automatic;
  if (std::strcmp(env, "atomic") == 0) return GradValuePath::atomic;
  if (std::strcmp(env, "sorted") == 0) return GradValuePath::sorted;
  if (std::strcmp(env, "local") == 0) return GradValuePath::local;
  return GradValuePath::automatic;
}

bool use_sorted_backward(const BackwardParams& p, bool deterministic) {
  switch (grad_value_path()) {
    case GradValuePath::atomic: return deterministic;
    case GradValuePath::sorted:
    case GradValuePath::local: return true;
    default: return deterministic || cuda::sorted_backward_preferred(p);
  }
}

// grad_value by sort and gather (backward_deterministic.cu): bitwise the same
// on every run. Scratch: per sample 4 keys / ids (4 bytes each, 8 when wide;
// the sort's double buffers, its temp is small) and 4 weights (16 bytes; 32
// for fp64); 8 bytes per cell.
at::Tensor deterministic_grad_value(BackwardParams p, const Prepared& in, cudaStream_t stream) {
  const auto& pb = in.pb;
  p.cell_stride = 2 * pb.S + 2 * pb.L;
  DeterministicBuffers b;
  b.items = sample_count(pb);
  b.cells = pb.N * pb.M * p.cell_stride;
  b.end_bit = bits_for(b.cells);
  b.wide = b.cells >= int64_t(UINT32_MAX) || b.items >= int64_t(UINT32_MAX);
  if (b.items == 0) return value_shaped(in.pb, in.value.options(), /*zeroed=*/true);
  if (grad_value_path() != GradValuePath::sorted && cuda::local_value_grad_ok(p)) {
    // Block-local: the dots kernel writes each sample's record (20 bytes)
    // instead of a key; the other scratch is the blocks' work counter.
    p.grad_value_acc = nullptr;
    p.cell_keys = nullptr;
    at::Tensor records = at::empty({cuda::local_value_grad_scratch_bytes(p)},
                                   in.value.options().dtype(at::kByte));
    cuda::local_value_grad_records(p, records.data_ptr());
    C10_CUDA_CHECK(cuda::backward(p, stream));
    at::Tensor grad_value = value_shaped(in.pb, in.value.options(), /*zeroed=*/false);
    at::Tensor counter = at::zeros({1}, in.value.options().dtype(at::kInt));
    C10_CUDA_CHECK(cuda::local_value_grad(p, grad_value.data_ptr(),
                                          reinterpret_cast<unsigned*>(counter.data_ptr<int>()), stream));
    return grad_value;
  }
  const auto idx = in.value.options().dtype(b.wide ? at::kLong : at::kInt);
  at::Tensor keys = at::empty({b.items}, idx), ids = at::empty({b.items}, idx);
  at::Tensor sorted_keys = at::empty({b.items}, idx), sorted_ids = at::empty({b.items}, idx);
  p.grad_value_acc = nullptr;
  p.cell_keys = keys.data_ptr();
  p.sample_ids = ids.data_ptr();
  p.wide_keys = b.wide;
  C10_CUDA_CHECK(cuda::backward(p, stream));

  b.keys = keys.data_ptr();
  b.ids = ids.data_ptr();
  b.sorted_keys = sorted_keys.data_ptr();
  b.sorted_ids = sorted_ids.data_ptr();
  C10_CUDA_CHECK(cuda::deterministic_temp_bytes(b, b.temp_bytes));
  at::Tensor temp = at::empty({int64_t(std::max<size_t>(b.temp_bytes, 1))},
                              in.value.options().dtype(at::kByte));
  b.temp = temp.data_ptr();
  at::Tensor starts = at::empty({b.cells + 1}, in.value.options().dtype(at::kLong));
  b.cell_starts = starts.data_ptr();
  const auto acc_type = in.value.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor weights = at::empty({4 * b.items}, in.value.options().dtype(acc_type));
  b.weights = weights.data_ptr();
  at::Tensor grad_value = value_shaped(in.pb, in.value.options(), /*zeroed=*/false);
  b.grad_value = grad_value.data_ptr();
  // 16 bytes of the value dtype per lane (32 bytes of the fp32 accumulator
  // measured slower, benchmarks/NOTES.md).
  const int64_t elem = in.value.element_size();
  b.vec = pick_vec(pb.D, elem, static_cast<int>(16 / elem), {p.grad_out, b.grad_value});
  C10_CUDA_CHECK(cuda::deterministic_value_grad(p, b, stream));
  return grad_value;
}

}  // namespace msda::cuda
