// Input validation and preparation shared by the CPU and CUDA bindings.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <type_traits>
#include <vector>

#include "params.h"

namespace msda {

// The operator's inputs after validation: contiguous, locations and weights in
// one dtype (the wider of the two when the caller mixed them).
struct Prepared {
  Problem pb;
  at::Tensor value, spatial_shapes, level_start, loc, attn;
  at::ScalarType loc_dtype_in, attn_dtype_in;  // what the caller passed
  std::vector<int64_t> host_shapes;  // spatial_shapes_list flattened (H0, W0, H1, ...), or empty
};

// Validates every argument (rank, sizes, dtypes, devices; on CPU also the
// values of spatial_shapes and level_start_index) and raises a clear error
// naming the argument, the expected and the actual value.
// spatial_shapes_list: the level shapes on the host, flattened (H0, W0, H1,
// W1, ...), as (H, W) pairs in Python; optional. Checked against L and S (and
// against spatial_shapes when that is a host tensor).
Prepared prepare_inputs(const at::Tensor& value, const at::Tensor& spatial_shapes,
                        const at::Tensor& level_start_index,
                        const at::Tensor& sampling_locations,
                        const at::Tensor& attention_weights,
                        at::OptionalIntArrayRef spatial_shapes_list = std::nullopt);

// Points a ForwardParams / BackwardParams at the prepared inputs.
template <typename Params>
void set_inputs(Params& p, const Prepared& in) {
  p.pb = in.pb;
  p.value = in.value.data_ptr();
  p.spatial_shapes = in.spatial_shapes.data_ptr<int64_t>();
  p.level_start = in.level_start.data_ptr<int64_t>();
  p.loc = in.loc.data_ptr();
  p.attn = in.attn.data_ptr();
  if constexpr (std::is_same_v<Params, ForwardParams>) {
    p.host_shapes = in.host_shapes.empty() ? nullptr : in.host_shapes.data();
  }
}

// Checks grad_output against the prepared problem and returns it contiguous.
at::Tensor prepare_grad_output(const at::Tensor& grad_output, const Prepared& in);

DType to_dtype(at::ScalarType t);

// Allocates an output the kernels fill completely. With the environment
// variable MS_DEFORM_ATTN_POISON=1 it is filled with NaN first (tests use it to
// catch elements a kernel leaves unwritten).
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options);

// Hooks that the CUDA part of the extension installs when it is compiled in.
struct CudaHooks {
  // Backends that can run on this device at all (arch, build), in preference order.
  std::vector<std::string> (*available)(int device) = nullptr;
  // Backend "auto" resolves to for these inputs.
  std::string (*select)(const Problem& pb, int device) = nullptr;
  // Why backend `name` cannot run these inputs ("" when it can).
  std::string (*reason)(const std::string& name, const Problem& pb, int device) = nullptr;
};
CudaHooks& cuda_hooks();

// Elements per vector access: `want` when that divides D and every pointer in
// `ptrs` is aligned to want * elem_size bytes, else 1 (the kernels are
// instantiated for exactly these two widths).
int pick_vec(int64_t D, int64_t elem_size, int want, std::initializer_list<const void*> ptrs);

}  // namespace msda
