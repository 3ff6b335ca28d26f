#include "bench/sweep.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>
#include <actorpipe/memory.hpp>
#include <actorpipe/trace.hpp>

#include "stages/precision.hpp"
#include "training/progress.hpp"
#include "training/run_plan.hpp"

namespace actorpipe::bench {
namespace {

using clock_type = std::chrono::steady_clock;

int64_t rss_mb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      return std::stoll(line.substr(6)) / 1024;
    }
  }
  return 0;
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

// MSE against one-hot targets (the RPC tutorial's), cross-entropy per token for a language model.
loss_function loss_for(const training::model_setup& setup) {
  if (setup.file.size() > 0) {
    // A tensor file: class indices (int64 targets) or values.
    return setup.file.labels.scalar_type() == torch::kLong ? builtin_loss("cross_entropy")
                                                           : loss_function(mse);
  }
  return setup.language_model() ? builtin_loss("cross_entropy") : loss_function(mse);
}

// One configuration under test: a pipeline, or plain libtorch with a thread count.
struct contender {
  sweep_row row;
  std::unique_ptr<pipeline> pipe;
  schedule plan;
  // Plain libtorch.
  layer_list layers;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  int threads = 0;
  std::vector<double> times;
  std::vector<double> lower;
  std::vector<double> fill_drain;
  std::vector<double> predicted;
  std::vector<double> per_sample;
  std::vector<double> stash_mb;
  loss_function loss_fn = mse;
  precision_mode precision = precision_mode::fp32;

  // Plain libtorch's forward and loss, under the pipeline's autocast for bf16.
  torch::Tensor plain_loss(const torch::Tensor& x, const torch::Tensor& y) const {
    torch::Tensor out;
    {
      stages::autocast_scope autocast(precision);
      out = run_layers(layers, x);
    }
    return loss_fn(stages::boundary_cast(out, precision, /*last=*/true), y);
  }

  // Training steps per measured step: 2 when overlapping steps are measured (each configuration
  // then takes every batch twice, submitted together, and a step's time is half the pair's).
  std::size_t repeats = 1;

  void step(const torch::Tensor& x, const torch::Tensor& y, bool record) {
    if (pipe && repeats == 1) {
      record_step(pipe->train_step(x, y), x, record, /*ms=*/-1);
    } else if (pipe) {
      auto start = clock_type::now();
      std::vector<std::future<step_result>> futures;
      for (std::size_t i = 0; i < repeats; ++i) {
        futures.push_back(pipe->train_step_async(x, y));
      }
      std::vector<step_result> results;
      for (auto& f : futures) {
        results.push_back(f.get());
      }
      auto ms = std::chrono::duration<double, std::milli>(clock_type::now() - start).count() /
                static_cast<double>(repeats);
      for (auto& r : results) {
        record_step(std::move(r), x, record, ms);
      }
    } else {
      for (std::size_t i = 0; i < repeats; ++i) {
        plain_step(x, y, record);
      }
    }
    row.rss_mb = std::max(row.rss_mb, rss_mb());
  }

  // A pipeline's step: its time (`ms`, or the step's own when < 0), ideals and prediction.
  void record_step(step_result r, const torch::Tensor& x, bool record, double ms) {
    row.losses.push_back(r.loss);
    if (!record) {
      return;
    }
    times.push_back(ms < 0 ? r.wall_ms : ms);
    auto p = r.stages.size();
    auto m = static_cast<double>(row.splits);
    auto report = compare_bubbles(plan, row.splits, r);
    double sum = 0;
    double slowest = 0;
    for (auto busy : report.busy_ms) {
      sum += busy;
      slowest = std::max(slowest, busy);
    }
    double optimizer_ms = 0;
    for (const auto& s : r.stages) {
      optimizer_ms = std::max(optimizer_ms, s.optimizer_ms);
    }
    lower.push_back(std::max(sum / static_cast<double>(p), slowest) + optimizer_ms);
    fill_drain.push_back((m + static_cast<double>(p) - 1) * slowest / m + optimizer_ms);
    predicted.push_back(report.planned_ms + optimizer_ms);
    per_sample.push_back(sum / static_cast<double>(x.size(0)));
    int64_t stash = 0;
    for (const auto& s : r.stages) {
      stash = std::max(stash, s.peak_stash_bytes);
    }
    stash_mb.push_back(static_cast<double>(stash) / 1e6);
  }

