"""The models PyTorch users have, through actorpipe against PyTorch eager: three causal language
model families and a mixture of experts from Hugging Face transformers, a ViT and two CNNs from
torchvision (tests/oracle/hf_models.py), exported as users export them and cut with the default
segments; their weights in and out as safetensors, against the Python `safetensors` package and
`from_pretrained`. The PyTorch 2.x line, with transformers and torchvision installed (./setup.sh
test --torch pip installs them)."""
import copy
import os
import subprocess
import sys
import tempfile
import unittest

import torch
import torch.nn.functional as F

import actorpipe

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "oracle"))
import eager as reference  # noqa: E402
import hf_models  # noqa: E402

EXPORT = hasattr(torch, "export") and hasattr(torch.export, "ExportedProgram")
WHY_NOT = None if EXPORT else f"torch.export is PyTorch 2.x's (this is {torch.__version__})"
WHY_NOT = WHY_NOT or hf_models.available()
needs_models = unittest.skipIf(WHY_NOT is not None, WHY_NOT or "")

STEPS = 3
SGD = ("sgd", {"lr": 0.05, "momentum": 0.9})
ADAMW = ("adamw", {"lr": 0.003, "weight_decay": 0.01})


def loss_of(output, target):
    return F.cross_entropy(output.flatten(0, -2), target.flatten()) if output.dim() > 2 \
        else F.cross_entropy(output, target)


def batches(name, steps=STEPS):
    return [hf_models.make(name, seed=1 + s)[1:3] for s in range(steps)]


def eager(model, optimizer, data, microbatches, schedule="1f1b"):
    """PyTorch eager on the same micro-batches (tests/oracle/eager.py); the model trained in
    place, as the module the program was exported from."""
    net = hf_models.wrapped(model)
    return reference.train(net, optimizer, data, microbatches, loss_of, schedule), net


_programs = {}


def program(name):
    if name not in _programs:
        model, x, _, _ = hf_models.make(name)
        _programs[name] = hf_models.export(copy.deepcopy(model), x)
    return _programs[name]


def quiet_transformers():
    import transformers
    transformers.logging.set_verbosity_error()


@needs_models
class ModelsOracleTest(unittest.TestCase):
    """Each model, exported as a user exports it and cut by the default segments, trained by
    PyTorch eager and through the pipeline: the same first loss bit for bit where the
    micro-batches are of one size (the same kernels on one thread; uneven ones are scaled and
    summed in another order), every loss within 1e-5 relative, the same trained weights.
    AdamW's losses within 1e-4, its weights not compared: torch.optim.AdamW moves its first
    moment with lerp_, libtorch's C++ AdamW (each stage's) with mul_ and add_, so their last bits
    part from the second step on, and AdamW's sign-like step moves a weight whose gradient is
    noise (a batch norm's bias before another batch norm) by whole steps either way."""

    # (schedule, stages, chunks, micro-batches), per model: GPipe, 1F1B, zero-bubble and V
    # schedules over 2-4 stages and 1-8 micro-batches.
    CASES = {
        "llama": [("gpipe", 2, 1, 1), ("zb-v", 2, 2, 4)],
        "qwen2": [("1f1b", 3, 1, 3), ("zb-h1", 4, 1, 8)],
        "gpt2": [("v-half", 2, 2, 2), ("1f1b", 4, 1, 4)],
        "mixtral": [("1f1b", 2, 1, 2), ("gpipe", 3, 1, 6), ("zb-h2", 4, 1, 4)],
        "vit": [("zb-h1", 2, 1, 2), ("dualpipe-v", 2, 2, 4)],
        "resnet18": [("1f1b", 4, 1, 4), ("gpipe", 2, 1, 1)],
        "mobilenet_v2": [("zb-v", 2, 2, 4), ("1f1b", 3, 1, 2)],
    }

    @classmethod
    def setUpClass(cls):
        quiet_transformers()
        cls.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    @classmethod
    def tearDownClass(cls):
        torch.set_num_threads(cls.threads)

    def check(self, name):
        data = batches(name)
        for k, (schedule, stages, chunks, m) in enumerate(self.CASES[name]):
            optimizer = SGD if k % 2 == 0 else ADAMW
            what = f"{name} {schedule} stages={stages} microbatches={m} {optimizer[0]}"
            with self.subTest(what):
                want, net = eager(hf_models.make(name)[0], optimizer, data, m, schedule)
                with actorpipe.Pipeline(program(name), stages=stages, chunks=chunks,
                                        microbatches=m, schedule=schedule, optimizer=optimizer,
                                        loss="cross_entropy", threads=1) as p:
                    got = [p.train_step(x, y) for x, y in data]
                    state = p.state_dict()
                if data[0][0].shape[0] % m == 0:
                    self.assertEqual(got[0], want[0], what)
                rtol = 1e-5 if optimizer is SGD else 1e-4
                for step, (g, w) in enumerate(zip(got, want)):
                    self.assertAlmostEqual(g, w, delta=rtol * abs(w), msg=f"{what}: step {step}")
                for key, value in net.state_dict().items():
                    if value.is_floating_point() and optimizer is SGD:
                        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                                   msg=lambda m: f"{what}: {key}: {m}")

    def test_llama(self):
        self.check("llama")

    def test_qwen2(self):
        self.check("qwen2")

    def test_gpt2_head_tied_to_the_embedding(self):
        self.check("gpt2")

    def test_mixtral_mixture_of_experts(self):
        # transformers' grouped_mm experts: transformers::grouped_mm_fallback, our kernel.
        self.check("mixtral")

    def test_vit(self):
        self.check("vit")

    def test_resnet18(self):
        self.check("resnet18")

    def test_mobilenet_v2(self):
        self.check("mobilenet_v2")


