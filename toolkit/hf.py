"""Hugging Face GPT-2 folders both ways: config.json + model.safetensors (or pytorch_model.bin).

    model = load_gpt2("path/to/gpt2-dir") # or "gpt2" ... "gpt2-xl" when in the local HF cache
    save_gpt2(model, "out-dir")           # transformers' GPT2LMHeadModel loads it as the same model

HF stores the attention and MLP weights as Conv1D, transposed relative to nn.Linear; keys may carry
a `transformer.` prefix; `lm_head.weight` is tied to the token embedding and may be absent. Nothing
is ever downloaded: hub names are looked up in the local cache through huggingface_hub.
"""
import functools
import json
import math
import os

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from torch import nn

from model import GPT, GPTConfig, check_config
from toolkit.checkpoint import check_shape, check_tied_head, read_weights
from toolkit.device import check_memory
from toolkit.cli import CLIError
from toolkit.textfiles import read_text
from toolkit.files import atomic_write, read_json, write_json, write_text
from toolkit.gpt2_vocab import GPT2_FACTS
from toolkit.tokenizers import (EOT_TEXT, EOT_TEXTS, SPELLING, Tokenizer, bos_token_id,
                               gpt2_ranks, load_tokenizer, read_facts)

# this toolkit's tokenizer facts, for folders of other vocabularies
TOKENIZER_FILE = "tokenizer_facts.json"
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
        raise FileNotFoundError(f"no model directory at '{path}'; pass a local GPT-2 directory "
                                "(config.json + model.safetensors or pytorch_model.bin) or one of "
                                f"{', '.join(HUB_NAMES)}")
    from huggingface_hub import try_to_load_from_cache  # 135 ms, for a hub name only
    for repo in (f"openai-community/{name}", name):
        config = try_to_load_from_cache(repo, "config.json")
        if isinstance(config, str) and any(os.path.isfile(os.path.join(os.path.dirname(config), f))
                                           for f in WEIGHT_FILES):
            return os.path.dirname(config)
    raise FileNotFoundError(f"'{path}' is not in the local Hugging Face cache and is never "
                            "downloaded; on a machine with internet run `hf download "
                            f"openai-community/{name} --local-dir DIR`, copy DIR here and pass DIR")