  // Plain libtorch's step (accumulating over the micro-batches when row.accumulated > 1).
  void plain_step(const torch::Tensor& x, const torch::Tensor& y, bool record) {
    auto previous = at::get_num_threads();
    at::set_num_threads(threads);
    auto start = clock_type::now();
    optimizer->zero_grad();
    double loss = 0;
    if (row.accumulated > 1) {
      // The pipeline's micro-batches (torch::tensor_split) and loss scales.
      auto parts = static_cast<int64_t>(row.accumulated);
      auto xs = torch::tensor_split(x, parts, 0);
      auto ys = torch::tensor_split(y, parts, 0);
      for (std::size_t i = 0; i < xs.size(); ++i) {
        auto part = plain_loss(xs[i], ys[i]) *
                    (static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0)));
        part.backward();
        loss += part.item<double>();
      }
    } else {
      auto whole = plain_loss(x, y);
      whole.backward();
      loss = whole.item<double>();
    }
    optimizer->step();
    auto ms = std::chrono::duration<double, std::milli>(clock_type::now() - start).count();
    row.losses.push_back(loss);
    at::set_num_threads(previous);
    if (record) {
      times.push_back(ms);
    }
  }
};

std::string format_row(const sweep_row& r) {
  char line[400];
  std::snprintf(line, sizeof line,
                "%-32s %6zu %8.2f %8.2f %8.2f %8.2f %8.2f %6.2f %8.2f %7.2fx %7.2fx %7.2fx %7.1f "
                "%5.0f%% %8.2f %7lld %8.2f %9.0f",
                r.name.c_str(), r.accumulated > 0 ? r.accumulated : r.splits, r.median_ms / 1000,
                r.min_ms / 1000, r.max_ms / 1000, r.lower_bound_ms / 1000, r.fill_drain_ms / 1000,
                r.efficiency, r.predicted_ms / 1000, r.speedup_1t, r.speedup_all,
                r.speedup_accumulated, r.gflops, 100 * r.peak_share, r.compute_ms_per_sample,
                static_cast<long long>(r.rss_mb), r.stash_mb, r.per_second);
  return line;
}