@needs_models
class SegmentsTest(unittest.TestCase):
    """The default cut: at the blocks, through wrappers, named by the user's module paths."""

    @classmethod
    def setUpClass(cls):
        quiet_transformers()

    def layers(self, name, **settings):
        with actorpipe.Pipeline(program(name), loss="cross_entropy", **settings) as p:
            return p.stats()["layout"]["layers"]

    def test_blocks_through_wrappers(self):
        self.assertEqual(self.layers("llama", stages=2),
                         ["model.model.embed_tokens"] +
                         [f"model.model.layers.{i}" for i in range(4)] +
                         ["model.model.norm+model.lm_head"])
        self.assertEqual(self.layers("gpt2", stages=2)[1:5],
                         [f"model.transformer.h.{i}" for i in range(4)])
        vit = self.layers("vit", stages=2)
        self.assertEqual(vit[1:5], [f"encoder.layers.encoder_layer_{i}" for i in range(4)])
        resnet = self.layers("resnet18", stages=2)
        self.assertEqual(resnet[0], "conv1+bn1")
        self.assertEqual(resnet[1:9], [f"layer{s}.{b}" for s in range(1, 5) for b in range(2)])
        self.assertEqual(resnet[-1], "fc")
        mobilenet = self.layers("mobilenet_v2", stages=2)
        self.assertEqual(len(mobilenet), 17 + 2)  # the inverted residuals, the stem, the head

    def test_any_stage_count_up_to_the_blocks_and_auto(self):
        x, y = batches("llama", 1)[0]
        for stages in (2, 3, 4, 5, 6):
            with actorpipe.Pipeline(program("llama"), stages=stages, microbatches=2,
                                    loss="cross_entropy") as p:
                p.train_step(x, y)
                self.assertEqual(p.stages, stages)
                self.assertTrue(all(n > 0 for n in p.stats()["layout"]["stage_parameters"]))
        with actorpipe.Pipeline(program("llama"), stages="auto", example=x,
                                loss="cross_entropy") as p:
            p.train_step(x, y)
            self.assertGreaterEqual(p.stages, 1)

    def test_the_model_itself_and_outputs_as_libraries_return_them(self):
        # LlamaForCausalLM without a wrapper returns a ModelOutput; a dict with the logits among
        # other tensors: the loss reads `logits`.
        model, x, y, _ = hf_models.make("llama")
        want, _ = eager(copy.deepcopy(model), SGD, [(x, y)], 2)

        class Outputs(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, ids):
                out = self.model(input_ids=ids, output_hidden_states=True)
                return {"hidden": out.hidden_states[-1], "logits": out.logits}

        for what, module in (("ModelOutput", copy.deepcopy(model)),
                             ("dict", Outputs(copy.deepcopy(model)))):
            with self.subTest(what):
                with actorpipe.Pipeline(module, example=x, stages=3, microbatches=2,
                                        optimizer=SGD, loss="cross_entropy", threads=1) as p:
                    self.assertAlmostEqual(p.train_step(x, y), want[0], delta=1e-6)

    def test_a_stage_without_parameters_is_said_once(self):
        model, x, y, _ = hf_models.make("resnet18")
        with tempfile.TemporaryDirectory(prefix="actorpipe-") as d:
            torch.export.save(hf_models.export(model, x), os.path.join(d, "model.pt2"))
            torch.save({"inputs": x, "targets": y}, os.path.join(d, "data.pt"))
            run = subprocess.run(
                [os.environ["ACTORPIPE_CLI"], "train", "--model", os.path.join(d, "model.pt2"),
                 "--data", "tensors:" + os.path.join(d, "data.pt"), "--segments", "modules",
                 "--stages", "3", "--partition", "cut:2,4", "--batch", "8", "--steps", "1",
                 "--loss", "cross_entropy"], capture_output=True, text=True, timeout=300)
        self.assertEqual(run.returncode, 0, run.stderr)
        said = [line for line in run.stderr.splitlines() if "holds no parameters" in line]
        self.assertEqual(len(said), 1, run.stderr)
        self.assertIn("stage 1 (layers relu..maxpool)", said[0])


