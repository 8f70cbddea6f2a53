"""The tokenizers: GPT-2's BPE (tiktoken's r50k_base, or the same from vocabulary files), a
byte-level BPE trained on the user's own text (or any HF tokenizer.json of a BPE model, through HF
`tokenizers`), the characters of the data, or raw bytes. facts() describes one in JSON and
load_tokenizer rebuilds it from them (meta.json and every checkpoint keep them, a trained BPE whole,
so sampling needs no data folder).

    tok = load_tokenizer({"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256})
    ids = tok.encode("Hello world")        # [15496, 995]
    tok = Tokenizer("bpe", tokenizer_json=text)  # a tokenizer.json (prepare.train_bpe trains one)
"""
import codecs
import json
import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import tiktoken
import tiktoken.load
from tiktoken_ext.openai_public import r50k_pat_str
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers

from toolkit import gpt2_vocab
from toolkit.cli import CLIError
from toolkit.files import parse_json, read_json, require_file

if TYPE_CHECKING:  # data preparation imports this module and never needs torch
    from model import GPT

EOT_TEXT = "<|endoftext|>"
EOT_TEXTS = (EOT_TEXT, "<|end_of_text|>")  # GPT-2's, Qwen's and SmolLM's; Llama 3's
# Places where every tokenizer here splits a text anyway (GPT-2's pre-tokenizing pattern, and the
# byte-level BPEs that use it; char and byte split everywhere): before a single space between two
# other characters, after a newline between two, after Chinese punctuation followed by a letter or a
# digit. A long text cut there has the tokens of the whole, a piece at a time.
CUT = re.compile(r"(?<=\S)(?= \S)|(?<=\S\n)(?=\S)|(?<=[，。！？；：、])(?=[^\W_])")
KINDS = ("gpt2", "bpe", "char", "byte")
# GPT-2's byte-level alphabet: the printable stand-in of each byte in its tokens
# (encoder.py of openai/gpt-2)
PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
             *range(ord("®"), ord("ÿ") + 1)]
SPELLING = {**{b: chr(b) for b in PRINTABLE},
            **{b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in PRINTABLE)}}
BYTE_OF = {char: b for b, char in SPELLING.items()}


def read_bpe(tokenizer_json: str, source: str) -> HFTokenizer:
    """The HF tokenizer of a tokenizer.json: a BPE model with the end-of-text token, or a
    CLIError."""
    spec = parse_json(tokenizer_json, source)
    model_type = spec.get("model", {}).get("type") if isinstance(spec, dict) else None
    if model_type != "BPE" or not isinstance(spec.get("model", {}).get("vocab"), dict):
        raise CLIError(f"{source} is not the tokenizer.json of a BPE model (its model is "
                       f"{model_type!r})")
    try:
        bpe = HFTokenizer.from_str(tokenizer_json)
    except Exception as e:  # tokenizers raises its own plain Exception
        raise CLIError(f"{source}: HF tokenizers cannot read it "
                       f"({' '.join(str(e).split())[:200]})") from None
    if all(bpe.token_to_id(name) is None for name in EOT_TEXTS):
        raise CLIError(f"{source} has no end-of-text token ({' or '.join(EOT_TEXTS)}), which "
                       f"separates documents; add {EOT_TEXT} as a special token, or train one here "
                       "(tokenizer.py --tokenizer bpe)")
    # special-token text in the data is text, as with the other tokenizers
    bpe.encode_special_tokens = True
    return bpe


def bos_of(bpe: HFTokenizer) -> int | None:
    """The token a tokenizer.json's post-processor puts before every text (Llama 3's
    <|begin_of_text|>), or None."""
    plain, processed = (bpe.encode("a", add_special_tokens=flag).ids for flag in (False, True))
    return processed[0] if processed[1:1 + len(plain)] == plain and len(processed) > len(plain) \
        else None


def bos_token_id(facts: dict) -> int | None:
    """HF's bos_token_id of the tokenizer facts describe, without building it: a tokenizer.json's
    BOS (Llama 3's), else end-of-text, as GPT-2's config.json names it."""
    bos = bos_of(HFTokenizer.from_str(facts["json"])) if facts.get("tokenizer") == "bpe" else None
    return facts.get("eot_id") if bos is None else bos