void write_plot(const std::string& path, const std::vector<sweep_row>& rows,
                const std::string& title) {
  std::vector<sweep_row> piped;
  double top = 0;
  std::vector<std::size_t> splits;
  for (const auto& r : rows) {
    if (r.splits > 0) {
      piped.push_back(r);
      top = std::max({top, r.median_ms, r.fill_drain_ms});
      if (std::find(splits.begin(), splits.end(), r.splits) == splits.end()) {
        splits.push_back(r.splits);
      }
    }
  }
  for (const auto& r : rows) {
    if (r.splits == 0) {
      top = std::max(top, r.median_ms);
    }
  }
  std::sort(splits.begin(), splits.end());
  const double left = 70, width = 700, plot_top = 50, height = 320;
  auto x_of = [&](std::size_t m) {
    auto i = std::find(splits.begin(), splits.end(), m) - splits.begin();
    return left + (splits.size() > 1
                     ? width * static_cast<double>(i) / static_cast<double>(splits.size() - 1)
                     : width / 2);
  };
  auto y_of = [&](double ms) { return plot_top + height * (1 - ms / (top * 1.05)); };
  auto y_eff = [&](double e) { return plot_top + height * (1 - e); };
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << left + width + 220
      << "\" height=\"" << plot_top + height + 70
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << left << "\" y=\"28\" font-size=\"15\">" << title << "</text>\n"
      << "<line x1=\"" << left << "\" y1=\"" << plot_top + height << "\" x2=\"" << left + width
      << "\" y2=\"" << plot_top + height << "\" stroke=\"black\"/>\n"
      << "<line x1=\"" << left << "\" y1=\"" << plot_top << "\" x2=\"" << left << "\" y2=\""
      << plot_top + height << "\" stroke=\"black\"/>\n"
      << "<line x1=\"" << left + width << "\" y1=\"" << plot_top << "\" x2=\"" << left + width
      << "\" y2=\"" << plot_top + height << "\" stroke=\"#888\"/>\n";
  for (int t = 0; t <= 5; ++t) {
    auto ms = top * 1.05 * t / 5;
    svg << "<text x=\"" << left - 8 << "\" y=\"" << y_of(ms) + 4 << "\" text-anchor=\"end\">"
        << std::fixed << std::setprecision(1) << ms / 1000 << "</text>\n"
        << "<text x=\"" << left + width + 8 << "\" y=\"" << y_eff(t / 5.0) + 4
        << "\" fill=\"#888\">" << std::setprecision(1) << t / 5.0 << "</text>\n";
  }
  for (auto m : splits) {
    svg << "<text x=\"" << x_of(m) << "\" y=\"" << plot_top + height + 18
        << "\" text-anchor=\"middle\">" << m << "</text>\n";
  }
  svg << "<text x=\"" << left + width / 2 << "\" y=\"" << plot_top + height + 40
      << "\" text-anchor=\"middle\">micro-batches (splits)</text>\n"
      << "<text x=\"14\" y=\"" << plot_top - 12 << "\">step time (s)</text>\n"
      << "<text x=\"" << left + width - 40 << "\" y=\"" << plot_top - 12
      << "\" fill=\"#888\">efficiency</text>\n";
  const char* colours[] = {"#4C78A8", "#E45756", "#54A24B", "#B279A2"};
  std::vector<std::string> partitions;
  for (const auto& r : piped) {
    if (std::find(partitions.begin(), partitions.end(), r.partition) == partitions.end()) {
      partitions.push_back(r.partition);
    }
  }
  double legend_y = plot_top + 10;
  for (std::size_t k = 0; k < partitions.size(); ++k) {
    const char* colour = colours[k % 4];
    std::ostringstream measured, ideal;
    for (const auto& r : piped) {
      if (r.partition != partitions[k]) {
        continue;
      }
      measured << x_of(r.splits) << ',' << y_of(r.median_ms) << ' ';
      ideal << x_of(r.splits) << ',' << y_of(r.lower_bound_ms) << ' ';
      svg << "<circle cx=\"" << x_of(r.splits) << "\" cy=\"" << y_eff(r.efficiency)
          << "\" r=\"4\" fill=\"none\" stroke=\"" << colour << "\"/>\n";
    }
    svg << "<polyline fill=\"none\" stroke=\"" << colour << "\" stroke-width=\"2\" points=\""
        << measured.str() << "\"/>\n"
        << "<polyline fill=\"none\" stroke=\"" << colour << "\" stroke-dasharray=\"5,4\" points=\""
        << ideal.str() << "\"/>\n"
        << "<text x=\"" << left + width + 40 << "\" y=\"" << legend_y << "\" fill=\"" << colour
        << "\">" << partitions[k] << ": measured (line),</text>\n"
        << "<text x=\"" << left + width + 40 << "\" y=\"" << legend_y + 14 << "\" fill=\"" << colour
        << "\">ideal (dashed), efficiency (o)</text>\n";
    legend_y += 36;
  }
  for (const auto& r : rows) {
    if (r.splits == 0 && r.accumulated == 0) {
      svg << "<line x1=\"" << left << "\" y1=\"" << y_of(r.median_ms) << "\" x2=\"" << left + width
          << "\" y2=\"" << y_of(r.median_ms)
          << "\" stroke=\"#999\" stroke-dasharray=\"2,3\"/>\n<text x=\"" << left + 6 << "\" y=\""
          << y_of(r.median_ms) - 4 << "\" fill=\"#666\">" << r.name << "</text>\n";
    }
  }
  svg << "</svg>\n";
  std::ofstream out(path);
  out << svg.str();
  ACTORPIPE_CHECK(out.good(), "--plot: cannot write '", path, "'");
}

} // namespace

std::vector<std::pair<torch::Tensor, torch::Tensor>>
make_batches(const training::model_setup& setup, uint64_t seed, std::size_t count) {
  const auto& mo = setup.options;
  torch::manual_seed(seed);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (std::size_t i = 0; i < count; ++i) {
    if (setup.file.size() > 0) {
      // A tensor file, in order as training reads it.
      auto k = static_cast<int64_t>(i);
      auto rows = torch::arange(k * setup.batch, (k + 1) * setup.batch, torch::kLong)
                    .remainder(setup.file.size());
      batches.emplace_back(setup.file.images.index({rows}), setup.file.labels.index({rows}));
      continue;
    }
    if (setup.language_model()) {
      auto tokens = torch::randint(mo.vocabulary, {setup.batch, mo.context + 1}, torch::kLong);
      batches.emplace_back(tokens.slice(1, 0, mo.context).contiguous(),
                           tokens.slice(1, 1, mo.context + 1).contiguous());
      continue;
    }
    auto x = torch::randn({setup.batch, mo.in_channels, mo.image_size, mo.image_size});
    auto labels = torch::randint(mo.num_classes, {setup.batch}, torch::kLong);
    batches.emplace_back(x,
                         torch::nn::functional::one_hot(labels, mo.num_classes).to(torch::kFloat));
  }
  return batches;
}

