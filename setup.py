"""Build of the ms_deform_attn extension.

The CUDA sources are compiled when torch has CUDA and nvcc is found, or when
FORCE_CUDA=1; otherwise a CPU-only extension is built. With FORCE_CUDA=1, no
visible GPU and TORCH_CUDA_ARCH_LIST unset, the architectures default to
DEFAULT_ARCHS below instead of torch's guess. MAX_JOBS is honoured (ninja).
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


_find_cuda_home()
_pick_cxx()

from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402
import torch  # noqa: E402

# Ampere, Ada and Hopper (9.0a: the Hopper-only backends need it).
DEFAULT_ARCHS = "8.0;8.9;9.0a"

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda():
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True
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


def extension():
    rel = lambda pattern: sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    sources = rel("csrc/*.cpp") + rel("csrc/cpu/*.cpp")
    cxx = ["-O3"]
    debug = os.environ.get("MSDA_DEBUG", "0") == "1"
    if debug:
        cxx = ["-O0", "-g"]
    if not want_cuda():
        return CppExtension("ms_deform_attn._C", sources, extra_compile_args={"cxx": cxx},
                            py_limited_api=False)
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    if os.environ.get("MSDA_PTXAS_VERBOSE", "0") == "1":
        nvcc.append("-Xptxas=-v")
    sources += rel("csrc/cuda/*.cpp") + rel("csrc/cuda/*.cu")
    return CUDAExtension("ms_deform_attn._C", sources, include_dirs=library_header_dirs(),
                         extra_compile_args={"cxx": cxx, "nvcc": nvcc})


setup(
    name="ms_deform_attn",
    version="0.1.0",
    description="Multi-Scale Deformable Attention for PyTorch: one operator, CPU and CUDA kernels",
    packages=find_packages(include=["ms_deform_attn", "ms_deform_attn.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    zip_safe=False,
)
