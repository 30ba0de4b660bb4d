// The names errors print (tensor.h), spelled as torch prints them; the
// allocation through the C shim.
#include "tensor.h"

namespace msda {

namespace {

// The dtypes the library allocates or reads, with the C shim's code of each;
// the shim's codes are read once.
struct DtypeCode {
  int32_t code;
  ScalarType type;
};
const std::array<DtypeCode, 7>& dtype_codes() {
  static const std::array<DtypeCode, 7> codes = {{
      {aoti_torch_dtype_float32(), ScalarType::Float},
      {aoti_torch_dtype_bfloat16(), ScalarType::BFloat16},
      {aoti_torch_dtype_float16(), ScalarType::Half},
      {aoti_torch_dtype_int64(), ScalarType::Long},
      {aoti_torch_dtype_float64(), ScalarType::Double},
      {aoti_torch_dtype_int32(), ScalarType::Int},
      {aoti_torch_dtype_uint8(), ScalarType::Byte},
  }};
  return codes;
}

int32_t shim_dtype(ScalarType t) {
  for (const auto& [code, type] : dtype_codes()) {
    if (type == t) return code;
  }
  detail::fail("ms_deform_attn: no allocation of dtype ", dtype_name(t));
}

}  // namespace

ScalarType dtype_of(const Tensor& t) {
  int32_t code = 0;
  MSDA_SHIM_CHECK(aoti_torch_get_dtype(t.get(), &code));
  for (const auto& [c, type] : dtype_codes()) {
    if (c == code) return type;
  }
  return t.scalar_type();
}

Device device_of(const Tensor& t, int32_t type, int32_t index) {
  using torch::headeronly::DeviceType;
  static const int32_t cpu = aoti_torch_device_type_cpu(), cuda = aoti_torch_device_type_cuda();
  const auto i = static_cast<decltype(t.device().index())>(index);
  if (type == cuda) return Device(DeviceType::CUDA, i);
  if (type == cpu) return Device(DeviceType::CPU, i);
  return t.device();
}

Tensor empty(Sizes sizes, ScalarType dtype, const Device& device) {
  constexpr size_t kMaxDims = 8;  // the library's tensors have at most 6
  MSDA_CHECK(sizes.size() <= kMaxDims, "ms_deform_attn: no allocation of more than ", kMaxDims,
             " dimensions, got ", sizes.size());
  std::array<int64_t, kMaxDims> strides{};
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(sizes.begin()[i], 1);
  }
  const int32_t type = device.is_cuda() ? aoti_torch_device_type_cuda()
                                        : aoti_torch_device_type_cpu();
  AtenTensorHandle handle = nullptr;
  MSDA_SHIM_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.begin(),
                                           strides.data(), shim_dtype(dtype), type,
                                           device.has_index() ? device.index() : 0, &handle));
  return Tensor(handle);
}

const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "Float";
    case ScalarType::Double: return "Double";
    case ScalarType::Half: return "Half";
    case ScalarType::BFloat16: return "BFloat16";
    case ScalarType::Long: return "Long";
    case ScalarType::Int: return "Int";
    case ScalarType::Short: return "Short";
    case ScalarType::Char: return "Char";
    case ScalarType::Byte: return "Byte";
    case ScalarType::Bool: return "Bool";
    case ScalarType::ComplexFloat: return "ComplexFloat";
    case ScalarType::ComplexDouble: return "ComplexDouble";
    default: return "a dtype other than the floating and integer ones";
  }
}

std::string device_name(const Device& d) {
  using torch::headeronly::DeviceType;
  std::string name;
  switch (d.type()) {
    case DeviceType::CPU: name = "cpu"; break;
    case DeviceType::CUDA: name = "cuda"; break;
    case DeviceType::Meta: name = "meta"; break;
    default: name = "device type " + std::to_string(static_cast<int>(d.type())); break;
  }
  if (d.has_index()) name += ":" + std::to_string(d.index());
  return name;
}

std::string shape_str(const Tensor& t) {
  std::ostringstream os;
  os << "[";
  for (int64_t i = 0; i < t.dim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << "]";
  return os.str();
}

}  // namespace msda
