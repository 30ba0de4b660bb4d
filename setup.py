"""Build of ms_deform_attn: the operator library and its Python module.

Three shared objects, all inside the package:
  ms_deform_attn/lib/libms_deform_attn.so  the operator library (schemas,
      queries, validation, CPU and CUDA kernels) on LibTorch's stable ABI
      only: it loads into the torch release STABLE_TARGET below and every
      later one; no Python;
  ms_deform_attn/lib/torch<major>_<minor>/libms_deform_attn_torch.so  the
      version-bound layer over it (autograd, autocast, the public C++ API)
      for the torch of this build, from the sources in csrc/layer, which the
      build copies into the package (share/ms_deform_attn/src, beside the
      public headers of csrc/include in include/) for the CMake package to
      build into C++ programs instead (share/cmake). Under another torch release
      the package registers autograd and autocast from Python instead
      (ms_deform_attn/_layer.py);
  ms_deform_attn/_C...so  the Python extension module: empty, links the
      library (rpath $ORIGIN/lib), so that importing it registers the
      operator.
The CUDA sources are compiled when torch has CUDA and nvcc is found, or when
FORCE_CUDA=1; otherwise the library is CPU-only. With FORCE_CUDA=1, no
visible GPU and TORCH_CUDA_ARCH_LIST unset, the architectures default to
DEFAULT_ARCHS below instead of torch's guess. MAX_JOBS is honoured (ninja).
The CPU kernels run on torch's intra-op threads (its parallel_for).
Metadata and the optional extras are in pyproject.toml; the distribution is
named torch-msda (ms-deform-attn on PyPI is another project), the import
name is ms_deform_attn.
"""
import glob
import os
import shutil


def _find_cuda_home():
    """torch guesses CUDA_HOME from `which nvcc`; a wrapper script on the PATH
    (as /usr/local/bin/nvcc here) makes that guess wrong. Prefer a directory
    that really holds the toolkit's headers."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
            os.environ["CUDA_HOME"] = home
            return


def _shared_libstdcxx(cxx):
    """Whether `cxx` links libstdc++ dynamically into a shared object. A
    compiler that links it statically (seen: a g++ wrapper on a GPU image)
    puts a second C++ runtime into the process next to PyTorch's, which crashes
    in the first formatted error message. None when it cannot be told."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "t.cpp"), os.path.join(tmp, "t.so")
        with open(src, "w") as f:
            f.write("#include <sstream>\nstd::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n")
        try:
            subprocess.run([cxx, "-shared", "-fPIC", src, "-o", lib], check=True, timeout=120,
                           capture_output=True)
            dyn = subprocess.run(["readelf", "-d", lib], check=True, timeout=30,
                                 capture_output=True, text=True).stdout
        except Exception:
            return None
    return "libstdc++.so" in dyn


def _pick_cxx():
    cxx = os.environ.get("CXX")
    if not cxx or not os.path.exists("/usr/bin/g++"):
        return
    if os.path.realpath(shutil.which(cxx) or cxx) == os.path.realpath("/usr/bin/g++"):
        return
    if _shared_libstdcxx(cxx) is False:
        print(f"setup.py: CXX={cxx} links libstdc++ statically into shared objects; "
              "building with /usr/bin/g++ instead")
        os.environ["CXX"] = "/usr/bin/g++"


def _check_wheel_support():
    """pip builds a wheel (bdist_wheel) even for a plain install: a setuptools
    older than 70.1 without the `wheel` package stops there with "invalid
    command 'bdist_wheel'", after nothing tells what to install. Say it
    before compiling anything."""
    import sys

    if "bdist_wheel" not in sys.argv:
        return
    try:
        from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401  (setuptools >= 70.1)
        return
    except ImportError:
        pass
    try:
        import wheel.bdist_wheel  # noqa: F401  (the `wheel` package, for older setuptools)
        return
    except ImportError:
        pass
    import setuptools
    raise SystemExit(
        f"ms_deform_attn: building a wheel (what pip install does) needs setuptools 70.1 or newer, "
        f"or the `wheel` package beside an older one; this environment has setuptools "
        f"{setuptools.__version__} and no `wheel`. Install one of them, then build again:\n"
        "    pip install 'setuptools>=70.1'      # or: pip install wheel\n"
        "    pip install --no-build-isolation .")


_check_wheel_support()
_find_cuda_home()
_pick_cxx()

try:
    import torch  # noqa: E402
