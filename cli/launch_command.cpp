#include "cli/launch_command.hpp"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <actorpipe/errors.hpp>

#include "training/cluster.hpp"

namespace actorpipe::cli {

CLI::App* add_launch_command(CLI::App& app, launch_args& a) {
  auto* cmd = app.add_subcommand(
    "launch", "Start N ranks of an actorpipe command on this host, e.g. "
              "`actorpipe launch --nproc 2 -- train --stages 2`; each rank gets RANK, WORLD_SIZE, "
              "LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun sets them (across hosts: "
              "torchrun or srun, docs/distributed.md)");
  cmd->add_option("--nproc", a.nproc, "Ranks to start")
    ->capture_default_str()
    ->check(CLI::Range(1, 1024));
  cmd->add_option("--master-addr", a.master_addr, "Rendezvous address (rank 0 serves it)")
    ->capture_default_str();
  cmd->add_option("--master-port", a.master_port, "Rendezvous port (0: pick a free one)")
    ->capture_default_str()
    ->check(CLI::Range(0, 65535));
  cmd
    ->add_option("--grace", a.grace_seconds,
                 "Seconds the other ranks get to stop after one failed, before SIGKILL")
    ->capture_default_str();
  cmd->add_option("command", a.command, "The actorpipe subcommand and its flags, after --")
    ->required();
  return cmd;
}

namespace {

int exit_code(int status) {
  if (WIFEXITED(status)) {
    return WEXITSTATUS(status);
  }
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1;
}

// Starts a.nproc copies of this program running a.command, each with its rank in the
// environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun sets them).
std::vector<pid_t> start_ranks(const launch_args& a, int port) {
  std::vector<std::string> argv_text{"/proc/self/exe"};
  argv_text.insert(argv_text.end(), a.command.begin(), a.command.end());
  std::vector<char*> argv;
  for (auto& s : argv_text) {
    argv.push_back(s.data());
  }
  argv.push_back(nullptr);
  std::vector<pid_t> pids;
  for (std::size_t rank = 0; rank < a.nproc; ++rank) {
    pid_t pid = ::fork();
    ACTORPIPE_CHECK(pid >= 0, "launch: fork failed for rank ", rank);
    if (pid == 0) {
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(a.nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", a.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::execv("/proc/self/exe", argv.data());
      std::perror("actorpipe launch: exec");
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  return pids;
}

void signal_running(const std::vector<pid_t>& pids, const std::vector<bool>& done, int signal) {
  for (std::size_t r = 0; r < pids.size(); ++r) {
    if (!done[r]) {
      ::kill(pids[r], signal);
    }
  }
}

// Waits for every rank; the first failure stops the rest (after `grace_seconds`, by force).
// Returns the first failed rank's exit code, or 0.
int wait_for_ranks(const std::vector<pid_t>& pids, double grace_seconds) {
  int result = 0;
  std::size_t running = pids.size();
  std::vector<bool> done(pids.size(), false);
  bool stopping = false;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      auto it = std::find(pids.begin(), pids.end(), pid);
      auto r = static_cast<std::size_t>(it - pids.begin());
      if (it == pids.end() || done[r]) {
        continue;
      }
      done[r] = true;
      --running;
      auto code = exit_code(status);
      if (code != 0 && result == 0) {
        result = code;
        std::cerr << "actorpipe launch: rank " << r << " exited with code " << code
                  << (running > 0 ? "; stopping the other ranks" : "") << '\n';
      }
      continue;
    }
    if (result != 0 && !stopping) {
      stopping = true;
      signal_running(pids, done, SIGTERM);
      stop_deadline = std::chrono::steady_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000));
    }
    if (stopping && std::chrono::steady_clock::now() > stop_deadline) {
      signal_running(pids, done, SIGKILL);
      stop_deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return result;
}

} // namespace

int run_launch(const launch_args& a) {
  ACTORPIPE_CHECK(!a.command.empty(), "launch: no command given (e.g. -- train --stages 2)");
  ACTORPIPE_CHECK(a.command.front() != "launch", "launch: cannot launch `launch` itself");
  auto port = a.master_port > 0 ? static_cast<int>(a.master_port)
                                : static_cast<int>(training::free_port(a.master_addr));
  ACTORPIPE_CHECK(port != 0, "launch: cannot find a free port on ", a.master_addr,
                  "; give one with --master-port");
  std::cerr << "actorpipe launch: " << a.nproc << " ranks, rendezvous " << a.master_addr << ':'
            << port << '\n';
  return wait_for_ranks(start_ranks(a, port), a.grace_seconds);
}

} // namespace actorpipe::cli
