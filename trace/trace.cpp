#include <actorpipe/trace.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include <actorpipe/errors.hpp>

namespace actorpipe {
namespace {

std::size_t chunks_in(const step_result& step) {
  int32_t most = 0;
  for (const auto& s : step.stages) {
    for (const auto& a : s.actions) {
      most = std::max(most, a.what.chunk);
    }
  }
  return static_cast<std::size_t>(most) + 1;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.flush();
  if (!out) {
    throw pipeline_error(detail::concat("cannot write '", path, "'"),
                         error_details{error_kind::io});
  }
}

const char* colour_of(action_kind kind) {
  switch (kind) {
  case action_kind::forward:
    return "#4C78A8";
  case action_kind::backward:
    return "#54A24B";
  case action_kind::weight:
    return "#F58518";
  }
  return "#999999";
}

// The tracks' names: a host track per stage, the data track where the loop measured its waits,
// and a GPU track per stage where any action has the device's times.
struct tracks {
  std::size_t stages = 0;
  std::size_t device_tid = 0;
  bool device = false;
};

tracks name_tracks(nlohmann::json& events, const std::vector<step_result>& steps) {
  std::size_t stages = steps.empty() ? 0 : steps.front().stages.size();
  for (std::size_t s = 0; s < stages; ++s) {
    events.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", 1},
                      {"tid", s},
                      {"args", {{"name", detail::concat("stage ", s)}}}});
  }
  // The training loop's wait for each batch (train() measures it): a track of its own, before
  // each step, so a loader that keeps ahead shows as slivers and one that does not as gaps.
  const bool data_track = std::any_of(
    steps.begin(), steps.end(), [](const step_result& s) { return s.data_wait_ms.has_value(); });
  if (data_track) {
    events.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", 1},
                      {"tid", stages},
                      {"args", {{"name", "data: wait for batch"}}}});
  }
  // Stages on GPUs: a track per stage for when their actions ran on the device (tids after the
  // data track), beside the host's track of when they were queued.
  const bool device_tracks = std::any_of(steps.begin(), steps.end(), [](const step_result& s) {
    return std::any_of(s.stages.begin(), s.stages.end(), [](const stage_stats& st) {
      return std::any_of(st.actions.begin(), st.actions.end(),
                         [](const action_record& a) { return a.device_start_ms >= 0; });
    });
  });
  const std::size_t device_tid = stages + 1;
  for (std::size_t s = 0; device_tracks && s < stages; ++s) {
    events.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", 1},
                      {"tid", device_tid + s},
                      {"args", {{"name", detail::concat("stage ", s, " on its GPU")}}}});
  }
  return {stages, device_tid, device_tracks};
}

// Where each action ran: (kind, micro-batch, virtual stage) -> (stage, record).
using placed_actions =
  std::map<std::tuple<action_kind, int32_t, std::size_t>, std::pair<std::size_t, action_record>>;

// Action `a` of stage `s` on the host's track, and on its GPU's where measured.
void add_action(nlohmann::json& events, const step_result& step, std::size_t s,
                const action_record& a, double offset_ms, std::size_t device_tid) {
  events.push_back({{"ph", "X"},
                    {"name", to_string(a.what)},
                    {"cat", a.what.kind == action_kind::forward    ? "forward"
                            : a.what.kind == action_kind::backward ? "backward"
                                                                   : "weight"},
                    {"pid", 1},
                    {"tid", s},
                    {"ts", (offset_ms + a.start_ms) * 1000},
                    {"dur", (a.end_ms - a.start_ms) * 1000},
                    {"args",
                     {{"step", step.step},
                      {"microbatch", a.what.microbatch},
                      {"chunk", a.what.chunk},
                      {"bytes_sent", a.bytes_sent}}}});
  if (a.device_start_ms >= 0 && a.device_end_ms >= a.device_start_ms) {
    events.push_back({{"ph", "X"},
                      {"name", to_string(a.what)},
                      {"cat", "device"},
                      {"pid", 1},
                      {"tid", device_tid + s},
                      {"ts", (offset_ms + a.device_start_ms) * 1000},
                      {"dur", (a.device_end_ms - a.device_start_ms) * 1000},
                      {"args", {{"step", step.step}, {"microbatch", a.what.microbatch}}}});
  }
}

