// The CUDA backward's host side (backward.h): the plan for a call, then the
// scratch buffers and launches of its grad_value path.
#include "backward.h"

#include <algorithm>

#include "../../operator/output.h"
#include "../../operator/overrides.h"
#include "../device_info.h"
#include "../host.h"
#include "../entry_points.h"

namespace msda::cuda {
namespace {

// Bits needed to write every value in [0, x].
int bits_for(int64_t x) {
  int bits = 0;
  while (bits < 63 && (int64_t(1) << bits) <= x) ++bits;
  return bits;
}

Tensor run_atomic_path(BackwardParams& p, const Prepared& in, cudaStream_t stream) {
  const auto vt = in.value_dtype;
  auto acc = value_shaped(in.pb, vt == kDouble ? kDouble : kFloat, in.device,
                          /*zeroed=*/true);
  if (in.pb.N * in.pb.Lq * in.pb.M > 0) {
    p.grad_value_acc = acc.data_ptr();
    MSDA_CUDA_CHECK(ffma_dots(p, stream));
  }
  return to(acc, vt);
}

cudaError_t dots(const BackwardParams& p, cudaStream_t stream) {
  return p.plan.dots == DotsKernel::ffma ? ffma_dots(p, stream) : mma_dots(p, stream);
}

// A stream of this thread for `device`, and two events, made once: where
// the block-local grad_value makes its own records it runs on this stream
// beside the dots kernel, forked from and joined back into the caller's
// stream (under CUDA-graph capture: two branches of the graph).
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};

cudaError_t side_stream(int device, SideStream*& out) {
  constexpr int kDevices = 64;
  thread_local SideStream side[kDevices];
  if (device < 0 || device >= kDevices) return cudaErrorInvalidDevice;
  SideStream& s = side[device];
  if (s.stream == nullptr) {
    // All three or none: a failure leaves nothing half made for the next call.
    SideStream made;
    cudaError_t e = cudaStreamCreateWithFlags(&made.stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) return e;
    if ((e = cudaEventCreateWithFlags(&made.fork, cudaEventDisableTiming)) != cudaSuccess) {
      cudaStreamDestroy(made.stream);
      return e;
    }
    if ((e = cudaEventCreateWithFlags(&made.join, cudaEventDisableTiming)) != cudaSuccess) {
      cudaEventDestroy(made.fork);
      cudaStreamDestroy(made.stream);
      return e;
    }
    s = made;
  }
  out = &s;
  return cudaSuccess;
}

// Block-local: the dots kernel writes each sample's record (20 bytes)
// instead of a key, or (self_records) none, the grad_value kernel making
// them and running beside it; the other scratch is the blocks' work counter.
Tensor run_local_path(BackwardParams& p, const Prepared& in, cudaStream_t stream) {
  const Device dev = in.device;
  Tensor grad_value = value_shaped(in.pb, in.value_dtype, dev, /*zeroed=*/false);
  Tensor counter = zeros({1}, kInt, dev);
  unsigned* count = reinterpret_cast<unsigned*>(data_as<int>(counter));
  if (p.plan.self_records) {
    SideStream* side = nullptr;
    MSDA_CUDA_CHECK(side_stream(dev.index(), side));
    MSDA_CUDA_CHECK(cudaEventRecord(side->fork, stream));
    MSDA_CUDA_CHECK(cudaStreamWaitEvent(side->stream, side->fork, 0));
    MSDA_CUDA_CHECK(grad_value_local(p, grad_value.data_ptr(), count, side->stream));
    MSDA_CUDA_CHECK(dots(p, stream));
    MSDA_CUDA_CHECK(cudaEventRecord(side->join, side->stream));
    MSDA_CUDA_CHECK(cudaStreamWaitEvent(stream, side->join, 0));
    return grad_value;
  }
  Tensor records = empty({grad_value_local_scratch_bytes(p)}, kByte, dev);
  grad_value_local_records(p, records.data_ptr());
  MSDA_CUDA_CHECK(dots(p, stream));
  MSDA_CUDA_CHECK(grad_value_local(p, grad_value.data_ptr(), count, stream));
  return grad_value;
}

// Global sort and gather. Scratch: per sample 4 keys / ids (4 bytes each, 8
// when wide; the sort's double buffers, its temp is small) and 4 weights
// (16 bytes; 32 for fp64); 8 bytes per cell.
Tensor run_sorted_path(BackwardParams& p, const Prepared& in, cudaStream_t stream) {
  const auto& pb = in.pb;
  SortedBuffers b;
  b.items = sample_count(pb);
  b.cells = pb.N * pb.M * p.cell_stride;
  b.end_bit = bits_for(b.cells);
  b.wide = b.cells >= int64_t(UINT32_MAX) || b.items >= int64_t(UINT32_MAX);
  const Device dev = in.device;
  const ScalarType idx = b.wide ? kLong : kInt;
  Tensor keys = empty({b.items}, idx, dev), ids = empty({b.items}, idx, dev);
  Tensor sorted_keys = empty({b.items}, idx, dev), sorted_ids = empty({b.items}, idx, dev);
  p.cell_keys = keys.data_ptr();
  p.sample_ids = ids.data_ptr();
  p.wide_keys = b.wide;
  MSDA_CUDA_CHECK(dots(p, stream));

  b.keys = keys.data_ptr();
  b.ids = ids.data_ptr();
  b.sorted_keys = sorted_keys.data_ptr();
  b.sorted_ids = sorted_ids.data_ptr();
  MSDA_CUDA_CHECK(sorted_temp_bytes(b, b.temp_bytes));
  Tensor temp = empty({int64_t(std::max<size_t>(b.temp_bytes, 1))}, kByte, dev);
  b.temp = temp.data_ptr();
  Tensor starts = empty({b.cells + 2}, kLong, dev);
  b.cell_starts = starts.data_ptr();
  b.big_weights = data_as<int64_t>(starts) + b.cells + 1;  // the last one
  const auto acc_type = in.value_dtype == kDouble ? kDouble : kFloat;
  Tensor weights = empty({4 * b.items}, acc_type, dev);
  b.weights = weights.data_ptr();
  Tensor grad_value = value_shaped(in.pb, in.value_dtype, dev, /*zeroed=*/false);
  b.grad_value = grad_value.data_ptr();
  b.vec = p.plan.gather_vec;
  MSDA_CUDA_CHECK(grad_value_sorted(p, b, stream));
  return grad_value;
}

}  // namespace

Tensor run_backward(BackwardParams p, const Prepared& in, cudaStream_t stream) {
  p.vec = p.plan.vec;
  if (p.plan.grad_value == GradValuePath::atomic) return run_atomic_path(p, in, stream);
  p.cell_stride = 2 * in.pb.S + 2 * in.pb.L;
  if (sample_count(in.pb) == 0) {
    return value_shaped(in.pb, in.value_dtype, in.device, /*zeroed=*/true);
  }
  return p.plan.grad_value == GradValuePath::local ? run_local_path(p, in, stream)
                                                   : run_sorted_path(p, in, stream);
}

}  // namespace msda::cuda
