"""GGUF files of this toolkit's models, which llama.cpp (and so ollama and LM Studio) loads
and runs.

    save_gguf(model, "model.gguf", facts, "f16")    # test.py --export-gguf model.gguf

GGUF (ggml's docs/gguf.md) is one file of key-value metadata and named tensors, written here with
the `gguf` package. GPT-2's family is llama.cpp's `gpt2` architecture; the llama family is its
`qwen3` with QK-norm and `llama` without. Tensor and key names are llama.cpp's (src/llama-arch.cpp).
Every vocabulary becomes llama.cpp's byte-level BPE (tokenizer.ggml.model "gpt2"), token ids
unchanged:

- GPT-2's and a trained BPE's own tokens and merges; the pre-tokenizer is named for the pattern that
  splits the text first (GPT-2's is llama.cpp's "gpt-2", Qwen2's "qwen2");
- a char vocabulary's characters as their UTF-8 bytes, with merges that join the bytes of each
  character and nothing else, so the pre-tokenizer cannot matter;
- the byte vocabulary's 256 bytes, with no merges.

The end-of-text token is llama.cpp's end of generation (a char vocabulary needs one: tokenizer.py
adds it), and the chat template (toolkit/chat.py: an instruction-tuned model's, or a downloaded
folder's own) goes in as Jinja, so llama.cpp's chat formats turns as `test.py --chat` does.
"""
import json

import numpy as np
import torch

from model import GPT, rope_frequencies
from toolkit.chat import export_template
from toolkit.cli import CLIError
from toolkit.files import atomic_write
from toolkit.hf import gpt2_vocab_merges
from toolkit.hf_llama import hf_tensors
from toolkit.tokenizers import EOT_TEXT, SPELLING, Tokenizer, load_tokenizer

WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0")
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp's token types (gguf.TokenType)
# the Split pattern before a ByteLevel without its own, as Qwen2 and Qwen3's tokenizer.json have it
SPLIT_PATTERNS = {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
                  " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "qwen2",
                  # Llama 3's: digits in threes
                  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|"
                  " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "llama-bpe"}
# llama.cpp's names of one block's tensors, from HF's (toolkit/hf_llama.py splits our fused
# matrices)
LLAMA_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GPT2_BLOCK = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
              "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}


def spelled(data: bytes) -> str:
    """A token's bytes in the byte-level BPE's printable alphabet (GPT-2's)."""
    return "".join(SPELLING[b] for b in data)


def char_vocabulary(chars: str) -> tuple[list[str], list[str]]:
    """Tokens and merges that make llama.cpp's BPE split text into these characters: each
    character's UTF-8 bytes, merged left to right (a prefix of a character only ever meets its next
    byte)."""
    try:
        encoded = [c.encode("utf-8") for c in chars]
    except UnicodeEncodeError:
        raise CLIError("the char vocabulary holds a lone surrogate, "
                       "which no GGUF tokenizer can hold") from None
    merges = dict.fromkeys(f"{spelled(data[:k])} {spelled(data[k:k + 1])}"
                           for data in encoded for k in range(1, len(data)))
    return [spelled(data) for data in encoded], list(merges)


def bpe_pre_tokenizer(spec: dict) -> str:
    """llama.cpp's name of the pre-tokenizer of a byte-level BPE's tokenizer.json, or a CLIError."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        name = SPLIT_PATTERNS.get((steps[0].get("pattern") or {}).get("Regex"))
        if name:
            return name
    raise CLIError(f"this BPE's pre-tokenizer ({json.dumps(pre)[:120]}) is not one llama.cpp "
                   "knows by name (GPT-2's, Qwen2's or Llama 3's pattern); llama.cpp would split "
                   "text differently")


def bpe_vocabulary(facts: dict) -> tuple[dict[int, str], dict[int, int], list[str], str]:
    """Tokens (id -> text), the types of its added tokens (a downloaded folder's <|im_start|> is a
    control token, <think> a user-defined one, as llama.cpp's converter types them), merges and
    pre-tokenizer name of a BPE's tokenizer.json."""
    spec = json.loads(facts["json"])
    model = spec["model"]
    if spec.get("normalizer") or (spec.get("decoder") or {}).get("type") != "ByteLevel" or \
            model.get("byte_fallback"):
        raise CLIError("only byte-level BPEs without a normalizer go into GGUF (llama.cpp's gpt2 "
                       "tokenizer); this tokenizer.json is another kind")
    tokens = {i: token for token, i in model["vocab"].items()}
    added = spec.get("added_tokens", [])
    tokens.update({token["id"]: token["content"] for token in added})
    types = {token["id"]: CONTROL if token.get("special") else USER_DEFINED for token in added}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges, bpe_pre_tokenizer(spec)


def vocabulary(facts: dict, rows: int) -> tuple[list[str], list[int], list[str], str]:
    """(tokens, token types, merges, pre-tokenizer) of the toolkit's tokenizer facts for a model of
    `rows` embedding rows, ids unchanged: end-of-text, the special tokens a fine-tuning added and
    ids without text (the padding rows of Qwen3's embedding too) are control tokens, a
    tokenizer.json's added tokens typed as it marks them."""
    kind, eot_id, types = facts["tokenizer"], facts.get("eot_id"), {}
    if eot_id is None:
        raise CLIError(f"this {kind} vocabulary has no end-of-text token, which llama.cpp needs to "
                       "end its generation; prepare the data again with tokenizer.py (char "
                       "vocabularies now have one) and train on it")
    if kind == "gpt2":
        vocab, merges = gpt2_vocab_merges(facts)
        tokens, pre = {i: token for token, i in vocab.items()}, "gpt-2"
    elif kind == "bpe":
        tokens, types, merges, pre = bpe_vocabulary(facts)
    elif kind == "char":
        texts, merges = char_vocabulary(facts["chars"])
        tokens, pre = dict(enumerate(texts)), "gpt-2"
    else:  # byte
        tokens, merges, pre = {b: spelled(bytes([b])) for b in range(256)}, [], "gpt-2"
    special = {i: f"<|unused{i}|>" for i in range(rows) if i not in tokens}
    special.update({eot_id: tokens.get(eot_id, EOT_TEXT),
                    **{i: name if name.startswith("<|") else f"<|{name}|>"
                       for name, i in (facts.get("special_tokens") or {}).items()}})
    tokens.update(special)
    ids = range(rows)
    types.update(dict.fromkeys(special, CONTROL))
    return [tokens[i] for i in ids], [types.get(i, NORMAL) for i in ids], merges, pre


def permuted(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Query or key rows from rotate_half's layout (each head's first half, then its second) to the
    interleaved pairs llama.cpp's `llama` rope rotates: row j of each half goes to rows 2j and
    2j + 1."""
    return weight.reshape(heads, 2, -1, weight.size(-1)).transpose(1, 2).reshape(weight.shape)


def gguf_tensors(model: GPT) -> tuple[str, dict[str, torch.Tensor]]:
    """llama.cpp's architecture name for the model and its tensors under llama.cpp's names."""
    c = model.config
    if c.arch == "gpt2":
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        tensors = {"token_embd.weight": state["transformer.wte.weight"],
                   "position_embd.weight": state["transformer.wpe.weight"]}
        for i in range(c.n_layer):
            for ours, theirs in GPT2_BLOCK.items():
                weight = state[f"transformer.h.{i}.{ours}.weight"]
                bias = state.get(f"transformer.h.{i}.{ours}.bias")
                tensors[f"blk.{i}.{theirs}.weight"] = weight
                tensors[f"blk.{i}.{theirs}.bias"] = bias if bias is not None else \
                    weight.new_zeros(len(weight))
        weight = state["transformer.ln_f.weight"]
        tensors["output_norm.weight"] = weight
        tensors["output_norm.bias"] = state.get("transformer.ln_f.bias",
                                                weight.new_zeros(len(weight)))
        return "gpt2", tensors  # llama.cpp ties the head to token_embd when there is no `output`
    if c.bias:
        raise CLIError("a llama-family model with biases has no GGUF layout here (llama.cpp's "
                       "llama and qwen3 have none)")
    arch = "qwen3" if c.qk_norm else "llama"
    hf = hf_tensors(model)
    tensors = {"token_embd.weight": hf["model.embed_tokens.weight"],
               "output_norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        tensors["output.weight"] = hf["lm_head.weight"]
    for i in range(c.n_layer):
        for name, theirs in LLAMA_BLOCK.items():
            if f"model.layers.{i}.{name}.weight" in hf:
                tensors[f"blk.{i}.{theirs}.weight"] = hf[f"model.layers.{i}.{name}.weight"]
        if arch == "llama":  # qwen3 rotates halves as rotate_half does; llama interleaved pairs
            tensors[f"blk.{i}.attn_q.weight"] = permuted(tensors[f"blk.{i}.attn_q.weight"],
                                                         c.n_head)
            tensors[f"blk.{i}.attn_k.weight"] = permuted(tensors[f"blk.{i}.attn_k.weight"],
                                                         c.kv_heads)
    # Llama 3's: what each frequency is divided by, as llama.cpp's converter writes it
    if c.rope_scaling:
        if arch != "llama":
            raise CLIError("llama.cpp's qwen3 has no Llama 3 rope scaling; "
                           "this model has no GGUF layout here")
        tensors["rope_freqs.weight"] = (rope_frequencies(c.head_size, c.rope_theta) /
                                        rope_frequencies(c.head_size, c.rope_theta, c.rope_scaling))
    return arch, tensors


def add_hyperparameters(writer, model: GPT, arch: str) -> None:
    c = model.config
    writer.add_context_length(c.block_size)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(c.mlp_width)
    writer.add_head_count(c.n_head)
    writer.add_head_count_kv(c.kv_heads)
    if arch == "gpt2":
        writer.add_layer_norm_eps(1e-5)
        return
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_rope_dimension_count(c.head_size)
    writer.add_key_length(c.head_size)
    writer.add_value_length(c.head_size)


def end_of_generation(template: dict | None, tokenizer: Tokenizer) -> int:
    """llama.cpp's eos id, as its converter takes it: a chat template's eos token where it is one of
    the stop ids (Qwen3's <|im_end|>, Llama 3's <|eot_id|>), else its first stop id, else
    end-of-text."""
    stops = template["stop_ids"] if template else []
    if not stops:
        return tokenizer.eot_id
    try:
        named = tokenizer.encode_with_special_tokens(template.get("eos_token") or "")
    except ValueError:  # (text a char vocabulary cannot spell: this toolkit's <|endoftext|>)
        named = []
    return named[0] if len(named) == 1 and named[0] in stops else stops[0]


def add_vocabulary(writer, facts: dict, rows: int) -> None:
    tokens, types, merges, pre = vocabulary(facts, rows)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # llama.cpp's BPE needs a merge list, and GGUF has no empty array: a vocabulary without merges
    # (bytes, ASCII characters) gets one that never applies, since no merge makes its left part
    writer.add_token_merges(merges or [f"{spelled(bytes(2))} {spelled(bytes(1))}"])
    template, tokenizer = export_template(facts), load_tokenizer(facts)
    bos = tokenizer.bos_id
    writer.add_bos_token_id(facts["eot_id"] if bos is None else bos)
    writer.add_eos_token_id(end_of_generation(template, tokenizer))
    # Llama 3's BOS starts each text, as its tokenizer.json adds it; the others' models the text
    writer.add_add_bos_token(bos is not None)
    writer.add_add_eos_token(False)
    if template:
        writer.add_chat_template(template["jinja"])


def add_tensors(writer, tensors: dict[str, torch.Tensor], weight_type: str) -> None:
    """Matrices in weight_type (q8_0 where rows split into its blocks of 32, else f16), vectors in
    f32, as llama.cpp's converter stores them."""
    import gguf  # 120 ms to import: exports only

    for name, tensor in tensors.items():
        data = tensor.float().contiguous().numpy()
        kind = weight_type if data.ndim == 2 else "f32"
        if kind == "q8_0" and \
                data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]:
            kind = "f16"
        if kind == "f32":
            writer.add_tensor(name, data)
        elif kind == "f16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind.upper()]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def save_gguf(model: GPT, path: str, facts: dict, weight_type: str = "f16") -> str:
    """One GGUF file of the model and its tokenizer, written atomically; a line saying what it
    wrote."""
    import gguf  # 120 ms: exports only

    if model.config.block_size > 2**32 - 1:  # (GGUF's hyperparameters are uint32s)
        raise CLIError(f"GGUF holds the context length as a 32-bit number; this model's "
                       f"{model.config.block_size:,} positions (max_position_embeddings) do not "
                       "fit: set it to 4,294,967,295 or fewer in its config.json")
    if model.config.vocab_size < facts["vocab_size"]:  # (more rows: Qwen3's padded embedding)
        raise CLIError(f"the model has {model.config.vocab_size} token rows but its tokenizer "
                       f"{facts['vocab_size']} ids")
    arch, tensors = gguf_tensors(model)

    def write(tmp: str) -> None:
        writer = gguf.GGUFWriter(tmp, arch)
        writer.add_name(f"nano-gpt {arch}")
        writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32,
                              "f16": gguf.LlamaFileType.MOSTLY_F16,
                              "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[weight_type])
        add_hyperparameters(writer, model, arch)
        add_vocabulary(writer, facts, model.config.vocab_size)
        add_tensors(writer, tensors, weight_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(path, write)
    return f"wrote {path} (GGUF, llama.cpp's {arch} architecture, {weight_type} weights)"
