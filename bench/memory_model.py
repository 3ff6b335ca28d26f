#!/usr/bin/env python3
"""Predicted memory per stage against measured (docs/memory.md, BENCHMARKS.md).

    python3 bench/memory_model.py build/cli/actorpipe [--resnet50] [--json OUT]

For each case, `actorpipe plan` predicts every stage's peak (parameters, gradients, optimizer
state, stashed activations) and `actorpipe train --json` measures the same layout: gradients
and optimizer state held (stage_stats::gradient_bytes, optimizer_bytes; parameters count as
much as their gradients) and the most the stage stashed (peak_stash_bytes, recomputed
activations included while they live), the largest over the steps after the first. Cases: the
gpt on fortunes, a TorchScript CNN scripted here by PyTorch, each with and without
`--recompute always`, and with --resnet50 the bench's ResNet-50 (minutes on 2 cores).
"""
import json
import os
import re
import subprocess
import sys
import tempfile

STAGE = re.compile(
    r"stage (\d+): busy .*; memory ([0-9.]+) MB \(parameters ([0-9.]+), gradients ([0-9.]+), "
    r"optimizer ([0-9.]+), activations ([0-9.]+)\)")


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


def measure(actorpipe, name, model, layout, steps, directory):
    predicted = {}
    for m in STAGE.finditer(run(actorpipe, f"plan {model} {layout} --profile-repeats 2")):
        predicted[int(m.group(1))] = [float(m.group(i)) for i in range(2, 7)]
    report_path = os.path.join(directory, "report.json")
    trace_path = os.path.join(directory, "trace.json")  # makes train keep every step's stats
    run(actorpipe, f"train {model} {layout} --steps {steps} --no-progress --json {report_path} "
                   f"--trace {trace_path}")
    with open(report_path) as f:
        report = json.load(f)
    measured = {}
    for step in report["steps"][1:]:
        for s in step.get("stages", []):
            mb = [s["gradient_bytes"] / 1e6, s["optimizer_bytes"] / 1e6,
                  s["peak_stash_bytes"] / 1e6]
            old = measured.get(s["stage"], [0, 0, 0])
            measured[s["stage"]] = [max(a, b) for a, b in zip(old, mb)]
    rows = []
    for stage, p in sorted(predicted.items()):
        g, o, a = measured[stage]
        total = 2 * g + o + a
        rows.append({"case": name, "stage": stage, "predicted": p, "measured": [g, o, a],
                     "predicted_total": p[0], "measured_total": total,
                     "error": (p[0] - total) / total if total > 0 else 0.0})
    return rows


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    actorpipe = sys.argv[1]
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    layout = "--stages 2 --microbatches 4 --schedule 1f1b"
    with tempfile.TemporaryDirectory() as directory:
        cnn = script_cnn(directory)
        cases = [
            ("gpt on fortunes, Adam", "--data text", layout, 3),
            ("gpt on fortunes, Adam, recompute always", "--data text",
             layout + " --recompute always", 3),
            ("TorchScript CNN, 64 images 3x64x64, SGD", cnn, layout + " --partition params", 3),
            ("TorchScript CNN, recompute always", cnn,
             layout + " --partition params --recompute always", 3),
        ]
        if "--resnet50" in sys.argv:
            cases.append(("ResNet-50, batch 120, SGD", "--data synthetic --model resnet50",
                          layout + " --partition time", 2))
            cases.append(("ResNet-50, recompute always", "--data synthetic --model resnet50",
                          layout + " --partition time --recompute always", 2))
        rows = []
        for name, model, case_layout, steps in cases:
            print(f"measuring: {name}", file=sys.stderr, flush=True)
            rows += measure(actorpipe, name, model, case_layout, steps, directory)
    print("| case | stage | predicted: parameters, gradients, optimizer, activations (MB) | "
          "measured: gradients, optimizer, peak stash (MB) | total, predicted / measured |")
    print("|---|---|---|---|---|")
    for r in rows:
        p, m = r["predicted"], r["measured"]
        print(f"| {r['case']} | {r['stage']} | {p[1]:.1f}, {p[2]:.1f}, {p[3]:.1f}, {p[4]:.1f} | "
              f"{m[0]:.2f}, {m[1]:.2f}, {m[2]:.2f} | {r['predicted_total']:.1f} / "
              f"{r['measured_total']:.1f} ({100 * r['error']:+.1f}%) |")
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nlargest difference: {100 * worst:.1f}%")
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


main()