// The replica sync after each stage's last backward (data parallelism).
void add_syncs(nlohmann::json& events, const step_result& step, double offset_ms) {
  auto p = step.stages.size();
  for (std::size_t s = 0; s < p; ++s) {
    const auto& st = step.stages[s];
    if (st.sync_end_ms > st.sync_start_ms) {
      events.push_back({{"ph", "X"},
                        {"name", "all-reduce"},
                        {"cat", "sync"},
                        {"pid", 1},
                        {"tid", s},
                        {"ts", (offset_ms + st.sync_start_ms) * 1000},
                        {"dur", (st.sync_end_ms - st.sync_start_ms) * 1000},
                        {"args", {{"step", step.step}, {"bytes", st.sync_bytes}}}});
    }
  }
}

// Flow arrows: forward vs -> forward vs + 1, backward vs -> backward vs - 1.
void add_sends(nlohmann::json& events, const placed_actions& placed, std::size_t virtual_stages,
               double offset_ms, uint64_t& flow_id) {
  for (const auto& [k, where] : placed) {
    auto [kind, mb, vs] = k;
    if (kind == action_kind::weight || where.second.bytes_sent == 0) {
      continue;
    }
    auto to_vs = kind == action_kind::forward ? vs + 1 : vs - 1;
    auto it = placed.find({kind, mb, to_vs});
    if (it == placed.end() || to_vs >= virtual_stages) {
      continue;
    }
    const char* name = kind == action_kind::forward ? "activation" : "gradient";
    ++flow_id;
    events.push_back({{"ph", "s"},
                      {"name", name},
                      {"cat", "send"},
                      {"id", flow_id},
                      {"pid", 1},
                      {"tid", where.first},
                      {"ts", (offset_ms + where.second.end_ms) * 1000}});
    events.push_back({{"ph", "f"},
                      {"bp", "e"},
                      {"name", name},
                      {"cat", "send"},
                      {"id", flow_id},
                      {"pid", 1},
                      {"tid", it->second.first},
                      {"ts", (offset_ms + it->second.second.start_ms) * 1000}});
  }
}

// One step's actions (on the host, and on the GPU where measured), replica syncs and sends, at
// `offset_ms` on the trace's time axis.
void add_step(nlohmann::json& events, const step_result& step, double offset_ms, const tracks& t,
              uint64_t& flow_id) {
  auto p = step.stages.size();
  placed_actions placed;
  for (std::size_t s = 0; s < p; ++s) {
    for (const auto& a : step.stages[s].actions) {
      auto vs = virtual_stage_of(step.placement, p, s, static_cast<std::size_t>(a.what.chunk));
      placed[{a.what.kind, a.what.microbatch, vs}] = {s, a};
      add_action(events, step, s, a, offset_ms, t.device_tid);
    }
  }
  add_syncs(events, step, offset_ms);
  add_sends(events, placed, p * chunks_in(step), offset_ms, flow_id);
}

} // namespace

