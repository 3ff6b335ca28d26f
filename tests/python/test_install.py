"""The package as installed (docs/install.md): what it says it was built against, its refusal of
another torch before the extension loads, and `python -m actorpipe` as the program of this
installation. On the PyTorch 2.x lines CTest runs it against what `pip install .` installed."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import torch

import actorpipe
from actorpipe import __main__ as program_entry


class InstallTest(unittest.TestCase):
    def test_build_info_names_this_torch(self):
        info = actorpipe.build_info
        # Debian's torch says 1.13.0a0 where its CMake config says 1.13.0; wheels add +cu130.
        self.assertTrue(torch.__version__.startswith(info["torch"].split("+")[0]),
                        f"{info['torch']} against {torch.__version__}")
        self.assertEqual(info["cuda"], actorpipe.has_cuda)
        # A reason is given exactly where a CUDA torch got the CPU engine.
        if info["cuda_reason"]:
            self.assertFalse(info["cuda"])

    def test_import_refuses_another_torch_naming_both_and_the_rebuild(self):
        with tempfile.TemporaryDirectory() as d:
            package = os.path.join(d, "actorpipe")
            shutil.copytree(os.path.dirname(actorpipe.__file__), package)
            with open(os.path.join(package, "_build_info.py"), "a") as f:
                f.write('\ntorch_version = "2.0.0"\n')
            run = subprocess.run([sys.executable, "-c", "import actorpipe"], capture_output=True,
                                 text=True, env={**os.environ, "PYTHONPATH": d}, timeout=120)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("actorpipe was built against torch 2.0.0, and this Python's torch is "
                      f"{torch.__version__}", run.stderr)
        self.assertRegex(run.stderr, r"rebuild it for this torch with `(pip install "
                                     r"--force-reinstall --no-deps|cmake -S) ")

    @unittest.skipUnless(os.environ.get("ACTORPIPE_CLI"), "needs ACTORPIPE_CLI (the program)")
    def test_python_m_actorpipe_is_the_program_of_this_installation(self):
        self.assertEqual(os.path.realpath(program_entry.program()),
                         os.path.realpath(os.environ["ACTORPIPE_CLI"]))
        run = subprocess.run([sys.executable, "-m", "actorpipe", "--version"],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertRegex(run.stdout, r"^actorpipe \d+\.\d+\.\d+")
        # Its exit code is the program's own: a flag it does not know.
        run = subprocess.run([sys.executable, "-m", "actorpipe", "train", "--no-such-flag"],
                             capture_output=True, text=True, timeout=120)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("no-such-flag", run.stdout + run.stderr)


if __name__ == "__main__":
    unittest.main()
