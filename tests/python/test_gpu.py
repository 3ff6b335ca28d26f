"""actorpipe.Pipeline with stages on a GPU, against PyTorch on the same GPU (skipped where torch
sees no CUDA device)."""
import copy
import unittest

import torch

import actorpipe


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 10))


@unittest.skipUnless(torch.cuda.is_available(), "torch sees no CUDA device")
class GpuTest(unittest.TestCase):
    def test_two_stages_on_the_gpu_train_as_torch_there(self):
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))
                for _ in range(3)]
        reference = model().cuda()
        scripted = torch.jit.script(copy.deepcopy(model()))
        opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        want = []
        for x, y in data:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(reference(x.cuda()), y.cuda())
            loss.backward()
            opt.step()
            want.append(loss.item())
        with actorpipe.Pipeline(scripted, stages=2, microbatches=4, devices="cuda:0",
                                loss="cross_entropy",
                                optimizer=("sgd", {"lr": 0.05, "momentum": 0.9})) as p:
            # CPU batches and batches already on the GPU alike.
            got = [p.train_step(x.cuda() if i % 2 else x, y) for i, (x, y) in enumerate(data)]
            out = p(data[0][0])
            params = dict(p.named_parameters())
        self.assertEqual(out.device.type, "cuda")
        for g_, w in zip(got, want):
            self.assertAlmostEqual(g_, w, delta=1e-4)
        for name, value in reference.named_parameters():
            torch.testing.assert_close(params[name].cpu(), value.detach().cpu(), rtol=1e-4,
                                       atol=1e-5)

    def test_cuda_graphs_replay_the_eager_steps(self):
        # cuda_graphs= (the table's setting, as --cuda-graphs): two eager steps, then each
        # micro-batch's forward and backward captured and replayed, to the eager losses.
        g = torch.Generator().manual_seed(2)
        data = [(torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))
                for _ in range(5)]
        losses = {}
        for mode in ("off", "on"):
            scripted = torch.jit.script(copy.deepcopy(model()))
            with actorpipe.Pipeline(scripted, stages=2, microbatches=4, devices="cuda:0",
                                    loss="cross_entropy", cuda_graphs=mode,
                                    optimizer=("sgd", {"lr": 0.05})) as p:
                losses[mode] = [p.train_step(x.cuda(), y.cuda()) for x, y in data]
        for on, off in zip(losses["on"], losses["off"]):
            self.assertAlmostEqual(on, off, delta=1e-5)


if __name__ == "__main__":
    unittest.main()
