// DeviceInfo of CUDA devices (device_info.h), cached per device, and the hook
// through which the backend queries (../backend_queries.h) ask for it.
#include "device_info.h"

#include <mutex>

#include "../operator/backend_queries.h"

namespace msda::cuda {
namespace {

cudaError_t query(int dev, DeviceInfo& d) {
  int smem_optin = 0, smem_per_sm = 0, smem_reserved = 0;
  cudaError_t err = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
  d.smem_optin = smem_optin;
  d.smem_per_sm = smem_per_sm;
  d.smem_reserved = smem_reserved;
  return err;
}

// The queries' hook (and the operator's, on every call): nullopt where no
// CUDA device is usable; the runtime's answer for a device is cached.
std::optional<DeviceInfo> for_queries(int device) {
  DeviceInfo d;
  if (device_info(device, d) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nullopt;
  }
  return d;
}

const bool kHookInstalled = [] {
  set_cuda_device_info(&for_queries);
  return true;
}();

}  // namespace

cudaError_t device_info(int device, DeviceInfo& d) {
  if (device < 0) {
    const cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
  }
  constexpr int kMaxDevices = 64;
  if (device >= kMaxDevices) return query(device, d);
  static std::once_flag once[kMaxDevices];
  static DeviceInfo cached[kMaxDevices];
  static cudaError_t status[kMaxDevices];
  std::call_once(once[device], [device] { status[device] = query(device, cached[device]); });
  d = cached[device];
  return status[device];
}

}  // namespace msda::cuda
