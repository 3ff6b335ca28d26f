"""actorpipe.Pipeline's API: futures, the GIL, errors with the engine's fields, refusals by name,
save and load, the trained model back as TorchScript, the planner, nodes."""
import os
import shutil
import tempfile
import threading
import time
import unittest

import torch

import actorpipe
import node_processes


def model(seed=0, width=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 4))


def batch(seed, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def pipe(**kwargs):
    settings = dict(stages=2, microbatches=2, optimizer=("sgd", {"lr": 0.1, "momentum": 0.9}))
    settings.update(kwargs)
    return actorpipe.Pipeline(kwargs.pop("net", None) or model(), **settings)


class StepsTest(unittest.TestCase):
    def test_async_steps_run_in_call_order_and_equal_sync_ones(self):
        data = [batch(i) for i in range(4)]
        with pipe() as p:
            sync = [p.train_step(x, y) for x, y in data]
        with pipe() as p:
            futures = [p.train_step_async(x, y) for x, y in data]
            self.assertIsInstance(futures[0], actorpipe.StepFuture)
            results = [f.result(timeout=60) for f in futures]
            self.assertTrue(all(f.done() for f in futures))
            self.assertEqual(futures[-1].stats()["step"], 4)
        self.assertEqual(results, sync)

    def test_the_gil_is_free_while_stages_compute(self):
        # A Python thread counts while the main thread is inside train_step: with the GIL held
        # through the step it could not count at all.
        big = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
        x, y = torch.randn(256, 512), torch.randn(256, 512)
        with actorpipe.Pipeline(big, stages=2, microbatches=4) as p:
            p.train_step(x, y)
            counted, stop = [0], threading.Event()

            def count():
                while not stop.is_set():
                    counted[0] += 1

            counter = threading.Thread(target=count)
            counter.start()
            time.sleep(0.05)
            before = counted[0]
            for _ in range(3):
                p.train_step(x, y)
            during = counted[0] - before
            stop.set()
            counter.join()
        self.assertGreater(during, 1000)

    def test_forward_and_the_module_back_equal_the_trained_parameters(self):
        x, y = batch(0)
        with pipe() as p:
            for _ in range(3):
                p.train_step(x, y)
            out = p(x)
            trained = p.module()
            params = dict(p.named_parameters())
            stats = p.stats()
        self.assertIsInstance(trained, torch.jit.ScriptModule)
        for name, value in trained.named_parameters():
            torch.testing.assert_close(value, params[name])
        with torch.no_grad():
            torch.testing.assert_close(trained(x), out, rtol=1e-5, atol=1e-6)
        self.assertEqual(stats["layout"]["stages"], 2)
        self.assertEqual(stats["layout"]["bounds"], [0, 3, 5])
        self.assertEqual(stats["step"]["step"], 3)
        self.assertEqual(len(stats["step"]["stages"]), 2)

    def test_set_learning_rate_takes_effect(self):
        x, y = batch(0)
        with pipe(optimizer=("sgd", {"lr": 0.1})) as p:
            before = dict(p.named_parameters())
            p.set_learning_rate(0.0)
            p.train_step(x, y)
            after = dict(p.named_parameters())
        for name in before:
            torch.testing.assert_close(after[name], before[name])


class ErrorsTest(unittest.TestCase):
    def test_a_failed_step_raises_with_fields_and_changes_nothing(self):
        x, y = batch(0)
        with pipe() as p:
            p.train_step(x, y)
            before = dict(p.named_parameters())
            with self.assertRaises(actorpipe.PipelineError) as caught:
                p.train_step(torch.randn(8, 7), y)
            e = caught.exception
            self.assertEqual(e.stage, 0)
            self.assertEqual(e.step, 2)
            self.assertIn(e.kind, ("shape_mismatch", "stage_failure"))
            self.assertIsNotNone(e.microbatch)
            self.assertIn("stage 0", str(e))
            for name, value in p.named_parameters():
                torch.testing.assert_close(value, before[name])
            p.train_step(x, y)  # the pipeline goes on

    def test_a_save_on_a_full_disk_raises_disk_full_with_each_stage(self):
        if not os.path.exists("/dev/full"):
            self.skipTest("no /dev/full on this machine")
        folder = tempfile.mkdtemp(prefix="actorpipe-python-test-")
        try:
            for stage in range(2):
                os.symlink("/dev/full", os.path.join(folder, "stage-%d.pt" % stage))
            with pipe() as p:
                p.train_step(*batch(0))
                with self.assertRaises(actorpipe.PipelineError) as caught:
                    p._p.save_state(folder)
            e = caught.exception
            self.assertEqual(e.kind, "disk_full")
            self.assertEqual([f.stage for f in e.failures], [0, 1])
            self.assertEqual({f.kind for f in e.failures}, {"disk_full"})
            self.assertIn("disk is full", str(e))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def test_a_failed_async_step_raises_from_its_future(self):
        x, y = batch(0)
        with pipe() as p:
            bad = p.train_step_async(x, torch.randn(8, 5))
            with self.assertRaises(actorpipe.PipelineError) as caught:
                bad.result(timeout=60)
            self.assertEqual(caught.exception.step, 1)
            self.assertEqual(caught.exception.stage, 1)
            self.assertGreater(p.train_step_async(x, y).result(timeout=60), 0)

    def test_python_functions_are_refused_by_name(self):
        def my_loss(out, target):
            return ((out - target) ** 2).mean()

        with self.assertRaisesRegex(TypeError, "loss: my_loss is a Python function"):
            pipe(loss=my_loss)
        with self.assertRaisesRegex(TypeError, "after_forward: .* Python function"):
            pipe(after_forward=lambda ctx, t: t)
        with self.assertRaisesRegex(TypeError, "optimizer: a torch.optim object"):
            pipe(optimizer=torch.optim.SGD(model().parameters(), lr=0.1))

    def test_bad_settings_name_what_is_wrong(self):
        with self.assertRaisesRegex(ValueError, "optimizer: sgd takes .*not betas"):
            pipe(optimizer=("sgd", {"lr": 0.1, "betas": (0.9, 0.99)}))
        with self.assertRaisesRegex(ValueError, "unknown schedule 'zigzag'"):
            pipe(schedule="zigzag")
        with self.assertRaisesRegex(ValueError, "loss: unknown built-in 'hinge'"):
            pipe(loss="hinge")
        with self.assertRaisesRegex(ValueError, "example"):
            pipe(stages="auto")
        with self.assertRaisesRegex(ValueError, "stages"):
            pipe(stages=0)
        with self.assertRaisesRegex(ValueError, "devices: 'gpu7' is no device"):
            pipe(devices=["gpu7", "cpu"])
        with self.assertRaisesRegex(ValueError, "cuda:0 is listed twice in devices"):
            pipe(stages="auto", example=torch.randn(8, 8), devices=["cuda:0", "cuda:0"])
        # 1.13 scripts the module; 2.x exports it, which needs an example batch.
        with self.assertRaisesRegex(TypeError, "model: .*(cannot be scripted|give example=)"):
            actorpipe.Pipeline(Unscriptable())

    def test_a_closed_pipeline_refuses_calls(self):
        p = pipe()
        p.close()
        with self.assertRaisesRegex(ValueError, "closed"):
            p.train_step(*batch(0))

    def test_check_finite_hook_names_the_stage(self):
        x, y = batch(0)
        x[3, 2] = float("nan")
        with pipe(after_forward="check_finite") as p:
            with self.assertRaises(actorpipe.PipelineError) as caught:
                p.train_step(x, y)
        self.assertEqual(caught.exception.stage, 0)


class Unscriptable(torch.nn.Module):
    def forward(self, x):
        return x.numpy()


class FilesTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="actorpipe-python-test-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_save_then_load_onto_another_cut_goes_on_as_if_uninterrupted(self):
        data = [batch(i) for i in range(4)]
        with pipe() as p:
            straight = [p.train_step(x, y) for x, y in data]
        path = os.path.join(self.dir, "run")
        with pipe() as p:
            first = [p.train_step(x, y) for x, y in data[:2]]
            p.save(path)
            p.save(path)  # replaces the folder
        self.assertTrue(os.path.exists(os.path.join(path, "actorpipe.json")))
        with actorpipe.Pipeline.load(path, stages=3) as q:
            self.assertEqual(q.stages, 3)
            rest = [q.train_step(x, y) for x, y in data[2:]]
        for got, want in zip(first + rest, straight):
            self.assertAlmostEqual(got, want, delta=1e-6)

    def test_a_failed_save_keeps_what_was_there(self):
        path = os.path.join(self.dir, "run")
        with pipe() as p:
            p.train_step(*batch(0))
            p.save(path)
            with open(os.path.join(path, "actorpipe.json")) as f:
                saved = f.read()
            blocker = os.path.join(self.dir, "file")
            open(blocker, "w").close()
            with self.assertRaises(OSError):
                p.save(blocker)
        with open(os.path.join(path, "actorpipe.json")) as f:
            self.assertEqual(f.read(), saved)
        self.assertEqual([n for n in os.listdir(self.dir) if n.startswith(".actorpipe")], [])

    def test_load_names_a_folder_that_is_not_a_save(self):
        with self.assertRaisesRegex(FileNotFoundError, "no actorpipe.json"):
            actorpipe.Pipeline.load(self.dir)
        with open(os.path.join(self.dir, "actorpipe.json"), "w") as f:
            f.write("{not json")
        with self.assertRaisesRegex(ValueError, "not JSON"):
            actorpipe.Pipeline.load(self.dir)


class PlannerTest(unittest.TestCase):
    def test_stages_auto_plans_from_an_example_and_trains(self):
        x, y = batch(0, n=16)
        with actorpipe.Pipeline(model(), stages="auto", example=x) as p:
            layout = p.stats()["layout"]
            self.assertGreaterEqual(layout["stages"], 1)
            self.assertGreaterEqual(layout["microbatches"], 1)
            loss = p.train_step(x, y)
        self.assertTrue(loss == loss)

    def test_stages_auto_takes_the_first_of_more_devices_than_it_places(self):
        x, y = batch(0, n=16)
        with actorpipe.Pipeline(model(), stages="auto", example=x, devices=["cpu"] * 5) as p:
            self.assertLess(p.stats()["layout"]["stages"], 5)  # the cores bound it
            loss = p.train_step(x, y)
        self.assertTrue(loss == loss)

    def test_the_signature_restates_none_of_the_engines_defaults(self):
        import inspect
        made = actorpipe._actorpipe.Config()
        parameters = inspect.signature(actorpipe.Pipeline.__init__).parameters
        shared = [(name, parameter.default) for name, parameter in parameters.items()
                  if hasattr(made, name) and parameter.default is not inspect.Parameter.empty
                  and parameter.default is not None]
        self.assertGreaterEqual(len(shared), 3)
        for name, default in shared:
            if name == "optimizer":  # (name, its settings)
                self.assertEqual(default, (made.optimizer, {"lr": made.lr}))
            else:
                self.assertEqual(default, getattr(made, name), name)
        # The run's settings are the engine's table, the CLI's flags': each one a keyword with
        # the table's default, milliseconds shown as seconds.
        rows = {row["name"]: row for row in actorpipe._actorpipe.settings()}
        self.assertGreaterEqual(len(rows), 20)
        for name in ("stages", "microbatches", "schedule", "precision", "cuda_graphs",
                     "wait_timeout", "step_timeout", "dp_timeout", "max_memory"):
            self.assertIn(name, rows)
            self.assertIn(name, parameters)
        self.assertEqual(parameters["stages"].default, int(rows["stages"]["default"]))
        self.assertEqual(parameters["wait_timeout"].default,
                         int(rows["wait_timeout"]["default"]) / 1000)
        self.assertEqual(parameters["precision"].default, "fp32")
        self.assertIn("cuda_graphs='off'", actorpipe.Pipeline.__doc__)

    def test_settings_are_refused_by_their_keyword(self):
        with self.assertRaisesRegex(TypeError, "unexpected keyword argument 'precison' "
                                               "\\(did you mean 'precision'\\?\\)"):
            actorpipe.Pipeline(model(), precison="bf16")
        with self.assertRaisesRegex(ValueError, "precision: unknown precision 'fp16'"):
            actorpipe.Pipeline(model(), precision="fp16")
        with self.assertRaisesRegex(ValueError, "stages: '0' is neither a count >= 1 nor auto"):
            actorpipe.Pipeline(model(), stages=0)
        with self.assertRaisesRegex(TypeError, "microbatches: a whole number, not 2.5"):
            actorpipe.Pipeline(model(), microbatches=2.5)
        # A setting given where it does not apply is refused, as the CLI's flag is.
        with self.assertRaisesRegex(ValueError, "cuda_graphs applies to stages on GPUs"):
            actorpipe.Pipeline(model(), cuda_graphs="on")
        with self.assertRaisesRegex(ValueError, "heartbeat_timeout applies to stages on nodes"):
            actorpipe.Pipeline(model(), heartbeat_timeout=2.0)
        with self.assertRaisesRegex(ValueError, "shard applies to replicas"):
            actorpipe.Pipeline(model(), shard="optimizer")

    def test_settings_python_lacked_before_reach_the_engine(self):
        x, y = batch(0, n=16)
        # max_stages bounds the planner's stage counts (the CLI's --max-stages).
        with actorpipe.Pipeline(model(), stages="auto", max_stages=1, profile_repeats=1,
                                example=x) as p:
            self.assertEqual(p.stats()["layout"]["stages"], 1)
        # cold_memory and step_timeout change how, not what, a step computes.
        with actorpipe.Pipeline(model(), stages=2, step_timeout=30, cold_memory=True) as p:
            loss = p.train_step(x, y)
        with actorpipe.Pipeline(model(), stages=2) as q:
            self.assertEqual(q.train_step(x, y), loss)


@unittest.skipUnless(os.environ.get("ACTORPIPE_CLI"), "needs ACTORPIPE_CLI (the program)")
class NodesTest(unittest.TestCase):
    def test_stages_on_nodes_train_as_in_process(self):
        with node_processes.nodes(2) as addresses:
            data = [batch(i) for i in range(3)]
            with pipe(threads=1) as p:
                local = [p.train_step(x, y) for x, y in data]
            with pipe(threads=1, nodes=addresses) as p:
                remote = [p.train_step(x, y) for x, y in data]
                self.assertEqual(len(p.named_parameters()), 6)
            for got, want in zip(remote, local):
                self.assertAlmostEqual(got, want, delta=1e-6)
            with self.assertRaisesRegex(ValueError, "scripted loss runs in this process only"):
                pipe(nodes=addresses, loss=torch.jit.script(torch.nn.MSELoss()))


if __name__ == "__main__":
    unittest.main()
