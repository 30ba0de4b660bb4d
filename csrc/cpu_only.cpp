// A build without the CUDA kernels (no nvcc at build time) still answers
// CUDA tensors with an error that says so and how to rebuild, on every
// operator, instead of the dispatcher's generic "no kernel" message.
#ifndef MSDA_WITH_CUDA
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

void cuda_kernels_missing(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, op.schema().name(),
              ": this build of ms_deform_attn has no CUDA kernels (it was built CPU-only: no "
              "nvcc was found, no GPU was visible and FORCE_CUDA=1 was not set, or torch had "
              "no CUDA), but got CUDA tensors. Rebuild with the CUDA "
              "toolkit matching torch.version.cuda on the PATH (or CUDA_HOME set), e.g. "
              "`FORCE_CUDA=1 pip install --no-build-isolation .`, or pass CPU tensors.");
}

}  // namespace

TORCH_LIBRARY_IMPL(ms_deform_attn, CUDA, m) {
  for (const char* name : {"ms_deform_attn", "ms_deform_attn_fused", "_ms_deform_attn_backward",
                           "_ms_deform_attn_fused_backward", "_column_sum"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&cuda_kernels_missing>());
  }
}
#endif  // MSDA_WITH_CUDA
