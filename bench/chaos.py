#!/usr/bin/env python3
"""A chaos soak (issue 41, part 6; docs/distributed.md's fault table, docs/benchmarks/resilience.md).

    python3 bench/chaos.py ACTORPIPE [--minutes 30] [--fault-every 30] [--seed 1] [--json OUT]
                           [--faults node-kill,node-stop,driver-kill[,host-crash,link-cut]]
                           [--throughput 0.97] [--kept 0.97] [--memory 0.05]

Trains the small mlp over three `actorpipe node` processes on loopback (3 stages,
--on-node-loss continue, snapshots every 10 steps) twice, for the steps a fault-free run takes
in --minutes (calibrated first):

1. fault-free, every step's loss from its step line;
2. the same command with a fault every --fault-every seconds, drawn (seeded) from: a node killed
   (-9) and started again on its port 2 s later (it is taken back at a step boundary), a node
   stopped (SIGSTOP) for 10 s and continued, the training process killed (-9) and started again
   with `--resume nodes`; with --faults host-crash (not drawn by default), the training process
   and a node killed at once, both started again (the node's stages come from its neighbour's
   copy); with --faults link-cut (needs root and iproute2), the training process and every node
   run in network namespaces of their own on a bridge (tools/netns_hosts.sh), the fault-free runs
   too, and a node's link is cut (set down) for 10 s and restored: the node lives on, unreachable.

Checks, each printed: every step line's loss (replayed steps' too) equals the fault-free run's
at that step, to the 9 digits printed; no step missing; throughput (fault-free seconds over
chaos seconds) at least --throughput (0.97); the time kept at the chaos run's own speed (its
counting steps' own times, each step's first line, plus the fault-free run's time between steps,
over the chaos run's seconds: what the faults cost, which the machine's drift between the two
runs does not move) at least --kept (0.97); the resident memory of the nodes that were never
killed and of the training process at the first fault and at the end within --memory (5%; a
process started again is measured from its start); after the nodes are stopped, no node process
and no listening port left. Exits 1 when one fails, 77 (skipped) when link-cut is asked for where
network namespaces cannot be made. Every wait has a deadline (a run that makes no step for 120 s
fails).
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

STEP = re.compile(r"^step (\d+)/\d+\s+loss ([0-9.eE+-]+)(?:\s+time ([0-9.eE+-]+) s)?", re.M)
COMMON = ("--data synthetic --model mlp --batch 256 --microbatches 8 --threads 1 --lr 0.1 "
          "--seed 3 --stages 3 --on-node-loss continue --snapshot-every 10 "
          "--max-recoveries 100000 --connect-timeout 2000").split()
STALL = 120  # seconds without a step: a hang


def rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def port_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Hosts:
    """Where the processes run: loopback, or (`netns`) a network namespace each, on a bridge, so
    that one node's link can be cut."""

    def __init__(self, ports, netns, work):
        self.netns, self.work = netns, work
        self.secret = []  # addresses off loopback need the shared secret
        self.tag = f"cx{os.getpid() % 10000}{ports[0] % 100}"
        self.net = f"10.{77 + ports[0] % 50}.{ports[0] % 200 + 20}"
        self.names = [f"{self.tag}n{i}" for i in range(len(ports))] + [f"{self.tag}d"]
        self.address = {p: f"{self.net}.{i + 1}" if netns else "127.0.0.1"
                        for i, p in enumerate(ports)}

    def make(self):
        """The namespaces and the secret (remove() takes away what was made, also on failure)."""
        if not self.netns:
            return
        path = os.path.join(self.work, "secret")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write("chaos soak\n")
        self.secret = ["--secret-file", path]
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools",
                              "netns_hosts.sh")
        subprocess.run(["bash", "-c", f'source "{script}" && netns_hosts "$@"', "hosts",
                        f"{self.tag}br", self.net] + self.names, check=True)

    def command(self, index, args):
        """`args` run on host `index` (a node's; -1: the training process's)."""
        return ["ip", "netns", "exec", self.names[index]] + args if self.netns else args

    def link(self, index, up):
        name = self.names[index]
        subprocess.run(["ip", "-n", name, "link", "set", f"v{name}", "up" if up else "down"],
                       check=True)

    def remove(self):
        for name in self.names + [f"{self.tag}br"] if self.netns else []:
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)


