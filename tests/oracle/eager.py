"""The reference the Python tests hold a pipeline to: PyTorch eager training a model on the same
micro-batches, gradients accumulated, one optimizer step per batch."""
import torch


def train(model, optimizer, data, microbatches, loss, schedule="1f1b"):
    """Trains `model` in place on `data` ([(inputs, targets)], a batch a step) with `optimizer`
    (("sgd" | "adamw", {settings})) and `loss(output, target)`; returns each step's loss. Batch
    norm normalises each micro-batch, as a stage does. The micro-batches' gradients are summed in
    the order the schedule's backwards run (GPipe's last first), so that the sums round as the
    pipeline's do."""
    model.train()
    name, args = optimizer
    opt = (torch.optim.SGD if name == "sgd" else torch.optim.AdamW)(model.parameters(), **args)
    losses = []
    for x, y in data:
        opt.zero_grad()
        parts = [loss(model(xs), ys) * (xs.shape[0] / x.shape[0])
                 for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches))]
        for part in reversed(parts) if schedule == "gpipe" else parts:
            part.backward()
        opt.step()
        losses.append(sum(part.item() for part in parts))
    return losses
