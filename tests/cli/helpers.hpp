// Helpers of the CLI tests: run the program, read its JSON reports, find free ports.
#pragma once

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "../ports.hpp"

namespace actorpipe::test {

struct run_result {
  int exit_code;
  std::string output;
};

// Runs `actorpipe <args>` (or the shell command `args` itself) and collects its output.
inline run_result run(const std::string& args, bool prefix_cli = true) {
  std::string command =
    (prefix_cli ? std::string(ACTORPIPE_CLI_PATH) + " " : std::string{}) + args + " 2>&1";
  std::string output;
  FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) {
    output += buffer;
  }
  int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

inline std::vector<double> losses(const std::filesystem::path& json_file) {
  std::ifstream in(json_file);
  auto report = nlohmann::json::parse(in);
  std::vector<double> result;
  for (const auto& step : report["steps"]) {
    result.push_back(step["loss"].get<double>());
  }
  return result;
}

// tests/oracle/pytorch_script.py run by python3-torch with `args`.
inline run_result pytorch_oracle(const std::string& args) {
  return run("/usr/bin/python3 " + std::string(ACTORPIPE_SOURCE_DIR) +
               "/tests/oracle/pytorch_script.py " + args,
             false);
}

// The oracle's scripted model `name` and its tensor file, made in `dir` (created).
struct oracle_model {
  std::string model;
  std::string data;
};

inline oracle_model make_oracle_model(const std::string& name, const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  auto made = pytorch_oracle("make --model " + name + " --out " + dir.string());
  INFO(made.output);
  REQUIRE(made.exit_code == 0);
  return {(dir / "model.pt").string(), (dir / "data.pt").string()};
}

// The losses of the oracle's `train` with `args` (python3-torch's own training).
inline std::vector<double> oracle_losses(const std::string& args) {
  auto python = pytorch_oracle("train " + args);
  INFO(python.output);
  REQUIRE(python.exit_code == 0);
  return nlohmann::json::parse(python.output.substr(python.output.rfind('{')))["losses"]
    .get<std::vector<double>>();
}

inline std::filesystem::path temp_file(const std::string& name) {
  return std::filesystem::temp_directory_path() /
         ("actorpipe_cli_test_" + std::to_string(::getpid()) + "_" + name);
}

/// `actorpipe <args>` running in the background, its output in a file; killed when destroyed.
class background {
public:
  background(const std::string& args, std::filesystem::path log) : log_(std::move(log)) {
    std::string command =
      "exec " + std::string(ACTORPIPE_CLI_PATH) + " " + args + " > " + log_.string() + " 2>&1";
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~background() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    std::filesystem::remove(log_);
  }
  background(const background&) = delete;
  background& operator=(const background&) = delete;

  /// The output so far.
  std::string output() const {
    std::ifstream in(log_);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  /// Waits (with a deadline) until the output contains `text`.
  bool wait_for(const std::string& text, std::chrono::milliseconds timeout) const {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (output().find(text) != std::string::npos) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  /// Sends `signal` (SIGSTOP, SIGCONT, ...) without waiting.
  void signal(int signal) const { ::kill(pid_, signal); }

  /// Sends `signal` and waits (with a deadline) for the exit; returns the exit code, 128 + the
  /// signal for a kill, or -1 when it did not exit in time.
  int stop(int signal, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    ::kill(pid_, signal);
    auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

private:
  std::filesystem::path log_;
  pid_t pid_ = -1;
};

} // namespace actorpipe::test
