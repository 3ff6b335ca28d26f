"""`python -m actorpipe ARGS`: the `actorpipe` program (docs/cli.md) of this installation.

In a build tree the program is build/cli/actorpipe beside build/python; `pip install .` puts it
into the environment's bin/ (listed in the package's RECORD). The process becomes the
program (exec), so its exit code and signals are the program's own.
"""
import os
import sys
from importlib import metadata


def program():
    """The path of the `actorpipe` program that belongs to this package."""
    here = os.path.dirname(os.path.abspath(__file__))
    built = os.path.normpath(os.path.join(here, "..", "..", "cli", "actorpipe"))
    if os.path.isfile(built) and os.access(built, os.X_OK):
        return built
    try:
        for f in metadata.distribution("actorpipe").files or []:
            if f.name == "actorpipe" and f.parent.name in ("bin", "scripts"):
                path = f.locate()
                if os.path.isfile(path) and os.access(path, os.X_OK):
                    return str(path)
    except metadata.PackageNotFoundError:
        pass
    raise SystemExit("actorpipe: the program is neither installed with this package (pip install "
                     f".) nor beside its build tree ({built})")


def main():
    path = program()
    os.execv(path, [path, *sys.argv[1:]])


if __name__ == "__main__":
    main()