namespace {

// Parameters drawn as every contender's: the same seed, the same model.
layer_list fresh_layers(const training::model_setup& setup, uint64_t seed) {
  return setup.fresh(seed);
}

// The precisions measured: "fp32", "bf16".
std::vector<std::string> precisions_of(const sweep_options& o) {
  return o.precisions.empty() ? std::vector<std::string>{"fp32"} : o.precisions;
}

// The recomputation modes measured.
std::vector<std::string> recompute_modes_of(const sweep_options& o) {
  return o.recompute.empty() ? std::vector<std::string>{"never"} : o.recompute;
}

// " <value>" in a configuration's name when the bench measures several values, or another than
// the usual.
std::string suffix(const std::vector<std::string>& values, const std::string& value,
                   const char* usual = "fp32", const char* prefix = "") {
  return values.size() > 1 || value != usual ? detail::concat(" ", prefix, value) : std::string{};
}

// Plain libtorch on one thread and on all cores, whole batch, and on all cores accumulating over
// each swept split's micro-batches (the pipeline's math without the pipeline).
std::vector<contender> plain_contenders(const sweep_options& o, const training::model_setup& setup,
                                        int cores) {
  std::vector<contender> contenders;
  if (o.baselines) {
    std::vector<std::pair<int, std::size_t>> plain{{1, 0}, {cores, 0}};
    for (auto m : o.splits) {
      if (o.accumulated && m > 1) {
        plain.emplace_back(cores, m);
      }
    }
    auto precisions = precisions_of(o);
    for (const auto& precision : precisions) {
      for (auto [threads, accumulate] : plain) {
        contender c;
        c.row.name = accumulate > 0 ? detail::concat("plain ", threads, "t accum ", accumulate)
                                    : detail::concat("plain libtorch ", threads, "t");
        c.row.name += suffix(precisions, precision);
        c.row.precision = precision;
        c.precision = parse_precision(precision);
        c.row.accumulated = accumulate;
        c.layers = fresh_layers(setup, o.model.seed);
        c.loss_fn = loss_for(setup);
        std::vector<torch::Tensor> params;
        std::set<const c10::TensorImpl*> seen; // a tied parameter is stepped once
        for (const auto& l : c.layers) {
          if (auto m = l.module()) {
            for (auto& p : m->parameters()) {
              if (seen.insert(p.unsafeGetTensorImpl()).second) {
                params.push_back(p);
              }
            }
          }
        }
        c.optimizer = sgd(o.lr)(params);
        c.threads = threads;
        contenders.push_back(std::move(c));
      }
    }
  }
  return contenders;
}

// The stage threads' memory of each configuration: "warm", "cold".
std::vector<std::string> memory_modes_of(const sweep_options& o) {
  auto modes = o.memory;
  if (modes.empty()) {
    modes.push_back(o.plan.cold_memory ? "cold" : "warm");
  }
  return modes;
}

// One pipeline configuration of the sweep.
struct pipeline_setting {
  training::planning_args plan;
  std::string precision = "fp32";
  std::string memory;
  std::string update = "wait";
};

// Every setting of `all` with each of `values` (set by `set`): the sweep's product, one
// dimension at a time.
template <class T, class Set>
void expand(std::vector<pipeline_setting>& all, const std::vector<T>& values, Set set) {
  std::vector<pipeline_setting> out;
  for (const auto& setting : all) {
    for (const auto& v : values) {
      out.push_back(setting);
      set(out.back(), v);
    }
  }
  all = std::move(out);
}

// A pipeline per stage count x partition x schedule x split x memory mode x precision x
// recomputation x optimizer update.
std::vector<contender> pipeline_contenders(engine& sys, const sweep_options& o,
                                           const training::model_setup& setup) {
  auto memory_modes = memory_modes_of(o);
  auto precisions = precisions_of(o);
  auto recompute_modes = recompute_modes_of(o);
  auto updates = o.updates.empty() ? std::vector<std::string>{"wait"} : o.updates;
  std::vector<contender> contenders;
  auto add = [&](const pipeline_setting& s, const training::plan_choice& choice,
                 const std::string& prefix) {
    auto po = training::pipeline_options_for(choice, s.plan);
    po.loss = loss_for(setup);
    po.optimizer = sgd(o.lr);
    po.precision = parse_precision(s.precision);
    po.optimistic_update = s.update == "early";
    po.overlap_steps = s.update == "overlap";
    contender c;
    c.loss_fn = po.loss;
    c.precision = po.precision;
    c.row.precision = s.precision;
    c.row.recompute = to_string(po.recompute);
    auto partition_name =
      choice.ranking.empty() ? s.plan.partition : choice.ranking.front().partition_spec;
    c.row.name =
      detail::concat(prefix, choice.schedule_name, " ", partition_name, " ", choice.stages(), "p",
                     choice.threads > 0 ? detail::concat(" ", choice.threads, "t") : std::string{},
                     memory_modes.size() > 1 ? " " + s.memory : "", suffix(precisions, s.precision),
                     suffix(recompute_modes, s.plan.recompute, "never", "rc "),
                     suffix(updates, s.update, "wait", "update "));
    c.row.partition = partition_name;
    c.row.splits = choice.microbatches;
    c.row.stages = choice.cut.stages();
    c.row.threads = training::threads_per_stage(choice.stages(), po.threads_per_stage);
    c.row.planned_ms = choice.ranking.empty() ? 0 : choice.ranking.front().step_ms;
    c.pipe = std::make_unique<pipeline>(sys, fresh_layers(setup, o.model.seed), choice.cut, po);
    c.plan = c.pipe->training_schedule();
    contenders.push_back(std::move(c));
  };
  pipeline_setting first;
  first.plan = o.plan;
  if (o.plan.layout_auto()) {
    // The planner's layout, measured beside every configuration of the sweep.
    add(first, training::plan_layout(setup.layers, setup.sample(), o.plan).choice(), "plan: ");
    first.plan.threads_auto = false;
    first.plan.stages = 1;
  }
  // Default: --stages, or with --stages auto the stage counts the planner compared.
  auto stage_counts =
    !o.stage_counts.empty() ? o.stage_counts
    : o.plan.stages > 0
      ? std::vector<std::size_t>{o.plan.stages}
      : training::layout_space_for(setup.layers, setup.batch, o.plan).stage_counts;
  std::vector<pipeline_setting> settings{first};
  expand(settings, stage_counts, [](pipeline_setting& s, std::size_t p) { s.plan.stages = p; });
  expand(settings, o.partitions.empty() ? std::vector<std::string>{o.plan.partition} : o.partitions,
         [](pipeline_setting& s, const std::string& spec) { s.plan.partition = spec; });
  expand(settings, o.schedules.empty() ? std::vector<std::string>{o.plan.schedule} : o.schedules,
         [](pipeline_setting& s, const std::string& schedule) { s.plan.schedule = schedule; });
  expand(settings, o.splits, [](pipeline_setting& s, std::size_t m) { s.plan.microbatches = m; });
  expand(settings, memory_modes, [](pipeline_setting& s, const std::string& memory) {
    s.memory = memory;
    s.plan.cold_memory = memory == "cold";
  });
  expand(settings, precisions,
         [](pipeline_setting& s, const std::string& precision) { s.precision = precision; });
  expand(settings, recompute_modes, [&o](pipeline_setting& s, const std::string& recompute) {
    s.plan.recompute = recompute;
    s.plan.recompute_given = s.plan.recompute_given || !o.recompute.empty();
  });
  expand(settings, updates,
         [](pipeline_setting& s, const std::string& update) { s.update = update; });

  for (const auto& s : settings) {
    add(s, training::plan_layout(setup.layers, setup.sample(), s.plan).choice(), "");
  }
  return contenders;
}

// The largest relative difference between two loss series.
double relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    d = std::max(d, std::abs(a[i] - b[i]) / std::max(1e-12, std::abs(b[i])));
  }
  return d;
}