except ImportError:
    raise SystemExit(
        "ms_deform_attn compiles against the PyTorch it will run with, so torch must be "
        "installed first:\n    pip install torch\n    pip install --no-build-isolation .\n"
        "(--no-build-isolation lets the build see that torch; without it pip would build "
        "against a different copy.)")
from setuptools import Extension, find_namespace_packages, setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

# Ampere, Ada and Hopper (9.0a: the Hopper-only backends need it).
DEFAULT_ARCHS = "8.0;8.9;9.0a"

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda():
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True
    if torch.version.cuda is not None and CUDA_HOME is None:
        gpu = torch.cuda.is_available()
        bar = "!" * 78
        print(f"\n{bar}\nms_deform_attn: building CPU-ONLY: torch {torch.__version__} has CUDA "
              f"{torch.version.cuda}{' and a GPU is visible' if gpu else ''}, but no nvcc was found "
              "(neither CUDA_HOME nor nvcc on the PATH).\nThe CUDA kernels will be missing: CUDA "
              "tensors will raise an error. To build them, install the CUDA toolkit matching "
              f"torch.version.cuda ({torch.version.cuda}), put its nvcc on the PATH or set CUDA_HOME, "
              "and rebuild (FORCE_CUDA=1 builds them without a visible GPU).\n"
              f"{bar}\n", flush=True)
        return False
    if torch.version.cuda is not None and not torch.cuda.is_available():
        print("ms_deform_attn: building CPU-only: no GPU is visible (FORCE_CUDA=1 compiles the CUDA "
              "kernels without one; TORCH_CUDA_ARCH_LIST picks the architectures)", flush=True)
        return False
    return torch.cuda.is_available() and CUDA_HOME is not None


def library_header_dirs():
    """ATen's CUDA headers include cuSPARSE / cuBLAS headers. A minimal toolkit
    (nvcc and the runtime only) lacks them; the CUDA wheels torch depends on
    carry them under site-packages/nvidia/*/include. Used only when the
    toolkit has none."""
    home = os.environ.get("CUDA_HOME") or CUDA_HOME or ""
    if os.path.exists(os.path.join(home, "include", "cusparse.h")):
        return []
    try:
        import nvidia  # namespace package of the CUDA wheels
    except ImportError:
        return []
    found = set()
    for base in nvidia.__path__:
        found.update(os.path.dirname(h) for h in glob.glob(os.path.join(base, "*", "include", "cusparse.h")))
    return sorted(found)


# The oldest torch whose stable ABI the operator library is built for
# (TORCH_TARGET_VERSION): 2.10 brought the stable strings, lists and devices
# its schemas use.
STABLE_TARGET = (2, 10)
STABLE_TARGET_HEX = "0x%02x%02x000000000000" % STABLE_TARGET
LIB = "ms_deform_attn.lib.libms_deform_attn"  # built as ms_deform_attn/lib/libms_deform_attn.so
# ms_deform_attn/lib/torch<major>_<minor>/libms_deform_attn_torch.so
TORCH_RELEASE = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
LAYER = "ms_deform_attn.lib.torch%d_%d.libms_deform_attn_torch" % TORCH_RELEASE
LAYER_SOURCES = os.path.join("csrc", "layer")
PUBLIC_HEADERS = os.path.join(ROOT, "csrc", "include")  # ms_deform_attn/*.h
GENERATED = os.path.join(ROOT, "build", "generated")  # ms_deform_attn_build.h
# Where the package carries the C++ sources for C++ programs (its CMake
# package builds the layer from them): copies of csrc/'s, made by the build.
PACKAGED_SOURCES = {
    os.path.join(PUBLIC_HEADERS, "ms_deform_attn"): os.path.join(ROOT, "ms_deform_attn", "include",
                                                                 "ms_deform_attn"),
    os.path.join(ROOT, LAYER_SOURCES): os.path.join(ROOT, "ms_deform_attn", "share", "ms_deform_attn",
                                                    "src"),
}


def torch_requirement():
    """The torch requirement of what is built here: the operator library's
    stable ABI target and every release after it (each gets the C++ layer
    if it is the build's own release, the Python one otherwise)."""
    return "torch>=%d.%d" % STABLE_TARGET


