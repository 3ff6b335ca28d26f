"""actorpipe.Pipeline: the Python face of the engine's pipeline (python/python_pipeline.hpp)."""
import atexit
import contextlib
import difflib
import inspect
import io
import json
import os
import shutil
import tempfile
import textwrap
import warnings
import weakref

import torch

from . import _actorpipe

_OPTIMIZERS = {"sgd": {"lr", "momentum", "weight_decay", "nesterov"}, "adam": {"lr", "weight_decay"},
               "adamw": {"lr", "weight_decay"}}
_LOSSES = ("mse", "cross_entropy")
_FORMAT = 1
_live = weakref.WeakSet()
# The engine's defaults (a Config as made), which Pipeline's signature shows: none restated here.
_DEFAULT = _actorpipe.Config()
# The run's settings Pipeline takes as keywords, declared once in the engine (training/settings.cpp,
# also `actorpipe train`'s flags): name -> {name, kind, default, help}.
_SETTINGS = {row["name"]: row for row in _actorpipe.settings()}
# torch.export's programs reach the engine on PyTorch 2.x; 1.13 scripts nn.Sequentials.
_EXPORT = hasattr(torch, "export") and hasattr(torch.export, "ExportedProgram")


@contextlib.contextmanager
def _quiet_jit():
    """PyTorch 2.x marks torch.jit deprecated; TorchScript is still how a model reaches the C++
    engine (docs/python.md), so the module's own calls say nothing about it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _load_script(path):
    with _quiet_jit():
        return torch.jit.load(path)


# How Python runs a model file written back, by the file ending the engine's table of formats
# gives it (models/model_formats.hpp): one entry per row.
_LOAD_IN_PYTHON = {".pt2": lambda path: torch.export.load(path).module(), ".pt": _load_script}


def _script_bytes(obj, what):
    with _quiet_jit():
        return _script_bytes_of(obj, what)


def _script_bytes_of(obj, what):
    """The bytes of a TorchScript file of `obj`: a path, a ScriptModule or ScriptFunction, or an
    nn.Module that torch.jit.script accepts."""
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj)
    if isinstance(obj, (str, os.PathLike)):
        with open(obj, "rb") as f:
            return f.read()
    if isinstance(obj, torch.jit.ScriptFunction):
        return obj.save_to_buffer()
    if isinstance(obj, torch.nn.Module) and not isinstance(obj, torch.jit.ScriptModule):
        try:
            obj = torch.jit.script(obj)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TypeError(
                f"{what}: {type(obj).__name__} cannot be scripted ({first}); the stages run "
                f"TorchScript on threads of their own, without the GIL"
            ) from e
    if isinstance(obj, torch.jit.ScriptModule):
        buffer = io.BytesIO()
        torch.jit.save(obj, buffer)
        return buffer.getvalue()
    raise TypeError(f"{what}: expected a TorchScript module or a path, not {type(obj).__name__}")


def _exported_bytes(program):
    """The bytes of a PT2 archive of an ExportedProgram (what torch.export.save writes)."""
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def _export(module, example):
    """torch.export.export of `module` on `example`, its batch dimension dynamic where the
    model allows (Dim.AUTO: else fixed, and micro-batches of another size are refused)."""
    if example is None:
        raise TypeError(f"model: a {type(module).__name__} is exported for the stages "
                        f"(torch.export.export) on a batch like the ones to come: give "
                        f"example=<a batch>, or export it yourself and pass the ExportedProgram")
    inputs = example if isinstance(example, tuple) else (example,)
    batch = tuple({0: torch.export.Dim.AUTO} if isinstance(t, torch.Tensor) and t.dim() > 0
                  else None for t in inputs)
    try:
        with _without_cache(module):
            return torch.export.export(module, inputs, dynamic_shapes=batch)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TypeError(f"model: torch.export.export of {type(module).__name__} failed ({first})"
                        ) from e


@contextlib.contextmanager
def _without_cache(module):
    """A transformers model exported for training: no key-value cache (its forward would return
    a DynamicCache, which torch.export cannot flatten, and training has no use for it)."""
    configs = [m.config for m in module.modules()
               if getattr(getattr(m, "config", None), "use_cache", False) is True]
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs:
            config.use_cache = True


def _model_bytes(model, example):
    """The bytes of the model file the stages load: a PT2 archive (an ExportedProgram, a .pt2
    file, or an nn.Module exported here on the PyTorch 2.x line) or TorchScript (1.13's line)."""
    if _EXPORT and isinstance(model, torch.export.ExportedProgram):
        return _exported_bytes(model)
    plain = isinstance(model, torch.nn.Module) and not isinstance(model, torch.jit.ScriptModule)
    # An nn.Sequential without an example is scripted, as on 1.13 (TorchScript is deprecated
    # upstream from 2.11: give example= to have it exported).
    if _EXPORT and plain and (example is not None or not isinstance(model, torch.nn.Sequential)):
        return _exported_bytes(_export(model, example))
    return _script_bytes(model, "model")


def _refuse_python_function(obj, what, instead):
    """TypeError for a plain Python callable: stage threads run TorchScript, never Python."""
    if callable(obj) and not isinstance(obj, (torch.nn.Module, torch.jit.ScriptFunction)):
        name = getattr(obj, "__name__", type(obj).__name__)
        raise TypeError(f"{what}: {name} is a Python function, which would need the GIL on a "
                        f"stage's thread; give {instead}")


def _loss_of(loss):
    """(built-in name, scripted module bytes)."""
    if isinstance(loss, str):
        if loss not in _LOSSES:
            raise ValueError(f"loss: unknown built-in '{loss}' (choose {' or '.join(_LOSSES)}, "
                             f"or give a scripted module)")
        return loss, b""
    _refuse_python_function(loss, "loss", "'mse', 'cross_entropy', or TorchScript "
                            "(torch.jit.script of an nn.Module or a function taking (output, "
                            "target))")
    return "mse", _script_bytes(loss, "loss")


def _hook_of(hook, where):
    """(built-in, TorchScript bytes, name) of a hook: None, "clamp:V", "check_finite", or a
    scripted module whose forward(x) returns the tensor to send on."""
    if hook is None:
        return "", b"", ""
    if isinstance(hook, str):
        return hook, b"", hook
    _refuse_python_function(hook, where, "a built-in ('clamp:V', 'check_finite') or a scripted "
                            "nn.Module")
    return "", _script_bytes(hook, where), f"{where} ({type(hook).__name__})"


def _optimizer_of(optimizer):
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer: a torch.optim object holds a Python model's parameters; the "
                        "stages build their own from ('sgd', 'adam' or 'adamw', {'lr': ...})")
    if isinstance(optimizer, str):
        name, args = optimizer, {}
    else:
        try:
            name, args = optimizer
        except (TypeError, ValueError):
            raise TypeError(f"optimizer: expected ('sgd', 'adam' or 'adamw', {{settings}}), not "
                            f"{optimizer!r}") from None
    if name not in _OPTIMIZERS:
        raise ValueError(f"optimizer: unknown '{name}' (choose sgd, adam or adamw)")
    unknown = sorted(set(args) - _OPTIMIZERS[name])
    if unknown:
        raise ValueError(f"optimizer: {name} takes {', '.join(sorted(_OPTIMIZERS[name]))}, not "
                         f"{', '.join(unknown)}")
    args = dict(args)
    if name == "adamw":
        args.setdefault("weight_decay", 1e-2)  # torch.optim.AdamW's default
    return name, args


