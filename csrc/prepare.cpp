#include "prepare.h"

#include <cstdlib>
#include <limits>

#include "sampling.h"

namespace msda {

namespace {

const char* kOp = "ms_deform_attn: ";

bool check_device_shapes() {
  const char* env = std::getenv("MS_DEFORM_ATTN_CHECK_SHAPES");
  return env != nullptr && std::string(env) == "1";
}

// spatial_shapes / level_start_index values (host tensors).
void check_level_values(const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                        const Problem& pb) {
  auto shapes = spatial_shapes.contiguous();
  auto starts = level_start_index.contiguous();
  const int64_t* sh = shapes.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  int64_t total = 0;
  for (int l = 0; l < pb.L; ++l) {
    const int64_t H = sh[2 * l], W = sh[2 * l + 1];
    TORCH_CHECK(H > 0 && W > 0, kOp, "spatial_shapes[", l, "] = (", H, ", ", W,
                ") must be positive (H, W)");
    TORCH_CHECK(H * W <= INT32_MAX, kOp, "spatial_shapes[", l, "] = (", H, ", ", W,
                "): H * W must be < 2^31");
    TORCH_CHECK(st[l] == total, kOp, "level_start_index[", l,
                "] must be the exclusive cumulative sum of H * W, expected ", total, ", got ",
                st[l]);
    total += H * W;
  }
  TORCH_CHECK(total == pb.S, kOp, "value.size(1) (S) must equal the sum of H * W over levels = ",
              total, ", got ", pb.S);
}

// spatial_shapes_list: 2 * L positive numbers whose (H, W) pairs cover S.
// Compared with spatial_shapes too when that is a host tensor (no sync); on
// CUDA the kernels that use it (tma) fall back to spatial_shapes for any
// level where the two disagree, so a wrong list never reads out of bounds.
std::vector<int64_t> check_host_shapes(at::IntArrayRef list, const at::Tensor& spatial_shapes,
                                       const Problem& pb) {
  TORCH_CHECK(static_cast<int64_t>(list.size()) == 2 * pb.L, kOp,
              "spatial_shapes_list must hold one (H, W) pair per level, ", 2 * pb.L,
              " numbers for spatial_shapes.size(0) = ", pb.L, " levels, got ", list.size());
  int64_t total = 0;
  for (int l = 0; l < pb.L; ++l) {
    const int64_t H = list[2 * l], W = list[2 * l + 1];
    TORCH_CHECK(H > 0 && W > 0, kOp, "spatial_shapes_list[", l, "] = (", H, ", ", W,
                ") must be positive (H, W)");
    TORCH_CHECK(H <= INT32_MAX && W <= INT32_MAX && H * W <= INT32_MAX, kOp, "spatial_shapes_list[",
                l, "] = (", H, ", ", W, "): H * W must be < 2^31");
    total += H * W;
  }
  TORCH_CHECK(total == pb.S, kOp,
              "spatial_shapes_list must cover value.size(1) (S): sum of H * W = ", total,
              ", expected ", pb.S);
  if (spatial_shapes.device().is_cpu()) {
    auto shapes = spatial_shapes.contiguous();
    const int64_t* sh = shapes.data_ptr<int64_t>();
    for (int l = 0; l < 2 * pb.L; ++l) {
      TORCH_CHECK(sh[l] == list[l], kOp, "spatial_shapes_list[", l / 2, "] = (", list[l / 2 * 2],
                  ", ", list[l / 2 * 2 + 1], ") must equal spatial_shapes[", l / 2, "] = (",
                  sh[l / 2 * 2], ", ", sh[l / 2 * 2 + 1], ")");
    }
  }
  return std::vector<int64_t>(list.begin(), list.end());
}

void check_rank(const at::Tensor& t, const char* name, int64_t rank, const char* layout) {
  TORCH_CHECK(t.dim() == rank, kOp, name, " must have ", rank, " dimensions ", layout,
              ", got ", t.dim(), " (shape ", t.sizes(), ")");
}

void check_size(const at::Tensor& t, const char* name, int64_t dim, const char* what,
                int64_t expected, const char* source) {
  TORCH_CHECK(t.size(dim) == expected, kOp, name, ".size(", dim, ") (", what, ") must equal ",
              source, " = ", expected, ", got ", t.size(dim));
}

bool is_float_kind(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

void check_loc_dtype(const at::Tensor& t, const char* name, at::ScalarType vt) {
  TORCH_CHECK(t.scalar_type() == vt || t.scalar_type() == at::kFloat, kOp, name,
              " must have the value's dtype (", vt, ") or float32, got ", t.scalar_type());
}

// Wider of two floating dtypes among {value dtype, float32}.
at::ScalarType wider(at::ScalarType a, at::ScalarType b) {
  if (a == b) return a;
  if (a == at::kDouble || b == at::kDouble) return at::kDouble;
  return at::kFloat;  // one of them is fp32, the other 16-bit
}

}  // namespace

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::f32;
    case at::kHalf: return DType::f16;
    case at::kBFloat16: return DType::bf16;
    case at::kDouble: return DType::f64;
    default: TORCH_CHECK(false, kOp, "unsupported dtype ", t);
  }
}

