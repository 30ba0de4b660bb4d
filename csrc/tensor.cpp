// The names errors print (tensor.h), spelled as torch prints them.
#include "tensor.h"

namespace msda {

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
