// The Python extension module ms_deform_attn._C: empty. Importing it loads
// the libraries it links (lib/libms_deform_attn_torch.so, the version-bound
// layer: autograd, autocast; and under it lib/libms_deform_attn.so, the
// operator library; no Python dependency), whose static initialisers
// register the operator. The calls below make the links real (linkers drop
// unused libraries).
#include <Python.h>

extern "C" const char* ms_deform_attn_library_version(void);
extern "C" const char* ms_deform_attn_torch_layer_built_for(void);

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr &&
      (PyModule_AddStringConstant(module, "library_version", ms_deform_attn_library_version()) != 0 ||
       PyModule_AddStringConstant(module, "torch_layer_built_for",
                                  ms_deform_attn_torch_layer_built_for()) != 0)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
