#!/usr/bin/env python3
"""Predicted memory per stage against measured (docs/memory.md, docs/benchmarks/planner.md).

    python3 bench/memory_model.py build/cli/actorpipe [--resnet50] [--gpu] [--json OUT]

For each case, `actorpipe plan` predicts every stage's peak (parameters, gradients, optimizer
state, stashed activations, and the working set of one action) and `actorpipe train --json`
measures the same layout: gradients and optimizer state held (stage_stats::gradient_bytes,
optimizer_bytes; parameters count as much as their gradients), the most the stage stashed
(peak_stash_bytes, recomputed activations included while they live) and the most one action
needed beyond that (peak_working_bytes, on the CPU), the largest over the steps after the
first. "kept" compares all but the working set; "peak" all of it. Cases: the
gpt on fortunes, a TorchScript CNN scripted here by PyTorch, each with and without
`--recompute always`, the gpt under ZB-H1 and DualPipeV (split backwards; two chunks per stage
in a V), and with --resnet50 the bench's ResNet-50 (minutes on 2 cores).

With --gpu (the CUDA build, a GPU): plan profiles the layers on cuda:0 (--profile-device) and
each stage is measured on cuda:0 with the other stage on the CPU (`--devices cuda:0,cpu`, then
`cpu,cuda:0`), so that the caching allocator's peak on the GPU (stage_stats::device_peak_bytes)
is that stage's alone: that is the measured peak there (it also holds what the model leaves
out: the loss's temporaries, the allocator's rounding).
"""
import json
import os
import re
import subprocess
import sys
import tempfile

STAGE = re.compile(
    r"stage (\d+): busy .*; memory ([0-9.]+) MB \(parameters ([0-9.]+), gradients ([0-9.]+), "
    r"optimizer ([0-9.]+), activations ([0-9.]+), working ([0-9.]+), workspace ([0-9.]+)\)")


def script_cnn(directory):
    """A scripted CNN (convolutions, batch norm, pooling) and 256 images of 3x64x64."""
    import torch
    import torch.nn as nn
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(128, 10))
    model_path = os.path.join(directory, "cnn.pt")
    data_path = os.path.join(directory, "images.pt")
    torch.jit.save(torch.jit.script(model), model_path)
    torch.save({"inputs": torch.randn(256, 3, 64, 64), "targets": torch.randint(10, (256,))},
               data_path)
    return f"--model {model_path} --data tensors:{data_path} --batch 64"


