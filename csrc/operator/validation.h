// Input validation: the one host function every device and backend goes
// through before any kernel runs (CPU and CUDA operators, the autograd
// wrapper's backward, the backend queries). It never synchronises with a GPU.
#pragma once

#include <array>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/params.h"
#include "../binding/tensor.h"

namespace msda {

// What validation learns on the host: the problem's sizes and dtypes, the
// level shapes when the host has them (spatial_shapes_list's numbers,
// (H0, W0, H1, ...), not copied: the caller's list outlives the call; or
// null), the dtypes the caller passed.
struct Checked {
  Problem pb;
  const int64_t* host_shapes = nullptr;
  ScalarType value_dtype, loc_dtype_in, attn_dtype_in;
  Device device{torch::headeronly::DeviceType::CPU};  // value's
  std::array<bool, 5> contiguous{};  // each tensor argument's, in schema order
};

// Validates every argument and raises an error naming the argument, the
// expected and the actual value:
//   ranks, sizes, dtypes and devices of all five tensors;
//   backend: "auto" or a known backend name (whether it can run the inputs
//     is the forward planner's question, plan/forward_plan.h);
//   level shapes, wherever the host knows them: spatial_shapes and
//     level_start_index when they are host tensors, spatial_shapes_list when
//     given (each H, W > 0, H * W < 2^31, level_start_index the exclusive
//     cumulative sum, the sum of H * W equal to S; the same checks and
//     messages for both sources). Shapes that live only on the device are
//     checked by the kernels instead (cuda/device/common.cuh, load_levels: NaN
//     results), or here at the cost of a sync with MS_DEFORM_ATTN_CHECK_SHAPES=1.
// Allocates and copies nothing.
Checked check_inputs(const Tensor& value, const Tensor& spatial_shapes,
                     const Tensor& level_start_index, const Tensor& sampling_locations,
                     const Tensor& attention_weights, std::string_view backend = "auto",
                     const IntListOpt& spatial_shapes_list = std::nullopt);

// Whether `value` (rank 4) is head-major: not contiguous as (N, S, M, D),
// but the transpose(1, 2) view of a contiguous (N, M, S, D) tensor. Such a
// value is read in place (Problem::value_head_major); any other layout is
// copied to a contiguous one.
inline bool value_is_head_major(const Tensor& value) {
  return value.dim() == 4 && !value.is_contiguous() && transpose(value, 1, 2).is_contiguous();
}

// The operator's inputs after check_inputs(): contiguous (value possibly
// head-major, see above), locations and weights in one dtype (the wider of
// the two when the caller mixed them).
struct Prepared {
  Problem pb;
  Tensor value, spatial_shapes, level_start, loc, attn;
  ScalarType value_dtype, loc_dtype;       // loc's and attn's, after the widening
  ScalarType loc_dtype_in, attn_dtype_in;  // what the caller passed
  Device device;                           // value's
  const int64_t* host_shapes;              // see Checked
};

Prepared prepare_inputs(const Tensor& value, const Tensor& spatial_shapes,
                        const Tensor& level_start_index,
                        const Tensor& sampling_locations,
                        const Tensor& attention_weights, std::string_view backend = "auto",
                        const IntListOpt& spatial_shapes_list = std::nullopt);

// Checks grad_output against the prepared inputs: shape (N, Lq, M * D),
// value's dtype and device.
void check_grad_output(const Tensor& grad_output, const Prepared& in);

// Points a ForwardParams / BackwardParams at the prepared inputs.
template <typename Params>
void set_inputs(Params& p, const Prepared& in) {
  p.pb = in.pb;
  p.value = in.value.data_ptr();
  p.spatial_shapes = data_as<int64_t>(in.spatial_shapes);
  p.level_start = data_as<int64_t>(in.level_start);
  p.loc = in.loc.data_ptr();
  p.attn = in.attn.data_ptr();
  if constexpr (std::is_same_v<Params, ForwardParams>) {
    p.host_shapes = in.host_shapes;
  }
}

DType to_dtype(ScalarType t);

// _column_sum's argument: a floating tensor of at least one dimension,
// summed over every dimension but the last (rows: their product).
struct ColumnSumSizes {
  int64_t rows, cols;
};
ColumnSumSizes check_column_sum(const Tensor& grad);

}  // namespace msda
