// The library's tensor vocabulary: LibTorch's stable ABI (torch/csrc/stable)
// and nothing else of torch, so that one build loads into every torch
// release from the one it targets (TORCH_TARGET_VERSION, setup.py) on.
// Tensors, the few ATen operators the host code needs (called through the
// dispatcher), errors, and the names errors print.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "check.h"

namespace msda {

using IntListOpt = std::optional<std::vector<int64_t>>;

// A call of torch's C shim (aoti_torch_*, torch_*) that must succeed (the
// shim has already printed its error).
#define MSDA_SHIM_CHECK(call) \
  MSDA_CHECK((call) == AOTI_TORCH_SUCCESS, "ms_deform_attn: torch's call ", #call, " failed")

using Tensor = torch::stable::Tensor;
using Device = torch::stable::Device;
using ScalarType = torch::headeronly::ScalarType;
using Shape = std::vector<int64_t>;

constexpr ScalarType kFloat = ScalarType::Float;
constexpr ScalarType kDouble = ScalarType::Double;
constexpr ScalarType kHalf = ScalarType::Half;
constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
constexpr ScalarType kLong = ScalarType::Long;
constexpr ScalarType kInt = ScalarType::Int;
constexpr ScalarType kByte = ScalarType::Byte;

// ---- names, as torch prints them ------------------------------------------
const char* dtype_name(ScalarType t);         // "Float", "BFloat16", ...
std::string device_name(const Device& d);     // "cpu", "cuda:0"
std::string shape_str(const Tensor& t);       // "[2, 3, 4]"

// t.scalar_type() for the dtypes the operator takes, in one call of the C
// shim (the stable conversion compares the shim's code with each dtype's in
// turn, a call each).
ScalarType dtype_of(const Tensor& t);

// t's device, given the C shim's codes of its type and index: CPU and CUDA
// without further calls (t.device() converts through a chain of them).
Device device_of(const Tensor& t, int32_t type, int32_t index);

// t's data as T*, for a tensor whose dtype validation has checked (the
// stable mutable_data_ptr<T> checks it again, a shim call per dtype).
template <typename T>
T* data_as(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

inline bool is_floating(ScalarType t) {
  return t == kFloat || t == kHalf || t == kBFloat16 || t == kDouble;
}
// Bytes per element of the dtypes the operator takes.
inline int64_t dtype_size(ScalarType t) {
  switch (t) {
    case kDouble: case kLong: return 8;
    case kFloat: case kInt: return 4;
    case kHalf: case kBFloat16: return 2;
    case kByte: return 1;
    default: detail::fail("ms_deform_attn: no element size for dtype ", dtype_name(t));
  }
}
inline Shape sizes_of(const Tensor& t) {
  const auto s = t.sizes();
  return Shape(s.begin(), s.end());
}

// ---- allocation and views -------------------------------------------------
// The sizes of a tensor to allocate, not copied: a Shape, an array or a
// tensor's sizes(), each of which outlives the allocation. A braced list
// goes to the SizeList overloads below, which keep it alive for the call
// (a Sizes made from one would point into a temporary).
class Sizes {
 public:
  Sizes(const int64_t* data, size_t size) : data_(data), size_(size) {}
  Sizes(const Shape& s) : data_(s.data()), size_(s.size()) {}
  template <size_t N>
  Sizes(const std::array<int64_t, N>& s) : data_(s.data()), size_(N) {}
  Sizes(decltype(std::declval<const Tensor&>().sizes()) s) : data_(s.data()), size_(s.size()) {}
  const int64_t* begin() const { return data_; }
  const int64_t* end() const { return data_ + size_; }
  size_t size() const { return size_; }

 private:
  const int64_t* data_;
  size_t size_;
};
using SizeList = std::initializer_list<int64_t>;
inline Sizes sizes_in(const SizeList& s) { return Sizes(s.begin(), s.size()); }

// A contiguous tensor, through the C shim's direct allocation (not a boxed
// dispatcher call: this is on every call's path).
Tensor empty(Sizes sizes, ScalarType dtype, const Device& device);
inline Tensor empty(SizeList sizes, ScalarType dtype, const Device& device) {
  return empty(sizes_in(sizes), dtype, device);
}
// zeros and to go through the C shim's own zero_ and copy_ (unboxed calls),
// not torch::stable's, which call the dispatcher by the operator's name
// (boxed, a lookup each call): both are on the backward's path.
inline Tensor zeros(Sizes sizes, ScalarType dtype, const Device& device) {
  Tensor t = empty(sizes, dtype, device);
  MSDA_SHIM_CHECK(aoti_torch_zero_(t.get()));
  return t;
}
inline Tensor zeros(SizeList sizes, ScalarType dtype, const Device& device) {
  return zeros(sizes_in(sizes), dtype, device);
}
inline Tensor full(Sizes sizes, double value, ScalarType dtype, const Device& device) {
  return torch::stable::full(Shape(sizes.begin(), sizes.end()), value, dtype, std::nullopt, device);
}
inline Tensor full(SizeList sizes, double value, ScalarType dtype, const Device& device) {
  return full(sizes_in(sizes), value, dtype, device);
}
// t in `dtype`: t itself when it has it; a contiguous CPU or CUDA t copied
// into a new contiguous tensor; anything else through torch's to() (which
// keeps other layouts and serves other devices).
inline Tensor to(const Tensor& t, ScalarType dtype) {
  if (dtype_of(t) == dtype) return t;
  const Device device = t.device();
  if (!(device.is_cpu() || device.is_cuda()) || !t.is_contiguous()) {
    return torch::stable::to(t, dtype);
  }
  Tensor out = empty(t.sizes(), dtype, device);
  MSDA_SHIM_CHECK(aoti_torch_copy_(out.get(), t.get(), /*non_blocking=*/0));
  return out;
}
// t itself when contiguous (no dispatcher call), else a contiguous copy;
// contiguous_as where t's contiguity is known already.
inline Tensor contiguous_as(const Tensor& t, bool is_contiguous) {
  return is_contiguous ? t : torch::stable::contiguous(t);
}
inline Tensor make_contiguous(const Tensor& t) { return contiguous_as(t, t.is_contiguous()); }
// clone, transpose, reshape, view, narrow, unsqueeze, sum: torch::stable's
// (found by argument-dependent lookup on Tensor).

// torch's parallel_for over [begin, end) in chunks of at least `grain`.
// Work of one chunk runs here, as ATen's own parallel_for runs it, without
// the call through the C shim (a small call's host time).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (end - begin <= std::max<int64_t>(grain, 1)) {
    f(begin, end);
    return;
  }
  torch::stable::parallel_for(begin, end, grain, f);
}

// ---- any ATen (or this library's) operator, through the dispatcher ---------
// call_op<R>("aten::softmax", "int", args...): the arguments in schema order
// (Tensor, int64_t, double, bool, std::optional<...>, std::vector<int64_t>,
// std::string, ScalarType); R a Tensor or a std::tuple of them.
namespace detail {
template <typename R>
struct Returns {
  static constexpr size_t count = 1;
  static R read(StableIValue* s) { return torch::stable::detail::to<R>(s[0]); }
};
template <typename... T>
struct Returns<std::tuple<T...>> {
  static constexpr size_t count = sizeof...(T);
  template <size_t... I>
  static std::tuple<T...> read_impl(StableIValue* s, std::index_sequence<I...>) {
    return {torch::stable::detail::to<T>(s[I])...};
  }
  static std::tuple<T...> read(StableIValue* s) {
    return read_impl(s, std::index_sequence_for<T...>{});
  }
};
}  // namespace detail

template <typename R = Tensor, typename... Args>
R call_op(const char* name, const char* overload, const Args&... args) {
  constexpr size_t n = std::max(sizeof...(Args), detail::Returns<R>::count);
  std::array<StableIValue, n> stack{};
  size_t i = 0;
  ((stack[i++] = torch::stable::detail::from(args)), ...);
  MSDA_SHIM_CHECK(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION));
  return detail::Returns<R>::read(stack.data());
}

}  // namespace msda