class Cluster:
    """The node processes, each on its port; started again where killed."""

    def __init__(self, program, ports, work, hosts):
        self.program, self.ports, self.work, self.hosts = program, ports, work, hosts
        self.procs = {}
        self.started = {}
        for p in ports:
            self.start(p)

    def start(self, port):
        log = open(os.path.join(self.work, f"node{port}.log"), "a")
        offset = log.tell()  # a node started again: its own line, not the one before
        self.procs[port] = subprocess.Popen(
            self.hosts.command(self.ports.index(port), [
                self.program, "node", "--listen", f"{self.hosts.address[port]}:{port}"]
                + self.hosts.secret),
            stdout=log, stderr=subprocess.STDOUT)
        self.started[port] = time.time()
        deadline = time.time() + 20
        while time.time() < deadline:
            with open(log.name, errors="replace") as f:
                f.seek(offset)
                if "listening on" in f.read():
                    return
            time.sleep(0.05)
        raise SystemExit(f"chaos: node {self.hosts.address[port]}:{port} did not listen within "
                         "20 s")

    def nodes(self):
        return ",".join(f"{self.hosts.address[p]}:{p}" for p in self.ports)

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=20)


class Driver:
    """`actorpipe train` over the cluster; its step lines collected across restarts."""

    def __init__(self, program, cluster, steps, work):
        self.program, self.cluster, self.steps, self.work = program, cluster, steps, work
        self.logs = []
        self.proc = None
        self.started = None
        self.found = []  # the step lines read so far, and where each log was read to
        self.seconds = []  # each step line's own time ("time X s"), in the order of `found`
        self.read_to = {}

    def start(self, resume=False):
        path = os.path.join(self.work, f"train{len(self.logs)}.log")
        self.logs.append(path)
        args = [self.program, "train"] + COMMON + ["--steps", str(self.steps), "--nodes",
                                                   self.cluster.nodes()] + self.cluster.hosts.secret
        if resume:
            args += ["--resume", "nodes"]
        self.proc = subprocess.Popen(self.cluster.hosts.command(-1, args), stdout=open(path, "w"),
                                     stderr=subprocess.STDOUT)
        self.started = time.time()

    def lines(self):
        """Every step line so far, each log read on from where it was read to (whole lines)."""
        for path in self.logs:
            with open(path, "rb") as f:
                f.seek(self.read_to.get(path, 0))
                chunk = f.read()
            whole = chunk[:chunk.rfind(b"\n") + 1]
            self.read_to[path] = self.read_to.get(path, 0) + len(whole)
            text = whole.decode(errors="replace")
            for m in STEP.finditer(text):
                self.found.append((int(m.group(1)), m.group(2)))
                self.seconds.append(float(m.group(3) or 0))
        return self.found

    def useful_seconds(self):
        """The seconds of each step's first line: the steps that count, at this run's speed."""
        seen, total = set(), 0.0
        for (step, _), seconds in zip(self.lines(), self.seconds):
            if step not in seen:
                seen.add(step)
                total += seconds
        return total

    def last_step(self):
        lines = self.lines()
        return lines[-1][0] if lines else 0

    def progressed(self, since_lines):
        """Waits for a step line after `since_lines` lines (or the run's end)."""
        deadline = time.time() + STALL
        while time.time() < deadline:
            if len(self.lines()) > since_lines or self.proc.poll() is not None:
                return True
            time.sleep(0.2)
        return False


def run_steps(program, steps, work, faults=None, fault_every=30, seed=1, netns=False):
    """One run of `steps`; with `faults`, a fault every `fault_every` s. Returns the report."""
    base = 20000 + random.Random(seed * 7919 + steps).randrange(10000)
    hosts = Hosts([base, base + 1, base + 2], netns, work)
    try:
        hosts.make()
        return run_on(program, steps, work, faults, fault_every, seed, base, hosts)
    finally:
        hosts.remove()


