"""Hugging Face GPT-2 folders both ways: config.json + model.safetensors (or pytorch_model.bin).

    model = load_gpt2("path/to/gpt2-dir")   # or "gpt2" ... "gpt2-xl" when in the local HF cache
    save_gpt2(model, "out-dir")            # transformers' GPT2LMHeadModel loads it as the same model

HF stores the attention and MLP weights as Conv1D, transposed relative to nn.Linear; keys may carry a
`transformer.` prefix; `lm_head.weight` is tied to the token embedding and may be absent. Nothing is
ever downloaded: hub names are looked up in the local cache through huggingface_hub.
"""
import math
import os

import torch
from torch import nn

from model import GPT, GPTConfig, check_config
from toolkit.checkpoint import read_weights
from toolkit.device import check_memory
from toolkit.files import atomic_write, read_json, write_json
from toolkit.gpt2_vocab import GPT2_FACTS

TOKENIZER_FILE = "tokenizer_facts.json"  # this toolkit's tokenizer facts, for folders of other vocabularies
HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
CONV1D_MODULES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
CONV1D_WEIGHTS = tuple(m + ".weight" for m in CONV1D_MODULES)
# GPT2Config fields (with transformers' defaults) whose other values would change the function
REQUIRED = {
    "activation_function": ("gelu_new", ("gelu_new", "gelu_pytorch_tanh")),
    "n_inner": (None, (None,)),
    "scale_attn_weights": (True, (True,)),
    "scale_attn_by_inverse_layer_idx": (False, (False,)),
    "add_cross_attention": (False, (False,)),
    "tie_word_embeddings": (True, (True,)),
}


def find_model_dir(path: str) -> str:
    """A local folder as it is, or a GPT-2 hub name found in the local Hugging Face cache."""
    if os.path.isdir(path):
        return path
    name = path.removeprefix("openai-community/")
    if name not in HUB_NAMES:
        raise FileNotFoundError(f"no model directory at '{path}'; pass a local GPT-2 directory (config.json + "
                                f"model.safetensors or pytorch_model.bin) or one of {', '.join(HUB_NAMES)}")
    from huggingface_hub import try_to_load_from_cache
    for repo in (f"openai-community/{name}", name):
        config = try_to_load_from_cache(repo, "config.json")
        if isinstance(config, str) and any(os.path.isfile(os.path.join(os.path.dirname(config), f))
                                           for f in WEIGHT_FILES):
            return os.path.dirname(config)
    raise FileNotFoundError(f"'{path}' is not in the local Hugging Face cache and is never downloaded; on a machine "
                            f"with internet run `hf download openai-community/{name} --local-dir DIR`, copy DIR "
                            f"here and pass DIR")


def read_config(directory: str) -> GPTConfig:
    """The GPTConfig of an HF GPT-2 config.json; any setting that would change GPT-2's function is refused."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory}: no config.json; expected a Hugging Face GPT-2 model directory")
    hf = read_json(path, "HF config")
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"{path}: model_type is {hf.get('model_type')!r}, only 'gpt2' is supported")
    if hf.get("n_inner") == 4 * hf.get("n_embd", 768):
        hf["n_inner"] = None  # the same as the default
    for key, (default, allowed) in REQUIRED.items():
        if hf.get(key, default) not in allowed:
            raise ValueError(f"{path}: {key}={hf[key]!r} is not GPT-2-compatible (need one of {allowed})")
    if not math.isclose(hf.get("layer_norm_epsilon", 1e-5), 1e-5):
        raise ValueError(f"{path}: layer_norm_epsilon={hf['layer_norm_epsilon']} is not GPT-2's 1e-5")
    hf.setdefault("n_positions", hf.get("n_ctx", 1024))
    config = GPTConfig(block_size=hf["n_positions"], vocab_size=hf.get("vocab_size"), n_layer=hf.get("n_layer"),
                       n_head=hf.get("n_head"), n_embd=hf.get("n_embd"), bias=True)
    try:
        check_config(config)  # before anything is allocated
        check_memory(config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return config


def load_gpt2(path: str, **overrides) -> GPT:
    """A GPT with the weights of an HF GPT-2 folder (or cached hub name); overrides set e.g. dropout."""
    directory = find_model_dir(path)
    config = read_config(directory)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):  # skip the random init; every tensor is replaced below
        model = GPT(config)
    expected = model.state_dict()
    state = {}
    for key, tensor in read_weights(directory).items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue  # causal-mask buffers; the head is tied to wte
        if key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        state["transformer." + key] = tensor.float().contiguous()
    state["lm_head.weight"] = state.get("transformer.wte.weight")
    missing = sorted(k for k in expected if state.get(k) is None)
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{directory}: not a GPT-2 checkpoint; missing {missing[:3]}, unexpected {unexpected[:3]}")
    for k, t in state.items():
        if t.shape != expected[k].shape:
            raise ValueError(f"{directory}: {k} has shape {tuple(t.shape)}, config implies {tuple(expected[k].shape)}")
    model.load_state_dict(state, assign=True)
    model.lm_head.weight = model.transformer.wte.weight  # assign=True replaced the tied parameter
    return model


def save_gpt2(model: GPT, out_dir: str, tokenizer: dict | None = None) -> None:
    """config.json + model.safetensors that transformers' GPT2LMHeadModel loads as the same model.

    bias=False is written as zero biases (the same function). `tokenizer` (facts, as in checkpoints; default
    GPT-2's) gives bos/eos_token_id, none for a vocabulary without an end-of-text token; facts of another
    tokenizer are also written to TOKENIZER_FILE, so test.py samples the folder with the right one."""
    from safetensors.torch import save_file

    c = model.config
    tokenizer = tokenizer or GPT2_FACTS
    eot_id = tokenizer.get("eot_id")
    hf = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": c.vocab_size,
        "n_positions": c.block_size,
        "n_ctx": c.block_size,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
    }
    tensors = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding)) or name == "lm_head":
            continue
        weight = module.weight.detach()
        if name.endswith(CONV1D_MODULES):
            weight = weight.t()
        tensors[f"{name}.weight"] = weight.contiguous().cpu()
        if not isinstance(module, nn.Embedding):
            bias = module.bias if module.bias is not None else module.weight.new_zeros(module.weight.size(0))
            tensors[f"{name}.bias"] = bias.detach().contiguous().cpu()
    atomic_write(os.path.join(out_dir, "model.safetensors"),
                 lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    write_json(os.path.join(out_dir, "config.json"), hf)
    if tokenizer.get("tokenizer") != "gpt2":
        write_json(os.path.join(out_dir, TOKENIZER_FILE), tokenizer)


def read_tokenizer(directory: str, vocab_size: int) -> dict:
    """The tokenizer facts of an HF folder: TOKENIZER_FILE when this toolkit wrote one, else GPT-2's."""
    path = os.path.join(directory, TOKENIZER_FILE)
    facts = read_json(path, "tokenizer facts") if os.path.isfile(path) else dict(GPT2_FACTS)
    if facts.get("vocab_size") != vocab_size:
        raise ValueError(f"{directory} holds a model of {vocab_size} tokens but its tokenizer "
                         f"({facts.get('tokenizer')}) "
                         f"has {facts.get('vocab_size')}; without {TOKENIZER_FILE} an HF folder is read with "
                         f"GPT-2's tokenizer")
    return facts
