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

try:
    import torch  # loads the libtorch that the extension below shares
except ImportError as e:  # pragma: no cover - depends on the Python it runs in
    raise ImportError(
        "actorpipe needs PyTorch in this Python: on Debian's line `apt-get install python3-torch` "
        "(PyTorch 1.13, the libtorch actorpipe's default build uses), or run Python from the "
        "2.x line's venv, .venv-torch/bin/python (./setup.sh build --torch pip); docs/python.md"
    ) from e

from ._errors import PipelineError

try:
    from . import _actorpipe
except ImportError as e:  # pragma: no cover - says which torch the module was built for
    raise ImportError(
        f"actorpipe's extension did not load with torch {torch.__version__} from "
        f"{os.path.dirname(torch.__file__)}: it is built for one libtorch and the Python whose "
        f"torch shares it (docs/python.md) ({e})"
    ) from e

if not torch.__version__.startswith(_actorpipe.torch_version.split("+")[0]):
    raise ImportError(
        f"actorpipe was built against libtorch {_actorpipe.torch_version}, but this Python's "
        f"torch is {torch.__version__}: build it with -DACTORPIPE_PYTHON=<the python of that "
        f"torch> (docs/python.md)"
    )

from ._pipeline import Pipeline, StepFuture  # noqa: E402

#: Replicas on the CPU (c10d's Gloo) and stages on GPUs: what this build of the engine has.
has_gloo = _actorpipe.has_gloo
has_cuda = _actorpipe.has_cuda
#: The ops Python libraries register (torch.library) that an exported program may call and that
#: the engine runs with C++ kernels and autograd formulas of its own, as "namespace::name".
library_ops = _actorpipe.library_ops

__all__ = ["Pipeline", "StepFuture", "PipelineError", "has_gloo", "has_cuda", "library_ops"]
