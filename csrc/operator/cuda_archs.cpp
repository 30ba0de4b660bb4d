// The build's CUDA architectures and the error of a GPU without kernels
// (cuda_archs.h): what setup.py compiled for, and which GPUs that runs on.
#include "cuda_archs.h"

#include <sstream>

#if __has_include("ms_deform_attn_build.h")
#include "ms_deform_attn_build.h"  // written by setup.py: MSDA_CUDA_ARCHS
#endif
#ifndef MSDA_CUDA_ARCHS
#define MSDA_CUDA_ARCHS ""
#endif

namespace msda {

std::string cuda_archs() {
#ifdef MSDA_WITH_CUDA
  return MSDA_CUDA_ARCHS;
#else
  return "";
#endif
}

bool archs_run_on(const std::string& archs, int major, int minor) {
  std::string list = archs;
  for (char& c : list) {
    if (c == ';' || c == ',') c = ' ';
  }
  std::istringstream in(list);
  std::string item;
  while (in >> item) {
    const bool ptx = item.find("+PTX") != std::string::npos;
    const bool specific = !ptx && !item.empty() && (item.back() == 'a' || item.back() == 'f');
    int M = 0, m = 0;
    char dot = 0;
    std::istringstream num(item);
    if (!(num >> M >> dot >> m) || dot != '.') continue;
    if (ptx && (major > M || (major == M && minor >= m))) return true;
    if (specific ? (major == M && minor == m) : (major == M && minor >= m)) return true;
  }
  return false;
}

std::string kernel_image_error(const std::string& archs, int major, int minor,
                               const std::string& device) {
  if (archs_run_on(archs, major, minor)) return "";
  std::ostringstream os;
  os << "ms_deform_attn: this build has no CUDA kernels for " << device << " (compute capability "
     << major << "." << minor << "): it was compiled for "
     << (archs.empty() ? std::string("no CUDA architecture") : "TORCH_CUDA_ARCH_LIST=\"" + archs + "\"")
     << ". Install a wheel built for sm_" << major << minor
     << ", or build from source on this machine (TORCH_CUDA_ARCH_LIST=\"" << major << "." << minor
     << "\" pip install --no-build-isolation .).";
  return os.str();
}

}  // namespace msda
