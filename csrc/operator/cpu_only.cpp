// A build without the CUDA kernels (no nvcc at build time) still answers
// CUDA tensors with an error that says so and how to rebuild, on every
// operator, instead of the dispatcher's generic "no kernel" message: these
// are registered at load, whether or not a layer is (it has no CUDA kernels
// to register, kernel_table.h).
#ifndef MSDA_WITH_CUDA
#include "../binding/kernel_table.h"

msda::KernelTable msda::cuda_kernels() { return {}; }

namespace {

constexpr const char* kOperators[] = {"ms_deform_attn", "ms_deform_attn_fused",
                                      "_ms_deform_attn_backward",
                                      "_ms_deform_attn_fused_backward", "_column_sum"};

// The boxed kernel of operator kOperators[I] on CUDA tensors.
template <int I>
void cuda_kernels_missing(StableIValue*, uint64_t, uint64_t) {
  msda::detail::fail(
      "ms_deform_attn::", kOperators[I],
      ": this build of ms_deform_attn has no CUDA kernels (it was built CPU-only: no "
      "nvcc was found, no GPU was visible and FORCE_CUDA=1 was not set, or torch had "
      "no CUDA), but got CUDA tensors. Rebuild with the CUDA "
      "toolkit matching torch.version.cuda on the PATH (or CUDA_HOME set), e.g. "
      "`FORCE_CUDA=1 pip install --no-build-isolation .`, or pass CPU tensors.");
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(ms_deform_attn, CUDA, m) {
  m.impl(kOperators[0], &cuda_kernels_missing<0>);
  m.impl(kOperators[1], &cuda_kernels_missing<1>);
  m.impl(kOperators[2], &cuda_kernels_missing<2>);
  m.impl(kOperators[3], &cuda_kernels_missing<3>);
  m.impl(kOperators[4], &cuda_kernels_missing<4>);
}
#endif  // MSDA_WITH_CUDA