def run(actorpipe, args):
    result = subprocess.run([actorpipe] + args.split(), capture_output=True, text=True,
                            errors="replace")
    if result.returncode != 0:
        sys.exit(f"actorpipe {args} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result.stdout


def train_stats(actorpipe, model, layout, steps, directory, devices):
    """Per stage: [gradients, optimizer, peak stash, device peak, working] in MB, the most over
    the steps after the first."""
    report_path = os.path.join(directory, "report.json")
    trace_path = os.path.join(directory, "trace.json")  # makes train keep every step's stats
    run(actorpipe, f"train {model} {layout} --steps {steps} --no-progress --json {report_path} "
                   f"--trace {trace_path}" + (f" --devices {devices}" if devices else ""))
    with open(report_path) as f:
        report = json.load(f)
    measured = {}
    for step in report["steps"][1:]:
        for s in step.get("stages", []):
            mb = [s["gradient_bytes"] / 1e6, s["optimizer_bytes"] / 1e6,
                  s["peak_stash_bytes"] / 1e6, s.get("device_peak_bytes", -1) / 1e6,
                  s.get("peak_working_bytes", -1) / 1e6]
            old = measured.get(s["stage"], [0, 0, 0, -1, -1])
            measured[s["stage"]] = [max(a, b) for a, b in zip(old, mb)]
    return measured


def measure(actorpipe, name, model, layout, steps, directory, gpu):
    predicted = {}
    device = " --profile-device cuda:0" if gpu else ""
    plan = run(actorpipe, f"plan {model} {layout} --profile-repeats 2{device}")
    for m in STAGE.finditer(plan):
        predicted[int(m.group(1))] = [float(m.group(i)) for i in range(2, 9)]
    if gpu:  # each stage alone on the GPU, the other on the CPU
        measured = {}
        for stage in sorted(predicted):
            devices = ",".join("cuda:0" if k == stage else "cpu" for k in sorted(predicted))
            measured[stage] = train_stats(actorpipe, model, layout, steps, directory,
                                          devices)[stage]
    else:
        measured = train_stats(actorpipe, model, layout, steps, directory, None)
    rows = []
    for stage, p in sorted(predicted.items()):
        g, o, a, device_peak, working = measured[stage]
        kept = 2 * g + o + a
        # The CPU has no workspaces (the prediction's are 0 there).
        peak = device_peak if gpu else kept + working
        rows.append({"case": name, "stage": stage, "predicted": p, "measured": [g, o, a, working],
                     "predicted_kept": p[0] - p[5] - p[6], "measured_kept": kept,
                     "error": (p[0] - p[5] - p[6] - kept) / kept if kept > 0 else 0.0,
                     "predicted_peak": p[0], "measured_peak": peak,
                     "peak_error": (p[0] - peak) / peak if peak > 0 else 0.0,
                     "device_peak": device_peak})
    return rows


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    actorpipe = sys.argv[1]
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    layout = "--stages 2 --microbatches 4 --schedule 1f1b"
    gpu = "--gpu" in sys.argv
    with tempfile.TemporaryDirectory() as directory:
        cnn = script_cnn(directory)
        # The GPU machine has no fortunes: there the gpt trains on synthetic token sequences.
        gpt, gpt_name = (("--data synthetic --model gpt --width 512 --layers 4 --heads 8 "
                          "--context 128 --batch 16", "gpt (width 512, 128 tokens), Adam")
                         if gpu else ("--data text", "gpt on fortunes, Adam"))
        cases = [
            (gpt_name, gpt, layout, 3),
            (gpt_name + ", recompute always", gpt, layout + " --recompute always", 3),
            # Split backwards (what B keeps for W), and two chunks per stage in a V (on a GPU
            # each on a stream of its own, with its own workspaces).
            (gpt_name + ", ZB-H1", gpt, layout.replace("--schedule 1f1b", "--schedule zb-h1"), 3),
            (gpt_name + ", DualPipeV", gpt,
             layout.replace("--schedule 1f1b", "--schedule dualpipe-v"), 3),
            ("TorchScript CNN, 64 images 3x64x64, SGD", cnn, layout + " --partition params", 3),
            ("TorchScript CNN, recompute always", cnn,
             layout + " --partition params --recompute always", 3),
        ]
        if "--resnet50" in sys.argv:
            # On a GPU by parameters: a cut by time would be profiled on each run's first
            # device (the GPU or the CPU) and differ between them.
            resnet = layout + (" --partition params" if gpu else " --partition time")
            cases.append(("ResNet-50, batch 120, SGD", "--data synthetic --model resnet50",
                          resnet, 2))
            cases.append(("ResNet-50, recompute always", "--data synthetic --model resnet50",
                          resnet + " --recompute always", 2))
        rows = []
        for name, model, case_layout, steps in cases:
            print(f"measuring: {name}", file=sys.stderr, flush=True)
            rows += measure(actorpipe, name, model, case_layout, steps, directory, gpu)
            if out:  # what was measured so far, should a later case not finish
                with open(out, "w") as f:
                    json.dump(rows, f, indent=1)
    where = "the GPU's peak (device_peak_bytes)" if gpu else "kept + working"
    print("| case | stage | predicted: parameters, gradients, optimizer, activations, working, "
          "workspace (MB) "
          "| measured: gradients, optimizer, peak stash, working (MB) | kept, predicted / measured "
          f"| peak, predicted / measured ({where}) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        p, m = r["predicted"], r["measured"]
        working = f"{m[3]:.2f}" if m[3] >= 0 else "-"
        print(f"| {r['case']} | {r['stage']} | {p[1]:.1f}, {p[2]:.1f}, {p[3]:.1f}, {p[4]:.1f}, "
              f"{p[5]:.1f}, {p[6]:.1f} | {m[0]:.2f}, {m[1]:.2f}, {m[2]:.2f}, {working} | "
              f"{r['predicted_kept']:.1f} / {r['measured_kept']:.1f} ({100 * r['error']:+.1f}%) | "
              f"{r['predicted_peak']:.1f} / {r['measured_peak']:.1f} "
              f"({100 * r['peak_error']:+.1f}%) |")
    worst = max(abs(r["error"]) for r in rows)
    worst_peak = max(abs(r["peak_error"]) for r in rows)
    print(f"\nlargest difference: kept {100 * worst:.1f}%, peak {100 * worst_peak:.1f}%")
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


main()