class StepFuture:
    """A training step under way (Pipeline.train_step_async)."""

    def __init__(self, future):
        self._future = future
        self._stats = None

    def done(self):
        return self._future.done()

    def result(self, timeout=None):
        """The step's loss; raises PipelineError when the step failed, TimeoutError when it has
        not finished within `timeout` seconds. Waits without the GIL."""
        if self._stats is None:
            if not self._future.wait(-1.0 if timeout is None else float(timeout)):
                raise TimeoutError(f"the step did not finish within {timeout} s")
            self._stats = self._future.get()
        return self._stats["loss"]

    def stats(self):
        """The step's result as Pipeline.stats()["step"] gives it (waits for it)."""
        self.result()
        return self._stats


def _setting_default(row):
    """A setting's default as Python writes it: milliseconds as seconds, counts as ints."""
    kind, shown = row["kind"], row["default"]
    if kind == "flag":
        return shown == "true"
    if kind == "milliseconds":
        return int(shown) / 1000.0
    if kind == "number":
        return float(shown)
    return int(shown) if shown.isdigit() else shown


def _setting_text(name, value):
    """A keyword's value as the engine's setting reads it (Config.set), by the setting's kind."""
    kind = _SETTINGS[name]["kind"]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "flag":
        if not isinstance(value, bool):
            raise TypeError(f"{name}: True or False, not {value!r}")
        return "true" if value else "false"
    if kind == "milliseconds":
        if not number or value < 0:
            raise ValueError(f"{name}: seconds, a number >= 0, not {value!r}")
        return str(int(round(value * 1000)))
    if kind == "number":
        if not number:
            raise TypeError(f"{name}: a number, not {value!r}")
        return repr(float(value))
    if kind == "count" and not (isinstance(value, int) and not isinstance(value, bool)):
        raise TypeError(f"{name}: a whole number, not {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name}: a whole number or text, not {value!r}")
    return str(value)