def write_build_info(cuda: bool):
    """What the build was made against, for the checks at import
    (ms_deform_attn/_build_info.py: torch and CUDA versions) and at the first
    CUDA call (ms_deform_attn_build.h: the architectures)."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if cuda else ""
    os.makedirs(GENERATED, exist_ok=True)
    header = ("// Written by setup.py.\n#pragma once\n"
              f"#define MSDA_CUDA_ARCHS \"{archs}\"\n")
    info = ('"""Written by setup.py: what this build of ms_deform_attn was compiled against."""\n'
            f"TORCH_VERSION = {torch.__version__!r}\n"
            f"CUDA_VERSION = {(torch.version.cuda if cuda else None)!r}\n"
            f"CUDA_ARCHS = {archs!r}\n"
            f"# The oldest torch the operator library loads into (its stable ABI target).\n"
            f"STABLE_TARGET = {'%d.%d' % STABLE_TARGET!r}\n")
    for path, text in ((os.path.join(GENERATED, "ms_deform_attn_build.h"), header),
                       (os.path.join(ROOT, "ms_deform_attn", "_build_info.py"), info)):
        if not os.path.exists(path) or open(path).read() != text:  # keep ninja's timestamps
            with open(path, "w") as f:
                f.write(text)


def package_cpp_sources():
    """Copies the public headers and the layer's sources from csrc/ into the
    package (PACKAGED_SOURCES), where the CMake package and the wheel find
    them; a copy that is already the same is left alone (its timestamp too)."""
    for src, dst in PACKAGED_SOURCES.items():
        os.makedirs(dst, exist_ok=True)
        names = set(os.listdir(src))
        for stale in set(os.listdir(dst)) - names:
            os.remove(os.path.join(dst, stale))
        for name in sorted(names):
            a, b = os.path.join(src, name), os.path.join(dst, name)
            with open(a, "rb") as f:
                text = f.read()
            if not os.path.exists(b) or open(b, "rb").read() != text:
                with open(b, "wb") as f:
                    f.write(text)


def torch_rpath():
    """The run path to LibTorch's libraries (libc10, libtorch_cpu, ...): the
    torch package beside this one (site-packages/torch/lib), or where the
    torch it was built with lives. A C++ program's own run path does not
    reach its libraries' dependencies."""
    torch_lib = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "lib")
    return "-Wl,-rpath,$ORIGIN/../../torch/lib:" + torch_lib


def library():
    rel = lambda pattern: sorted(os.path.relpath(p, ROOT)
                                 for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))
    # csrc/ by role: binding (torch's vocabulary, registration), operator
    # (schemas, validation, queries), composite (the fused operator's), plan
    # (the policies), cpu; cuda/ below; core/ holds headers only.
    sources = [p for d in ("binding", "operator", "composite", "plan", "cpu")
               for p in rel(f"csrc/{d}/*.cpp")]
    # LibTorch's stable ABI only (csrc/binding/tensor.h), as of the oldest release it
    # serves: the library loads into that torch and every later one.
    # Hidden visibility, as torch's stable headers declare their types: the
    # library exports what library_kernels.h marks MSDA_LIBRARY_API.
    # No FMA contraction on the host (GCC's default contracts where the target
    # has FMA, as aarch64 does): pixel coordinates are rounded as PyTorch
    # rounds them (csrc/core/sampling.h, pixel_coord).
    opt = ["-O0", "-g"] if os.environ.get("MSDA_DEBUG", "0") == "1" else ["-O3"]
    cxx = opt + [f"-DTORCH_TARGET_VERSION={STABLE_TARGET_HEX}", "-fvisibility=hidden",
                 "-fvisibility-inlines-hidden", "-ffp-contract=off"]
    # LibTorch's libraries (libc10_cuda, ...) are found next to the torch
    # package beside this one (site-packages/torch/lib), or where the torch
    # it was built with lives: a C++ program's own run path does not reach
    # this library's dependencies.
    link = ["-Wl,-soname,libms_deform_attn.so", torch_rpath()]
    include_dirs = [PUBLIC_HEADERS, GENERATED]
    cuda = want_cuda()
    if cuda and not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
    write_build_info(cuda)
    package_cpp_sources()
    if not cuda:
        ext = CppExtension(LIB, sources, include_dirs=include_dirs, extra_link_args=link,
                           extra_compile_args={"cxx": cxx})
    else:
        # MSDA_WITH_CUDA: cpu_only.cpp and the build query know; USE_CUDA:
        # the stable ABI's CUDA stream query (cuda/host.h).
        cxx += ["-DMSDA_WITH_CUDA", "-DUSE_CUDA"]
        nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", "-DMSDA_WITH_CUDA",
                f"-DTORCH_TARGET_VERSION={STABLE_TARGET_HEX}", "-Xcompiler=-fvisibility=hidden"]
        if os.environ.get("MSDA_PTXAS_VERBOSE", "0") == "1":
            nvcc.append("-Xptxas=-v")
        sources += rel("csrc/cuda/**/*.cpp") + rel("csrc/cuda/**/*.cu")
        ext = CUDAExtension(LIB, sources, include_dirs=include_dirs + library_header_dirs(),
                            extra_link_args=link, extra_compile_args={"cxx": cxx, "nvcc": nvcc})
    # No Python: LibTorch programs load this library without an interpreter.
    ext.libraries = [lib for lib in ext.libraries if lib != "torch_python"]
    return ext


