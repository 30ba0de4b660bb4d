// Input validation (validation.h): every argument checked on the host,
// with a message naming it, the expected and the actual value, before any
// kernel of any device runs; and the inputs made contiguous for the kernels.
#include "validation.h"

#include "../plan/forward_plan.h"
#include "overrides.h"
#include "../core/sampling.h"

namespace msda {

namespace {

const char* kOp = "ms_deform_attn: ";

// Level shapes known on the host, from `source` ("spatial_shapes" or
// "spatial_shapes_list"): hw = (H0, W0, H1, ...); starts (may be null) the
// host copy of level_start_index. One set of checks and messages for both.
void check_levels(const int64_t* hw, const int64_t* starts, const char* source, const Problem& pb) {
  int64_t total = 0;
  for (int l = 0; l < pb.L; ++l) {
    const int64_t H = hw[2 * l], W = hw[2 * l + 1];
    MSDA_CHECK(H > 0 && W > 0, kOp, source, "[", l, "] = (", H, ", ", W,
                ") must be positive (H, W)");
    MSDA_CHECK(H <= INT32_MAX && W <= INT32_MAX && H * W <= INT32_MAX, kOp, source, "[", l,
                "] = (", H, ", ", W, "): H * W must be < 2^31");
    MSDA_CHECK(starts == nullptr || starts[l] == total, kOp, "level_start_index[", l,
                "] must be the exclusive cumulative sum of H * W, expected ", total, ", got ",
                starts == nullptr ? 0 : starts[l]);
    total += H * W;
  }
  MSDA_CHECK(total == pb.S, kOp, "value.size(1) (S) must equal the sum of H * W over the levels of ",
              source, " = ", total, ", got ", pb.S);
}

// What validation reads of a tensor, read once: each accessor of a stable
// tensor is a call into torch's C shim, on every call's path.
struct Meta {
  explicit Meta(const Tensor& t)
      : tensor(t), sizes(t.sizes()), dtype(dtype_of(t)), contiguous(t.is_contiguous()) {
    MSDA_SHIM_CHECK(aoti_torch_get_device_type(t.get(), &device_type));
    // A CPU tensor's index is -1 (torch's get_device()); ask the others'.
    if (!is_cpu()) MSDA_SHIM_CHECK(aoti_torch_get_device_index(t.get(), &device_index));
  }
  int64_t dim() const { return static_cast<int64_t>(sizes.size()); }
  bool same_device(const Meta& o) const {
    return device_type == o.device_type && device_index == o.device_index;
  }
  Device device() const { return device_of(tensor, device_type, device_index); }
  bool is_cpu() const {
    static const int32_t cpu = aoti_torch_device_type_cpu();
    return device_type == cpu;
  }
  const Tensor& tensor;
  decltype(std::declval<const Tensor&>().sizes()) sizes;
  ScalarType dtype;
  bool contiguous;
  int32_t device_type = 0, device_index = -1;
};

// The level tensors, host tensors of the checked dtype and rank.
void check_host_tensors(const Meta& spatial_shapes, const Meta& level_start_index,
                        const Problem& pb) {
  const Tensor shapes = contiguous_as(spatial_shapes.tensor, spatial_shapes.contiguous);
  const Tensor starts = contiguous_as(level_start_index.tensor, level_start_index.contiguous);
  check_levels(data_as<int64_t>(shapes), data_as<int64_t>(starts), "spatial_shapes", pb);
}

// spatial_shapes_list: one (H, W) pair per level covering S, equal to
// spatial_shapes when that is a host tensor (no sync). On CUDA the tma
// backend follows spatial_shapes on any level where a device tensor
// disagrees with the list, so a wrong list never reads out of bounds.
void check_list(const std::vector<int64_t>& list, const Meta& spatial_shapes, bool host,
                const Problem& pb) {
  MSDA_CHECK(static_cast<int64_t>(list.size()) == 2 * pb.L, kOp,
              "spatial_shapes_list must hold one (H, W) pair per level, ", 2 * pb.L,
              " numbers for spatial_shapes.size(0) = ", pb.L, " levels, got ", list.size());
  check_levels(list.data(), nullptr, "spatial_shapes_list", pb);
  if (host) {
    const Tensor shapes = contiguous_as(spatial_shapes.tensor, spatial_shapes.contiguous);
    const int64_t* sh = data_as<int64_t>(shapes);
    for (int l = 0; l < pb.L; ++l) {
      MSDA_CHECK(sh[2 * l] == list[2 * l] && sh[2 * l + 1] == list[2 * l + 1], kOp,
                  "spatial_shapes_list[", l, "] = (", list[2 * l], ", ", list[2 * l + 1],
                  ") must equal spatial_shapes[", l, "] = (", sh[2 * l], ", ", sh[2 * l + 1], ")");
    }
  }
}


void check_rank(const Meta& m, const char* name, int64_t rank, const char* layout) {
  MSDA_CHECK(m.dim() == rank, kOp, name, " must have ", rank, " dimensions ", layout, ", got ",
             m.dim(), " (shape ", shape_str(m.tensor), ")");
}

void check_size(const Meta& m, const char* name, int64_t dim, const char* what, int64_t expected,
                const char* source) {
  MSDA_CHECK(m.sizes[dim] == expected, kOp, name, ".size(", dim, ") (", what, ") must equal ",
             source, " = ", expected, ", got ", m.sizes[dim]);
}

void check_loc_dtype(ScalarType t, const char* name, ScalarType vt) {
  MSDA_CHECK(t == vt || t == kFloat, kOp, name, " must have the value's dtype (", dtype_name(vt),
             ") or float32, got ", dtype_name(t));
}

// Wider of two floating dtypes among {value dtype, float32}.
ScalarType wider(ScalarType a, ScalarType b) {
  if (a == b) return a;
  if (a == kDouble || b == kDouble) return kDouble;
  return kFloat;  // one of them is fp32, the other 16-bit
}

}  // namespace

DType to_dtype(ScalarType t) {
  switch (t) {
    case kFloat: return DType::f32;
    case kHalf: return DType::f16;
    case kBFloat16: return DType::bf16;
    case kDouble: return DType::f64;
    default: MSDA_CHECK(false, kOp, "unsupported dtype ", dtype_name(t));
  }
}

ColumnSumSizes check_column_sum(const Tensor& grad) {
  MSDA_CHECK(grad.dim() >= 1, "ms_deform_attn._column_sum: grad must have at least 1 dimension, got ",
              grad.dim());
  const auto t = dtype_of(grad);
  MSDA_CHECK(is_floating(t),
             "ms_deform_attn._column_sum: grad must be float32, float16, bfloat16 or float64, got ",
             dtype_name(t));
  const int64_t cols = grad.size(grad.dim() - 1);
  return {cols == 0 ? 0 : grad.numel() / cols, cols};
}

Checked check_inputs(const Tensor& value, const Tensor& spatial_shapes,
                     const Tensor& level_start_index, const Tensor& sampling_locations,
                     const Tensor& attention_weights, std::string_view backend,
                     const IntListOpt& spatial_shapes_list) {
  check_backend_name(backend);
  const Meta v(value), sh(spatial_shapes), st(level_start_index), lo(sampling_locations),
      at(attention_weights);

  // Ranks.
  check_rank(v, "value", 4, "(N, S, M, D)");
  check_rank(sh, "spatial_shapes", 2, "(L, 2)");
  check_rank(st, "level_start_index", 1, "(L,)");
  check_rank(lo, "sampling_locations", 6, "(N, Lq, M, L, P, 2)");
  check_rank(at, "attention_weights", 5, "(N, Lq, M, L, P)");

  // Devices.
  const std::pair<const Meta*, const char*> others[] = {{&sh, "spatial_shapes"},
                                                        {&st, "level_start_index"},
                                                        {&lo, "sampling_locations"},
                                                        {&at, "attention_weights"}};
  for (const auto& [m, name] : others) {
    MSDA_CHECK(m->same_device(v), kOp, name, " must be on the same device as value (",
               device_name(v.device()), "), got ", device_name(m->device()));
  }

  // Dtypes.
  const auto vt = v.dtype;
  MSDA_CHECK(is_floating(vt), kOp, "value must be float32, float16, bfloat16 or float64, got ",
             dtype_name(vt));
  MSDA_CHECK(sh.dtype == kLong, kOp, "spatial_shapes must be int64 (torch.long), got ",
             dtype_name(sh.dtype));
  MSDA_CHECK(st.dtype == kLong, kOp, "level_start_index must be int64 (torch.long), got ",
             dtype_name(st.dtype));
  check_loc_dtype(lo.dtype, "sampling_locations", vt);
  check_loc_dtype(at.dtype, "attention_weights", vt);

  // Sizes.
  Checked c;
  Problem& pb = c.pb;
  pb.N = v.sizes[0];
  pb.S = v.sizes[1];
  pb.M = v.sizes[2];
  pb.D = v.sizes[3];
  pb.value_head_major = !v.contiguous && value_is_head_major(value);
  pb.L = static_cast<int>(sh.sizes[0]);
  pb.Lq = lo.sizes[1];
  pb.P = static_cast<int>(lo.sizes[4]);
  MSDA_CHECK(sh.sizes[1] == 2, kOp, "spatial_shapes.size(1) must be 2 ((H, W) per level), got ",
             sh.sizes[1]);
  MSDA_CHECK(pb.L >= 1 && pb.L <= kMaxLevels, kOp,
             "spatial_shapes.size(0) (levels) must be in [1, ", kMaxLevels, "], got ", sh.sizes[0]);
  // Every level has a pixel: the kernels rely on S >= L (a device-side level
  // table that fails its check reads pixel 0 of each level).
  MSDA_CHECK(pb.S >= pb.L, kOp, "value.size(1) (S) must be at least the number of levels (",
             pb.L, "), every level having H * W >= 1 pixels, got ", pb.S);
  MSDA_CHECK(pb.M >= 1, kOp, "value.size(2) (heads M) must be >= 1, got ", pb.M);
  MSDA_CHECK(pb.D >= 1, kOp, "value.size(3) (channels D) must be >= 1, got ", pb.D);
  MSDA_CHECK(pb.P >= 1, kOp, "sampling_locations.size(4) (points P) must be >= 1, got ", pb.P);
  MSDA_CHECK(pb.M * pb.D <= INT32_MAX, kOp,
             "value.size(2) * value.size(3) (M * D) must be < 2^31, got ", pb.M * pb.D);
  const int64_t pixel_bytes = pb.M * pb.D * dtype_size(vt);
  MSDA_CHECK(pixel_bytes <= UINT32_MAX, kOp,
             "one pixel of value (M * D * element size) must be < 4 GiB, got ", pixel_bytes,
             " bytes");
  check_size(st, "level_start_index", 0, "levels L", pb.L, "spatial_shapes.size(0)");
  check_size(lo, "sampling_locations", 0, "batch N", pb.N, "value.size(0)");
  check_size(lo, "sampling_locations", 2, "heads M", pb.M, "value.size(2)");
  check_size(lo, "sampling_locations", 3, "levels L", pb.L, "spatial_shapes.size(0)");
  MSDA_CHECK(lo.sizes[5] == 2, kOp, "sampling_locations.size(5) must be 2 ((x, y)), got ",
             lo.sizes[5]);
  check_size(at, "attention_weights", 0, "batch N", pb.N, "value.size(0)");
  check_size(at, "attention_weights", 1, "queries Lq", pb.Lq, "sampling_locations.size(1)");
  check_size(at, "attention_weights", 2, "heads M", pb.M, "value.size(2)");
  check_size(at, "attention_weights", 3, "levels L", pb.L, "spatial_shapes.size(0)");
  check_size(at, "attention_weights", 4, "points P", pb.P, "sampling_locations.size(4)");

  // Level shapes, wherever the host has them. The list first: on CUDA it is
  // the only host-side source.
  const bool host = sh.is_cpu();
  if (spatial_shapes_list.has_value()) {
    check_list(*spatial_shapes_list, sh, host, pb);
    c.host_shapes = spatial_shapes_list->data();
    pb.host_shapes = true;
  }
  if (host) {
    check_host_tensors(sh, st, pb);
  } else if (check_shapes_on_host()) {
    const Device cpu(torch::headeronly::DeviceType::CPU);
    const Tensor shapes = torch::stable::to(spatial_shapes, cpu),
                 starts = torch::stable::to(level_start_index, cpu);
    check_host_tensors(Meta(shapes), Meta(starts), pb);
  }
  c.contiguous = {v.contiguous, sh.contiguous, st.contiguous, lo.contiguous, at.contiguous};

  c.value_dtype = vt;
  c.device = v.device();
  c.loc_dtype_in = lo.dtype;
  c.attn_dtype_in = at.dtype;
  pb.value_dtype = to_dtype(vt);
  pb.loc_dtype = to_dtype(wider(lo.dtype, at.dtype));
  return c;
}

void check_grad_output(const Tensor& grad_output, const Prepared& in) {
  const Problem& pb = in.pb;
  const Device dev = grad_output.device();
  MSDA_CHECK(dev == in.device, kOp, "grad_output must be on the same device as value (",
             device_name(in.device), "), got ", device_name(dev));
  MSDA_CHECK(grad_output.dim() == 3 && grad_output.size(0) == pb.N &&
                  grad_output.size(1) == pb.Lq && grad_output.size(2) == pb.M * pb.D,
              kOp, "grad_output must have shape (N, Lq, M * D) = (", pb.N, ", ", pb.Lq, ", ",
              pb.M * pb.D, "), got ", shape_str(grad_output));
  const ScalarType dt = dtype_of(grad_output);
  MSDA_CHECK(dt == in.value_dtype, kOp, "grad_output must have the value's dtype (",
             dtype_name(in.value_dtype), "), got ", dtype_name(dt));
}

Prepared prepare_inputs(const Tensor& value, const Tensor& spatial_shapes,
                        const Tensor& level_start_index,
                        const Tensor& sampling_locations,
                        const Tensor& attention_weights, std::string_view backend,
                        const IntListOpt& spatial_shapes_list) {
  Checked c = check_inputs(value, spatial_shapes, level_start_index, sampling_locations,
                           attention_weights, backend, spatial_shapes_list);
  const ScalarType loc_in = c.loc_dtype_in, attn_in = c.attn_dtype_in;
  const auto lt = wider(loc_in, attn_in);
  // Built whole: a default-constructed stable Tensor costs an allocation.
  const auto& contig = c.contiguous;
  return Prepared{c.pb,
                  contiguous_as(value, contig[0] || c.pb.value_head_major),
                  contiguous_as(spatial_shapes, contig[1]),
                  contiguous_as(level_start_index, contig[2]),
                  lt == loc_in ? contiguous_as(sampling_locations, contig[3])
                               : make_contiguous(torch::stable::to(sampling_locations, lt)),
                  lt == attn_in ? contiguous_as(attention_weights, contig[4])
                                : make_contiguous(torch::stable::to(attention_weights, lt)),
                  c.value_dtype,
                  lt,
                  loc_in,
                  attn_in,
                  c.device,
                  c.host_shapes};
}

}  // namespace msda
