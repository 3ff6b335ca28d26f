"""Prints, one per line, what a build against this Python's torch needs (cmake/TorchOfPython.cmake):
its version, the folder of its CMake config, the folder of its libraries, the CUDA it was built
with (empty for a CPU build) and the folder scripts are installed into ("bin/" of a venv).
Exits 3 where this Python has no torch."""
import os
import sys
import sysconfig

try:
    import torch
    import torch.utils
except ImportError:
    sys.exit(3)

print(torch.__version__)
print(torch.utils.cmake_prefix_path)
print(os.path.join(os.path.dirname(torch.__file__), "lib"))
print(torch.version.cuda or "")
print(sysconfig.get_path("scripts"))
