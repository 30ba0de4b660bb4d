// The Python extension module ms_deform_attn._C. Importing it loads the
// library it links (lib/libms_deform_attn.so, the operator library on
// LibTorch's stable ABI; no Python dependency), whose static initialisers
// register the schemas; the package then loads the layer for its torch
// release (kernels, autograd, autocast) or, lacking one, calls
// register_boxed_kernels and registers autograd and autocast from Python
// (ms_deform_attn/_layer.py).
#include <Python.h>

extern "C" const char* ms_deform_attn_library_version(void);
extern "C" void ms_deform_attn_register_boxed_kernels(void);

namespace {

PyObject* register_boxed_kernels(PyObject*, PyObject*) {
  ms_deform_attn_register_boxed_kernels();
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"register_boxed_kernels", register_boxed_kernels, METH_NOARGS,
     "Registers the library's kernels through the stable ABI (boxed): for a process "
     "without the layer for its torch release."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr &&
      PyModule_AddStringConstant(module, "library_version", ms_deform_attn_library_version()) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
