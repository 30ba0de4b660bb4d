# CMake package of ms_deform_attn, installed inside the Python package.
#
#   find_package(ms_deform_attn REQUIRED)
#   target_link_libraries(my_program PRIVATE ms_deform_attn::ms_deform_attn)
#
# Point CMAKE_PREFIX_PATH at `python -m ms_deform_attn --cmake-prefix-path`
# (which also names the torch the library was built against: Torch is found
# as a dependency). The imported target carries the public header
# (ms_deform_attn/ms_deform_attn.h) and links LibTorch.
include(CMakeFindDependencyMacro)
find_dependency(Torch)

get_filename_component(_msda_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
set(_msda_library "${_msda_prefix}/lib/libms_deform_attn.so")
if(NOT EXISTS "${_msda_library}")
  set(ms_deform_attn_FOUND FALSE)
  set(ms_deform_attn_NOT_FOUND_MESSAGE
      "${_msda_library} is missing: build the package first (pip install --no-build-isolation .)")
  return()
endif()

if(NOT TARGET ms_deform_attn::ms_deform_attn)
  add_library(ms_deform_attn::ms_deform_attn SHARED IMPORTED)
  set_target_properties(ms_deform_attn::ms_deform_attn PROPERTIES
    IMPORTED_LOCATION "${_msda_library}"
    IMPORTED_SONAME "libms_deform_attn.so"
    INTERFACE_INCLUDE_DIRECTORIES "${_msda_prefix}/include"
    INTERFACE_LINK_LIBRARIES "${TORCH_LIBRARIES}"
    INTERFACE_COMPILE_OPTIONS "${TORCH_CXX_FLAGS}")
endif()
set(ms_deform_attn_LIBRARY "${_msda_library}")
unset(_msda_library)
unset(_msda_prefix)