@needs_models
class MixtureOfExpertsTest(unittest.TestCase):
    """transformers' expert implementations other than its default (ops we do not run:
    test_export.py, test_a_custom_op_not_registered_in_the_process)."""

    @classmethod
    def setUpClass(cls):
        quiet_transformers()

    def train_both(self, model, stages=2, m=2):
        _, x, _, _ = hf_models.make("mixtral")
        ep = hf_models.export(copy.deepcopy(model), x)
        data = batches("mixtral", 2)
        want, _ = eager(model, SGD, data, m)
        with actorpipe.Pipeline(ep, stages=stages, microbatches=m, optimizer=SGD,
                                loss="cross_entropy", threads=1) as p:
            got = [p.train_step(x, y) for x, y in data]
        return ep, got, want

    def test_batched_and_bf16_grouped_products(self):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            model = hf_models.language_model("mixtral")
            model.set_experts_implementation("batched_mm")
            ep, got, want = self.train_both(model)
            self.assertIn("aten.bmm.default", {str(n.target) for n in ep.graph.nodes})
            for g, w in zip(got, want):
                self.assertAlmostEqual(g, w, delta=1e-5 * abs(w))
            # bfloat16 weights take torch._grouped_mm, which libtorch runs itself.
            model = hf_models.language_model("mixtral").to(torch.bfloat16)
            ep, got, want = self.train_both(model)
            self.assertIn("aten._grouped_mm.default", {str(n.target) for n in ep.graph.nodes})
            self.assertEqual(got, want)
        finally:
            torch.set_num_threads(threads)


