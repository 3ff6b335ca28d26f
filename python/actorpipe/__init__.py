"""actorpipe from Python: pipeline-parallel training of a PyTorch model on the C++ engine.

    import torch, actorpipe
    p = actorpipe.Pipeline(model, example=x, stages=2, microbatches=4, schedule="1f1b",
                           optimizer=("adamw", {"lr": 1e-3}), loss="cross_entropy")
    loss = p.train_step(x, y)          # a float; the stages compute without the GIL
    fut = p.train_step_async(x, y)     # a StepFuture: fut.result() is the loss
    out = p(x)                         # forward only
    model.load_state_dict(p.state_dict())   # the trained weights

On PyTorch 2.x the model is exported (torch.export) and its graph cut into segments; on 1.13 an
nn.Sequential is scripted and cut between its children. Each stage is an actor on a thread (and
device) of its own. docs/python.md has the rest.
"""
import os
import re
import sys
import warnings

try:
    import torch  # loads the libtorch that the extension below shares
except ImportError as e:  # pragma: no cover - depends on the Python it runs in
    raise ImportError(
        "actorpipe needs the PyTorch it was built against in this Python: `pip install torch` "
        "and `pip install .` in the checkout build it for yours; on Debian's line `apt-get install "
        "python3-torch` (PyTorch 1.13, the libtorch of actorpipe's default build); docs/install.md"
    ) from e

from . import _build_info
from ._errors import PipelineError


def _rebuild_command():
    if _build_info.pip:
        return f"pip install --force-reinstall --no-deps {_build_info.source_dir}"
    return f"cmake -S {_build_info.source_dir} -B build -DACTORPIPE_PYTHON={sys.executable}"


def _release(version):
    """"2.11.0" of "2.11.0+cu130", "1.13.0" of Debian's "1.13.0a0"."""
    return re.match(r"\d+(\.\d+)*", version).group(0)


# Checked before the extension loads: built for one libtorch, it may not load with another.
if _release(torch.__version__) != _release(_build_info.torch_version):
    raise ImportError(
        f"actorpipe was built against torch {_build_info.torch_version}, and this Python's torch "
        f"is {torch.__version__} ({os.path.dirname(torch.__file__)}): rebuild it for this torch "
        f"with `{_rebuild_command()}` (docs/install.md)"
    )

try:
    from . import _actorpipe
except ImportError as e:  # pragma: no cover - says which torch the module was built for
    raise ImportError(
        f"actorpipe's extension did not load with torch {torch.__version__} from "
        f"{os.path.dirname(torch.__file__)}: it is built for one libtorch and the Python whose "
        f"torch shares it; rebuild it with `{_rebuild_command()}` (docs/install.md) ({e})"
    ) from e

if _build_info.cuda_reason and torch.cuda.is_available():
    # Said once, where it matters: a GPU is here and this build cannot bind stages to it.
    warnings.warn(f"actorpipe was built without CUDA, so its stages run on CPU cores: "
                  f"{_build_info.cuda_reason} (docs/install.md)", stacklevel=2)

from ._pipeline import Pipeline, StepFuture  # noqa: E402

#: Replicas on the CPU (c10d's Gloo) and stages on GPUs: what this build of the engine has.
has_gloo = _actorpipe.has_gloo
has_cuda = _actorpipe.has_cuda
#: What this build is: the torch it was built against, whether stages can run on GPUs, and why
#: not where the torch is a CUDA build ("" otherwise).
build_info = {"torch": _build_info.torch_version, "cuda": has_cuda,
              "cuda_reason": _build_info.cuda_reason}
#: The ops Python libraries register (torch.library) that an exported program may call and that
#: the engine runs with C++ kernels and autograd formulas of its own, as "namespace::name".
library_ops = _actorpipe.library_ops

__all__ = ["Pipeline", "StepFuture", "PipelineError", "has_gloo", "has_cuda", "library_ops",
           "build_info"]