// How far apart the contenders' losses are: all against the first, pipelines against plain
// accumulation over their micro-batches (-1 when there is none).
struct loss_agreement {
  double loss_difference = 0;
  double accumulated_difference = -1;
};

// One row per contender, with its times, ideals, speedups and loss differences.
std::vector<sweep_row> rows_of(const std::vector<contender>& contenders, double flops,
                               double peak_all, loss_agreement& agreement) {
  std::vector<sweep_row> rows;
  // The whole-batch baselines of each precision.
  std::map<std::string, double> plain_1;
  std::map<std::string, double> plain_all;
  for (const auto& c : contenders) {
    auto r = c.row;
    r.min_ms = *std::min_element(c.times.begin(), c.times.end());
    r.max_ms = *std::max_element(c.times.begin(), c.times.end());
    r.median_ms = median(c.times);
    r.gflops = flops / (r.median_ms / 1000) / 1e9;
    r.peak_share = r.gflops / peak_all;
    if (c.pipe) {
      r.lower_bound_ms = median(c.lower);
      r.fill_drain_ms = median(c.fill_drain);
      r.efficiency = r.lower_bound_ms / r.median_ms;
      r.predicted_ms = median(c.predicted);
      r.compute_ms_per_sample = median(c.per_sample);
      r.stash_mb = median(c.stash_mb);
    } else if (r.accumulated == 0) {
      // The whole-batch baselines; accumulated ones are matched with the pipelines below.
      (c.threads == 1 ? plain_1 : plain_all)[r.precision] = r.median_ms;
    }
    rows.push_back(r);
  }
  auto& loss_difference = agreement.loss_difference;
  auto& accumulated_difference = agreement.accumulated_difference;
  for (auto& r : rows) {
    r.speedup_1t = plain_1.count(r.precision) > 0 ? plain_1[r.precision] / r.median_ms : 0;
    r.speedup_all = plain_all.count(r.precision) > 0 ? plain_all[r.precision] / r.median_ms : 0;
    for (const auto& a : rows) {
      if (r.splits > 1 && a.accumulated == r.splits && a.precision == r.precision) {
        r.speedup_accumulated = a.median_ms / r.median_ms;
        r.loss_difference_accumulated = relative_difference(r.losses, a.losses);
        accumulated_difference = std::max(accumulated_difference, r.loss_difference_accumulated);
      }
    }
    r.loss_difference = relative_difference(r.losses, rows.front().losses);
    loss_difference = std::max(loss_difference, r.loss_difference);
  }

  return rows;
}

