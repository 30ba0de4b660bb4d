# CMake package of ms_deform_attn, installed inside the Python package.
#
#   find_package(ms_deform_attn REQUIRED)
#   target_link_libraries(my_program PRIVATE ms_deform_attn::ms_deform_attn)
#
# Point CMAKE_PREFIX_PATH at `python -m ms_deform_attn --cmake-prefix-path`
# (which also names the torch the library was built against: Torch is found
# as a dependency, with the CUDA toolkit it needs located below). The target
# carries the public header (ms_deform_attn/ms_deform_attn.h), links the
# operator library (lib/libms_deform_attn.so: kernels, schemas, queries) and
# LibTorch, and the version-bound layer over it: autograd, autocast and the
# C++ API, built here from the package's sources
# (share/ms_deform_attn/src) against the LibTorch the program uses, as the
# shared library ms_deform_attn_torch of the program's own build.
include(CMakeFindDependencyMacro)

# A CUDA build of torch makes find_package(Torch) look for the CUDA toolkit
# (FindCUDA from the nvcc on the PATH, then libnvrtc). Where nvcc is a
# wrapper script or the toolkit lacks libnvrtc (torch's CUDA wheels carry
# it), that search fails; unless the caller set them, name the toolkit and
# the libnvrtc found here, so that the plain find_package works.
set(_msda_torch_root "")
foreach(_msda_p IN LISTS Torch_DIR CMAKE_PREFIX_PATH)
  if(NOT _msda_torch_root AND EXISTS "${_msda_p}/Torch/TorchConfig.cmake")
    get_filename_component(_msda_torch_root "${_msda_p}/../.." ABSOLUTE)
  elseif(NOT _msda_torch_root AND EXISTS "${_msda_p}/TorchConfig.cmake")
    get_filename_component(_msda_torch_root "${_msda_p}/../../.." ABSOLUTE)
  endif()
endforeach()
if(_msda_torch_root AND EXISTS "${_msda_torch_root}/lib/libtorch_cuda.so")
  if(NOT DEFINED CUDA_TOOLKIT_ROOT_DIR AND NOT DEFINED CUDAToolkit_ROOT)
    set(_msda_cuda "")
    find_program(_msda_nvcc nvcc)
    set(_msda_candidates "$ENV{CUDA_HOME}" "$ENV{CUDA_PATH}")
    if(_msda_nvcc)
      get_filename_component(_msda_nvcc_real "${_msda_nvcc}" REALPATH)
      get_filename_component(_msda_nvcc_root "${_msda_nvcc_real}/../.." ABSOLUTE)
      list(APPEND _msda_candidates "${_msda_nvcc_root}")
      # A wrapper script's target: "exec /path/to/bin/nvcc ..."
      file(STRINGS "${_msda_nvcc_real}" _msda_exec REGEX "^exec .*/bin/nvcc" LIMIT_COUNT 1 LIMIT_INPUT 4096)
      if(_msda_exec MATCHES "^exec +([^ ]+)/bin/nvcc")
        list(APPEND _msda_candidates "${CMAKE_MATCH_1}")
      endif()
    endif()
    list(APPEND _msda_candidates "/usr/local/cuda")
    foreach(_msda_c IN LISTS _msda_candidates)
      if(NOT _msda_cuda AND _msda_c AND EXISTS "${_msda_c}/include/cuda_runtime_api.h"
         AND EXISTS "${_msda_c}/bin/nvcc")
        set(_msda_cuda "${_msda_c}")
      endif()
    endforeach()
    if(NOT _msda_cuda)
      message(FATAL_ERROR
        "ms_deform_attn: the torch at ${_msda_torch_root} is a CUDA build, and find_package(Torch) "
        "then needs the CUDA toolkit (nvcc and its headers), which was not found (CUDA_HOME, "
        "CUDA_PATH, nvcc on the PATH, /usr/local/cuda). Install the toolkit matching "
        "torch.version.cuda, or pass -DCUDAToolkit_ROOT=<its directory>.")
    endif()
    set(CUDA_TOOLKIT_ROOT_DIR "${_msda_cuda}")
    set(CUDAToolkit_ROOT "${_msda_cuda}")
    if(NOT DEFINED CMAKE_CUDA_COMPILER)
      set(CMAKE_CUDA_COMPILER "${_msda_cuda}/bin/nvcc")
    endif()
  endif()
  if(NOT DEFINED CUDA_nvrtc_LIBRARY)
    set(_msda_root "${CUDAToolkit_ROOT}")
    if(NOT _msda_root)
      set(_msda_root "${CUDA_TOOLKIT_ROOT_DIR}")
    endif()
    file(GLOB _msda_nvrtc "${_msda_root}/lib64/libnvrtc.so" "${_msda_root}/lib/libnvrtc.so"
                          "${_msda_root}/lib64/libnvrtc.so.*" "${_msda_root}/lib/libnvrtc.so.*"
                          "${_msda_torch_root}/../nvidia/*/lib/libnvrtc.so.*")
    list(FILTER _msda_nvrtc EXCLUDE REGEX "alt|builtins")
    if(_msda_nvrtc)
      list(GET _msda_nvrtc 0 _msda_nvrtc)
      set(CUDA_nvrtc_LIBRARY "${_msda_nvrtc}" CACHE FILEPATH "libnvrtc for find_package(Torch)")
    endif()
  endif()
