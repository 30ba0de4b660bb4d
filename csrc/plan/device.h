// What the planners know of a device: one plain struct, filled from the CUDA
// runtime for a real device (cuda/device_info.cpp) or written out by hand for
// one that is not there (the CPU table tests of both planners). No CUDA here.
#pragma once

#include <cstdint>

namespace msda {

struct DeviceInfo {
  int major = 9, minor = 0;          // compute capability
  int sms = 132;                     // streaming multiprocessors
  int64_t smem_optin = 232448;       // shared memory a block may opt in to (bytes)
  int64_t smem_per_sm = 233472;      // the most an SM's carve-out holds
  int64_t smem_reserved = 1024;      // taken by the system from each resident block
  // The defaults: an H100 / H200 (sm_90, 132 SMs, 227 KB a block).
};

}  // namespace msda