void print_table(const std::vector<sweep_row>& rows, const loss_agreement& agreement,
                 const std::vector<std::string>& memory_modes, const char* unit) {
  const auto loss_difference = agreement.loss_difference;
  const auto accumulated_difference = agreement.accumulated_difference;
  std::printf("\n%-32s %6s %8s %8s %8s %8s %8s %6s %8s %8s %8s %8s %7s %6s %8s %7s %8s %9s\n",
              "config", "splits", "median", "min", "max", "ideal", "fill", "eff", "predict",
              "vs 1t", "vs all", "vs acc", "GFLOP/s", "peak", "ms/smpl", "RSS MB", "stash", "rate");
  std::printf("%-32s %6s %8s %8s %8s %8s %8s %6s %8s %8s %8s %8s %7s %6s %8s %7s %8s %9s\n", "", "",
              "s/step", "s", "s", "s", "drain s", "", "s", "", "", "", "", "", "compute", "", "MB",
              unit);
  for (const auto& r : rows) {
    std::printf("%s\n", format_row(r).c_str());
  }
  std::printf("ideal: lower bound max(sum/p, slowest stage) of the stages' own measured compute "
              "plus the optimizer step; eff = ideal / median; predict: the simulator with the "
              "step's mean action costs; stash: the most a stage kept for backward at once "
              "(inputs and saved activations); vs 1t/all/acc: against plain libtorch in the "
              "same precision\n");
  std::ostringstream reference_losses;
  for (std::size_t i = 0; i < rows.front().losses.size(); ++i) {
    reference_losses << (i > 0 ? ", " : "") << std::setprecision(9) << rows.front().losses[i];
  }
  std::printf("losses: every configuration's loss at every step within %.1e (relative) of %s's "
              "(%s)\n",
              loss_difference, rows.front().name.c_str(), reference_losses.str().c_str());
  if (accumulated_difference >= 0) {
    std::printf("losses: every pipeline within %.1e (relative) of plain libtorch accumulating over "
                "the same micro-batches (vs acc: speedup over it)\n",
                accumulated_difference);
  }
  auto warm = memory::stats();
  std::printf("warm memory of the stage threads: %zu buffers reused, %zu from the system, %.2f GB "
              "cached at the end%s\n",
              warm.hits, warm.misses, static_cast<double>(warm.cached_bytes) / 1e9,
              memory_modes.size() == 1 && memory_modes[0] == "cold" ? " (cold: off)" : "");
}

