// Who registers the CPU, CUDA and composite kernels (library_kernels.h): the
// version-bound layer, unboxed, through run_kernel; or, in a process without
// it, this library, boxed through the stable ABI, once asked to
// (ms_deform_attn_register_boxed_kernels). The schemas and the host queries
// are registered at load either way (ops.cpp).
#include <array>
#include <list>
#include <mutex>

#include "kernel_table.h"

namespace msda {
namespace {

constexpr KernelTable (*kTables[])() = {cpu_kernels, cuda_kernels, composite_kernels,
                                         linear_kernels};

// Every kernel's entry by its id, gathered once (null: none in this build).
const KernelEntry* find(Kernel k) {
  using Index = std::array<const KernelEntry*, static_cast<size_t>(Kernel::count)>;
  static const Index index = [] {
    Index entries{};
    for (auto table : kTables) {
      for (const KernelEntry& e : table()) entries[static_cast<size_t>(e.id)] = &e;
    }
    return entries;
  }();
  const auto i = static_cast<size_t>(k);
  return i < index.size() ? index[i] : nullptr;
}

}  // namespace

namespace library {

bool has_kernel(Kernel k) {
  const KernelEntry* e = find(k);
  return e != nullptr && e->unboxed != nullptr;
}

void run_kernel(Kernel k, Call& call) {
  const KernelEntry* e = find(k);
  if (e == nullptr || e->unboxed == nullptr) {
    // The call's handles are this function's (Call) whether it runs or not.
    for (size_t i = 0; i < call.in_count; ++i) aoti_torch_delete_tensor_object(call.in[i]);
    detail::fail("ms_deform_attn: this build has no kernel ", static_cast<int>(k),
                 " (the layer and the library were built apart)");
  }
  e->unboxed(call);
}

}  // namespace library
}  // namespace msda

extern "C" void ms_deform_attn_register_boxed_kernels(void) {
  using torch::stable::detail::StableLibrary;
  static std::once_flag once;
  std::call_once(once, [] {
    // Kept for the process's life, as a static registration's would be.
    static std::list<StableLibrary> libraries;
    for (auto table : msda::kTables) {
      for (const msda::KernelEntry& e : table()) {
        libraries.emplace_back(StableLibrary::Kind::IMPL, "ms_deform_attn", e.key, __FILE__,
                               __LINE__);
        libraries.back().impl(e.op, e.boxed);
      }
    }
  });
}
