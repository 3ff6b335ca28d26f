// actorpipe._actorpipe: the C++ side of `import actorpipe` (python/actorpipe/__init__.py is the
// API users see). Tensors cross as torch's own (libtorch_python's casters: no copies); every call
// that waits for or runs stage actors releases the GIL first.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/utils/pybind.h>

#include "python_pipeline.hpp"

namespace py = pybind11;

namespace actorpipe::python {
namespace {

template <class T>
py::object optional_of(const std::optional<T>& value) {
  return value ? py::cast(*value) : py::none();
}

// As python/actorpipe/_errors.py's PipelineError, which carries the engine's fields.
py::object python_error(const py::object& type, const std::string& message,
                        const error_details& d) {
  auto node = d.node.empty() ? py::none() : py::cast(d.node);
  return type(message, to_string(d.kind), optional_of(d.stage), optional_of(d.microbatch),
              optional_of(d.step), node);
}

void raise_pipeline_error(const pipeline_error& e) {
  try {
    auto type = py::module_::import("actorpipe._errors").attr("PipelineError");
    auto error = python_error(type, e.what(), e.details());
    py::list failures;
    for (const auto& part : e.failures()) {
      failures.append(python_error(type, part.message, part.details));
    }
    error.attr("failures") = failures;
    PyErr_SetObject(type.ptr(), error.ptr());
  } catch (const py::error_already_set&) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

void translate(std::exception_ptr failure) {
  try {
    if (failure) {
      std::rethrow_exception(failure);
    }
  } catch (const pipeline_error& e) {
    raise_pipeline_error(e);
  } catch (const invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const cluster_job_ended& end) {
    // This rank hosted its stage until rank 0 ended the job: the script goes no further.
    PyErr_SetObject(PyExc_SystemExit, py::int_(end.code).ptr());
  }
}

py::dict stats_of(const step_result& r) {
  py::list stages;
  for (const auto& s : r.stages) {
    py::dict stage;
    visit_scalars(s, [&](const char* name, const auto& value) { stage[name] = value; });
    stages.append(stage);
  }
  py::dict result;
  result["step"] = r.step;
  result["loss"] = r.loss;
  result["grad_norm"] = r.grad_norm;
  result["wall_ms"] = r.wall_ms;
  result["stages"] = stages;
  return result;
}

py::dict layout_of(const pipeline_layout& l) {
  py::dict layout;
  layout["stages"] = l.stages;
  layout["bounds"] = l.bounds;
  layout["schedule"] = l.schedule;
  layout["microbatches"] = l.microbatches;
  layout["chunks"] = l.chunks;
  layout["threads_per_stage"] = l.threads;
  layout["stage_parameters"] = l.parameters;
  layout["layers"] = l.layers;
  return layout;
}

// A hook as (built-in name, TorchScript bytes, name); empty strings where absent.
void set_hook(hook_spec& hook, const std::tuple<std::string, py::bytes, std::string>& value) {
  hook.builtin = std::get<0>(value);
  hook.torchscript = std::get<1>(value);
  hook.name = std::get<2>(value);
}

// Sets a setting of training/settings.hpp's table that Python binds, from its text (the
// package turns a keyword's value into it, by the row's kind); errors name the keyword.
void set_setting(pipeline_config& x, const std::string& name, const std::string& text) {
  const auto* row = training::find_setting(name);
  ACTORPIPE_CHECK(row != nullptr && row->bound_by(training::python_front), "'", name,
                  "' is no setting of actorpipe.Pipeline");
  training::set_setting(x.declared, *row, text, [](const std::string& n) { return n; });
}

// The table's rows Python binds: name, kind, default (as text), help.
py::list settings_table() {
  py::list rows;
  for (const auto& row : training::setting_table()) {
    if (row.bound_by(training::python_front)) {
      py::dict d;
      d["name"] = row.name;
      d["kind"] = training::to_string(row.kind);
      d["default"] = row.shown;
      d["help"] = row.help;
      rows.append(d);
    }
  }
  return rows;
}

void bind_config(py::module_& m) {
  using c = pipeline_config;
  py::class_<c>(m, "Config", "A pipeline's settings as plain values (see actorpipe.Pipeline).")
    .def(py::init<>())
    .def_property(
      "model", [](const c& x) { return py::bytes(x.model); },
      [](c& x, py::bytes b) { x.model = b; })
    .def_readwrite("model_name", &c::model_name)
    .def_readwrite("segments", &c::segments)
    .def_readwrite("init_from", &c::init_from)
    .def_property(
      "optimizer", [](const c& x) { return x.optimizer.name; },
      [](c& x, const std::string& name) { x.optimizer.name = name; })
    .def_property(
      "lr", [](const c& x) { return x.optimizer.lr; }, [](c& x, double v) { x.optimizer.lr = v; })
    .def_property(
      "momentum", [](const c& x) { return x.optimizer.momentum; },
      [](c& x, double v) { x.optimizer.momentum = v; })
    .def_property(
      "weight_decay", [](const c& x) { return x.optimizer.weight_decay; },
      [](c& x, double v) { x.optimizer.weight_decay = v; })
    .def_property(
      "nesterov", [](const c& x) { return x.optimizer.nesterov; },
      [](c& x, bool v) { x.optimizer.nesterov = v; })
    .def_readwrite("loss", &c::loss)
    .def_property(
      "loss_module", [](const c& x) { return py::bytes(x.loss_module); },
      [](c& x, py::bytes b) { x.loss_module = b; })
    .def_readwrite("devices", &c::devices)
    .def("set_after_forward",
         [](c& x, const std::tuple<std::string, py::bytes, std::string>& h) {
           set_hook(x.hooks.after_forward, h);
         })
    .def("set_after_backward",
         [](c& x, const std::tuple<std::string, py::bytes, std::string>& h) {
           set_hook(x.hooks.after_backward, h);
         })
    .def_readwrite("nodes", &c::nodes)
    .def_readwrite("secret", &c::secret)
    .def_readwrite("replicas", &c::replicas)
    .def_readwrite("cluster", &c::cluster)
    .def("set", &set_setting, py::arg("name"), py::arg("text"))
    .def_readwrite("example", &c::example);
}

void bind_pipeline(py::module_& m) {
  using p = python_pipeline;
  auto release = py::call_guard<py::gil_scoped_release>();
  py::class_<step_future>(m, "StepFuture")
    .def("wait", &step_future::wait, py::arg("seconds"), release)
    .def("done", &step_future::done, release)
    .def("get", [](const step_future& f) {
      step_result r;
      {
        py::gil_scoped_release unlocked;
        r = f.get();
      }
      return stats_of(r);
    });
  py::class_<p, std::shared_ptr<p>>(m, "Pipeline")
    .def(py::init([](pipeline_config config) {
      py::gil_scoped_release unlocked;
      return p::create(std::move(config));
    }))
    .def("train_step_async", &p::train_step_async, release)
    .def("train_step",
         [](p& self, torch::Tensor x, torch::Tensor y) {
           step_result r;
           {
             py::gil_scoped_release unlocked;
             r = self.train_step(std::move(x), std::move(y));
           }
           return stats_of(r);
         })
    .def("forward", &p::forward, release)
    .def("set_learning_rate", &p::set_learning_rate, release)
    .def("save_state", &p::save_state, release)
    .def("load_state", &p::load_state, release)
    .def("save_model", &p::save_model, release)
    .def("model_suffix", &p::model_suffix)
    .def("save_safetensors", &p::save_safetensors, release)
    .def("state_dict", &p::state_dict, release)
    .def("named_parameters", &p::named_parameters, release)
    .def("layout", [](const p& self) { return layout_of(self.layout()); })
    .def("last_result",
         [](const p& self) -> py::object {
           auto last = self.last_result();
           return last ? py::object(stats_of(*last)) : py::none();
         })
    .def("close", &p::close, release);
}

} // namespace
} // namespace actorpipe::python

PYBIND11_MODULE(_actorpipe, m) {
  m.doc() = "The C++ engine under `import actorpipe` (docs/python.md).";
  py::register_exception_translator(&actorpipe::python::translate);
  actorpipe::python::bind_config(m);
  actorpipe::python::bind_pipeline(m);
  m.def("settings", &actorpipe::python::settings_table,
        "The run's settings Pipeline takes as keywords, as the engine declares them "
        "(training/settings.hpp): name, kind, default, help");
  m.def("release_engine", &actorpipe::python::release_engine,
        py::call_guard<py::gil_scoped_release>());
  m.def("library_ops", &actorpipe::library_ops,
        "The ops Python libraries register that exported programs may call and actorpipe runs "
        "with kernels of its own (transformers' mixture-of-experts grouped product)");
#ifdef ACTORPIPE_WITH_GLOO
  m.attr("has_gloo") = true;
#else
  m.attr("has_gloo") = false;
#endif
#ifdef ACTORPIPE_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