// The planner's layout against its prediction and against the fastest of everything measured.
void print_planned(const std::vector<sweep_row>& rows) {
  for (const auto& r : rows) {
    if (r.planned_ms <= 0) {
      continue;
    }
    const sweep_row* fastest = nullptr;
    for (const auto& other : rows) {
      if (&other != &r && (fastest == nullptr || other.median_ms < fastest->median_ms)) {
        fastest = &other;
      }
    }
    std::printf("planner: %s predicted %.3f s/step, measured %.3f (%+.1f%%)", r.name.c_str(),
                r.planned_ms / 1000, r.median_ms / 1000,
                100 * (r.planned_ms - r.median_ms) / r.median_ms);
    if (fastest != nullptr) {
      std::printf("; fastest other configuration %s %.3f s/step: planned / fastest %.3f",
                  fastest->name.c_str(), fastest->median_ms / 1000,
                  r.median_ms / fastest->median_ms);
    }
    std::printf("\n");
  }
}

// --json and --csv.
void write_reports(const sweep_options& o, const std::vector<sweep_row>& rows,
                   const training::model_setup& setup, double flops, double peak_1,
                   double peak_all) {
  const auto& mo = setup.options;
  if (!o.json.empty() || !o.csv.empty()) {
    nlohmann::json j = nlohmann::json::array();
    std::ofstream csv;
    if (!o.csv.empty()) {
      csv.open(o.csv);
      csv << "config,partition,splits,median_ms,min_ms,max_ms,lower_bound_ms,fill_drain_ms,"
             "efficiency,predicted_ms,speedup_1t,speedup_all,speedup_accumulated,gflops,peak_share,"
             "compute_ms_per_sample,rss_mb,precision,recompute,stash_mb\n";
    }
    for (const auto& r : rows) {
      j.push_back({{"config", r.name},
                   {"partition", r.partition},
                   {"splits", r.splits},
                   {"median_ms", r.median_ms},
                   {"min_ms", r.min_ms},
                   {"max_ms", r.max_ms},
                   {"lower_bound_ms", r.lower_bound_ms},
                   {"fill_drain_ms", r.fill_drain_ms},
                   {"efficiency", r.efficiency},
                   {"predicted_ms", r.predicted_ms},
                   {"planned_ms", r.planned_ms},
                   {"threads", r.threads},
                   {"speedup_1t", r.speedup_1t},
                   {"speedup_all", r.speedup_all},
                   {"speedup_accumulated", r.speedup_accumulated},
                   {"accumulated", r.accumulated},
                   {"gflops", r.gflops},
                   {"peak_share", r.peak_share},
                   {"compute_ms_per_sample", r.compute_ms_per_sample},
                   {"rss_mb", r.rss_mb},
                   {"precision", r.precision},
                   {"recompute", r.recompute},
                   {"stash_mb", r.stash_mb},
                   {"per_second", r.per_second},
                   {"stages", r.stages},
                   {"losses", r.losses},
                   {"loss_difference", r.loss_difference},
                   {"loss_difference_accumulated", r.loss_difference_accumulated}});
      if (csv.is_open()) {
        csv << r.name << ',' << r.partition << ',' << r.splits << ',' << r.median_ms << ','
            << r.min_ms << ',' << r.max_ms << ',' << r.lower_bound_ms << ',' << r.fill_drain_ms
            << ',' << r.efficiency << ',' << r.predicted_ms << ',' << r.speedup_1t << ','
            << r.speedup_all << ',' << r.speedup_accumulated << ',' << r.gflops << ','
            << r.peak_share << ',' << r.compute_ms_per_sample << ',' << r.rss_mb << ','
            << r.precision << ',' << r.recompute << ',' << r.stash_mb << '\n';
      }
    }
    if (!o.json.empty()) {
      std::ofstream out(o.json);
      out << nlohmann::json{{"model", setup.name},           {"batch", setup.batch},
                            {"image", mo.image_size},        {"stages", o.plan.stages},
                            {"schedule", o.plan.schedule},   {"steps", o.steps},
                            {"gflop_per_step", flops / 1e9}, {"gemm_gflops_1t", peak_1},
                            {"gemm_gflops_all", peak_all},   {"rows", j}}
               .dump(2)
          << '\n';
    }
  }
}

} // namespace

