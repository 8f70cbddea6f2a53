"""The tokenizers: GPT-2's BPE (tiktoken's r50k_base, or the same from vocabulary files), the
characters of the data, or raw bytes; facts() describes one in JSON and load_tokenizer rebuilds it
from them (meta.json and every checkpoint keep them, so sampling needs no data folder).

    tok = load_tokenizer({"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256})
    ids = tok.encode("Hello world")        # [15496, 995]
"""
import json
import os

import numpy as np
import tiktoken
import tiktoken.load
from tiktoken_ext.openai_public import r50k_pat_str

from model import GPT
from toolkit import gpt2_vocab
from toolkit.cli import CLIError

EOT_TEXT = "<|endoftext|>"


def load_local_ranks(vocab_file: str, merge_file: str | None) -> dict[bytes, int]:
    """BPE ranks from a .tiktoken file, or from Megatron-style gpt2-vocab.json + gpt2-merges.txt."""
    for path in (vocab_file, merge_file):
        if path is not None and not os.path.isfile(path):
            raise CLIError(f"vocabulary file not found: {path}")
    # tiktoken caches even local files, keyed by their path (a stale copy would win): turn its cache off
    # here
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        if merge_file is None:
            return tiktoken.load.load_tiktoken_bpe(vocab_file)
        return tiktoken.load.data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=merge_file, encoder_json_file=vocab_file)
    except (AssertionError, KeyError, json.JSONDecodeError, ValueError) as e:
        raise CLIError("cannot read the vocabulary from "
                       f"{vocab_file}{' + ' + merge_file if merge_file else ''}: {e!r}") from None
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved


def gpt2_ranks(vocab_file: str | None = None, merge_file: str | None = None) -> dict[bytes, int]:
    """The BPE ranks of GPT-2's vocabulary: r50k_base from tiktoken's cache, or from vocabulary
    files."""
    if vocab_file is not None:
        return load_local_ranks(vocab_file, merge_file)
    if not gpt2_vocab.installed():
        raise CLIError("the GPT-2 vocabulary is not in tiktoken's cache "
                       f"({gpt2_vocab.tiktoken_cache_dir()}); run: {gpt2_vocab.INSTALL_HINT}")
    return tiktoken.load.load_tiktoken_bpe(os.path.join(gpt2_vocab.tiktoken_cache_dir(), gpt2_vocab.R50K_CACHE_NAME))


def gpt2_encoding(vocab_file: str | None = None, merge_file: str | None = None) -> tiktoken.Encoding:
    """GPT-2's BPE: tiktoken's r50k_base, or the same split pattern and <|endoftext|> over ranks
    from files."""
    if vocab_file is None:
        if not gpt2_vocab.installed():
            raise CLIError("the GPT-2 vocabulary is not in tiktoken's cache "
                           f"({gpt2_vocab.tiktoken_cache_dir()}); run: {gpt2_vocab.INSTALL_HINT}")
        return tiktoken.get_encoding("r50k_base")
    ranks = load_local_ranks(vocab_file, merge_file)
    return tiktoken.Encoding(name=f"gpt2:{os.path.basename(vocab_file)}", pat_str=r50k_pat_str,
                             mergeable_ranks=ranks, special_tokens={EOT_TEXT: len(ranks)})


