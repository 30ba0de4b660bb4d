// The one dtype dispatch of the library, for the CPU and CUDA launchers
// alike: each names its own 16-bit types (torch::headeronly::Half / BFloat16 on the
// CPU, __half / __nv_bfloat16 in CUDA).
#pragma once

#include "params.h"

namespace msda {

template <typename T> struct Tag { using type = T; };

// Calls f(Tag<T>{}) for one tensor's dtype t.
template <typename Half, typename BFloat16, typename F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: f(Tag<float>{}); break;
    case DType::f64: f(Tag<double>{}); break;
    case DType::f16: f(Tag<Half>{}); break;
    case DType::bf16: f(Tag<BFloat16>{}); break;
  }
}

// Calls f(Tag<T>{}, Tag<LT>{}) for the (value, location) dtype pair of pb:
// locations and weights in value's dtype, or float32.
template <typename Half, typename BFloat16, typename F>
void dispatch_dtypes(const Problem& pb, F&& f) {
  dispatch_dtype<Half, BFloat16>(pb.value_dtype, [&](auto t) {
    if (pb.loc_dtype == DType::f32) {
      f(t, Tag<float>{});
    } else {
      f(t, t);
    }
  });
}

}  // namespace msda
