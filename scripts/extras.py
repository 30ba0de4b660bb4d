"""Prints the requirements of the named optional extras of pyproject.toml
([project.optional-dependencies]), one per line, for `pip install`:

    python scripts/extras.py test hf onnx
    python scripts/extras.py --lowest hf        # the lowest set each allows: transformers==5.13 ...
"""
import os
import sys


def load(path):
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            sys.exit("scripts/extras.py: needs Python 3.11+ or the tomli package")
    with open(path, "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def lowest(requirement: str) -> str:
    """`name==X` for a requirement bounded below by `>=X`: the oldest
    release it allows (CI installs that set beside the newest)."""
    name, sep, rest = requirement.partition(">=")
    if not sep:
        sys.exit(f"scripts/extras.py: {requirement!r} has no lower bound (>=) to install")
    return f"{name.strip()}=={rest.split(',')[0].strip()}"


def main(names):
    low = names[:1] == ["--lowest"]
    names = names[1:] if low else names
    extras = load(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"))
    unknown = [n for n in names if n not in extras]
    if unknown:
        sys.exit(f"scripts/extras.py: unknown extra(s) {unknown}; known: {sorted(extras)}")
    seen = []
    for n in names:
        seen += [r for r in extras[n] if r not in seen]
    print("\n".join(lowest(r) for r in seen) if low else "\n".join(seen))


if __name__ == "__main__":
    main(sys.argv[1:])