def torch_layer():
    """The version-bound layer over the library for this build's torch:
    plain C++ against LibTorch (no CUDA, no Python), linking the library
    (rpath $ORIGIN/..)."""
    ext = CppExtension(LAYER, sorted(os.path.relpath(p, ROOT) for p in
                                     glob.glob(os.path.join(ROOT, LAYER_SOURCES, "*.cpp"))),
                       include_dirs=[PUBLIC_HEADERS],
                       libraries=["ms_deform_attn"],
                       extra_link_args=["-Wl,-soname,libms_deform_attn_torch.so",
                                        "-Wl,--no-as-needed", "-Wl,-rpath,$ORIGIN/..",
                                        torch_rpath()],
                       extra_compile_args={"cxx": ["-O2", "-g0"]})
    ext.libraries = [lib for lib in ext.libraries if lib != "torch_python"]
    return ext


def python_module():
    # Plain (no torch libraries): all it does is load the library (the
    # package loads the layer, _layer.py). Python's limited API (3.9 on): one
    # build serves every Python (an abi3 module).
    return Extension("ms_deform_attn._C", ["csrc/python/module.cpp"],
                     libraries=["ms_deform_attn"],
                     extra_link_args=["-Wl,-rpath,$ORIGIN/lib"], language="c++",
                     define_macros=[("Py_LIMITED_API", "0x03090000")], py_limited_api=True)


class Build(BuildExtension):
    """The library gets a plain name (libms_deform_attn.so, not a Python
    module's), and the module links it from where it was just built."""

    def get_ext_filename(self, fullname):
        name = super().get_ext_filename(fullname)
        for lib in (LIB, LAYER):  # called with the full name and with its last part
            if fullname.split(".")[-1] == lib.split(".")[-1]:
                return os.path.join(os.path.dirname(name), lib.split(".")[-1] + ".so")
        return name

    def run(self):
        # An in-place build copies the libraries into ms_deform_attn/lib/ and
        # lib/torch<major>_<minor>/ (not packages).
        if self.inplace:
            os.makedirs(os.path.join(ROOT, *LAYER.split(".")[:-1]), exist_ok=True)
        # The layer of another torch release, left by an earlier build in
        # build/ (or in place), was built from other sources: it goes, so that
        # a wheel carries only this build's.
        ours = LAYER.split(".")[-2]
        for base in (self.build_lib,) + ((ROOT,) if self.inplace else ()):
            for old in glob.glob(os.path.join(base, "ms_deform_attn", "lib", "torch*_*")):
                if os.path.basename(old) != ours:
                    shutil.rmtree(old, ignore_errors=True)
        super().run()

    def build_extension(self, ext):
        os.makedirs(os.path.dirname(self.get_ext_fullpath(ext.name)), exist_ok=True)
        if ext.name in ("ms_deform_attn._C", LAYER):
            ext.library_dirs = list(ext.library_dirs) + [os.path.dirname(self.get_ext_fullpath(LIB))]
        super().build_extension(ext)


setup(
    # The header and CMake folders are data, listed as (namespace) packages so
    # that setuptools ships them without warning.
    packages=find_namespace_packages(include=["ms_deform_attn", "ms_deform_attn.*"],
                                     exclude=["ms_deform_attn.lib", "ms_deform_attn.lib.*", "ms_deform_attn.__pycache__"]),
    package_data={"ms_deform_attn": ["include/ms_deform_attn/*.h", "share/cmake/ms_deform_attn/*.cmake",
                                      "share/ms_deform_attn/src/*"]},
    ext_modules=[library(), torch_layer(), python_module()],
    install_requires=[torch_requirement()],
    cmdclass={"build_ext": Build.with_options(use_ninja=True)},
    # The wheel's Python module uses the limited API; its library no Python.
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    zip_safe=False,
)
