// The library's kernels as a table (cpu/, cuda/, fused.cpp, ops.cpp each
// give theirs): per kernel its dispatch key, operator, the boxed function
// the stable ABI registers and the unboxed one the version-bound layer
// calls (library_kernels.h says which of the two runs).
#pragma once

#include <array>
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../layer/library_kernels.h"
#include "tensor.h"

namespace msda {

using library::Call;
using library::Kernel;

struct KernelEntry {
  Kernel id;
  const char* key;  // "CPU", "CUDA", "CompositeExplicitAutograd"
  const char* op;   // the operator's name in ms_deform_attn::
  void (*boxed)(StableIValue*, uint64_t, uint64_t);
  void (*unboxed)(Call&);  // null: the layer has its own (_linear: at::linear)
};

// A file's kernels.
struct KernelTable {
  const KernelEntry* first = nullptr;
  size_t size = 0;
  template <size_t N>
  constexpr KernelTable(const KernelEntry (&entries)[N]) : first(entries), size(N) {}
  constexpr KernelTable() = default;
  const KernelEntry* begin() const { return first; }
  const KernelEntry* end() const { return first + size; }
};

KernelTable cpu_kernels();        // cpu/msda_cpu.cpp
KernelTable cuda_kernels();       // cuda/msda_cuda.cpp; none CPU-only (cpu_only.cpp)
KernelTable composite_kernels();  // fused.cpp
KernelTable linear_kernels();     // ops.cpp

namespace detail {

template <typename T>
constexpr bool is_tensor = std::is_same_v<std::decay_t<T>, Tensor>;

// Position of each argument among the tensor arguments.
template <typename... A>
constexpr std::array<size_t, sizeof...(A)> tensor_slots() {
  std::array<size_t, sizeof...(A)> slot{};
  size_t k = 0, j = 0;
  ((slot[j++] = is_tensor<A> ? k++ : 0), ...);
  return slot;
}

// Argument of type T of a call: its tensor, or the option of that type.
template <typename T>
decltype(auto) argument(const Call& c, const Tensor* tensors, size_t slot) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, Tensor>) {
    return tensors[slot];
  } else if constexpr (std::is_same_v<D, std::string_view>) {
    return c.backend;
  } else if constexpr (std::is_same_v<D, std::string>) {
    return std::string(c.backend);
  } else if constexpr (std::is_same_v<D, bool>) {
    return c.deterministic == 1;
  } else if constexpr (std::is_same_v<D, std::optional<bool>>) {
    return c.deterministic < 0 ? std::optional<bool>() : std::optional<bool>(c.deterministic == 1);
  } else if constexpr (std::is_same_v<D, IntListOpt>) {
    return c.shapes_list_len < 0
               ? IntListOpt()
               : IntListOpt(std::in_place, c.shapes_list, c.shapes_list + c.shapes_list_len);
  } else {
    static_assert(sizeof(D) == 0, "an argument type Call does not carry");
  }
}

// Hands the results to the caller, borrowed (Call::take_results).
template <typename R>
void put_results(const R& r, const Call& c) {
  if constexpr (std::is_same_v<R, Tensor>) {
    const AtenTensorHandle h = r.get();
    c.take_results(c.context, &h);
  } else {
    const auto handles = std::apply(
        [](const auto&... t) { return std::array<AtenTensorHandle, sizeof...(t)>{t.get()...}; }, r);
    c.take_results(c.context, handles.data());
  }
}

template <typename R, typename... A, size_t... I, size_t... J>
void call_unboxed(R (*fn)(A...), Call& c, std::index_sequence<I...>, std::index_sequence<J...>) {
  constexpr auto slot = tensor_slots<A...>();
  // Every handle is owned before anything can raise.
  const std::array<Tensor, sizeof...(I)> tensors{Tensor(c.in[I])...};
  put_results(fn(argument<A>(c, tensors.data(), slot[J])...), c);
}

template <typename R, typename... A>
void call_unboxed(R (*fn)(A...), Call& c) {
  constexpr size_t tensors = (size_t(is_tensor<A>) + ... + 0);
  call_unboxed(fn, c, std::make_index_sequence<tensors>{}, std::index_sequence_for<A...>{});
}

}  // namespace detail

template <auto fn>
void unboxed_kernel(Call& c) {
  detail::call_unboxed(fn, c);
}

}  // namespace msda

// A table entry for kernel function fn of operator op on dispatch key key.
#define MSDA_KERNEL(id, key, op, fn) \
  ::msda::KernelEntry { ::msda::Kernel::id, key, op, TORCH_BOX(fn), &::msda::unboxed_kernel<fn> }
// The same for a kernel the layer does not call (boxed only).
#define MSDA_BOXED_KERNEL(id, key, op, fn) \
  ::msda::KernelEntry { ::msda::Kernel::id, key, op, TORCH_BOX(fn), nullptr }
