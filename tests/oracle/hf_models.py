"""Models nobody here wrote, as a PyTorch user takes them: causal language models and a mixture
of experts from Hugging Face `transformers`, a ViT and CNNs from `torchvision`, at small sizes
with random weights, for the tests (tests/python/test_models.py) and the bench
(bench/python/models_bench.py). `make(name, seed, batch)` returns (model, inputs, targets, loss);
`export(model, x)` the program as a user exports it: the model in a wrapper whose forward returns
`model(input_ids=x).logits` (a language model) or the model itself (torchvision's), the batch
dimension dynamic."""
import torch

LANGUAGE_MODELS = ("llama", "qwen2", "gpt2", "mixtral")
VISION_MODELS = ("vit", "resnet18", "mobilenet_v2")
VOCABULARY, CONTEXT = 96, 16


def available():
    """Why the models cannot be made here, or None."""
    try:
        import torchvision  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"transformers and torchvision are not installed ({e})"
    return None


def _language_config(name, layers):
    import transformers as t
    common = dict(vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, use_cache=False)
    if name == "llama":
        return t.LlamaConfig(**common), t.LlamaForCausalLM
    if name == "qwen2":
        return t.Qwen2Config(**common), t.Qwen2ForCausalLM
    if name == "mixtral":
        # Four experts, two per token: routed with data-dependent counts per expert.
        return t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common), \
            t.MixtralForCausalLM
    if name == "gpt2":
        # GPT-2's head is tied to its token embedding; no dropout, so that eager draws nothing.
        return t.GPT2Config(vocab_size=VOCABULARY, n_embd=32, n_layer=layers, n_head=4,
                            n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0, use_cache=False), t.GPT2LMHeadModel
    raise ValueError(f"unknown language model {name}")


def language_model(name, layers=4, seed=0):
    torch.manual_seed(seed)
    config, cls = _language_config(name, layers)
    return cls(config)


def vision_model(name, seed=0):
    import torchvision
    torch.manual_seed(seed)
    if name == "vit":
        return torchvision.models.VisionTransformer(
            image_size=16, patch_size=4, num_layers=4, num_heads=2, hidden_dim=32, mlp_dim=64,
            num_classes=10)
    if name == "resnet18":
        return torchvision.models.resnet18(num_classes=10)
    if name == "mobilenet_v2":
        # No dropout before the classifier, so that eager draws nothing.
        return torchvision.models.mobilenet_v2(num_classes=10, width_mult=0.25, dropout=0.0)
    raise ValueError(f"unknown vision model {name}")


def make(name, seed=0, batch=8):
    """(model, inputs, targets, loss) for `name`, the data drawn from `seed`."""
    if name in LANGUAGE_MODELS:
        model = language_model(name)
        g = torch.Generator().manual_seed(1000 + seed)
        tokens = torch.randint(0, VOCABULARY, (batch, CONTEXT), generator=g)
        targets = torch.randint(0, VOCABULARY, (batch, CONTEXT), generator=g)
        return model, tokens, targets, "cross_entropy"
    model = vision_model(name)
    g = torch.Generator().manual_seed(1000 + seed)
    side = 16 if name == "vit" else 32
    x = torch.randn(batch, 3, side, side, generator=g)
    return model, x, torch.randint(0, 10, (batch,), generator=g), "cross_entropy"


class Logits(torch.nn.Module):
    """The usual wrapper around a transformers model for torch.export: token ids in, logits
    out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def wrapped(model):
    """What is exported and what eager runs: the logits of a language model, a vision model
    as it is."""
    if hasattr(model, "config") and hasattr(model.config, "vocab_size"):
        return Logits(model)
    return model


def export(model, x):
    """The program a user exports, its batch dimension dynamic."""
    return torch.export.export(wrapped(model), (x,),
                               dynamic_shapes=({0: torch.export.Dim("batch", max=1024)},))