def run_on(program, steps, work, faults, fault_every, seed, base, hosts):
    cluster = Cluster(program, [base, base + 1, base + 2], work, hosts)
    driver = Driver(program, cluster, steps, work)
    rng = random.Random(seed)
    events, memory = [], {}
    killed = set()
    t0 = time.time()
    driver.start()
    driver_now = None
    try:
        next_fault = t0 + fault_every
        while driver.proc.poll() is None:
            if not driver.progressed(len(driver.lines())):
                raise SystemExit(f"chaos: no step for {STALL} s: {driver.logs[-1]}")
            # The training process's size: from 20 s after its start (warm), the latest while
            # it lives.
            if time.time() - driver.started > 20:
                driver_now = rss_kb(driver.proc.pid) or driver_now
                if memory and memory.get("driver") is None:
                    memory["driver"] = driver_now
            # No fault in the last tenth of the steps: it would outlast the run.
            if faults is None or time.time() < next_fault or driver.last_step() > 0.9 * steps:
                continue
            if not memory:  # first fault: the baseline of every process alive
                memory = {"driver": driver_now}
                memory.update({p: rss_kb(q.pid) for p, q in cluster.procs.items()})
            kind = rng.choice(faults)
            before = len(driver.lines())
            at = time.time() - t0
            port = rng.choice(cluster.ports)
            if kind == "node-kill":
                cluster.procs[port].kill()
                cluster.procs[port].wait()
                killed.add(port)
                time.sleep(2)
                cluster.start(port)
            elif kind == "node-stop":
                cluster.procs[port].send_signal(signal.SIGSTOP)
                time.sleep(10)
                cluster.procs[port].send_signal(signal.SIGCONT)
            elif kind == "link-cut":  # the node lives on, unreachable for 10 s
                hosts.link(cluster.ports.index(port), False)
                time.sleep(10)
                hosts.link(cluster.ports.index(port), True)
            elif kind == "host-crash":  # the training process and a node at once
                driver.proc.kill()
                cluster.procs[port].kill()
                driver.proc.wait()
                cluster.procs[port].wait()
                killed.add(port)
                time.sleep(2)
                cluster.start(port)
                driver.start(resume=True)
                memory["driver"] = driver_now = None
            else:  # driver-kill
                port = None
                driver.proc.kill()
                driver.proc.wait()
                driver.start(resume=True)
                memory["driver"] = driver_now = None  # a new process: measured anew
            ok = driver.progressed(before)
            events.append({"at_s": round(at, 1), "fault": kind, "node": port,
                           "to_next_step_s": round(time.time() - t0 - at, 2),
                           "step": driver.last_step()})
            print(f"chaos: {at:7.1f} s {kind:10s} {port or '':>6} -> step "
                  f"{driver.last_step()}", file=sys.stderr, flush=True)
            if not ok:
                raise SystemExit(f"chaos: no step for {STALL} s after {kind}")
            next_fault = time.time() + fault_every
        end = {"driver": driver_now}
        end.update({p: rss_kb(q.pid) for p, q in cluster.procs.items()})
        seconds = time.time() - t0
        code = driver.proc.returncode
    finally:
        if driver.proc.poll() is None:
            driver.proc.kill()
        cluster.stop()
    leftovers = [p for p in cluster.ports if not hosts.netns and not port_free(p)]
    alive = subprocess.run(["pgrep", "-f", f"^{re.escape(program)} node --listen [0-9.]+:"
                            f"({base}|{base + 1}|{base + 2})( |$)"], capture_output=True,
                           text=True).stdout.split()
    return {"seconds": seconds, "exit": code, "lines": driver.lines(),
            "step_seconds": driver.useful_seconds(), "events": events,
            "memory_first_fault": memory, "memory_end": end, "killed": sorted(killed),
            "ports_left": leftovers, "processes_left": alive, "logs": driver.logs}