Prepared prepare_inputs(const at::Tensor& value, const at::Tensor& spatial_shapes,
                        const at::Tensor& level_start_index,
                        const at::Tensor& sampling_locations,
                        const at::Tensor& attention_weights,
                        at::OptionalIntArrayRef spatial_shapes_list) {
  // Ranks.
  check_rank(value, "value", 4, "(N, S, M, D)");
  check_rank(spatial_shapes, "spatial_shapes", 2, "(L, 2)");
  check_rank(level_start_index, "level_start_index", 1, "(L,)");
  check_rank(sampling_locations, "sampling_locations", 6, "(N, Lq, M, L, P, 2)");
  check_rank(attention_weights, "attention_weights", 5, "(N, Lq, M, L, P)");

  // Devices.
  const auto dev = value.device();
  const std::pair<const at::Tensor*, const char*> others[] = {
      {&spatial_shapes, "spatial_shapes"},
      {&level_start_index, "level_start_index"},
      {&sampling_locations, "sampling_locations"},
      {&attention_weights, "attention_weights"}};
  for (const auto& [t, name] : others) {
    TORCH_CHECK(t->device() == dev, kOp, name, " must be on the same device as value (", dev,
                "), got ", t->device());
  }

  // Dtypes.
  const auto vt = value.scalar_type();
  TORCH_CHECK(is_float_kind(vt), kOp,
              "value must be float32, float16, bfloat16 or float64, got ", vt);
  TORCH_CHECK(spatial_shapes.scalar_type() == at::kLong, kOp,
              "spatial_shapes must be int64 (torch.long), got ", spatial_shapes.scalar_type());
  TORCH_CHECK(level_start_index.scalar_type() == at::kLong, kOp,
              "level_start_index must be int64 (torch.long), got ",
              level_start_index.scalar_type());
  check_loc_dtype(sampling_locations, "sampling_locations", vt);
  check_loc_dtype(attention_weights, "attention_weights", vt);

  // Sizes.
  Problem pb;
  pb.N = value.size(0);
  pb.S = value.size(1);
  pb.M = value.size(2);
  pb.D = value.size(3);
  pb.L = static_cast<int>(spatial_shapes.size(0));
  pb.Lq = sampling_locations.size(1);
  pb.P = static_cast<int>(sampling_locations.size(4));
  TORCH_CHECK(spatial_shapes.size(1) == 2, kOp,
              "spatial_shapes.size(1) must be 2 ((H, W) per level), got ", spatial_shapes.size(1));
  TORCH_CHECK(pb.L >= 1 && pb.L <= kMaxLevels, kOp, "spatial_shapes.size(0) (levels) must be in [1, ",
              kMaxLevels, "], got ", spatial_shapes.size(0));
  TORCH_CHECK(pb.M >= 1, kOp, "value.size(2) (heads M) must be >= 1, got ", pb.M);
  TORCH_CHECK(pb.D >= 1, kOp, "value.size(3) (channels D) must be >= 1, got ", pb.D);
  TORCH_CHECK(pb.P >= 1, kOp, "sampling_locations.size(4) (points P) must be >= 1, got ", pb.P);
  TORCH_CHECK(pb.M * pb.D <= INT32_MAX, kOp, "value.size(2) * value.size(3) (M * D) must be < 2^31, got ",
              pb.M * pb.D);
  TORCH_CHECK(pb.M * pb.D * value.element_size() <= UINT32_MAX, kOp,
              "one pixel of value (M * D * element size) must be < 4 GiB, got ",
              pb.M * pb.D * value.element_size(), " bytes");
  check_size(level_start_index, "level_start_index", 0, "levels L", pb.L, "spatial_shapes.size(0)");
  check_size(sampling_locations, "sampling_locations", 0, "batch N", pb.N, "value.size(0)");
  check_size(sampling_locations, "sampling_locations", 2, "heads M", pb.M, "value.size(2)");
  check_size(sampling_locations, "sampling_locations", 3, "levels L", pb.L, "spatial_shapes.size(0)");
  TORCH_CHECK(sampling_locations.size(5) == 2, kOp,
              "sampling_locations.size(5) must be 2 ((x, y)), got ", sampling_locations.size(5));
  check_size(attention_weights, "attention_weights", 0, "batch N", pb.N, "value.size(0)");
  check_size(attention_weights, "attention_weights", 1, "queries Lq", pb.Lq,
             "sampling_locations.size(1)");
  check_size(attention_weights, "attention_weights", 2, "heads M", pb.M, "value.size(2)");
  check_size(attention_weights, "attention_weights", 3, "levels L", pb.L, "spatial_shapes.size(0)");
  check_size(attention_weights, "attention_weights", 4, "points P", pb.P,
             "sampling_locations.size(4)");

  // Values of spatial_shapes / level_start_index: checkable without a host
  // sync only when they live on the CPU. On CUDA the kernels treat a level
  // that does not fit inside value as empty, so bad values never read out of
  // bounds; MS_DEFORM_ATTN_CHECK_SHAPES=1 checks them there too, at the cost
  // of a device-to-host copy (a sync: not for CUDA-graph capture).
  if (spatial_shapes.device().is_cpu() && level_start_index.device().is_cpu()) {
    check_level_values(spatial_shapes, level_start_index, pb);
  } else if (check_device_shapes()) {
    check_level_values(spatial_shapes.cpu(), level_start_index.cpu(), pb);
  }

  Prepared in;
  if (spatial_shapes_list.has_value()) {
    in.host_shapes = check_host_shapes(*spatial_shapes_list, spatial_shapes, pb);
    pb.host_shapes = true;
  }
  in.pb = pb;
  in.loc_dtype_in = sampling_locations.scalar_type();
  in.attn_dtype_in = attention_weights.scalar_type();
  const auto lt = wider(in.loc_dtype_in, in.attn_dtype_in);
  in.value = value.contiguous();
  in.spatial_shapes = spatial_shapes.contiguous();
  in.level_start = level_start_index.contiguous();
  in.loc = sampling_locations.to(lt).contiguous();
  in.attn = attention_weights.to(lt).contiguous();
  in.pb.value_dtype = to_dtype(vt);
  in.pb.loc_dtype = to_dtype(lt);
  return in;
}

