"""Hugging Face folders of the llama family both ways: LlamaForCausalLM and Qwen3ForCausalLM
(config.json, model.safetensors or indexed shards, tokenizer.json), the layout SmolLM, Qwen3 and
Llama are published in.

    model, facts = load_llama("path/to/SmolLM2-135M") # a GPT of arch llama, and its tokenizer facts
    save_llama(model, "out-dir", facts)               # transformers loads it alone: the same logits

Llama 3.1's rope scaling (rope_type "llama3") is read into GPTConfig.rope_scaling and written back;
other rope scalings are refused.

HF keeps q, k and v (and the MLP's gate and up) as separate matrices, which this toolkit holds as
one (attn.c_attn, mlp.c_fc): they are concatenated on the way in and split on the way out. Both lay
rotary pairs out the same way (rotate_half), so no weight is permuted. A tied head has no
lm_head.weight.
"""
import os

import torch
from safetensors.torch import save_file

from model import GPT, ROPE_SCALING, GPTConfig, check_config
from toolkit.checkpoint import check_tied_head, read_weights
from toolkit.cli import CLIError
from toolkit.device import check_memory
from toolkit.textfiles import read_text
from toolkit.files import atomic_write, read_json, write_json, write_text
from toolkit.gpt2_vocab import GPT2_FACTS
from toolkit.hf import (NO_HF_TOKENIZER, TOKENIZER_FILE, read_chat_template,
                        write_generation_config, write_tokenizer_files)
from toolkit.tokenizers import Tokenizer, bos_token_id, read_facts

