# Test setup: every output the operator allocates is filled with NaN before a
# kernel runs, so an element a kernel leaves unwritten fails the comparison.
import os

os.environ.setdefault("MS_DEFORM_ATTN_POISON", "1")

# MSDA_EXPECT_INSTALLED=1 (the wheel tests: .ci/run, scripts/gpu_check.sh
# stage wheel): the package under test must be an installed one, not a
# source checkout's ms_deform_attn/ found first on sys.path.
if os.environ.get("MSDA_EXPECT_INSTALLED") == "1":
    import ms_deform_attn

    _root = os.path.dirname(os.path.dirname(os.path.abspath(ms_deform_attn.__file__)))
    if os.path.exists(os.path.join(_root, "setup.py")):
        raise RuntimeError(f"MSDA_EXPECT_INSTALLED=1, but ms_deform_attn was imported from the "
                           f"source checkout {_root}; run the tests from outside it")
    print(f"conftest: testing the installed ms_deform_attn at {os.path.dirname(ms_deform_attn.__file__)}")