at::Tensor prepare_grad_output(const at::Tensor& grad_output, const Prepared& in) {
  const auto& pb = in.pb;
  TORCH_CHECK(grad_output.device() == in.value.device(), kOp,
              "grad_output must be on the same device as value (", in.value.device(), "), got ",
              grad_output.device());
  TORCH_CHECK(grad_output.dim() == 3 && grad_output.size(0) == pb.N &&
                  grad_output.size(1) == pb.Lq && grad_output.size(2) == pb.M * pb.D,
              kOp, "grad_output must have shape (N, Lq, M * D) = (", pb.N, ", ", pb.Lq, ", ",
              pb.M * pb.D, "), got ", grad_output.sizes());
  TORCH_CHECK(grad_output.scalar_type() == in.value.scalar_type(), kOp,
              "grad_output must have the value's dtype (", in.value.scalar_type(), "), got ",
              grad_output.scalar_type());
  return grad_output.contiguous();
}

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const char* env = std::getenv("MS_DEFORM_ATTN_POISON");
  if (env != nullptr && env[0] == '1') {
    return at::full(sizes, std::numeric_limits<double>::quiet_NaN(), options);
  }
  return at::empty(sizes, options);
}

CudaHooks& cuda_hooks() {
  static CudaHooks hooks;
  return hooks;
}

int pick_vec(int64_t D, int64_t elem_size, int want, std::initializer_list<const void*> ptrs) {
  if (D % want != 0) return 1;
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % (want * elem_size) != 0) return 1;
  }
  return want;
}

}  // namespace msda
