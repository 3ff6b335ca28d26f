"""What a transformers causal language model and a torchvision CNN cost through actorpipe,
against PyTorch eager accumulating the same micro-batches on the same cores, and against
PyTorch's own torch.distributed.pipelining where its pipeline() splits the model (one process per
stage over Gloo, as its docs run it on CPUs). One row per model and runner: the median seconds
per step over --steps after --warmup, and the ratio to eager, measured side by side in one run.

    PYTHONPATH=build-cuda/python .venv-torch/bin/python bench/python/models_bench.py \\
        --json models.json

The models (tests/oracle/hf_models.py's kinds, at bench sizes): a Llama of 4 decoder layers,
width 256, vocabulary 4096, on batches of 16 sequences of 128 tokens; torchvision's ResNet-18 on
batches of 32 images of 64x64. Every runner uses all the cores given (--threads): eager's
intra-op threads, actorpipe's stages share them (2 stages on 2 cores: one each),
torch.distributed.pipelining's processes one each."""
import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "oracle"))
import hf_models  # noqa: E402


def loss_of(output, target):
    return F.cross_entropy(output.flatten(0, -2), target.flatten()) if output.dim() > 2 \
        else F.cross_entropy(output, target)


def make(name, batch):
    torch.manual_seed(0)
    if name == "llama":
        import transformers
        config = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688,
                                          num_hidden_layers=4, num_attention_heads=8,
                                          num_key_value_heads=4, max_position_embeddings=256,
                                          use_cache=False)
        model = transformers.LlamaForCausalLM(config)
        x = torch.randint(0, 4096, (batch, 128))
        return hf_models.wrapped(model), x, torch.randint(0, 4096, (batch, 128))
    import torchvision
    model = torchvision.models.resnet18(num_classes=100)
    return model, torch.randn(batch, 3, 64, 64), torch.randint(0, 100, (batch,))


def median_step(step, warmup, steps):
    times = []
    for k in range(warmup + steps):
        start = time.perf_counter()
        step()
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_eager(model, x, y, m, threads, warmup, steps):
    torch.set_num_threads(threads)
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            (loss_of(model(xs), ys) * (xs.shape[0] / x.shape[0])).backward()
        opt.step()
    return median_step(step, warmup, steps)


def run_actorpipe(model, x, y, m, stages, threads, warmup, steps):
    import actorpipe
    torch.set_num_threads(threads)
    ep = torch.export.export(copy.deepcopy(model), (x[: x.shape[0] // m],),
                             dynamic_shapes=({0: torch.export.Dim("batch", max=4096)},))
    # The cut by profiled time (a CNN's early blocks cost the most and hold the fewest
    # parameters), as `actorpipe train --partition time` makes it.
    with actorpipe.Pipeline(ep, stages=stages, microbatches=m, schedule="1f1b",
                            partition="time", example=x, loss="cross_entropy",
                            optimizer=("sgd", {"lr": 0.01})) as p:
        return median_step(lambda: p.train_step(x, y), warmup, steps), p.stats()["layout"]


def _pipelining_rank(rank, world, name, batch, m, warmup, steps, port, out, cut):
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, pipeline
    from torch.distributed.pipelining import SplitPoint
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, x, y = make(name, batch)
        pipe = pipeline(model, mb_args=(x.chunk(m)[0],), split_spec={cut: SplitPoint.BEGINNING})
        stage = pipe.build_stage(rank, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_of)
        opt = torch.optim.SGD(stage.submod.parameters(), lr=0.01)

        def step():
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            opt.step()
            dist.barrier()
        seconds = median_step(step, warmup, steps)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"seconds": seconds}, f)
    except Exception as e:  # what its pipeline() says of the model, on the rank that failed
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"error": f"{type(e).__name__}: {first}"}, f)
    finally:
        dist.destroy_process_group()


def run_pipelining(name, batch, m, warmup, steps, cut):
    """torch.distributed.pipelining cut where actorpipe's planner cut (before module `cut`)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        port = 29500 + os.getpid() % 1000
        mp.spawn(_pipelining_rank, args=(2, name, batch, m, warmup, steps, port, out, cut),
                 nprocs=2, join=True)
        results = []
        for rank in range(2):
            with open(f"{out}.{rank}") as f:
                results.append(json.load(f))
        # The first rank's cause, not the other's "connection closed" that follows it.
        errors = [r for r in results if "error" in r and "Connection closed" not in r["error"]]
        errors = errors or [r for r in results if "error" in r]
        return errors[0] if errors else results[0]


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,resnet18")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3,
                        help="each runner this many times, in turn; the median of the medians")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    batches = {"llama": 16, "resnet18": 32}
    rows = []
    for name in args.models.split(","):
        model, x, y = make(name, batches[name])
        m = args.microbatches
        eagers, ourses, theirses = [], [], []
        for _ in range(args.rounds):
            eagers.append(run_eager(model, x, y, m, args.threads, args.warmup, args.steps))
            seconds, layout = run_actorpipe(model, x, y, m, 2, args.threads, args.warmup,
                                            args.steps)
            ourses.append(seconds)
            # The Logits wrapper's modules are its model's, one level down.
            cut = layout["layers"][layout["bounds"][1]].split("+")[0]
            theirses.append(run_pipelining(name, batches[name], m, args.warmup, args.steps, cut))
        eager, ours = statistics.median(eagers), statistics.median(ourses)
        theirs = theirses[0] if "error" in theirses[0] else \
            {"seconds": statistics.median(t["seconds"] for t in theirses)}
        row = {"model": name, "batch": batches[name], "microbatches": m, "stages": 2,
               "eager_s": eager, "actorpipe_s": ours, "actorpipe_layers": layout["bounds"],
               "actorpipe_vs_eager": eager / ours}
        if "seconds" in theirs:
            row.update(pipelining_s=theirs["seconds"], actorpipe_vs_pipelining=theirs["seconds"] / ours)
        else:
            row["pipelining_error"] = theirs["error"]
        rows.append(row)
        print(f"{name}: batch {batches[name]}, {m} micro-batches, 2 stages: eager {eager:.3f} s, "
              f"actorpipe {ours:.3f} s ({eager / ours:.2f}x eager), torch.distributed.pipelining "
              + (f"{theirs['seconds']:.3f} s ({theirs['seconds'] / ours:.2f}x)"
                 if "seconds" in theirs else f"refused: {theirs['error']}"), flush=True)
    result = {"cpu": cpu_name(), "cores": args.threads, "torch": torch.__version__, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