def _unknown_keyword(name):
    near = difflib.get_close_matches(name, list(_SETTINGS) + list(_OWN_KEYWORDS), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return TypeError(f"Pipeline() got an unexpected keyword argument {name!r}{hint}")


def _settings_doc():
    """The settings' part of Pipeline's docstring, from the engine's table."""
    lines = []
    for name, row in _SETTINGS.items():
        unit = " (in seconds here)" if row["kind"] == "milliseconds" else ""
        text = f"{name}={_setting_default(row)!r}{unit}: {row['help']}"
        lines += textwrap.wrap(text, 96, initial_indent="    ", subsequent_indent="      ")
    return "\n".join(lines)


def _devices_of(devices, stages):
    if devices is None:
        return []
    if isinstance(devices, (str, torch.device)):
        if not stages:
            raise ValueError("devices: one device for every stage needs a stage count; with "
                             "stages='auto' give the list the planner may use")
        return [str(devices)] * stages
    return [str(d) for d in devices]


class Pipeline:
    """A model written in PyTorch cut into stage actors that train it as one model would.

    model: on PyTorch 2.x, a torch.export.ExportedProgram (torch.export.export's), an nn.Module
      (exported here on `example`, its batch dimension dynamic where the model allows) or the
      path of a PT2 archive (torch.export.save): its graph is cut into segments (`segments`),
      skip connections and all. Also, and on PyTorch 1.13 only: a torch.jit.ScriptModule of an
      nn.Sequential (an nn.Sequential is scripted there), or a path to a torch.jit.save file,
      whose children are the layers a cut falls between.
    segments: where an exported graph is cut into layers: "auto" (pipe_split() markers if any,
      else "blocks" where the model repeats blocks, else "modules"), "blocks" (each decoder
      layer, ResNet block or encoder layer, through any wrappers; the embedding and the head
      apart), "modules" (each top-level submodule), "modules:K", "markers", "nodes". The loss
      reads forward's only tensor, else `logits` of a dict or ModelOutput, else the first.
    init_from: an exported program's starting weights: a .safetensors file or a
      save_pretrained folder, matched by name (a wrapper's "model." prefix included); a tensor
      missing, left over, or of another shape or dtype is refused by name.
    optimizer: ("sgd", {"lr", "momentum", "weight_decay", "nesterov"}), ("adam", {"lr",
      "weight_decay"}) or ("adamw", {"lr", "weight_decay"}: 0.01 unless given, as
      torch.optim.AdamW): each stage steps its own over its own parameters.
    loss: "mse", "cross_entropy", or TorchScript taking (output, target). A Python function is
      refused: it would need the GIL on a stage's thread.
    devices: one per stage ("cpu", "cuda:0", ...), or one for all.
    warm_memory: cold_memory's older, inverted name.
    after_forward, after_backward: a hook on every stage: "clamp:V", "check_finite", or a
      scripted module whose forward(x) returns the tensor to send on.
    nodes: "host:port" of `actorpipe node` processes, one per stage (replica after replica);
      secret: their shared secret.
    replicas: data-parallel replicas (in this process, or on nodes); a batch is split among them
      and their gradients averaged, so a step equals one pipeline's on the whole batch. Under
      torchrun or srun (a world of several processes) the world holds stages x replicas, one
      stage per process: rank 0's script drives; on the other ranks this constructor hosts the
      rank's stage until rank 0 closes its pipeline, then exits (docs/clusters.md).
    example: a batch like the ones to come, for stages="auto", schedule="auto",
      partition="time".

    The run's settings below are declared once in the engine, as `actorpipe train`'s flags are
    (--max-grad-norm is max_grad_norm); None or left out: the default shown.
    """

    def __init__(self, model, *, optimizer=(_DEFAULT.optimizer, {"lr": _DEFAULT.lr}),
                 loss=_DEFAULT.loss, devices=None, after_forward=None, after_backward=None,
                 nodes=None, secret="", replicas=None, example=None, segments=_DEFAULT.segments,
                 init_from=None, warm_memory=None, **settings):
        for name in settings:
            if name not in _SETTINGS:
                raise _unknown_keyword(name)
        if warm_memory is not None:  # cold_memory's older, inverted name
            settings.setdefault("cold_memory", not warm_memory)
        given = {name: value for name, value in settings.items() if value is not None}
        stages = given.get("stages", _setting_default(_SETTINGS["stages"]))
        opt_name, opt_args = _optimizer_of(optimizer)
        loss_name, loss_bytes = _loss_of(loss)
        c = _actorpipe.Config()
        c.model = _model_bytes(model, example)
        c.segments = segments
        if init_from is not None:
            c.init_from = os.fspath(init_from)
        c.model_name = os.path.basename(str(model)) if isinstance(model, (str, os.PathLike)) \
            else type(model).__name__
        for name, value in given.items():
            c.set(name, _setting_text(name, value))
        c.optimizer = opt_name
        for key, value in opt_args.items():
            setattr(c, key, value)
        c.loss, c.loss_module = loss_name, loss_bytes
        c.devices = _devices_of(devices, None if stages == "auto" else stages)
        hooks = (_hook_of(after_forward, "after_forward"), _hook_of(after_backward, "after_backward"))
        c.set_after_forward(hooks[0])
        c.set_after_backward(hooks[1])
        # replicas= given: under torchrun or srun the world holds stages x replicas, one stage
        # per process (docs/clusters.md); on every rank but 0 the constructor hosts this rank's
        # stage until rank 0's pipeline is closed, then exits with rank 0's code (SystemExit).
        c.cluster = replicas is not None
        replicas = _DEFAULT.replicas if replicas is None else replicas
        c.nodes, c.secret, c.replicas = list(nodes or []), secret, replicas
        if isinstance(example, tuple):
            # torch.export's own form, (x,): the engine's batch is its one tensor.
            if len(example) != 1 or not isinstance(example[0], torch.Tensor):
                raise TypeError("example: a batch tensor, or a tuple of one (x,), not a tuple "
                                f"of {len(example)}")
            example = example[0]
        if example is not None:
            c.example = example
        self._config = c
        self._hooks = hooks
        self._p = _actorpipe.Pipeline(c)
        # What save() writes and load() rebuilds from: the settings given, and the layout the
        # planner chose, fixed.
        layout = self._p.layout()
        self._settings = dict(
            given, stages=layout["stages"], microbatches=layout["microbatches"],
            schedule=layout["schedule"], chunks=layout["chunks"],
            partition="cut:" + ",".join(str(b) for b in layout["bounds"][1:-1])
            if len(layout["bounds"]) > 2 else "uniform",
            optimizer=[opt_name, opt_args], loss=loss_name, devices=list(c.devices),
            nodes=list(c.nodes), replicas=replicas, segments=segments)
        _live.add(self)

    # Training and inference.
    def train_step(self, inputs, targets):
        """One step on a batch (batch dimension first); returns the batch's loss as a float.
        Raises PipelineError (a failed step changes no parameter) or ValueError."""
        return self._p.train_step(inputs, targets)["loss"]

    def train_step_async(self, inputs, targets):
        """Starts a step and returns a StepFuture at once; steps run in call order."""
        return StepFuture(self._p.train_step_async(inputs, targets))

    def forward(self, inputs):
        """Forward only (no gradients, eval mode); the outputs on the last stage's device."""
        return self._p.forward(inputs)

    __call__ = forward

    def set_learning_rate(self, lr):
        """Every stage's learning rate from the next step on."""
        self._p.set_learning_rate(float(lr))

    # The model.
    def named_parameters(self):
        """Copies of the parameters, named as the nn.Sequential's state_dict names them."""
        return list(self._p.named_parameters())

    def parameters(self):
        return [t for _, t in self.named_parameters()]

    def state_dict(self):
        """The trained parameters and persistent buffers by the Python module's names (each name
        of a tied parameter): what model.load_state_dict takes."""
        return dict(self._p.state_dict())

    def save_safetensors(self, path, max_shard_size=5 << 30):
        """Writes the trained weights into the folder `path` as save_pretrained does
        (model.safetensors, or shards of at most `max_shard_size` bytes and an index), under the
        names init_from's file had (else the program's), with its config.json:
        transformers' from_pretrained(path) loads them. Exported programs only."""
        self._p.save_safetensors(os.fspath(path), int(max_shard_size))

    def module(self):
        """The model with the trained parameters and buffers: an exported program's as
        torch.export.load(...).module() gives it, a TorchScript model's as a ScriptModule."""
        with tempfile.TemporaryDirectory(prefix="actorpipe-") as d:
            path = os.path.join(d, "model" + self._p.model_suffix())
            self._p.save_model(path)
            return _LOAD_IN_PYTHON[self._p.model_suffix()](path)

    def stats(self):
        """The layout (stages, bounds, schedule, micro-batches, threads, parameters per stage)
        and the newest finished step's figures (loss, wall_ms, per-stage times and stash)."""
        return {"layout": self._p.layout(), "step": self._p.last_result()}

    @property
    def stages(self):
        return self._p.layout()["stages"]

    # Files.
    def save(self, path):
        """Writes parameters, buffers and optimizer state (one file per stage), the model and the
        settings to the folder `path`. The folder is replaced only once all is written."""
        path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        work = tempfile.mkdtemp(prefix=".actorpipe-save-", dir=parent)
        try:
            self._p.save_state(work)
            files = {"model": "model" + self._p.model_suffix()}
            with open(os.path.join(work, files["model"]), "wb") as f:
                f.write(self._config.model)
            if self._config.loss_module:
                files["loss"] = "loss.pt"
                with open(os.path.join(work, "loss.pt"), "wb") as f:
                    f.write(self._config.loss_module)
            hooks = {}
            for (builtin, script, _), where in zip(self._hooks, ("after_forward", "after_backward")):
                if script:
                    hooks[where] = where + ".pt"
                    with open(os.path.join(work, where + ".pt"), "wb") as f:
                        f.write(script)
                elif builtin:
                    hooks[where] = builtin
            manifest = {"format": _FORMAT, "settings": self._settings, "files": files,
                        "hooks": hooks, "torch": torch.__version__}
            with open(os.path.join(work, "actorpipe.json"), "w") as f:
                json.dump(manifest, f, indent=2)
            _replace_folder(work, path)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise

    @classmethod
    def load(cls, path, **overrides):
        """A pipeline of what save() wrote, with its state; keyword arguments override the
        saved settings (another stage count, say: the state loads into any cut)."""
        path = os.fspath(path)
        manifest_path = os.path.join(path, "actorpipe.json")
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no actorpipe.json (not a folder Pipeline.save "
                                    f"wrote)") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{manifest_path}: not JSON ({e})") from None
        if manifest.get("format") != _FORMAT:
            raise ValueError(f"{manifest_path}: format {manifest.get('format')!r}, this actorpipe "
                             f"reads {_FORMAT}")
        settings = dict(manifest["settings"])
        settings["optimizer"] = tuple(settings["optimizer"])
        files = manifest["files"]
        with _quiet_jit():
            if "loss" in files:
                settings["loss"] = torch.jit.load(os.path.join(path, files["loss"]))
            for where, hook in manifest.get("hooks", {}).items():
                settings[where] = torch.jit.load(os.path.join(path, hook)) \
                    if hook.endswith(".pt") else hook
        if "stages" in overrides and "partition" not in overrides:
            settings["partition"] = "uniform"
        settings.update(overrides)
        pipe = cls(os.path.join(path, files["model"]), **settings)
        pipe._p.load_state(path)
        return pipe

    # Lifetime.
    def close(self):
        """Stops the stage actors; later calls raise ValueError. Also at interpreter exit."""
        self._p.close()

    def __del__(self):
        # Stopping the stages waits for their threads: without the GIL (close() releases it),
        # never in the C++ destructor, which would run holding it.
        p = getattr(self, "_p", None)
        if p is not None:
            p.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        layout = self._p.layout()
        return (f"actorpipe.Pipeline(stages={layout['stages']}, "
                f"microbatches={layout['microbatches']}, schedule='{layout['schedule']}', "
                f"bounds={layout['bounds']})")


def _replace_folder(work, path):
    old = None
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise NotADirectoryError(f"{path}: exists and is not a folder")
        old = tempfile.mkdtemp(prefix=".actorpipe-old-", dir=os.path.dirname(os.path.abspath(path)))
        os.rmdir(old)
        os.rename(path, old)
    os.rename(work, path)
    if old:
        shutil.rmtree(old, ignore_errors=True)


@atexit.register
def _shutdown():
    for pipe in list(_live):
        pipe.close()
    _actorpipe.release_engine()


def _signature():
    """Pipeline's signature: its own keywords, then every setting with the engine's default."""
    own = inspect.signature(Pipeline.__init__)
    kept = [p for p in own.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    settings = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                  default=_setting_default(row))
                for name, row in _SETTINGS.items()]
    return own.replace(parameters=kept + settings)


# Pipeline's own keywords (not settings), for the nearest name to a mistyped one.
_OWN_KEYWORDS = [name for name, p in inspect.signature(Pipeline.__init__).parameters.items()
                 if p.kind == inspect.Parameter.KEYWORD_ONLY]
Pipeline.__init__.__signature__ = _signature()
Pipeline.__doc__ += _settings_doc() + "\n"