def read_config(directory: str) -> GPTConfig:
    """The GPTConfig of an HF GPT-2 config.json, refusing settings that change GPT-2's function."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory}: no config.json; expected a Hugging Face GPT-2 model "
                                "directory")
    hf = read_json(path, "HF config")
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"{path}: model_type is {hf.get('model_type')!r}, only 'gpt2' is "
                         "supported")
    if hf.get("n_inner") == 4 * hf.get("n_embd", 768):
        hf["n_inner"] = None  # the same as the default
    for key, (default, allowed) in REQUIRED.items():
        if hf.get(key, default) not in allowed:
            raise ValueError(f"{path}: {key}={hf[key]!r} is not GPT-2-compatible (need one of "
                             f"{allowed})")
    if not math.isclose(hf.get("layer_norm_epsilon", 1e-5), 1e-5):
        raise ValueError(f"{path}: layer_norm_epsilon={hf['layer_norm_epsilon']} is not GPT-2's "
                         "1e-5")
    hf.setdefault("n_positions", hf.get("n_ctx", 1024))
    config = GPTConfig(block_size=hf["n_positions"], vocab_size=hf.get("vocab_size"),
                       n_layer=hf.get("n_layer"), n_head=hf.get("n_head"), n_embd=hf.get("n_embd"),
                       bias=True)
    try:
        check_config(config)  # before anything is allocated
        check_memory(config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return config


def load_gpt2(path: str, **overrides) -> GPT:
    """A GPT loaded from an HF GPT-2 folder (or cached hub name); overrides set e.g. dropout."""
    directory = find_model_dir(path)
    config = read_config(directory)
    for key, value in overrides.items():
        setattr(config, key, value)
    weights = read_weights(directory)
    check_shape(config, {"transformer." + k.removeprefix("transformer."): v
                         for k, v in weights.items()},
                os.path.join(directory, "config.json"))
    with torch.device("meta"):  # skip the random init; every tensor is replaced below
        model = GPT(config)
    expected = model.state_dict()
    state = {}
    for key, tensor in weights.items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue  # causal-mask buffers; the head is tied to wte
        if key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        state["transformer." + key] = tensor.float().contiguous()
    check_tied_head(weights.get("lm_head.weight"), state.get("transformer.wte.weight"), directory)
    state["lm_head.weight"] = state.get("transformer.wte.weight")
    missing = sorted(k for k in expected if state.get(k) is None)
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{directory}: not a GPT-2 checkpoint; missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}")
    for k, t in state.items():
        if t.shape != expected[k].shape:
            raise ValueError(f"{directory}: {k} has shape {tuple(t.shape)}, config implies "
                             f"{tuple(expected[k].shape)}")
    model.load_state_dict(state, assign=True)
    model.lm_head.weight = model.transformer.wte.weight  # assign=True replaced the tied parameter
    return model


def save_gpt2(model: GPT, out_dir: str, tokenizer: dict | None = None,
              template: dict | None = None) -> str:
    """An HF GPT-2 folder that transformers loads alone, offline: config.json, model.safetensors and
    generation_config.json (AutoModelForCausalLM: GPT2LMHeadModel, the same model), and for GPT-2's
    vocabulary the tokenizer files (vocab.json, merges.txt, tokenizer.json, for AutoTokenizer).

    bias=False is written as zero biases (the same function). `tokenizer` (facts, as in checkpoints;
    default GPT-2's) gives bos/eos_token_id, none for a vocabulary without an end-of-text token;
    `template`, a chat template (chat.export_template's), goes in the tokenizer's configuration.
    Facts other than GPT-2's own are also written to TOKENIZER_FILE, so test.py reads the folder
    with the right tokenizer; a vocabulary an HF tokenizer cannot represent (char, byte) says so in
    the folder's README.md. Returns a line saying what was written."""
    c = model.config
    tokenizer = tokenizer or GPT2_FACTS
    eot_id = tokenizer.get("eot_id")
    hf = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.vocab_size,
          "n_positions": c.block_size, "n_ctx": c.block_size, "n_embd": c.n_embd,
          "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": None,
          "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
          "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
          "initializer_range": 0.02, "scale_attn_weights": True, "tie_word_embeddings": True,
          "bos_token_id": bos_token_id(tokenizer), "eos_token_id": eot_id}
    tensors = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding)) or name == "lm_head":
            continue
        weight = module.weight.detach()
        if name.endswith(CONV1D_MODULES):
            weight = weight.t()
        tensors[f"{name}.weight"] = weight.contiguous().cpu()
        if not isinstance(module, nn.Embedding):
            bias = module.bias if module.bias is not None else \
                module.weight.new_zeros(module.weight.size(0))
            tensors[f"{name}.bias"] = bias.detach().contiguous().cpu()
    atomic_write(os.path.join(out_dir, "model.safetensors"),
                 lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    write_json(os.path.join(out_dir, "config.json"), hf)
    write_generation_config(out_dir, tokenizer, template)
    if tokenizer != GPT2_FACTS:
        write_json(os.path.join(out_dir, TOKENIZER_FILE), tokenizer)
    if tokenizer.get("tokenizer") in ("gpt2", "bpe"):
        write_tokenizer_files(out_dir, tokenizer, c.block_size, template)
        return "an HF GPT-2 folder"
    write_text(os.path.join(out_dir, "README.md"), NO_HF_TOKENIZER.format(**tokenizer))
    return (f"an HF GPT-2 folder (its {tokenizer['tokenizer']} tokenizer has no HF tokenizer: "
            "see its README.md)")


NO_HF_TOKENIZER = """# A model with this toolkit's {tokenizer} tokenizer

transformers loads its weights (`AutoModelForCausalLM.from_pretrained` of this folder is the same \
network), but no
Hugging Face tokenizer represents a {tokenizer} vocabulary of {vocab_size} ids, so there is no \
tokenizer file here
and `AutoTokenizer` cannot load the folder. The vocabulary is described in tokenizer_facts.json; \
`python test.py
--ckpt THIS_FOLDER` and every script of the toolkit read it.
"""


def merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts BPE joins into token: merges of lower rank reduce its bytes to exactly two."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, len(ranks)), i)
                 for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank >= ranks[token]:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], b"".join(parts[1:])