@needs_models
class WeightsTest(unittest.TestCase):
    """save_pretrained folders and safetensors files in, the trained weights out, both ways
    against the Python safetensors package and from_pretrained."""

    @classmethod
    def setUpClass(cls):
        quiet_transformers()

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory(prefix="actorpipe-weights-")
        self.d = self.dir.name

    def tearDown(self):
        self.dir.cleanup()

    def pretrained(self, name="llama", seed=7, **save):
        path = os.path.join(self.d, f"{name}-pretrained")
        hf_models.language_model(name, seed=seed).save_pretrained(path, **save)
        return path

    def test_init_from_a_folder_sharded_or_not_and_a_file(self):
        from safetensors.torch import load_file
        import transformers
        for what, path in (("one file", self.pretrained()),
                           ("shards", self.pretrained(seed=8, max_shard_size="40KB"))):
            with self.subTest(what):
                if what == "shards":
                    self.assertTrue(os.path.exists(os.path.join(path,
                                                                "model.safetensors.index.json")))
                want = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
                with actorpipe.Pipeline(program("llama"), stages=2, loss="cross_entropy",
                                        init_from=path) as p:
                    got = p.state_dict()
                for key, value in want.items():
                    self.assertTrue(torch.equal(got["model." + key], value), key)
        # A bare .safetensors file, named as the program names its tensors.
        path = os.path.join(self.pretrained(seed=9), "model.safetensors")
        with actorpipe.Pipeline(program("llama"), stages=2, loss="cross_entropy",
                                init_from=path) as p:
            got = p.state_dict()
        for key, value in load_file(path).items():
            self.assertTrue(torch.equal(got["model." + key], value), key)

    def test_refused_by_name_before_anything_trains(self):
        from safetensors.torch import load_file, save_file
        good = load_file(os.path.join(self.pretrained(), "model.safetensors"))
        cases = {
            "missing": ({k: v for k, v in good.items() if k != "model.norm.weight"},
                        "no tensor for 'model.model.norm.weight'"),
            "left over": (dict(good, extra=torch.zeros(2)), "no tensor 'extra'"),
            "shape": (dict(good, **{"lm_head.weight": torch.zeros(3, 3)}), "'lm_head.weight' is"),
            "dtype": (dict(good, **{"model.norm.weight": good["model.norm.weight"].double()}),
                      "'model.norm.weight' is Double"),
        }
        for what, (tensors, message) in cases.items():
            with self.subTest(what):
                path = os.path.join(self.d, what.replace(" ", "-") + ".safetensors")
                save_file(tensors, path, metadata={"format": "pt"})
                with self.assertRaises(ValueError) as e:
                    actorpipe.Pipeline(program("llama"), stages=2, loss="cross_entropy",
                                       init_from=path)
                self.assertIn(message, str(e.exception))
                self.assertIn(path, str(e.exception))
        truncated = os.path.join(self.d, "truncated.safetensors")
        with open(os.path.join(self.pretrained(), "model.safetensors"), "rb") as f:
            data = f.read()
        with open(truncated, "wb") as f:
            f.write(data[:len(data) // 2])
        with self.assertRaises(ValueError) as e:
            actorpipe.Pipeline(program("llama"), stages=2, loss="cross_entropy",
                               init_from=truncated)
        self.assertIn("truncated.safetensors", str(e.exception))

    def test_saved_weights_read_by_safetensors_and_from_pretrained(self):
        from safetensors.torch import load_file
        import transformers
        # GPT-2: save_pretrained leaves out the head tied to the embedding; so does the output.
        path = self.pretrained("gpt2")
        for shard in (5 << 30, 30_000):
            with self.subTest(shard=shard):
                out = os.path.join(self.d, f"out-{shard}")
                with actorpipe.Pipeline(program("gpt2"), stages=3, microbatches=2,
                                        loss="cross_entropy", optimizer=SGD,
                                        init_from=path) as p:
                    for x, y in batches("gpt2", 2):
                        p.train_step(x, y)
                    p.save_safetensors(out, max_shard_size=shard)
                    state = p.state_dict()
                files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
                self.assertEqual(len(files) > 1, shard < 1 << 20, files)
                self.assertIn("config.json", os.listdir(out))
                read = {}
                for f in files:
                    read.update(load_file(os.path.join(out, f)))
                self.assertNotIn("lm_head.weight", read)
                for key, value in read.items():
                    self.assertTrue(torch.equal(value, state["model." + key]), key)
                back = transformers.AutoModelForCausalLM.from_pretrained(out)
                for key, value in back.state_dict().items():
                    self.assertTrue(torch.equal(value, state["model." + key]), key)

    def test_fine_tune_round_trip_through_the_program(self):
        # save_pretrained -> actorpipe train --init-from -> --save-safetensors ->
        # from_pretrained: the logits of PyTorch's own fine-tune of the same weights.
        import transformers
        pre = self.pretrained()
        model, x, _, _ = hf_models.make("llama", seed=3)  # other weights: init_from sets them
        model_path = os.path.join(self.d, "model.pt2")
        torch.export.save(hf_models.export(model, x), model_path)
        data = batches("llama", 3)
        torch.save({"inputs": torch.cat([b[0] for b in data]),
                    "targets": torch.cat([b[1] for b in data])},
                   os.path.join(self.d, "data.pt"))
        out = os.path.join(self.d, "tuned")
        run = subprocess.run(
            [os.environ["ACTORPIPE_CLI"], "train", "--model", model_path, "--init-from", pre,
             "--data", "tensors:" + os.path.join(self.d, "data.pt"), "--batch", "8",
             "--steps", "3", "--stages", "2", "--microbatches", "2", "--schedule", "1f1b",
             "--optimizer", "adamw", "--lr", "0.003", "--loss", "cross_entropy",
             "--threads", "1", "--save-safetensors", out],
            capture_output=True, text=True, timeout=300)
        self.assertEqual(run.returncode, 0, run.stderr)
        tuned = transformers.AutoModelForCausalLM.from_pretrained(pre)
        want_losses, _ = eager(tuned, ADAMW, data, 2)
        back = transformers.AutoModelForCausalLM.from_pretrained(out)
        tuned.eval()
        back.eval()
        with torch.no_grad():
            torch.testing.assert_close(back(input_ids=x).logits, tuned(input_ids=x).logits,
                                       rtol=1e-5, atol=1e-5)
        losses = [float(line.split("loss ")[1].split()[0]) for line in run.stdout.splitlines()
                  if line.startswith("step ")]
        for got, want in zip(losses, want_losses):
            self.assertAlmostEqual(got, want, delta=1e-5 * abs(want))
