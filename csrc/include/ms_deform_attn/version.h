// The version of ms_deform_attn: of these headers (MS_DEFORM_ATTN_VERSION)
// and of the operator library loaded at run time. No torch here: the
// operator library (on LibTorch's stable ABI) includes it too.
#pragma once

#if defined(_WIN32)
#define MS_DEFORM_ATTN_API
#else
#define MS_DEFORM_ATTN_API __attribute__((visibility("default")))
#endif

#define MS_DEFORM_ATTN_VERSION "0.1.0"

// The version of the library loaded at run time (MS_DEFORM_ATTN_VERSION of
// the build that made it).
extern "C" MS_DEFORM_ATTN_API const char* ms_deform_attn_library_version(void);
