"""actorpipe.Pipeline against PyTorch itself: the same nn.Sequential trained by torch alone and
through the pipeline gives the same losses and parameters, for every schedule, 1-3 stages, SGD
with momentum and Adam."""
import copy
import unittest

import torch

import actorpipe

BATCH, STEPS, MICROBATCHES = 12, 3, 6


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def make_data(classes):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(BATCH, 8, generator=g) for _ in range(STEPS)]
    if classes:
        ys = [torch.randint(0, 4, (BATCH,), generator=g) for _ in range(STEPS)]
    else:
        ys = [torch.randn(BATCH, 4, generator=g) for _ in range(STEPS)]
    return xs, ys


def torch_alone(model, optimizer, xs, ys, classes):
    """The reference: plain PyTorch on the whole batch."""
    name, args = optimizer
    opt = (torch.optim.SGD if name == "sgd" else torch.optim.Adam)(model.parameters(), **args)
    loss_fn = torch.nn.CrossEntropyLoss() if classes else torch.nn.MSELoss()
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


# (schedule, stages, chunks): every built-in schedule over 1-3 stages, where the 7 layers allow
# the parts (stages x chunks) and the micro-batches the schedule's stage count (dualpipe-v
# needs 2 x stages of them).
CASES = [(s, n, 1) for s in ("gpipe", "1f1b", "zb-h1", "zb-h2") for n in (1, 2, 3)] + \
        [(s, n, 2) for s in ("interleaved", "interleaved-zb") for n in (1, 2, 3)] + \
        [(s, n, 2) for s in ("zb-v", "v-half", "v-min") for n in (1, 2, 3)] + \
        [("dualpipe-v", n, 2) for n in (1, 2, 3) if MICROBATCHES >= 2 * n]
OPTIMIZERS = [("sgd", {"lr": 0.05, "momentum": 0.9}), ("adam", {"lr": 0.01})]


class OracleTest(unittest.TestCase):
    def check(self, schedule, stages, chunks, optimizer, classes):
        xs, ys = make_data(classes)
        reference = make_model()
        scripted = torch.jit.script(copy.deepcopy(reference))
        want_losses, want_params = torch_alone(reference, optimizer, xs, ys, classes)
        with actorpipe.Pipeline(scripted, stages=stages, microbatches=MICROBATCHES,
                                schedule=schedule, chunks=chunks, optimizer=optimizer,
                                loss="cross_entropy" if classes else "mse") as p:
            losses = [p.train_step(x, y) for x, y in zip(xs, ys)]
            params = dict(p.named_parameters())
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            self.assertAlmostEqual(got, want, delta=1e-5 * max(1.0, abs(want)),
                                   msg=f"loss of step {step + 1}")
        self.assertEqual(sorted(params), sorted(want_params))
        for name, want in want_params.items():
            torch.testing.assert_close(params[name], want.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")

    def test_every_schedule_stage_count_and_optimizer(self):
        for schedule, stages, chunks in CASES:
            for optimizer in OPTIMIZERS:
                classes = optimizer[0] == "adam"
                with self.subTest(schedule=schedule, stages=stages, optimizer=optimizer[0]):
                    self.check(schedule, stages, chunks, optimizer, classes)

    def test_a_scripted_loss_trains_as_the_builtin(self):
        class Huber(torch.nn.Module):
            def forward(self, output, target):
                return torch.nn.functional.smooth_l1_loss(output, target)

        xs, ys = make_data(False)
        reference = make_model()
        scripted = torch.jit.script(copy.deepcopy(reference))
        opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        want = []
        for x, y in zip(xs, ys):
            opt.zero_grad()
            loss = torch.nn.functional.smooth_l1_loss(reference(x), y)
            loss.backward()
            opt.step()
            want.append(loss.item())
        with actorpipe.Pipeline(scripted, stages=2, microbatches=3, loss=torch.jit.script(Huber()),
                                optimizer=("sgd", {"lr": 0.1})) as p:
            got = [p.train_step(x, y) for x, y in zip(xs, ys)]
        for g, w in zip(got, want):
            self.assertAlmostEqual(g, w, delta=1e-5)


@unittest.skipUnless(actorpipe.has_gloo, "replicas on the CPU need c10d's Gloo, which this "
                     "libtorch (PyTorch's wheel) is built without; docs/gpu.md")
class ReplicasTest(unittest.TestCase):
    def test_replicas_equal_one_pipeline_on_the_whole_batch(self):
        xs, ys = make_data(False)
        reference = make_model()
        optimizer = ("sgd", {"lr": 0.05, "momentum": 0.9})
        want_losses, want_params = torch_alone(copy.deepcopy(reference), optimizer, xs, ys, False)
        with actorpipe.Pipeline(reference, stages=2, microbatches=2, replicas=2,
                                optimizer=optimizer) as p:
            losses = [p.train_step(x, y) for x, y in zip(xs, ys)]
            params = dict(p.named_parameters())
        for got, want in zip(losses, want_losses):
            self.assertAlmostEqual(got, want, delta=1e-5)
        for name, want in want_params.items():
            torch.testing.assert_close(params[name], want.detach(), rtol=1e-5, atol=1e-6)

    def test_sharded_replicas_equal_pytorch_alone(self):
        # ZeRO-1 and ZeRO-2 with Adam: each replica keeps half the optimizer state.
        xs, ys = make_data(False)
        reference = make_model()
        optimizer = ("adam", {"lr": 0.01})
        want_losses, want_params = torch_alone(copy.deepcopy(reference), optimizer, xs, ys, False)
        for shard in ("optimizer", "gradients"):
            with self.subTest(shard=shard), \
                    actorpipe.Pipeline(reference, stages=2, microbatches=2, replicas=2,
                                       optimizer=optimizer, shard=shard) as p:
                losses = [p.train_step(x, y) for x, y in zip(xs, ys)]
                params = dict(p.named_parameters())
                for got, want in zip(losses, want_losses):
                    self.assertAlmostEqual(got, want, delta=1e-5)
                for name, want in want_params.items():
                    torch.testing.assert_close(params[name], want.detach(), rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    unittest.main()
