// The Python extension module ms_deform_attn._C: empty. Importing it loads
// the library it links (lib/libms_deform_attn.so, the operator library on
// LibTorch's stable ABI; no Python dependency), whose static initialisers
// register the operator; the package then loads the autograd layer for its
// torch release (ms_deform_attn/_layer.py). The call below makes the link
// real (linkers drop unused libraries).
#include <Python.h>

extern "C" const char* ms_deform_attn_library_version(void);

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr &&
      PyModule_AddStringConstant(module, "library_version", ms_deform_attn_library_version()) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
