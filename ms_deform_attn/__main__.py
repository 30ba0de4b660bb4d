"""python -m ms_deform_attn --cmake-prefix-path: the CMAKE_PREFIX_PATH that
finds this package's CMake package (ms_deform_attn::ms_deform_attn) and the
torch it was built against, ';'-separated; --include / --library: where the
public header and the shared library are."""
import argparse
import os

from . import cmake_prefix_path, include_path, library_path


def main():
    ap = argparse.ArgumentParser(prog="python -m ms_deform_attn", description=__doc__)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--cmake-prefix-path", action="store_true")
    g.add_argument("--include", action="store_true")
    g.add_argument("--library", action="store_true")
    args = ap.parse_args()
    if args.cmake_prefix_path:
        import torch.utils

        print(";".join([cmake_prefix_path, torch.utils.cmake_prefix_path]))
    elif args.include:
        print(include_path)
    else:
        print(library_path)


if __name__ == "__main__":
    main()
