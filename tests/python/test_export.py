"""torch.export programs through actorpipe against PyTorch eager: models written as ordinary
nn.Modules (a Llama-style decoder with a tied head and a padding mask, a ResNet whose batch norm
buffers mutate, a U-Net whose skips cross stage boundaries), cut into segments and trained over
every schedule, 1-4 stages, 1-8 micro-batches, SGD with momentum and AdamW; the trained weights
back as a state_dict and as a PT2 archive; the programs the engine refuses, by name. The PyTorch
2.x line only (1.13 has no torch.export)."""
import copy
import io
import os
import re
import subprocess
import sys
import tempfile
import unittest
import zipfile

import torch
import torch.nn.functional as F

import actorpipe

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "oracle"))
import eager as reference  # noqa: E402
import export_models  # noqa: E402
import node_processes  # noqa: E402

EXPORT = hasattr(torch, "export") and hasattr(torch.export, "ExportedProgram")
needs_export = unittest.skipUnless(EXPORT, "torch.export is PyTorch 2.x's (this is "
                                   f"{torch.__version__})")

BATCH, STEPS = 24, 3
SGD = ("sgd", {"lr": 0.05, "momentum": 0.9})
ADAMW = ("adamw", {"lr": 0.01, "weight_decay": 0.01})


def loss_of(name, output, target):
    if name == "cross_entropy":
        return F.cross_entropy(output.flatten(0, -2), target.flatten()) if output.dim() > 2 \
            else F.cross_entropy(output, target)
    return F.mse_loss(output, target)


def batches(name, seed=1):
    """STEPS batches of BATCH rows for model `name`."""
    out = []
    for step in range(STEPS):
        _, x, y, _ = export_models.make(name, seed=seed + step, batch=BATCH)
        out.append((x, y))
    return out


def eager(name, optimizer, data, microbatches, schedule="1f1b"):
    """The reference: PyTorch eager on the same micro-batches (tests/oracle/eager.py)."""
    model, _, _, loss = export_models.make(name)
    losses = reference.train(model, optimizer, data, microbatches,
                             lambda output, target: loss_of(loss, output, target), schedule)
    return losses, model


_programs = {}


def program(name):
    """The model `name` exported once (its batch dimension dynamic), and its loss."""
    if name not in _programs:
        model, x, _, loss = export_models.make(name)
        ep = torch.export.export(copy.deepcopy(model), (x,),
                                 dynamic_shapes=({0: torch.export.Dim("batch", max=1024)},))
        _programs[name] = (ep, loss)
    return _programs[name]


def close(test, got_losses, want_losses, got_state, want_model, what):
    for step, (got, want) in enumerate(zip(got_losses, want_losses)):
        test.assertAlmostEqual(got, want, delta=1e-5 * max(1.0, abs(want)),
                               msg=f"{what}: loss of step {step + 1}")
    want_state = want_model.state_dict()
    test.assertEqual(sorted(got_state), sorted(want_state), msg=what)
    for key, want in want_state.items():
        if want.is_floating_point():
            torch.testing.assert_close(got_state[key], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what}: {key}: {m}")
        else:
            test.assertTrue(torch.equal(got_state[key], want), msg=f"{what}: {key}")


def train(name, data, **settings):
    ep, loss = program(name)
    with actorpipe.Pipeline(ep, loss=loss, **settings) as p:
        losses = [p.train_step(x, y) for x, y in data]
        return losses, p.state_dict(), p.stats()["layout"]


# (schedule, stages, chunks, micro-batches): every schedule over 1-4 stages, 1-8 micro-batches
# (as many as the schedule's stages need at least).
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("interleaved", 2),
             ("interleaved-zb", 2), ("zb-v", 2), ("v-half", 2), ("v-min", 2), ("dualpipe-v", 2)]
COUNTS = [1, 2, 3, 4, 6, 8]