def load_local_ranks(vocab_file: str, merge_file: str | None) -> dict[bytes, int]:
    """BPE ranks from a .tiktoken file, or from Megatron-style gpt2-vocab.json + gpt2-merges.txt."""
    for path in (vocab_file, merge_file):
        if path is not None:
            require_file(path, "vocabulary file")
    # tiktoken caches even local files, keyed by their path (a stale copy would win): turn it off
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        if merge_file is None:
            return tiktoken.load.load_tiktoken_bpe(vocab_file)
        return tiktoken.load.data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=merge_file,
                                                             encoder_json_file=vocab_file)
    except (AssertionError, KeyError, json.JSONDecodeError, ValueError, RecursionError) as e:
        # (tiktoken's messages may quote a whole line of the file, or be empty)
        what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise CLIError("cannot read the vocabulary from "
                       f"{vocab_file}{' + ' + merge_file if merge_file else ''}: "
                       f"{what[:120]}{'...' * (len(what) > 120)}; --vocab-file takes a .tiktoken "
                       "file, or GPT-2's vocab.json with --merge-file") from None
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved


def gpt2_ranks(vocab_file: str | None = None, merge_file: str | None = None) -> dict[bytes, int]:
    """GPT-2's BPE ranks: r50k_base from tiktoken's cache, or from vocabulary files."""
    if vocab_file is not None:
        return load_local_ranks(vocab_file, merge_file)
    if not gpt2_vocab.installed():
        raise CLIError("the GPT-2 vocabulary is not in tiktoken's cache "
                       f"({gpt2_vocab.tiktoken_cache_dir()}); run: {gpt2_vocab.INSTALL_HINT}")
    return tiktoken.load.load_tiktoken_bpe(os.path.join(gpt2_vocab.tiktoken_cache_dir(),
                                                        gpt2_vocab.R50K_CACHE_NAME))


def gpt2_encoding(vocab_file: str | None = None,
                  merge_file: str | None = None) -> tiktoken.Encoding:
    """GPT-2's BPE: r50k_base, or its split pattern and <|endoftext|> over ranks from files."""
    if vocab_file is None:
        if not gpt2_vocab.installed():
            raise CLIError("the GPT-2 vocabulary is not in tiktoken's cache "
                           f"({gpt2_vocab.tiktoken_cache_dir()}); run: {gpt2_vocab.INSTALL_HINT}")
        return tiktoken.get_encoding("r50k_base")
    ranks = load_local_ranks(vocab_file, merge_file)
    return tiktoken.Encoding(name=f"gpt2:{os.path.basename(vocab_file)}", pat_str=r50k_pat_str,
                             mergeable_ranks=ranks, special_tokens={EOT_TEXT: len(ranks)})