# Qwen3: Llama with QK-norm
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# HF's names of one block's tensors -> ours; q/k/v and gate/up are concatenated into one of ours
BLOCK = {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2",
         "self_attn.o_proj": "attn.c_proj", "mlp.down_proj": "mlp.c_proj",
         "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}
FUSED = {"attn.c_attn": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.c_fc": ("mlp.gate_proj", "mlp.up_proj")}
TOP = {"model.embed_tokens": "transformer.wte", "model.norm": "transformer.ln_f",
       "lm_head": "lm_head"}


def is_llama_folder(path: str) -> bool:
    """Whether path is an HF folder of a Llama or Qwen3 model."""
    config = os.path.join(path, "config.json")
    return os.path.isfile(config) and \
        read_json(config, "HF config").get("model_type") in ARCHITECTURES


def read_config(directory: str) -> GPTConfig:
    """The GPTConfig of a Llama or Qwen3 config.json, refusing settings that change the function."""
    path = os.path.join(directory, "config.json")
    hf = read_json(path, "HF config")
    # transformers 5 keeps the rotary settings in rope_parameters, 4 in rope_theta and rope_scaling
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(hf.get(key) or {}, dict):
            raise CLIError(f"{path}: {key} must be an object, got {hf[key]!r:.80}")
    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0),
                                         **(hf.get("rope_scaling") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    # (HF's fallback)
    scaling = {"original_max_position_embeddings": hf.get("max_position_embeddings"), **rope}
    unsupported = {"hidden_act": hf.get("hidden_act", "silu") != "silu",
                   "attention_bias": hf.get("attention_bias"), "mlp_bias": hf.get("mlp_bias"),
                   f"rope_type {rope_type}": rope_type not in ("default", "llama3"),
                   "use_sliding_window": hf.get("use_sliding_window")}
    if any(unsupported.values()):
        raise CLIError(f"{path}: {', '.join(k for k, v in unsupported.items() if v)} is not "
                       "supported here")
    config = GPTConfig(arch="llama", bias=False, vocab_size=hf.get("vocab_size"),
                       n_embd=hf.get("hidden_size"), n_layer=hf.get("num_hidden_layers"),
                       n_head=hf.get("num_attention_heads"),
                       n_kv_head=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
                       mlp_hidden=hf.get("intermediate_size"),
                       block_size=hf.get("max_position_embeddings"),
                       qk_norm=hf["model_type"] == "qwen3",
                       rope_theta=float(rope.get("rope_theta", 10000.0)),
                       norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                       rope_scaling={key: scaling.get(key) for key in ROPE_SCALING}
                                    if rope_type == "llama3" else None,
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    try:
        check_config(config)  # before anything is allocated
        check_memory(config)
    except ValueError as e:
        raise CLIError(f"{path}: {e}") from None
    return config


def ours(hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """HF's state dict under this toolkit's names (float32, the fused matrices concatenated)."""
    state = {ours_name + ".weight": hf[name + ".weight"] for name, ours_name in TOP.items()
             if name + ".weight" in hf}
    for i in range(config.n_layer):
        layer = f"model.layers.{i}."
        for name, ours_name in BLOCK.items():
            if layer + name + ".weight" in hf:
                state[f"transformer.h.{i}.{ours_name}.weight"] = hf[layer + name + ".weight"]
        for ours_name, names in FUSED.items():
            parts = [hf.get(layer + name + ".weight") for name in names]
            if all(part is not None for part in parts):
                state[f"transformer.h.{i}.{ours_name}.weight"] = torch.cat(parts)
    if config.tie_embeddings:
        state["lm_head.weight"] = state.get("transformer.wte.weight")
    return {name: tensor.float().contiguous() for name, tensor in state.items()
            if tensor is not None}


def load_llama(path: str, **overrides) -> tuple[GPT, dict]:
    """The GPT (arch llama) of an HF Llama or Qwen3 folder, and its tokenizer facts (its
    tokenizer.json, or the facts this toolkit wrote beside a vocabulary HF cannot represent)."""
    config = read_config(path)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):  # skip the random init; every tensor is replaced below
        model = GPT(config)
    expected = model.state_dict()
    weights = read_weights(path)
    if config.tie_embeddings:
        check_tied_head(weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight"),
                        path)
    state = ours(weights, config)
    missing = sorted(set(expected) - set(state))
    wrong = [f"{k} {tuple(state[k].shape)} (the config implies {tuple(expected[k].shape)})"
             for k in sorted(set(expected) & set(state)) if state[k].shape != expected[k].shape]
    if missing or wrong:
        raise CLIError(f"{path}: the weights do not fit its config.json: missing {missing[:3]}, "
                       f"{wrong[:2]}")
    model.load_state_dict(state, assign=True)
    if config.tie_embeddings:  # assign=True replaced the tied parameter
        model.lm_head.weight = model.transformer.wte.weight
    facts = read_tokenizer(path)
    if facts["vocab_size"] > config.vocab_size:  # (fewer ids: Qwen3's padded embedding)
        raise CLIError(f"{path}: its tokenizer has {facts['vocab_size']} ids but the model "
                       f"{config.vocab_size} token rows")
    return model, facts


def read_tokenizer(directory: str) -> dict:
    """An HF folder's tokenizer facts: TOKENIZER_FILE when this toolkit wrote one, else its
    tokenizer.json as a BPE, with the folder's own chat template if it has one."""
    facts_path, json_path = (os.path.join(directory, TOKENIZER_FILE),
                             os.path.join(directory, "tokenizer.json"))
    if os.path.isfile(facts_path):
        return read_facts(facts_path)
    if not os.path.isfile(json_path):
        raise CLIError(f"{directory} has no tokenizer.json: the model's text cannot be tokenized")
    facts = Tokenizer("bpe", tokenizer_json=read_text(json_path, "tokenizer.json"),
                      source=json_path).facts()
    template = read_chat_template(directory, facts)
    return {**facts, "chat_template": template} if template else facts


def hf_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """The model's weights under HF's names (the fused matrices split; a tied head left out)."""
    config, state = model.config, model.state_dict()
    q, kv = config.n_head * config.head_size, config.kv_heads * config.head_size
    splits = {"attn.c_attn": [q, kv, kv], "mlp.c_fc": [config.mlp_width] * 2}
    tensors = {name + ".weight": state[ours_name + ".weight"] for name, ours_name in TOP.items()
               if not (name == "lm_head" and config.tie_embeddings)}
    for i in range(config.n_layer):
        block = f"transformer.h.{i}."
        for name, ours_name in BLOCK.items():
            if block + ours_name + ".weight" in state:
                tensors[f"model.layers.{i}.{name}.weight"] = state[block + ours_name + ".weight"]
        for ours_name, names in FUSED.items():
            for name, part in zip(names,
                                  state[block + ours_name + ".weight"].split(splits[ours_name])):
                tensors[f"model.layers.{i}.{name}.weight"] = part
    return {name: tensor.detach().float().contiguous().cpu() for name, tensor in tensors.items()}


def save_llama(model: GPT, out_dir: str, tokenizer: dict, template: dict | None = None) -> str:
    """An HF folder that transformers loads alone, offline, as the same model: config.json (Qwen3's
    layout with QK-norm, Llama's without), model.safetensors, generation_config.json, and the
    tokenizer files of a GPT-2 or BPE vocabulary (a README for char and byte), and the toolkit's
    tokenizer facts where they are not GPT-2's own, and the chat template, as save_gpt2 writes them.
    Returns what it wrote, in words."""
    c = model.config
    model_type = "qwen3" if c.qk_norm else "llama"
    eot_id = tokenizer.get("eot_id")
    scaling = {"rope_type": "llama3", **c.rope_scaling} if c.rope_scaling else None
    hf = {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]],
          "vocab_size": c.vocab_size, "hidden_size": c.n_embd, "intermediate_size": c.mlp_width,
          "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
          "num_key_value_heads": c.kv_heads, "head_dim": c.head_size,
          "max_position_embeddings": c.block_size, "rms_norm_eps": c.norm_eps, "hidden_act": "silu",
          "rope_theta": c.rope_theta, "rope_scaling": scaling,  # transformers 4's keys, then 5's
          "rope_parameters": {"rope_theta": c.rope_theta, **(scaling or {"rope_type": "default"})},
          "tie_word_embeddings": c.tie_embeddings, "attention_bias": False, "mlp_bias": False,
          "attention_dropout": c.dropout, "initializer_range": 0.02, "torch_dtype": "float32",
          "bos_token_id": bos_token_id(tokenizer), "eos_token_id": eot_id}
    if model_type == "qwen3":
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layer)
    tensors = hf_tensors(model)
    atomic_write(os.path.join(out_dir, "model.safetensors"),
                 lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    write_json(os.path.join(out_dir, "config.json"), hf)
    write_generation_config(out_dir, tokenizer, template)
    name = f"an HF {ARCHITECTURES[model_type]} folder"
    # read back as they are: special tokens (tokenizer.json's added tokens do not say
    # which), char, byte
    if tokenizer != GPT2_FACTS:
        write_json(os.path.join(out_dir, TOKENIZER_FILE), tokenizer)
    if tokenizer.get("tokenizer") in ("gpt2", "bpe"):
        write_tokenizer_files(out_dir, tokenizer, c.block_size, template)
        return name
    write_text(os.path.join(out_dir, "README.md"), NO_HF_TOKENIZER.format(**tokenizer))
    return f"{name} (its {tokenizer['tokenizer']} tokenizer has no HF tokenizer: see its README.md)"
