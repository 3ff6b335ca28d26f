"""The RPC tutorial's scenario three ways, side by side in one run: PyTorch's RPC pipeline (the
tutorial's DistResNet50: a master and two workers, micro-batch futures under a per-shard lock),
actorpipe's Python module (actorpipe.Pipeline), and the `actorpipe train` program on the same
scripted model and data. Medians of the step times after a warm-up step; each way gets the cores
divided between its two stages (torch threads per worker, actorpipe's threads per stage).

    PYTHONPATH=build/python python3 bench/python/rpc_vs_module.py --json out.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python"))
import rpc_tutorial  # noqa: E402

import actorpipe  # noqa: E402


def threads_per_stage():
    return max(1, (os.cpu_count() or 2) // 2)


class Shard(nn.Module):
    """One of the tutorial's ResNetShard1/2: a part of the Sequential under a lock."""

    def __init__(self, layers):
        super().__init__()
        import threading
        self._lock = threading.Lock()
        self.seq = layers
        torch.set_num_threads(threads_per_stage())

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            return self.seq(x)

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]


def make_shard(index, seed):
    torch.manual_seed(seed)
    seq, cut = rpc_tutorial.resnet50_in_one_sequential()
    return Shard(seq[:cut] if index == 0 else seq[cut:])


class DistResNet50(nn.Module):
    """The tutorial's: chains rpc.remote futures per micro-batch."""

    def __init__(self, split_size, workers, seed):
        super().__init__()
        self.split_size = split_size
        self.p1_rref = rpc.remote(workers[0], make_shard, args=(0, seed))
        self.p2_rref = rpc.remote(workers[1], make_shard, args=(1, seed))

    def forward(self, xs):
        out_futures = []
        for x in iter(xs.split(self.split_size, dim=0)):
            y_rref = self.p1_rref.remote().forward(RRef(x))
            out_futures.append(self.p2_rref.rpc_async().forward(y_rref))
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        return (self.p1_rref.remote().parameter_rrefs().to_here() +
                self.p2_rref.remote().parameter_rrefs().to_here())


def rpc_worker(rank, args, port, result_path):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=300)
    name = "master" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=3, rpc_backend_options=options)
    if rank == 0:
        model = DistResNet50(args.batch // args.microbatches, ["worker1", "worker2"], args.seed)
        opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
        loss_fn = nn.MSELoss()
        times = []
        for inputs, labels in batches(args):
            start = time.perf_counter()
            with dist_autograd.context() as context_id:
                loss = loss_fn(model(inputs), labels)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            times.append((time.perf_counter() - start) * 1000)
        with open(result_path, "w") as f:
            json.dump(times, f)
    rpc.shutdown()


def batches(args):
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(args.steps):
        inputs = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g)
        labels = torch.zeros(args.batch, rpc_tutorial.num_classes)
        labels[torch.arange(args.batch), torch.randint(0, 1000, (args.batch,), generator=g)] = 1
        yield inputs, labels


def run_rpc(args):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.spawn(rpc_worker, args=(args, 29500 + os.getpid() % 1000, f.name), nprocs=3, join=True)
        with open(f.name) as r:
            return json.load(r)


def scripted_model(args):
    torch.manual_seed(args.seed)
    seq, cut = rpc_tutorial.resnet50_in_one_sequential()
    return torch.jit.script(seq), cut


def run_module(args):
    model, cut = scripted_model(args)
    times = []
    with actorpipe.Pipeline(model, stages=2, partition=f"cut:{cut}", microbatches=args.microbatches,
                            loss="mse", optimizer=("sgd", {"lr": 0.05})) as p:
        for inputs, labels in batches(args):
            start = time.perf_counter()
            p.train_step(inputs, labels)
            times.append((time.perf_counter() - start) * 1000)
    return times


def run_cli(args, work):
    model, cut = scripted_model(args)
    model_path, data_path, out = (os.path.join(work, n) for n in ("m.pt", "d.pt", "cli.json"))
    torch.jit.save(model, model_path)
    data = list(batches(args))
    torch.save({"inputs": torch.cat([x for x, _ in data]),
                "targets": torch.cat([y for _, y in data])}, data_path)
    subprocess.run([args.cli, "train", "--model", model_path, "--data", f"tensors:{data_path}",
                    "--batch", str(args.batch), "--steps", str(args.steps), "--stages", "2",
                    "--partition", f"cut:{cut}", "--microbatches", str(args.microbatches),
                    "--loss", "mse", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0",
                    "--no-progress", "--json", out], check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return [s["wall_ms"] for s in json.load(f)["steps"]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cli", default=os.path.join(os.path.dirname(__file__), "..", "..",
                                                      "build", "cli", "actorpipe"))
    parser.add_argument("--json", help="write the medians and every step's time here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="actorpipe-bench-") as work:
        ways = {"rpc": run_rpc(args), "module": run_module(args), "cli": run_cli(args, work)}
    medians = {k: statistics.median(v[1:]) for k, v in ways.items()}
    print(f"ResNet-50, batch {args.batch} of 3x{args.image_size}x{args.image_size}, "
          f"{args.microbatches} micro-batches, 2 stages, {args.steps - 1} steps after a warm-up:")
    for way, ms in medians.items():
        print(f"  {way:7s} median {ms:9.1f} ms per step   ({ms / medians['cli']:.3f}x the CLI)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "median_ms": medians, "step_ms": ways}, f, indent=2)


if __name__ == "__main__":
    main()