void write_chrome_trace(const std::string& path, const std::vector<step_result>& steps) {
  nlohmann::json events = nlohmann::json::array();
  auto t = name_tracks(events, steps);
  double offset_ms = 0;
  uint64_t flow_id = 0;
  for (const auto& step : steps) {
    if (step.data_wait_ms) {
      events.push_back({{"ph", "X"},
                        {"name", "wait for batch"},
                        {"cat", "data"},
                        {"pid", 1},
                        {"tid", t.stages},
                        {"ts", offset_ms * 1000},
                        {"dur", *step.data_wait_ms * 1000},
                        {"args", {{"step", step.step}, {"wait_ms", *step.data_wait_ms}}}});
      offset_ms += *step.data_wait_ms;
    }
    add_step(events, step, offset_ms, t, flow_id);
    offset_ms += step.wall_ms;
  }
  nlohmann::json trace{{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  write_file(path, trace.dump());
}

std::vector<std::vector<timed_action>> timeline_of(const step_result& step) {
  std::vector<std::vector<timed_action>> rows;
  for (const auto& s : step.stages) {
    rows.emplace_back();
    for (const auto& a : s.actions) {
      rows.back().push_back({a.what, a.start_ms, a.end_ms});
    }
  }
  return rows;
}

void write_gantt_svg(const std::string& path, const std::vector<std::vector<timed_action>>& rows,
                     const std::string& title, const std::string& unit) {
  double end = 0;
  for (const auto& row : rows) {
    for (const auto& a : row) {
      end = std::max(end, a.end);
    }
  }
  end = std::max(end, 1e-9);
  const double left = 80;
  const double width = 1000;
  const double row_height = 36;
  const double top = 50;
  auto height = top + row_height * static_cast<double>(rows.size()) + 60;
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << left + width + 20 << "\" height=\""
      << height << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << left << "\" y=\"24\" font-size=\"15\">" << title << "</text>\n";
  for (std::size_t s = 0; s < rows.size(); ++s) {
    auto y = top + row_height * static_cast<double>(s);
    svg << "<text x=\"8\" y=\"" << y + row_height / 2 + 4 << "\">stage " << s << "</text>\n";
    for (const auto& a : rows[s]) {
      auto x = left + width * a.start / end;
      auto w = std::max(0.5, width * (a.end - a.start) / end);
      svg << "<rect x=\"" << x << "\" y=\"" << y + 4 << "\" width=\"" << w << "\" height=\""
          << row_height - 8 << "\" fill=\"" << colour_of(a.what.kind)
          << "\" stroke=\"white\" stroke-width=\"0.5\"><title>" << to_string(a.what) << ": "
          << a.start << " - " << a.end << ' ' << unit << "</title></rect>\n";
      if (w > 14) {
        svg << "<text x=\"" << x + w / 2 << "\" y=\"" << y + row_height / 2 + 4
            << "\" fill=\"white\" text-anchor=\"middle\">" << a.what.microbatch
            << (a.what.chunk > 0 ? detail::concat("@", a.what.chunk) : std::string{})
            << "</text>\n";
      }
    }
  }
  auto axis_y = top + row_height * static_cast<double>(rows.size()) + 10;
  svg << "<line x1=\"" << left << "\" y1=\"" << axis_y << "\" x2=\"" << left + width << "\" y2=\""
      << axis_y << "\" stroke=\"black\"/>\n";
  for (int tick = 0; tick <= 10; ++tick) {
    auto x = left + width * tick / 10.0;
    char label[32];
    std::snprintf(label, sizeof label, end >= 100 ? "%.0f" : "%.3g", end * tick / 10.0);
    svg << "<line x1=\"" << x << "\" y1=\"" << axis_y << "\" x2=\"" << x << "\" y2=\"" << axis_y + 5
        << "\" stroke=\"black\"/><text x=\"" << x << "\" y=\"" << axis_y + 18
        << "\" text-anchor=\"middle\">" << label << "</text>\n";
  }
  svg << "<text x=\"" << left + width << "\" y=\"" << axis_y + 34 << "\" text-anchor=\"end\">"
      << unit << "</text>\n";
  double lx = left;
  for (auto kind : {action_kind::forward, action_kind::backward, action_kind::weight}) {
    const char* name = kind == action_kind::forward    ? "forward"
                       : kind == action_kind::backward ? "backward (B)"
                                                       : "weight gradient (W)";
    svg << "<rect x=\"" << lx << "\" y=\"" << axis_y + 26 << "\" width=\"12\" height=\"12\" fill=\""
        << colour_of(kind) << "\"/><text x=\"" << lx + 16 << "\" y=\"" << axis_y + 36 << "\">"
        << name << "</text>\n";
    lx += 150;
  }
  svg << "</svg>\n";
  write_file(path, svg.str());
}

} // namespace actorpipe
