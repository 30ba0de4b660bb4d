// The CUDA architectures a build carries kernels for, and the error a GPU
// that none of them runs on gets (pure functions; cuda/kernel_image.cu asks
// the CUDA runtime, these say what and why).
#pragma once

#include <string>

namespace msda {

// TORCH_CUDA_ARCH_LIST as setup.py compiled the kernels for ("8.0;9.0a;
// 12.0+PTX"), "" in a CPU-only build.
std::string cuda_archs();

// Whether kernels built for `archs` run on a device of compute capability
// major.minor: SASS for X.Y runs on X.Z with Z >= Y (an "a" target, such as
// 9.0a, only on X.Y itself); "+PTX" X.Y is compiled by the driver on any
// device of X.Y or newer.
bool archs_run_on(const std::string& archs, int major, int minor);

// "" when archs_run_on holds, else the error for `device` (its name and
// index) saying which architectures the build has and which it needs.
std::string kernel_image_error(const std::string& archs, int major, int minor,
                               const std::string& device);

}  // namespace msda