def read_chat_template(folder: str, facts: dict) -> dict | None:
    """A downloaded folder's own chat template (Qwen3's, SmolLM's ChatML), where transformers keeps
    it: chat_template.jinja, or tokenizer_config.json's chat_template (a string, or named templates:
    the default one). With it, the bos and eos tokens it renders and the ids that end a reply:
    generation_config.json's eos_token_id, else the eos token's, else end-of-text. None without one.
    """
    config_path = os.path.join(folder, "tokenizer_config.json")
    config = read_json(config_path) if os.path.isfile(config_path) else {}
    jinja_path = os.path.join(folder, "chat_template.jinja")
    jinja = read_text(jinja_path) if os.path.isfile(jinja_path) else config.get("chat_template")
    if isinstance(jinja, list):
        jinja = next((t.get("template") for t in jinja
                      if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(jinja, str):
        return None
    bos, eos = (token_text(config.get(key)) for key in ("bos_token", "eos_token"))
    generation_path = os.path.join(folder, "generation_config.json")
    stops = read_json(generation_path).get("eos_token_id") if os.path.isfile(generation_path) \
        else None
    stops = [stops] if type(stops) is int else stops if isinstance(stops, list) else []
    if not all(type(i) is int and 0 <= i < facts["vocab_size"] for i in stops):
        raise CLIError(f"{generation_path}: eos_token_id must be token ids below the vocabulary's "
                       f"{facts['vocab_size']}, got {stops!r:.80}")
    if not stops and eos:
        ids = load_tokenizer(facts).encode_with_special_tokens(eos)
        stops = ids if len(ids) == 1 else []
    if not stops and facts.get("eot_id") is not None:
        stops = [facts["eot_id"]]
    return {"jinja": jinja, "bos_token": bos, "eos_token": eos, "stop_ids": stops}


def token_text(token) -> str | None:
    """A token as tokenizer_config.json names it: its text, or an AddedToken's {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else \
        token if isinstance(token, str) else None


def write_generation_config(out_dir: str, facts: dict, template: dict | None) -> None:
    """generation_config.json: generate() stops at the end-of-text token, or where the model chats
    at the ids that end a reply (an instruction-tuned model's <|end|> too, as Llama 3's lists
    <|eot_id|>; a downloaded folder's own). No max_length, as GPT-2's own: generate()'s
    max_new_tokens then comes with no warning."""
    eot_id = facts.get("eot_id")
    write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": bos_token_id(facts),
        "eos_token_id": template["stop_ids"] if template else eot_id})


def write_tokenizer_files(out_dir: str, facts: dict, block_size: int,
                          template: dict | None) -> None:
    """The tokenizer files of a GPT-2 or a trained BPE vocabulary, so that AutoTokenizer gives this
    toolkit's ids: tokenizer.json (the fast tokenizer) with the special tokens a fine-tuning added,
    its configuration (with the chat template of an instruction-tuned model or a downloaded
    folder's own, for apply_chat_template), and for GPT-2 also vocab.json and merges.txt rebuilt
    from tiktoken's ranks (the slow GPT2Tokenizer reads those alone)."""
    # GPT-1's start, ...: <|start|>; the chat template's are so named
    special = facts.get("special_tokens") or {}
    tokenizer = load_tokenizer(facts)
    added = {tokenizer.eot_text: facts["eot_id"],
             **{name if name.startswith("<|") else f"<|{name}|>": i for name, i in special.items()}}
    if facts["tokenizer"] == "bpe":
        bpe, tokenizer_class = HFTokenizer.from_str(facts["json"]), "PreTrainedTokenizerFast"
    else:
        bpe, tokenizer_class = gpt2_files(out_dir, facts), "GPT2Tokenizer"
    bpe.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in added])
    moved = [name for name, i in added.items() if bpe.token_to_id(name) != i]
    if moved:
        raise CLIError(f"the HF tokenizer would give {moved[0]} another id than the model's; the "
                       f"vocabulary and the model's embedding rows do not line up")
    eot = tokenizer.eot_text  # a template's bos and eos tokens are the ones it renders
    named = {"bos_token": tokenizer.bos_text or eot, "eos_token": eot, "unk_token": eot,
             **({key: template.get(key) for key in ("bos_token", "eos_token")} if template else {})}
    write_json(os.path.join(out_dir, "special_tokens_map.json"), named)
    write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": tokenizer_class, "model_max_length": block_size,
        "add_prefix_space": False, **named,
        "added_tokens_decoder": {str(i): {"content": name, "special": True, "lstrip": False,
                                          "rstrip": False, "normalized": False,
                                          "single_word": False} for name, i in added.items()},
        **({"chat_template": template["jinja"]} if template else {})})
    atomic_write(os.path.join(out_dir, "tokenizer.json"), bpe.save)


