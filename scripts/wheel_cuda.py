"""Checks that this environment builds the CUDA-<major> wheel (`make wheel
CUDA=<major>`): torch built for that CUDA major and an nvcc of it. Names
what was found and what is needed, exits 1 otherwise.

    python scripts/wheel_cuda.py 12
    python scripts/wheel_cuda.py --can-build    # 1 where torch is a CUDA build and nvcc is found, else 0
"""
import re
import subprocess
import sys


def nvcc_version(cuda_home):
    """"13.0" of the nvcc torch's extension builder would use, or None."""
    if cuda_home is None:
        return None
    try:
        out = subprocess.run([f"{cuda_home}/bin/nvcc", "--version"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def can_build() -> bool:
    """Whether `make wheel` can compile the CUDA kernels here: torch is a
    CUDA build and its extension builder finds an nvcc of the same major."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = nvcc_version(CUDA_HOME)
    return (torch.version.cuda is not None and nvcc is not None
            and nvcc.split(".")[0] == torch.version.cuda.split(".")[0])


def main(argv):
    want = argv[1] if len(argv) > 1 else ""
    if want == "--can-build":
        print(int(can_build()))
        return
    if not want.isdigit():
        sys.exit(f"make wheel: CUDA must be a CUDA major version (12 or 13), got {want!r}")
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    problems = []
    if (torch.version.cuda or "").split(".")[0] != want:
        problems.append(
            f"torch {torch.__version__} is built for "
            f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'no CUDA'}; install a torch "
            f"built for CUDA {want}.x (its wheels at https://download.pytorch.org/whl/cu{want}<minor>)")
    nvcc = nvcc_version(CUDA_HOME)
    if nvcc is None or nvcc.split(".")[0] != want:
        found = f"nvcc {nvcc} at {CUDA_HOME}" if nvcc else "no nvcc (CUDA_HOME unset, none on the PATH)"
        problems.append(f"found {found}; put the CUDA {want}.x toolkit's nvcc on the PATH or set "
                        "CUDA_HOME to it")
    if problems:
        sys.exit(f"make wheel CUDA={want}: this environment does not build the CUDA {want} wheel:\n  "
                 + "\n  ".join(problems))
    print(f"make wheel CUDA={want}: torch {torch.__version__}, nvcc {nvcc} at {CUDA_HOME}")


if __name__ == "__main__":
    main(sys.argv)