def cases():
    out, k = [], 0
    for schedule, chunks in SCHEDULES:
        for stages in (1, 2, 3, 4):
            least = 2 * stages if schedule == "dualpipe-v" else stages
            m = max(least, COUNTS[k % len(COUNTS)])
            k += 1
            if m <= 8:
                out.append((schedule, stages, chunks, m))
    return out


@needs_export
class ExportOracleTest(unittest.TestCase):
    """Each model trained by PyTorch eager and through the pipeline: the same losses, parameters
    and buffers (batch norm's running statistics and counts). Eager runs on one thread as each
    stage does: a kernel's sums round by its threads, and ResNet's AdamW steps amplify a 1e-7
    difference in a weight to 1e-3 within three steps (eager against itself perturbed)."""

    @classmethod
    def setUpClass(cls):
        cls.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    @classmethod
    def tearDownClass(cls):
        torch.set_num_threads(cls.threads)

    def check_model(self, name, segments, optimizers=(SGD, ADAMW)):
        data = batches(name)
        for schedule, stages, chunks, m in cases():
            for optimizer in optimizers:
                what = f"{name} {schedule} stages={stages} microbatches={m} {optimizer[0]}"
                with self.subTest(what):
                    want_losses, want_model = eager(name, optimizer, data, m, schedule)
                    got_losses, got_state, _ = train(
                        name, data, stages=stages, chunks=chunks, microbatches=m,
                        schedule=schedule, optimizer=optimizer, segments=segments, threads=1)
                    close(self, got_losses, want_losses, got_state, want_model, what)

    def test_llama_decoder(self):
        # Segments by top-level submodule (embed, rotary, layers.0-3, norm, head: enough parts
        # for 4 stages x 2 chunks; the default cuts at the blocks, 6 parts); the mask (bool), the
        # rotary tables and the residual stream travel across every cut; the head is tied to the
        # embedding.
        self.check_model("llama", "modules")

    def test_resnet_with_batch_norm(self):
        # One segment per submodule two deep (stem, bn, block1.conv1, ...): enough parts for
        # 4 stages x 2 chunks, and the blocks' skips cross cuts.
        self.check_model("resnet", "modules:2")

    def test_unet_skips_cross_stages(self):
        # By top-level submodule, 8 parts (the default cuts at the conv blocks: 6).
        self.check_model("unet", "modules")

    def test_bit_for_bit_where_the_sums_run_in_the_same_order(self):
        # One thread on both sides, the micro-batches' gradients summed in the schedule's order:
        # the same bits, across cuts.
        # Not the tied embedding on two stages with several micro-batches: each stage sums its
        # micro-batches, then the two sums are added (eager adds them micro-batch by micro-batch):
        # within 1e-6, and one step (a second would spread that to every weight).
        for name in ("llama", "resnet", "unet"):
            data = batches(name)[:1 if name == "llama" else 2]
            for schedule, stages, m in (("gpipe", 1, 1), ("1f1b", 2, 1), ("gpipe", 3, 4),
                                        ("1f1b", 4, 4)):
                with self.subTest(name=name, schedule=schedule, stages=stages, microbatches=m):
                    want_losses, want_model = eager(name, SGD, data, m, schedule)
                    _, got_state, _ = train(name, data, stages=stages, microbatches=m,
                                            schedule=schedule, optimizer=SGD, threads=1,
                                            segments="modules:2" if name == "resnet" else "auto")
                    for key, want in want_model.state_dict().items():
                        if key in ("embed.weight", "head.weight") and stages > 1 and m > 1:
                            torch.testing.assert_close(got_state[key], want, rtol=1e-6, atol=1e-8)
                        else:
                            self.assertTrue(torch.equal(got_state[key], want), f"{name}: {key}")

    def test_cut_at_every_node(self):
        # segments="nodes": a cut anywhere, inside attention and between an op and its view.
        data = batches("llama")
        for stages, schedule in ((3, "1f1b"), (4, "zb-h1")):
            with self.subTest(stages=stages, schedule=schedule):
                want_losses, want_model = eager("llama", SGD, data, 4)
                got_losses, got_state, layout = train("llama", data, stages=stages,
                                                      microbatches=4, schedule=schedule,
                                                      optimizer=SGD, segments="nodes")
                close(self, got_losses, want_losses, got_state, want_model, "nodes")
                self.assertEqual(layout["stages"], stages)

    def test_recompute_and_bf16(self):
        data = batches("unet")
        want_losses, want_model = eager("unet", SGD, data, 4)
        got_losses, got_state, _ = train("unet", data, stages=2, microbatches=4, optimizer=SGD,
                                         recompute="always")
        close(self, got_losses, want_losses, got_state, want_model, "recompute")
        # bf16: autocast on each stage as eager's torch.autocast does.
        model, _, _, _ = export_models.make("unet")
        x, y = data[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = F.mse_loss(model(x).float(), y).item()
        got, _, _ = train("unet", data[:1], stages=2, microbatches=1, precision="bf16",
                          optimizer=SGD)
        self.assertAlmostEqual(got[0], want, delta=2e-2 * abs(want))


@needs_export
class ExportModelTest(unittest.TestCase):
    """The trained model back in PyTorch, markers, modules exported for the user, dropout."""

    def test_state_dict_and_module_run_in_pytorch(self):
        data = batches("resnet")
        ep, loss = program("resnet")
        with actorpipe.Pipeline(ep, loss=loss, stages=3, microbatches=4, optimizer=SGD,
                                segments="modules:2") as p:
            for x, y in data:
                p.train_step(x, y)
            state = p.state_dict()
            x = data[0][0]
            got = p.forward(x)
            trained = p.module()
        model, _, _, _ = export_models.make("resnet")
        model.load_state_dict(state, strict=True)
        model.eval()
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # torch.export.load(...).module(): the same program with the trained weights.
        trained_state = trained.state_dict()
        for key, value in state.items():
            torch.testing.assert_close(trained_state[key], value, msg=key)

    def test_save_and_load_go_on_as_if_uninterrupted(self):
        # Parameters, buffers, AdamW's state and the archive in one folder; loaded onto
        # another stage count.
        data = batches("resnet")
        ep, loss = program("resnet")
        settings = dict(loss=loss, microbatches=2, optimizer=ADAMW, segments="modules:2")
        with actorpipe.Pipeline(ep, stages=2, **settings) as p:
            want = [p.train_step(x, y) for x, y in data]
            want_state = p.state_dict()
        with tempfile.TemporaryDirectory(prefix="actorpipe-save-") as d:
            with actorpipe.Pipeline(ep, stages=2, **settings) as p:
                got = [p.train_step(x, y) for x, y in data[:2]]
                p.save(os.path.join(d, "run"))
            with actorpipe.Pipeline.load(os.path.join(d, "run"), stages=3) as p:
                got.append(p.train_step(*data[2]))
                got_state = p.state_dict()
        for g, w in zip(got, want):
            self.assertAlmostEqual(g, w, delta=1e-6 * max(1.0, abs(w)))
        for key, value in want_state.items():
            torch.testing.assert_close(got_state[key], value, rtol=1e-5, atol=1e-6, msg=key)

    def test_tied_head_has_one_tensor_under_both_names(self):
        data = batches("llama")
        _, state, _ = train("llama", data[:1], stages=3, microbatches=3, optimizer=SGD)
        self.assertIn("embed.weight", state)
        self.assertIn("head.weight", state)
        torch.testing.assert_close(state["embed.weight"], state["head.weight"])

    def test_module_with_example_is_exported_for_the_user(self):
        data = batches("unet")
        model, x, _, loss = export_models.make("unet")
        want_losses, _ = eager("unet", SGD, data, 2)
        with actorpipe.Pipeline(model, example=x, loss=loss, stages=2, microbatches=2,
                                optimizer=SGD) as p:
            got = [p.train_step(x, y) for x, y in data]
        for g, w in zip(got, want_losses):
            self.assertAlmostEqual(g, w, delta=1e-5 * max(1.0, abs(w)))

    def test_pipe_split_markers_cut_the_program(self):
        from torch.distributed.pipelining import pipe_split

        class Split(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(8, 16)
                self.b = torch.nn.Linear(16, 16)
                self.c = torch.nn.Linear(16, 4)

            def forward(self, x):
                h = torch.tanh(self.a(x))
                pipe_split()
                h = torch.relu(self.b(h)) + h
                pipe_split()
                return self.c(h)

        torch.manual_seed(0)
        model = Split()
        x, y = torch.randn(8, 8), torch.randn(8, 4)
        ep = torch.export.export(copy.deepcopy(model), (x,))
        with actorpipe.Pipeline(ep, stages=3, microbatches=1, optimizer=("sgd", {"lr": 0.1})) as p:
            layout = p.stats()["layout"]
            got = p.train_step(x, y)
        self.assertEqual(layout["bounds"], [0, 1, 2, 3])
        want = F.mse_loss(model(x), y).item()
        self.assertAlmostEqual(got, want, delta=1e-6)

    def test_dropout_draws_fresh_masks_at_its_rate(self):
        # The engine draws dropout's numbers from each stage's generator, not in PyTorch's
        # order: the masks differ from eager's, their statistics do not.
        class Drop(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = torch.nn.Parameter(torch.ones(()))
                self.drop = torch.nn.Dropout(0.5)

            def forward(self, x):
                return self.drop(x * self.scale)

        x = torch.ones(8, 512)
        ep = torch.export.export(Drop(), (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
        with actorpipe.Pipeline(ep, stages=1, microbatches=2,
                                optimizer=("sgd", {"lr": 1e-9})) as p:
            losses = [p.train_step(x, torch.zeros(8, 512)) for _ in range(5)]
            kept = p.forward(x)
        # mean(out^2) = kept fraction x 2^2: about 2 when half is kept.
        for loss in losses:
            self.assertGreater(loss, 1.8)
            self.assertLess(loss, 2.2)
        # Two steps' kept fractions (of 4,096) agree by chance about once in 80 pairs: a mask
        # drawn again would make them all equal. (Once, beside other suites, all three of a
        # 3-step run agreed; not reproduced alone: see issue 61's closing note.)
        self.assertGreaterEqual(len(set(losses)), 3, f"every step draws a new mask: {losses}")
        torch.testing.assert_close(kept, x)  # eval: no dropout


@needs_export
class ExportFilesTest(unittest.TestCase):
    """PT2 archives through the actorpipe program and its nodes; the refusals, by name."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory(prefix="actorpipe-export-")
        self.addCleanup(self.dir.cleanup)

    def path(self, name):
        return os.path.join(self.dir.name, name)

    def cli(self, *args):
        return subprocess.run([os.environ["ACTORPIPE_CLI"], *args], capture_output=True,
                              text=True, timeout=300)

    def refused(self, ep_or_bytes, pattern, **kwargs):
        with self.assertRaisesRegex(ValueError, pattern):
            actorpipe.Pipeline(ep_or_bytes, stages=1, **kwargs)

    def test_train_and_export_from_the_command_line(self):
        ep, loss = program("unet")
        torch.export.save(ep, self.path("unet.pt2"))
        data = batches("unet")
        x = torch.cat([d[0] for d in data[:2]])
        y = torch.cat([d[1] for d in data[:2]])
        torch.save({"inputs": x, "targets": y}, self.path("data.pt"))
        run = self.cli("train", "--model", self.path("unet.pt2"), "--data",
                       "tensors:" + self.path("data.pt"), "--batch", str(BATCH), "--steps", "2",
                       "--stages", "2", "--microbatches", "2", "--lr", "0.05", "--momentum", "0.9",
                       "--export", self.path("trained.pt2"))
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("torch.export.load", run.stdout)
        _, want_model = eager("unet", SGD, data[:2], 2)
        trained = torch.export.load(self.path("trained.pt2")).module()
        for key, want in want_model.state_dict().items():
            torch.testing.assert_close(trained.state_dict()[key], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{key}: {m}")

    def test_stages_on_nodes_train_as_in_process(self):
        # The archive is sent to two `actorpipe node` processes, which cut it as this one does.
        with node_processes.nodes(2) as addresses:
            data = batches("llama")
            want_losses, want_model = eager("llama", ADAMW, data, 2)
            got_losses, got_state, _ = train("llama", data, stages=2, microbatches=2,
                                             optimizer=ADAMW, threads=1, nodes=addresses)
            close(self, got_losses, want_losses, got_state, want_model, "nodes")

    def test_refusals_name_the_node_and_op(self):
        class Slice(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.l = torch.nn.Linear(4, 4)

            def forward(self, x):
                y = self.l(x)
                y[:, 0] = 0.0
                return y

        x = torch.randn(2, 4)
        decomposed = torch.export.export(Slice(), (x,)).run_decompositions()
        if any(n.target is torch.ops.aten.copy.default for n in decomposed.graph.nodes):
            self.refused(decomposed, r"decomposed.*node '.*' \(torch\.ops\.aten\.copy\.default\) has no autograd formula")
        else:
            # torch 2.15 decomposes the slice's assignment into where(), which has a formula.
            actorpipe.Pipeline(decomposed, stages=1)

        class Branch(torch.nn.Module):
            def forward(self, x):
                return torch.cond(x.sum() > 0, lambda x: x + 1, lambda x: x - 1, (x,))

        self.refused(torch.export.export(Branch(), (x,)), r"\(torch\.ops\.higher_order\.cond\) is a higher-order op")
        self.refused(torch.export.export(Slice(), (x,)), r"segments 'bogus' is not auto",
                     segments="bogus")

    def test_broken_archives_are_refused_by_name(self):
        ep, _ = program("unet")
        buffer = io.BytesIO()
        torch.export.save(ep, buffer)
        whole = buffer.getvalue()
        with open(self.path("cut.pt2"), "wb") as f:
            f.write(whole[: len(whole) // 2])
        self.refused(self.path("cut.pt2"), r"cut\.pt2")
        # Another schema major version.
        source = zipfile.ZipFile(io.BytesIO(whole))
        with zipfile.ZipFile(self.path("future.pt2"), "w", zipfile.ZIP_STORED) as out:
            for info in source.infolist():
                data = source.read(info)
                if re.search(r"models/model\.json$", info.filename):
                    data = re.sub(rb'"major": ?\d+', b'"major": 99', data)
                out.writestr(info, data)
        self.refused(self.path("future.pt2"), r"schema (version )?99")

    def test_a_custom_op_not_registered_in_the_process(self):
        # The op exists in this Python process only: the actorpipe program is refused it.
        @torch.library.custom_op("actorpipe_test::twice", mutates_args=())
        def twice(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @twice.register_fake
        def _(x):
            return torch.empty_like(x)

        class Custom(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.l = torch.nn.Linear(4, 4)

            def forward(self, x):
                return twice(self.l(x))

        torch.export.save(torch.export.export(Custom(), (torch.randn(2, 4),)),
                          self.path("custom.pt2"))
        torch.save({"inputs": torch.randn(8, 4), "targets": torch.randn(8, 4)},
                   self.path("data.pt"))
        run = self.cli("train", "--model", self.path("custom.pt2"), "--data",
                       "tensors:" + self.path("data.pt"), "--steps", "1")
        self.assertNotEqual(run.returncode, 0)
        self.assertRegex(run.stderr, r"torch\.ops\.actorpipe_test\.twice\.default\) calls an op that is not registered")
        # The refusal names the ops of Python libraries the engine runs itself.
        self.assertIn("of such ops actorpipe runs transformers::grouped_mm_fallback", run.stderr)
        self.assertIn("transformers::grouped_mm_fallback", actorpipe.library_ops())


if __name__ == "__main__":
    unittest.main()