def gpt2_vocab_merges(facts: dict) -> tuple[dict[str, int], list[str]]:
    """GPT-2's vocabulary (byte-level token text -> id, end-of-text included) and merges, in rank
    order, rebuilt from the BPE ranks tiktoken uses."""
    ranks = gpt2_ranks(facts.get("vocab_file"), facts.get("merge_file"))

    def text(token: bytes) -> str:
        return "".join(SPELLING[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab[EOT_TEXT] = facts["eot_id"]
    merges = [" ".join(map(text, merge_of(token, ranks))) for token, _ in
              sorted(((t, r) for t, r in ranks.items() if len(t) > 1), key=lambda item: item[1])]
    return vocab, merges


def gpt2_files(out_dir: str, facts: dict) -> HFTokenizer:
    """GPT-2's vocab.json and merges.txt, and the fast tokenizer they make."""
    vocab, merges = gpt2_vocab_merges(facts)
    write_json(os.path.join(out_dir, "vocab.json"), vocab)
    write_text(os.path.join(out_dir, "merges.txt"), "#version: 0.2\n" + "\n".join(merges) + "\n")
    bpe = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    return bpe


def read_tokenizer(directory: str, vocab_size: int) -> dict:
    """An HF folder's tokenizer facts: TOKENIZER_FILE when this toolkit wrote one, else the
    folder's own vocabulary (folder_vocabulary), else GPT-2's; with the folder's own chat template
    if it has one."""
    path = os.path.join(directory, TOKENIZER_FILE)
    if os.path.isfile(path):
        facts = read_facts(path)
    else:
        facts = folder_vocabulary(directory)
        if facts is not None and facts["vocab_size"] > vocab_size:
            raise CLIError(f"{directory}: its tokenizer has {facts['vocab_size']:,} ids but the "
                           f"model {vocab_size:,} token rows")
        if facts is not None:  # (fewer ids than rows: an embedding padded to a round size)
            vocab_size = facts["vocab_size"]
        facts = facts or dict(GPT2_FACTS)
        template = read_chat_template(directory, facts)
        facts.update({"chat_template": template} if template else {})
    if facts.get("vocab_size") != vocab_size:
        raise ValueError(f"{directory} holds a model of {vocab_size} tokens but its tokenizer "
                         f"({facts.get('tokenizer')}) has {facts.get('vocab_size')}; without "
                         f"{TOKENIZER_FILE} or a tokenizer.json an HF folder is read with "
                         "GPT-2's tokenizer")
    return facts


def folder_vocabulary(directory: str) -> dict | None:
    """The tokenizer facts of a folder's own BPE files, as transformers reads them: tokenizer.json,
    else GPT2Tokenizer's vocab.json and merges.txt. GPT-2's own vocabulary gives GPT-2's facts
    (tiktoken encodes it, five times faster); None without such files."""
    json_path, vocab_path, merges_path = (os.path.join(directory, name) for name in
                                          ("tokenizer.json", "vocab.json", "merges.txt"))
    if os.path.isfile(json_path):
        text, source = read_text(json_path, "tokenizer.json"), json_path
    elif os.path.isfile(vocab_path) and os.path.isfile(merges_path):
        text, source = byte_level_bpe(vocab_path, merges_path), vocab_path
    else:
        return None
    tokenizer = Tokenizer("bpe", tokenizer_json=text, source=source)
    spec = json.loads(text)["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec.get("merges", [])]
    if len(spec["vocab"]) == GPT2_FACTS["vocab_size"] and (spec["vocab"], merges) == gpt2_spec():
        return dict(GPT2_FACTS)
    return tokenizer.facts()


@functools.cache
def gpt2_spec() -> tuple[dict[str, int], list[str]]:
    """GPT-2's vocab.json and merges.txt as tokenizer.json holds them (built once: about 1 s)."""
    return gpt2_vocab_merges(GPT2_FACTS)


def byte_level_bpe(vocab_path: str, merges_path: str) -> str:
    """The tokenizer.json of GPT2Tokenizer's vocab.json and merges.txt: a byte-level BPE, its
    end-of-text a special token."""
    try:
        bpe = HFTokenizer(models.BPE.from_file(vocab_path, merges_path))
    except Exception as e:  # tokenizers raises its own plain Exception
        raise CLIError(f"{vocab_path} with {merges_path}: HF tokenizers cannot read them "
                       f"({' '.join(str(e).split())[:200]})") from None
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(name, special=True, normalized=False)
                            for name in EOT_TEXTS if bpe.token_to_id(name) is not None])
    return bpe.to_str()