class Tokenizer:
    """GPT-2 BPE, char-level or byte-level; facts() holds all that load_tokenizer needs to rebuild
    it."""

    def __init__(self, name: str, chars: str | None = None, char_eot: bool = False,
                 vocab_file: str | None = None, merge_file: str | None = None):
        self.name = name
        self.chars = chars
        self.vocab_file = os.path.abspath(vocab_file) if vocab_file else None
        self.merge_file = os.path.abspath(merge_file) if merge_file else None
        self.special_tokens: dict[str, int] = {}
        if name == "gpt2":
            self.encoding = gpt2_encoding(self.vocab_file, self.merge_file)
            self.vocab_size, self.eot_id = self.encoding.n_vocab, self.encoding.eot_token
        elif name == "char":
            if not chars or len(set(chars)) != len(chars):
                raise CLIError("a char tokenizer needs its table of distinct characters")
            codepoints = [ord(c) for c in chars]
            self.char_ids = np.full(max(codepoints) + 2, -1, dtype=np.int64)  # code point -> id; the last is -1
            self.char_ids[codepoints] = np.arange(len(chars))
            self.eot_id = len(chars) if char_eot else None
            self.vocab_size = len(chars) + int(char_eot)
        elif name == "byte":
            self.vocab_size, self.eot_id = 257, 256
        else:
            raise CLIError(f"unknown tokenizer {name!r} (expected gpt2, char or byte)")

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of text (special-token text such as <|endoftext|> is encoded as ordinary
        text)."""
        if self.name == "gpt2":
            try:
                return self.encoding.encode_to_numpy(text, disallowed_special=())
            except UnicodeEncodeError:  # lone surrogates (JSON allows them): replace them, as tiktoken does
                text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
                return self.encoding.encode_to_numpy(text, disallowed_special=())
        if self.name == "byte":
            return np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        ids = self.char_ids[np.minimum(points, len(self.char_ids) - 1)]
        if (ids < 0).any():
            raise ValueError(f"character {chr(points[(ids < 0).argmax()])!r} is not in the char "
                             "vocabulary")
        return ids

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def add_special_tokens(self, special_tokens: dict[str, int]) -> None:
        """Name ids past the vocabulary as special tokens (fine-tuning's start, delimiter, extract):
        encode never makes them, decode skips them, and vocab_size grows to include them."""
        ids = list(special_tokens.values())
        if len(set(ids)) != len(ids) or any(type(i) is not int or i < self.vocab_size for i in ids):
            raise CLIError("special token ids must be distinct integers from the vocabulary size "
                           f"{self.vocab_size} on, got {special_tokens}")
        self.special_tokens.update(special_tokens)
        self.vocab_size = max(ids, default=self.vocab_size - 1) + 1

    def decode(self, ids: list[int]) -> str:
        """Text of ids; never fails: EOT and special tokens are skipped for char/byte, special
        tokens for gpt2, invalid bytes and unknown ids become U+FFFD."""
        if self.special_tokens:
            special = set(self.special_tokens.values())
            ids = [i for i in ids if i not in special]
        if self.name == "gpt2":
            return self.encoding.decode([i for i in ids if 0 <= i < self.encoding.n_vocab])
        if self.name == "byte":
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return "".join(self.chars[i] if 0 <= i < len(self.chars) else "\ufffd" for i in ids if i != self.eot_id)

    def facts(self) -> dict:
        """JSON-able description of this tokenizer (stored in meta.json and in checkpoints)."""
        facts = {"tokenizer": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id}
        if self.name == "gpt2":
            facts["encoding"] = "files" if self.vocab_file else "r50k_base"
            if self.vocab_file:
                facts.update(vocab_file=self.vocab_file, merge_file=self.merge_file)
        if self.name == "char":
            facts["chars"] = self.chars
        if self.special_tokens:
            facts["special_tokens"] = dict(self.special_tokens)
        return facts


def add_tokens(model: GPT, tokenizer: Tokenizer, names: tuple[str, ...]) -> dict[str, int]:
    """names as new rows of the model's (tied) embedding, right after its vocabulary, and as special
    tokens of the tokenizer, with the same ids: GPT-1's layout tokens (toolkit/tasks.py), the chat
    template's (toolkit/chat.py)."""
    first = model.config.vocab_size
    special = {name: first + i for i, name in enumerate(names)}
    model.resize_token_embeddings(first + len(special))
    tokenizer.add_special_tokens(special)
    return special


def load_tokenizer(facts: dict) -> Tokenizer:
    """The tokenizer that facts() described (e.g. the meta.json of a prepared corpus, or a
    fine-tuned checkpoint's facts, whose special tokens count in its vocab_size)."""
    name = facts.get("tokenizer")
    if name == "char":
        tokenizer = Tokenizer("char", chars=facts.get("chars"), char_eot=facts.get("eot_id") is not None)
    elif name in ("gpt2", "byte"):
        tokenizer = Tokenizer(name, vocab_file=facts.get("vocab_file"), merge_file=facts.get("merge_file"))
    else:
        raise CLIError(f"unknown tokenizer {name!r} in the tokenizer facts (expected gpt2, char or "
                       "byte)")
    special_tokens = facts.get("special_tokens") or {}
    if not isinstance(special_tokens, dict):
        raise CLIError("special_tokens in the tokenizer facts must map names to ids, got "
                       f"{special_tokens!r}")
    tokenizer.add_special_tokens(special_tokens)
    if "vocab_size" in facts and facts["vocab_size"] != tokenizer.vocab_size:
        raise CLIError(f"rebuilt {name} tokenizer has vocab_size {tokenizer.vocab_size}, the facts "
                       f"say {facts['vocab_size']}")
    return tokenizer