def namespaces_allowed():
    """Whether this process may make network namespaces (root, iproute2, a kernel that lets it)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"chaosprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], stderr=subprocess.DEVNULL).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], stderr=subprocess.DEVNULL)
    return made


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("program")
    a.add_argument("--minutes", type=float, default=30)
    a.add_argument("--fault-every", type=float, default=30)
    a.add_argument("--seed", type=int, default=1)
    a.add_argument("--throughput", type=float, default=0.97,
                   help="the least fault-free seconds over chaos seconds")
    a.add_argument("--kept", type=float, default=0.97,
                   help="the least share of the chaos run's time its counting steps take at its "
                        "own speed (with the fault-free run's time between steps): what the "
                        "faults cost, apart from the machine's drift between the runs")
    a.add_argument("--memory", type=float, default=0.05,
                   help="the largest growth of a process's resident memory (a share)")
    a.add_argument("--faults", default="node-kill,node-stop,driver-kill",
                   help="the faults to draw from (comma-separated)")
    a.add_argument("--json")
    a.add_argument("--logs", help="keep every process's log in this folder")
    args = a.parse_args()
    program = os.path.abspath(args.program)
    with tempfile.TemporaryDirectory() as temporary:
        work = args.logs or temporary
        for sub in "cfx":
            os.makedirs(os.path.join(work, sub), exist_ok=True)
        netns = "link-cut" in args.faults.split(",")  # every run in namespaces, to compare
        if netns and not namespaces_allowed():
            print("chaos: skipped: a cut link needs root, iproute2 and network namespaces",
                  flush=True)
            sys.exit(77)
        # The process's start (~1-2 s) is in the calibration's time: over 200 steps it reads
        # a step a third slower than it is, so a long soak calibrates over 1,000.
        trial = 1000 if args.minutes >= 5 else 200
        calibration = run_steps(program, trial, os.path.join(work, "c"), netns=netns)
        per_step = calibration["seconds"] / trial
        steps = max(50, int(args.minutes * 60 / per_step))
        print(f"chaos: {per_step * 1000:.1f} ms a step fault-free: {steps} steps for "
              f"{args.minutes} min", file=sys.stderr, flush=True)
        free = run_steps(program, steps, os.path.join(work, "f"), netns=netns)
        chaos = run_steps(program, steps, os.path.join(work, "x"),
                          args.faults.split(","), args.fault_every, args.seed, netns)
        checks = check(free, chaos, steps, (args.throughput, args.kept), args.memory)
    report = {"steps": steps, "fault_free_s": free["seconds"], "chaos_s": chaos["seconds"],
              "throughput": free["seconds"] / chaos["seconds"],
              "kept_at_own_speed": kept_at_own_speed(free, chaos, steps),
              "fault_free_step_s": free["step_seconds"], "chaos_step_s": chaos["step_seconds"],
              "events": chaos["events"],
              "memory_first_fault": chaos["memory_first_fault"],
              "memory_end": chaos["memory_end"], "checks": checks}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    failed = [c for c in checks if not c["ok"]]
    for c in checks:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['what']}: {c['detail']}")
    sys.exit(1 if failed else 0)


def kept_at_own_speed(free, chaos, steps):
    """The share of the chaos run's time that its counting steps (each step's first line) take,
    at the chaos run's own speed, with the fault-free run's time between steps (data, logging)
    per step: 1 less what detection, recovery, restarts and replayed steps cost. Unlike the
    throughput, the machine's drift between the two runs does not move it."""
    between = max(0.0, free["seconds"] - free["step_seconds"]) / steps
    return (chaos["step_seconds"] + between * steps) / chaos["seconds"] if chaos["seconds"] else 0


def check(free, chaos, steps, bars, memory):
    throughput, kept = bars
    reference = dict(free["lines"])
    checks = []

    def add(what, ok, detail):
        checks.append({"what": what, "ok": bool(ok), "detail": detail})

    add("fault-free run", free["exit"] == 0 and len(reference) == steps,
        f"exit {free['exit']}, {len(reference)} of {steps} steps")
    add("chaos run", chaos["exit"] == 0, f"exit {chaos['exit']}, {len(chaos['events'])} faults: "
        + ", ".join(f"{k} x{sum(e['fault'] == k for e in chaos['events'])}"
                    for k in ("node-kill", "node-stop", "driver-kill", "host-crash", "link-cut")))
    differ = [(s, l, reference.get(s)) for s, l in chaos["lines"] if reference.get(s) != l]
    seen = {s for s, _ in chaos["lines"]}
    add("every step's loss equals the fault-free run's", not differ and len(seen) == steps,
        f"{len(chaos['lines'])} step lines ({len(chaos['lines']) - len(seen)} replayed), "
        f"{steps - len(seen)} steps missing, {len(differ)} differ"
        + (f"; first: step {differ[0][0]} {differ[0][1]} against {differ[0][2]}" if differ
           else ""))
    ratio = free["seconds"] / chaos["seconds"] if chaos["seconds"] > 0 else 0
    add(f"throughput at least {throughput:.0%} of the fault-free run's", ratio >= throughput,
        f"{ratio:.3f} ({free['seconds']:.1f} s against {chaos['seconds']:.1f} s)")
    own = kept_at_own_speed(free, chaos, steps)
    add(f"time kept at the chaos run's own speed at least {kept:.0%}", own >= kept,
        f"{own:.3f} (its counting steps {chaos['step_seconds']:.1f} s of {chaos['seconds']:.1f} "
        f"s; the fault-free run's {free['step_seconds']:.1f} s of {free['seconds']:.1f} s)")
    growth = []
    for who, first in chaos["memory_first_fault"].items():
        end = chaos["memory_end"].get(who)
        if first and end and who not in chaos["killed"]:
            growth.append((who, end / first - 1))
    add(f"memory flat (within {memory:.0%})", all(abs(g) <= memory for _, g in growth),
        ", ".join(f"{'node ' if w != 'driver' else ''}{w}: {g:+.1%}" for w, g in growth)
        or "no process lived through the run")
    add("no process nor port left", not chaos["ports_left"] and not chaos["processes_left"],
        f"ports {chaos['ports_left']}, processes {chaos['processes_left']}")
    return checks


main()