class Tokenizer:
    """GPT-2's BPE, a trained BPE, char-level or byte-level; facts() holds all that load_tokenizer
    needs to rebuild it."""

    def __init__(self, name: str, chars: str | None = None, char_eot: bool = False,
                 vocab_file: str | None = None, merge_file: str | None = None,
                 tokenizer_json: str | None = None, source: str = "the tokenizer facts"):
        self.name = name
        self.chars = chars
        self.vocab_file = os.path.abspath(vocab_file) if vocab_file else None
        self.merge_file = os.path.abspath(merge_file) if merge_file else None
        self.special_tokens: dict[str, int] = {}
        self.chat_template: dict | None = None  # a downloaded HF folder's own (toolkit/chat.py)
        # what starts every sequence: a tokenizer.json's BOS (Llama 3's)
        self.bos_id: int | None = None
        # the two tokens' text (an HF or GGUF export names them)
        self.eot_text, self.bos_text = EOT_TEXT, None
        if name == "gpt2":
            self.encoding = gpt2_encoding(self.vocab_file, self.merge_file)
            self.vocab_size, self.eot_id = self.encoding.n_vocab, self.encoding.eot_token
        elif name == "bpe":
            self.bpe, self.tokenizer_json = read_bpe(tokenizer_json, source), tokenizer_json
            # the largest id + 1, not the number of entries: a tokenizer.json may leave ids out
            self.vocab_size = max(self.bpe.get_vocab(with_added_tokens=True).values()) + 1
            self.eot_text = next(name for name in EOT_TEXTS
                                 if self.bpe.token_to_id(name) is not None)
            self.eot_id, self.bos_id = self.bpe.token_to_id(self.eot_text), bos_of(self.bpe)
            self.bos_text = None if self.bos_id is None else self.bpe.id_to_token(self.bos_id)
            self.byte_level = isinstance(self.bpe.decoder, decoders.ByteLevel)
        elif name == "char":
            if not chars or len(set(chars)) != len(chars):
                raise CLIError("a char tokenizer needs its table of distinct characters")
            codepoints = [ord(c) for c in chars]
            # code point -> id; the last is -1
            self.char_ids = np.full(max(codepoints) + 2, -1, dtype=np.int64)
            self.char_ids[codepoints] = np.arange(len(chars))
            self.eot_id = len(chars) if char_eot else None
            self.vocab_size = len(chars) + int(char_eot)
        elif name == "byte":
            self.vocab_size, self.eot_id = 257, 256
        else:
            raise CLIError(f"unknown tokenizer {name!r} (expected {', '.join(KINDS)})")

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of text (special-token text like <|endoftext|> is encoded as ordinary text)."""
        if self.name == "bpe":
            try:
                text.encode("utf-8")  # HF tokenizers take valid Unicode only
            except UnicodeEncodeError as e:
                raise ValueError(f"the text holds a lone surrogate (U+{ord(text[e.start]):04X}) "
                                 f"at character {e.start}, which is not Unicode text; encode it "
                                 "properly first") from None
            return np.array(self.bpe.encode(text, add_special_tokens=False).ids, dtype=np.uint32)
        if self.name == "gpt2":
            try:
                return self.encoding.encode_to_numpy(text, disallowed_special=())
            except UnicodeEncodeError:  # lone surrogates (JSON allows them): replaced, as tiktoken
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

    def with_bos(self, ids: list[int]) -> list[int]:
        """ids as a sequence's start: after the BOS token where the tokenizer has one and they do
        not begin with it, as HF's tokenizer(text) adds Llama 3's <|begin_of_text|>."""
        return [self.bos_id, *ids] if self.bos_id is not None and ids[:1] != [self.bos_id] else ids

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """Token ids of text where special-token text is that token, as HF tokenizes a rendered chat
        template: the vocabulary's own (<|im_start|>, <|endoftext|>) and those a fine-tuning added
        (<|user|>); the other text as encode does."""
        # the added ones are not in the vocabulary's tokenizer: split at them
        if self.special_tokens:
            # (as the HF export names them)
            added = {name if name.startswith("<|") else f"<|{name}|>": i
                     for name, i in self.special_tokens.items()}
            names = "|".join(map(re.escape, sorted(added, key=len, reverse=True)))
            return [i for part in re.split(f"({names})", text) if part
                    for i in ([added[part]] if part in added
                              else self.encode_with_vocabulary_special_tokens(part))]
        return self.encode_with_vocabulary_special_tokens(text)

    def encode_with_vocabulary_special_tokens(self, text: str) -> list[int]:
        if self.name == "gpt2":
            return self.encoding.encode(text, allowed_special="all")
        if self.name != "bpe":
            return self.encode(text)
        self.bpe.encode_special_tokens = False
        try:
            return self.bpe.encode(text, add_special_tokens=False).ids
        finally:
            self.bpe.encode_special_tokens = True

    def add_special_tokens(self, special_tokens: dict[str, int]) -> None:
        """Name ids past the vocabulary as special tokens (fine-tuning's start, delimiter, extract):
        encode never makes them, decode skips them, and vocab_size grows to include them."""
        ids = list(special_tokens.values())
        if len(set(ids)) != len(ids) or any(type(i) is not int or i < self.vocab_size for i in ids):
            raise CLIError("special token ids must be distinct integers from the vocabulary size "
                           f"{self.vocab_size} on, got {special_tokens}")
        self.special_tokens.update(special_tokens)
        self.vocab_size = max(ids, default=self.vocab_size - 1) + 1

    def cuts_keep_ids(self) -> bool:
        """Whether a text cut at CUT encodes, a piece at a time, to the ids of the whole: GPT-2's
        pre-tokenizing pattern splits there (so char and byte do); a tokenizer.json of another
        pre-tokenizer (Llama 3's pattern joins "，" to the next word, SentencePiece's Metaspace
        marks each piece's start) or with a normalizer may not."""
        if self.name != "bpe":
            return True
        split = self.bpe.pre_tokenizer
        return (self.bpe.normalizer is None and isinstance(split, pre_tokenizers.ByteLevel) and
                split.use_regex and not split.add_prefix_space)

    def may_drop_characters(self) -> bool:
        """Whether some text has no tokens: a tokenizer.json BPE neither byte-level nor with byte
        fallback drops a character outside its alphabet, or writes its unknown token. (GPT-2's and
        byte are lossless; char is built from the data.)"""
        return self.name == "bpe" and not self.byte_level and not self.bpe.model.byte_fallback

    def unknown_characters(self, chars: Iterable[str]) -> list[str]:
        """Those of chars that this tokenizer drops or writes as its unknown token."""
        if not self.may_drop_characters():
            return []
        unk = self.bpe.model.unk_token
        unk_id = None if unk is None else self.bpe.token_to_id(unk)
        return sorted(char for char in chars
                      if not (ids := self.bpe.encode(char, add_special_tokens=False).ids)
                      or unk_id in ids)

    def decode(self, ids: list[int]) -> str:
        """Text of ids; never fails and never shows half a character: special tokens are skipped
        (EOT too for char and byte), invalid bytes and unknown ids become U+FFFD, and a character
        whose bytes are cut at the end (a sample stopped mid-character, or still streaming) is left
        out."""
        special = set(self.special_tokens.values())
        ids = [i for i in ids if i not in special]
        if self.name == "char":
            return "".join(self.chars[i] if 0 <= i < len(self.chars) else "\ufffd" for i in ids
                           if i != self.eot_id)
        if self.name == "bpe" and not self.byte_level:  # another kind of BPE: its own decoder
            return self.bpe.decode(ids, skip_special_tokens=False)
        return codecs.getincrementaldecoder("utf-8")("replace").decode(self.decode_bytes(ids),
                                                                       final=False)

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The UTF-8 bytes of ids (not special tokens; end-of-text as its text for the BPEs)."""
        if self.name == "gpt2":
            return self.encoding.decode_bytes([i for i in ids if 0 <= i < self.encoding.n_vocab])
        if self.name == "byte":
            return bytes(i for i in ids if 0 <= i < 256)
        tokens = (self.bpe.id_to_token(i) for i in ids if 0 <= i < self.vocab_size)
        # (not the alphabet: "?")
        return bytes(BYTE_OF.get(c, 0x3F) for token in tokens if token for c in token)

    def token_bytes(self) -> np.ndarray:
        """The UTF-8 bytes each token id stands for, 0 for end-of-text and special tokens: what bits
        per byte divide by (training.LanguageModeling)."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        if self.name == "char":
            lengths[:len(self.chars)] = [len(c.encode("utf-8", "surrogatepass"))
                                         for c in self.chars]
        elif self.name == "byte":
            lengths[:256] = 1
        elif self.name == "gpt2":
            n = self.encoding.n_vocab
            lengths[:n] = [len(self.encoding.decode_single_token_bytes(i)) for i in range(n)]
        else:
            added = {token.content for token in self.bpe.get_added_tokens_decoder().values()}
            for i in range(self.vocab_size):
                token = self.bpe.id_to_token(i)  # (None for an id a tokenizer.json leaves out)
                lengths[i] = 0 if token is None or token in added else len(token) \
                    if self.byte_level else len(self.bpe.decode([i]).encode("utf-8"))
        if self.eot_id is not None:
            lengths[self.eot_id] = 0
        return lengths

    def facts(self) -> dict:
        """JSON-able description of this tokenizer (stored in meta.json and in checkpoints)."""
        facts = {"tokenizer": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id}
        if self.name == "gpt2":
            facts["encoding"] = "files" if self.vocab_file else "r50k_base"
            if self.vocab_file:
                facts.update(vocab_file=self.vocab_file, merge_file=self.merge_file)
        if self.name == "char":
            facts["chars"] = self.chars
        if self.name == "bpe":
            facts["json"] = self.tokenizer_json
        if self.special_tokens:
            facts["special_tokens"] = dict(self.special_tokens)
        if self.chat_template:
            facts["chat_template"] = dict(self.chat_template)
        return facts


def add_tokens(model: "GPT", tokenizer: Tokenizer, names: tuple[str, ...]) -> dict[str, int]:
    """names as new rows of the model's (tied) embedding, right after its vocabulary, and as special
    tokens of the tokenizer, with the same ids: GPT-1's layout tokens (toolkit/tasks.py), the chat
    template's (toolkit/chat.py)."""
    first = model.config.vocab_size
    special = {name: first + i for i, name in enumerate(names)}
    model.resize_token_embeddings(first + len(special))
    tokenizer.add_special_tokens(special)
    return special


def same_vocabulary(a: dict, b: dict) -> bool:
    """Two tokenizers' facts that give the same ids to the same text (the special tokens a
    fine-tuning adds past the vocabulary aside)."""
    def base_size(facts: dict) -> int:
        return facts.get("vocab_size", 0) - len(facts.get("special_tokens") or {})

    def same_json(x, y) -> bool:  # the same tokenizer.json, however it is laid out
        if x == y or not (isinstance(x, str) and isinstance(y, str)):
            return x == y
        try:
            return json.loads(x) == json.loads(y)
        except ValueError:
            return False

    same = all(a.get(key) == b.get(key) for key in ("tokenizer", "eot_id", "chars"))
    return same and same_json(a.get("json"), b.get("json")) and base_size(a) == base_size(b)


def check_facts(facts) -> None:
    """Tokenizer facts as a file or a checkpoint holds them, checked before they are used: each
    value of the type and range it must have, or one CLIError naming what is wrong."""
    def refuse(key: str, wanted: str) -> CLIError:
        return CLIError(f"the tokenizer facts say {key} {facts.get(key)!r:.60}; it must be "
                        f"{wanted}")

    if not isinstance(facts, dict):
        raise CLIError(f"the tokenizer facts must be a JSON object, got {type(facts).__name__}")
    vocab_size, eot_id, chars = facts.get("vocab_size"), facts.get("eot_id"), facts.get("chars")
    special = facts.get("special_tokens") or {}
    if vocab_size is not None and not (type(vocab_size) is int and 0 < vocab_size <= 2**32):
        raise refuse("vocab_size", "an integer from 1 to 2**32")
    if eot_id is not None and not (type(eot_id) is int and eot_id >= 0):
        raise refuse("eot_id", "a token id (an integer from 0) or null")
    distinct_characters = isinstance(chars, str) and 0 < len(chars) == len(set(chars))
    if facts.get("tokenizer") == "char" and not distinct_characters:
        raise refuse("chars", "a string of distinct characters")
    names_and_ids = isinstance(special, dict) and all(isinstance(name, str) and type(i) is int
                                                      for name, i in special.items())
    if not names_and_ids:
        raise refuse("special_tokens", "an object of token names and ids")
    for key in ("vocab_file", "merge_file"):
        if not isinstance(facts.get(key) or "", str):
            raise refuse(key, "a file name")
    if facts.get("tokenizer") == "bpe" and not isinstance(facts.get("json"), str):
        raise refuse("json", "the text of a tokenizer.json")
    template = facts.get("chat_template")
    if template is not None and not is_chat_template(template, vocab_size or 2**32):
        raise refuse("chat_template", "an object of the Jinja text, its bos_token and eos_token "
                     "(text or null) and stop_ids (token ids)")


def is_chat_template(template, vocab_size: int) -> bool:
    """The shape of a downloaded folder's chat template in the facts (toolkit/hf.py reads it)."""
    if not (isinstance(template, dict) and isinstance(template.get("jinja"), str)):
        return False
    tokens = all(isinstance(template.get(key) or "", str) for key in ("bos_token", "eos_token"))
    stop_ids = template.get("stop_ids")
    return tokens and isinstance(stop_ids, list) and all(type(i) is int and 0 <= i < vocab_size
                                                         for i in stop_ids)


def read_facts(path: str) -> dict:
    """Tokenizer facts from a file (an HF folder's tokenizer_facts.json), checked by rebuilding the
    tokenizer they describe and for their vocab_size, or one line naming the file."""
    facts = read_json(path, "tokenizer facts")
    try:
        load_tokenizer(facts)
    except CLIError as e:
        raise CLIError(f"{path}: {e}") from None
    if "vocab_size" not in facts:
        raise CLIError(f"{path}: the tokenizer facts have no vocab_size")
    return facts


def load_tokenizer(facts: dict) -> Tokenizer:
    """The tokenizer that facts() described (e.g. the meta.json of a prepared corpus, or a
    fine-tuned checkpoint's facts, whose special tokens count in its vocab_size)."""
    check_facts(facts)
    name = facts.get("tokenizer")  # each kind takes the facts it needs (Tokenizer.__init__)
    tokenizer = Tokenizer(name, chars=facts.get("chars"), char_eot=facts.get("eot_id") is not None,
                          vocab_file=facts.get("vocab_file"), merge_file=facts.get("merge_file"),
                          tokenizer_json=facts.get("json"))
    tokenizer.add_special_tokens(facts.get("special_tokens") or {})
    tokenizer.chat_template = facts.get("chat_template")
    if "vocab_size" in facts and facts["vocab_size"] != tokenizer.vocab_size:
        raise CLIError(f"rebuilt {name} tokenizer has vocab_size {tokenizer.vocab_size}, the facts "
                       f"say {facts['vocab_size']}")
    return tokenizer