std::vector<sweep_row> run_sweep(const sweep_options& o) {
  ACTORPIPE_CHECK(o.steps >= 1, "--steps (", o.steps, ") must be >= 1");
  ACTORPIPE_CHECK(!o.splits.empty(), "--splits needs at least one count");
  auto setup = training::build_model(o.model);
  const auto& mo = setup.options;
  auto cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  // The batches: one warm-up and `steps` timed, the same for every contender.
  auto batches = make_batches(setup, o.model.seed + 1, o.steps + 1);
  auto flops = training_flops(setup.layers, batches[0].first);
  auto peak_1 = gemm_gflops(1);
  auto peak_all = gemm_gflops(cores);

  engine sys;
  std::vector<contender> contenders;
  if (o.baselines) {
    contenders = plain_contenders(o, setup, cores);
  }
  for (auto& c : pipeline_contenders(sys, o, setup)) {
    contenders.push_back(std::move(c));
  }

  auto input = setup.file.size() > 0
                 ? detail::concat(o.model.data, " ", setup.example.sizes().slice(1), " ",
                                  setup.example.scalar_type())
               : setup.language_model()
                 ? detail::concat(mo.context, " tokens of ", mo.vocabulary, " (",
                                  setup.batch * mo.context, " tokens per step)")
                 : detail::concat(mo.in_channels, "x", mo.image_size, "x", mo.image_size);
  std::printf("actorpipe bench: %s, batch %lld, input %s, %s stages, schedule %s, "
              "%zu timed steps after 1 warm-up, %d cores, seed %llu\n",
              setup.name.c_str(), static_cast<long long>(setup.batch), input.c_str(),
              o.plan.stages > 0 ? std::to_string(o.plan.stages).c_str() : "auto",
              o.plan.schedule.c_str(), o.steps, cores,
              static_cast<unsigned long long>(o.model.seed));
  std::printf("%.1f GFLOP per step (3 x forward conv/matmul); GEMM 2048^2: %.1f GFLOP/s on 1 "
              "thread, %.1f on %d\n",
              flops / 1e9, peak_1, peak_all, cores);
  auto precisions = precisions_of(o);
  if (std::find(precisions.begin(), precisions.end(), "bf16") != precisions.end()) {
    // What bf16 can gain here: a matrix product of each type, side by side.
    auto fp32 = gemm_gflops(cores, torch::kFloat, 1024);
    auto bf16 = gemm_gflops(cores, torch::kBFloat16, 1024);
    std::printf("GEMM 1024^2 on %d threads: fp32 %.1f GFLOP/s, bf16 %.1f (%.2fx); this CPU %s "
                "bf16 instructions (avx512_bf16 or amx_bf16)\n",
                cores, fp32, bf16, bf16 / fp32, stages::cpu_has_native_bf16() ? "has" : "has no");
  }
  std::fflush(stdout);

  if (std::find(o.updates.begin(), o.updates.end(), "overlap") != o.updates.end()) {
    // Overlapping steps need a step submitted behind the running one: every configuration takes
    // each batch twice, submitted together (plain libtorch one after the other).
    for (auto& c : contenders) {
      c.repeats = 2;
    }
    std::printf("--updates overlap: every configuration trains on each batch twice per measured "
                "step; times are per training step (half the pair's)\n");
  }
  training::progress_bar bar("bench", static_cast<int64_t>((o.steps + 1) * contenders.size()));
  int64_t done = 0;
  for (std::size_t i = 0; i <= o.steps; ++i) {
    for (auto& c : contenders) {
      c.step(batches[i].first, batches[i].second, /*record=*/i > 0);
      if (o.progress) {
        bar.update(++done, c.row.name);
      }
    }
  }

  loss_agreement agreement;
  auto rows = rows_of(contenders, flops, peak_all, agreement);
  // Throughput: samples, or a language model's tokens, per second.
  auto per_step =
    static_cast<double>(setup.batch) * static_cast<double>(setup.language_model() ? mo.context : 1);
  for (auto& r : rows) {
    r.per_second = per_step / (r.median_ms / 1000);
  }
  print_table(rows, agreement, memory_modes_of(o),
              setup.language_model() ? "tokens/s" : "samples/s");
  print_planned(rows);
  write_reports(o, rows, setup, flops, peak_1, peak_all);
  if (!o.plot.empty()) {
    write_plot(o.plot, rows,
               detail::concat(setup.name, ", batch ", setup.batch, ", ", o.plan.stages, " stages, ",
                              o.plan.schedule));
  }
  return rows;
}

} // namespace actorpipe::bench