endif()
find_dependency(Torch)

get_filename_component(_msda_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
set(_msda_library "${_msda_prefix}/lib/libms_deform_attn.so")
if(NOT EXISTS "${_msda_library}")
  set(ms_deform_attn_FOUND FALSE)
  set(ms_deform_attn_NOT_FOUND_MESSAGE
      "${_msda_library} is missing: build the package first (pip install --no-build-isolation .)")
  return()
endif()

# LibTorch's libraries as the program's own dependencies, found through its
# run path: the library's run path reaches torch only where torch is
# installed beside this package (site-packages), and a program's run path
# does not serve its libraries' dependencies. libc10_cuda is one of the
# library's that TORCH_LIBRARIES does not name.
set(_msda_link "${TORCH_LIBRARIES}")
if(EXISTS "${TORCH_INSTALL_PREFIX}/lib/libc10_cuda.so")
  list(APPEND _msda_link "-Wl,--no-as-needed,${TORCH_INSTALL_PREFIX}/lib/libc10_cuda.so" "-Wl,--as-needed")
endif()
if(NOT TARGET ms_deform_attn::operators)
  add_library(ms_deform_attn::operators SHARED IMPORTED)
  set_target_properties(ms_deform_attn::operators PROPERTIES
    IMPORTED_LOCATION "${_msda_library}"
    IMPORTED_SONAME "libms_deform_attn.so"
    INTERFACE_INCLUDE_DIRECTORIES "${_msda_prefix}/include"
    INTERFACE_LINK_LIBRARIES "${_msda_link}"
    INTERFACE_COMPILE_OPTIONS "${TORCH_CXX_FLAGS}")
endif()
# The version-bound layer: its sources in the installed package, or in the
# checkout for an in-place build.
set(_msda_layer_dir "${_msda_prefix}/share/ms_deform_attn/src")
file(GLOB _msda_layer_sources "${_msda_layer_dir}/*.cpp")
if(NOT _msda_layer_sources)
  set(ms_deform_attn_FOUND FALSE)
  set(ms_deform_attn_NOT_FOUND_MESSAGE "${_msda_layer_dir} holds no sources: reinstall the package")
  return()
endif()
if(NOT TARGET ms_deform_attn_torch)
  add_library(ms_deform_attn_torch SHARED ${_msda_layer_sources})
  target_include_directories(ms_deform_attn_torch PRIVATE "${_msda_layer_dir}")
  target_link_libraries(ms_deform_attn_torch PUBLIC ms_deform_attn::operators)
  # The C++ standard the LibTorch found asks for (TorchConfig.cmake sets it on
  # its torch target: 20 in recent releases), else 17.
  set(_msda_std 17)
  if(TARGET torch)
    get_target_property(_msda_torch_std torch CXX_STANDARD)
    if(_msda_torch_std)
      set(_msda_std ${_msda_torch_std})
    endif()
  endif()
  set_target_properties(ms_deform_attn_torch PROPERTIES CXX_STANDARD ${_msda_std}
                                                        CXX_STANDARD_REQUIRED ON)
endif()
if(NOT TARGET ms_deform_attn::ms_deform_attn)
  add_library(ms_deform_attn::ms_deform_attn INTERFACE IMPORTED)
  # Linked even where the program calls none of its functions: its static
  # initialisers register the autograd and autocast kernels.
  set_target_properties(ms_deform_attn::ms_deform_attn PROPERTIES
    INTERFACE_LINK_LIBRARIES
      "ms_deform_attn_torch;-Wl,--no-as-needed,$<TARGET_FILE:ms_deform_attn_torch>;-Wl,--as-needed;ms_deform_attn::operators")
endif()
set(ms_deform_attn_LIBRARY "${_msda_library}")
unset(_msda_library)
unset(_msda_link)
unset(_msda_prefix)
unset(_msda_layer_dir)
unset(_msda_layer_sources)
unset(_msda_std)
unset(_msda_torch_std)
