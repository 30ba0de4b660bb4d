// The Python extension module ms_deform_attn._C: empty. Importing it loads
// the operator library it links (lib/libms_deform_attn.so, no Python
// dependency), whose static initialisers register the operator. The call
// below is what makes the link real (linkers drop unused libraries).
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
