"""actorpipe from Python: pipeline-parallel training of a TorchScript model on the C++ engine.

    import torch, actorpipe
    p = actorpipe.Pipeline(torch.jit.script(model), stages=2, microbatches=4, schedule="1f1b",
                           optimizer=("sgd", {"lr": 0.05, "momentum": 0.9}),
                           loss="cross_entropy")
    loss = p.train_step(x, y)          # a float; the stages compute without the GIL
    fut = p.train_step_async(x, y)     # a StepFuture: fut.result() is the loss
    out = p(x)                         # forward only
    trained = p.module()               # a torch.jit.ScriptModule with the trained parameters

The model is an nn.Sequential (scripted here when it is not yet), cut between its children into
stage actors, each on a thread (and device) of its own. docs/python.md has the rest.
"""
import os

import torch  # loads the libtorch that the extension below shares

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

__all__ = ["Pipeline", "StepFuture", "PipelineError", "has_gloo", "has_cuda"]
