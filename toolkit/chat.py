"""Conversations: the file schema of instruction tuning, the chat template, the loss mask, and the
history of a chat. Instruction tuning's objective is toolkit/sft.py's.

The template gives each role a token and ends every turn with one more, all four new rows of the
token embedding (as GPT-1's tasks add theirs, toolkit/tasks.py), so no text a user types can forge a
turn:

    <|system|> Answer briefly. <|end|> <|user|> What is a tuple? <|end|> <|assistant|> A ... <|end|>

Instruction tuning (finetune.py --task sft) sees one conversation as one sequence
and learns only the assistant turns: the loss covers each assistant turn's content tokens and its
<|end|> (so the model learns to answer and to stop), never a system or user token or a role token.
A conversation longer than the block size plus one token is cut at its end (its later tokens are
lost); one left with no assistant token is left out; both are counted. Chat (test.py --chat)
prompts with the history followed by <|assistant|> and reads the reply up to <|end|>.

A model downloaded as an HF folder (Qwen3's, SmolLM's instruct models) keeps its own template, the
Jinja it ships, laid out as transformers' apply_chat_template does: to chat, and to be
instruction-tuned, where the loss covers what the template adds for each assistant turn after its
generation prompt (own_template_pieces).
"""
import functools
import json
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

import jinja2
import torch
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from model import GPT
from toolkit.cli import CLIError
from toolkit.files import parse_json
from toolkit.tokenizers import Tokenizer, add_tokens, load_tokenizer

ROLES = ("system", "user", "assistant")
# a downloaded template's bounds: no chat prompt takes a second or a million characters to render
RENDER_SECONDS = 10.0
RENDER_CHARS = 1 << 24
END = "<|end|>"
CHAT_TOKENS = (*(f"<|{role}|>" for role in ROLES), END)
# the template in Jinja, for the exports: HF's apply_chat_template and llama.cpp's chat then lay a
# conversation out in the same ids as turn_ids and chat_prompt below
# what render passes
TEMPLATE_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt")
CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


@dataclass
class Conversation:
    ids: list[int]  # the template's tokens, at most block_size + 1
    # per token: what an assistant turn adds (its content, its end): a target of the loss
    trained: list[bool]
    cut: bool  # tokens past block_size + 1 were dropped


def add_chat_tokens(model: GPT, tokenizer: Tokenizer) -> dict[str, int]:
    """The template's four tokens as new rows of the (tied) embedding and ids of the tokenizer; none
    for a model that came with its own template (it keeps that one)."""
    return {} if tokenizer.chat_template else add_tokens(model, tokenizer, CHAT_TOKENS)


def is_chat_tokenizer(tokenizer: Tokenizer) -> bool:
    """Whether the model was instruction-tuned here (its tokenizer holds this toolkit's
    template)."""
    return all(name in tokenizer.special_tokens for name in CHAT_TOKENS)


def can_chat(tokenizer: Tokenizer) -> bool:
    return is_chat_tokenizer(tokenizer) or tokenizer.chat_template is not None


def stop_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids that end a reply or a sample: <|end|> of this toolkit's template (and end-of-text, as
    its HF export's generation_config.json lists both), a downloaded folder's own (its
    generation_config.json's), else end-of-text where the vocabulary has one."""
    eot = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    if is_chat_tokenizer(tokenizer):
        return [tokenizer.special_tokens[END], *eot]
    if tokenizer.chat_template:
        return tokenizer.chat_template["stop_ids"]
    return eot


def chat_end_id(facts: dict) -> int | None:
    """<|end|>'s id where a checkpoint's tokenizer facts hold the whole template (an
    instruction-tuned model's), else None."""
    special = facts.get("special_tokens") or {}
    return special[END] if all(name in special for name in CHAT_TOKENS) else None


# ----- files -----

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                  "assistant": "assistant"}


def messages_of(record) -> list[dict]:
    """The messages of one record: {"messages": [{"role", "content"}, ...]}, or one of the layouts
    of LLaMA-Factory's datasets (most Chinese ones): {"prompt", "response"}, alpaca's
    {"instruction", "input" (optional: it follows the instruction after a line break), "output"}
    with an optional "system", or ShareGPT's {"conversations": [{"from": "human"|"gpt"|"system",
    "value"}, ...]}; a problem is a ValueError saying what is wrong."""
    record = as_messages(record) if isinstance(record, dict) else record
    messages = record.get("messages") if isinstance(record, dict) else None
    if not (isinstance(messages, list) and messages):
        raise ValueError('expected {"messages": [{"role": ..., "content": ...}, ...]}, {"prompt": '
                         '..., "response": ...}, alpaca\'s {"instruction": ..., "output": ...} or '
                         'ShareGPT\'s {"conversations": [{"from": ..., "value": ...}, ...]}')
    for i, message in enumerate(record["messages"]):
        is_message = isinstance(message, dict) and {"role", "content"} <= message.keys()
        if not is_message:
            raise ValueError(f"message {i} is not an object with role and content")
        if message["role"] not in ROLES:
            raise ValueError(f"message {i} has the unknown role {message['role']!r:.80} (roles: "
                             f"{', '.join(ROLES)})")
        if not isinstance(message["content"], str):
            raise ValueError(f"message {i} ({message['role']}) has content that is not a string")
    if not any(m["role"] == "assistant" for m in record["messages"]):
        raise ValueError("the conversation has no assistant turn, so nothing to learn")
    return record["messages"]


def as_messages(record: dict) -> dict:
    """A record of another layout as {"messages": [...]} (left as it is when it is none of them)."""
    if "messages" in record:
        return record
    system = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    if {"prompt", "response"} <= record.keys():
        turns = [{"role": "user", "content": record["prompt"]},
                 {"role": "assistant", "content": record["response"]}]
    elif {"instruction", "output"} <= record.keys():
        question, extra = record["instruction"], record.get("input") or ""
        if not isinstance(extra, str):
            raise ValueError('"input" is not a string')
        if extra and isinstance(question, str):
            question = f"{question}\n{extra}"
        turns = [{"role": "user", "content": question},
                 {"role": "assistant", "content": record["output"]}]
    elif isinstance(record.get("conversations"), list):
        # (a "from" that is not a string stays as it is: its message's role is then refused)
        turns = [{"role": SHAREGPT_ROLES.get(t.get("from"), t.get("from"))
                  if isinstance(t.get("from"), str) else t.get("from"),
                  "content": t.get("value")} if isinstance(t, dict) else t
                 for t in record["conversations"]]
    else:
        return record
    return {"messages": system + turns}


# ----- the template -----

def turn_ids(message: dict, tokenizer: Tokenizer) -> list[int]:
    """<|role|> content <|end|>"""
    special = tokenizer.special_tokens
    return [special[f"<|{message['role']}|>"], *tokenizer.encode(message["content"]), special[END]]


def encode_conversation(messages: list[dict], tokenizer: Tokenizer,
                        block_size: int) -> list[Conversation]:
    """The training sequences of one conversation, each cut to block_size + 1 tokens: one, unless a
    downloaded model's own template lays out a turn otherwise once a later turn follows it (Qwen3's
    drops an earlier answer's reasoning): then one per assistant turn, ending with it."""
    keep = block_size + 1  # block_size inputs, each with the next token as its target
    sequences = []
    for pieces in own_template_pieces(messages, tokenizer) if tokenizer.chat_template else \
            [toolkit_pieces(messages, tokenizer)]:
        ids = [token for tokens, _ in pieces for token in tokens]
        trained = [learnt for tokens, learnt in pieces for _ in tokens]
        sequences.append(Conversation(ids[:keep], trained[:keep], len(ids) > keep))
    return sequences


def toolkit_pieces(messages: list[dict], tokenizer: Tokenizer) -> list[tuple[list[int], bool]]:
    """(tokens, learnt) pieces in this toolkit's template: each turn's role token is given, an
    assistant turn's content and <|end|> learnt."""
    pieces = [(tokenizer.with_bos([]), False)]
    for message in messages:
        turn = turn_ids(message, tokenizer)
        pieces += [(turn[:1], False), (turn[1:], message["role"] == "assistant")]
    return pieces


def own_template_pieces(messages: list[dict],
                        tokenizer: Tokenizer) -> list[list[tuple[list[int], bool]]]:
    """The training sequences of a conversation in a downloaded model's own template, as (tokens,
    learnt) pieces: an assistant turn learns the text its template adds after the generation prompt
    (its content, its end token, Qwen3's empty <think> block), found by rendering the history up to
    the turn with the generation prompt, and up to and with the turn."""
    template = tokenizer.chat_template
    whole = render(template, messages, prompt=False)
    # (text before the turn, the turn's text) of each assistant turn, in its own rendering
    turns = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before = render(template, messages[:i])
            upto = whole if i == len(messages) - 1 else render(template, messages[: i + 1],
                                                               prompt=False)
            if not upto.startswith(before):
                raise ValueError(f"the model's chat template does not lay out message {i} after "
                                 "its generation prompt, so its tokens cannot be told from the "
                                 "prompt's")
            turns.append((before, upto))
    stable = all(whole.startswith(upto) for _, upto in turns) and all(
        len(upto) <= len(later) for (_, upto), (later, _) in zip(turns, turns[1:]))
    if not stable:  # one sequence per assistant turn, the turn last
        return [text_pieces([(before, False), (upto[len(before):], True)], tokenizer)
                for before, upto in turns]
    pieces, start = [], 0
    for before, upto in turns:
        pieces += [(whole[start:len(before)], False), (whole[len(before):len(upto)], True)]
        start = len(upto)
    return [text_pieces(pieces + [(whole[start:], False)], tokenizer)]


def text_pieces(pieces: list[tuple[str, bool]],
                tokenizer: Tokenizer) -> list[tuple[list[int], bool]]:
    """Each piece tokenized by itself: an answer's first tokens as the model gives them in a chat,
    after a prompt tokenized up to its generation prompt (a newline that opens an answer is not
    merged into the prompt's last one, as it would be in the whole text)."""
    return [(tokenizer.encode_with_special_tokens(text), learnt) for text, learnt in pieces if text]


def pad_conversations(conversations: list[Conversation],
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets) right-padded to the longest: each position's target is the next token where
    that token is learnt, else -1 (ignored by the loss), padding included."""
    width = max(len(c.ids) for c in conversations) - 1
    idx = torch.zeros(len(conversations), width, dtype=torch.long)
    targets = torch.full_like(idx, -1)
    for row, c in enumerate(conversations):
        ids = torch.tensor(c.ids)
        idx[row, : len(c.ids) - 1] = ids[:-1]
        targets[row, : len(c.ids) - 1] = torch.where(torch.tensor(c.trained[1:]), ids[1:], -1)
    return idx.to(device), targets.to(device)


def trained_tokens(conversations: list[Conversation]) -> int:
    return sum(sum(c.trained[1:]) for c in conversations)


def chat_prompt(history: list[dict], tokenizer: Tokenizer,
                variables: dict | None = None) -> list[int]:
    """The prompt for the next assistant turn: every turn of the history, then <|assistant|> (or
    the model's own template with its generation prompt, and the further variables given)."""
    if tokenizer.chat_template:
        return tokenizer.encode_with_special_tokens(render(tokenizer.chat_template, history,
                                                           variables=variables))
    ids = [token for message in history for token in turn_ids(message, tokenizer)]
    return tokenizer.with_bos(ids + [tokenizer.special_tokens["<|assistant|>"]])


def fit_history(history: list[dict], tokenizer: Tokenizer, room: int,
                variables: dict | None = None) -> tuple[list[dict], int]:
    """The history without its oldest turns (a system turn at the start stays) until its prompt
    takes at most room tokens; and how many turns were dropped. (A ValueError if the vocabulary
    cannot spell the history, its first turn included.)"""
    system = history[:1] if history and history[0]["role"] == "system" else []
    turns = history[len(system):]
    dropped = 0
    while len(chat_prompt(system + turns, tokenizer, variables)) > room and len(turns) > 1:
        turns, dropped = turns[1:], dropped + 1
    return system + turns, dropped


# ----- a downloaded model's own template -----

def template_variables(text: str | None) -> dict:
    """--chat-template-kwargs: a JSON object of further variables for the model's chat template, as
    transformers' apply_chat_template(**kwargs) and llama.cpp's llama-server take them (Qwen3's
    {"enable_thinking": false}); {} without it."""
    variables = {} if text is None else parse_json(text, "--chat-template-kwargs")
    if not isinstance(variables, dict):
        raise CLIError("--chat-template-kwargs must be a JSON object, e.g. "
                       "'{\"enable_thinking\": false}'")
    taken = [name for name in TEMPLATE_ARGUMENTS if name in variables]
    if taken:
        raise CLIError(f"--chat-template-kwargs cannot set {taken[0]}: the toolkit gives the "
                       "template its own")
    return variables


def render(template: dict, messages: list[dict], prompt: bool = True,
           variables: dict | None = None) -> str:
    """The text apply_chat_template(messages, add_generation_prompt=prompt, **variables) gives: the
    template runs in Jinja's immutable sandbox (it is code from a download), with what transformers
    adds to it, within RENDER_SECONDS and RENDER_CHARS (BoundedSandbox)."""
    tokens = {key: template[key] for key in ("bos_token", "eos_token") if template.get(key)}
    jinja = compiled(template["jinja"])
    pieces, size = [], 0
    try:
        with time_limit(RENDER_SECONDS):
            for piece in jinja.generate(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=prompt,
                                        **{**tokens, **(variables or {})}):
                pieces.append(piece)
                size += len(piece)
                if size > RENDER_CHARS:
                    raise SecurityError(f"it renders over {RENDER_CHARS:,} characters")
    except Exception as e:  # the template's raise_exception, a sandbox refusal, a bad expression
        raise CLIError("the model's chat template fails: "
                       f"{' '.join(str(e).split())[:200]}") from None
    return "".join(pieces)


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """A TimeoutError when the block runs longer (SIGALRM: in the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"it ran for over {seconds:g} s (a loop without end?)")

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox bounds range() but not what one operation may build: 'x' * 10**10 takes
    gigabytes in a second, 10 ** 10 ** 10 never ends. Here `*` and `**` and every call and filter
    are refused arguments that would build more than RENDER_CHARS items."""
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator: str, left, right):
        if operator == "**" and is_number(right) and abs(right) > 64 and is_number(left) and \
                abs(left) > 1:
            raise SecurityError(f"{left!r:.20} ** {right!r:.20} is too large")
        if operator == "*" and too_long(left, right):
            raise SecurityError("a sequence repeated beyond what a prompt can hold")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        check_sizes(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def too_long(left, right) -> bool:
    """Whether left * right repeats a sequence to more than RENDER_CHARS items."""
    for sequence, times in ((left, right), (right, left)):
        if isinstance(sequence, (str, list, tuple)) and is_number(times) and \
                len(sequence) * times > RENDER_CHARS:
            return True
    return False


def check_sizes(args: tuple, kwargs: dict) -> None:
    """A number past RENDER_CHARS given to a function or a filter (a width, a count) is refused."""
    if any(is_number(value) and abs(value) > RENDER_CHARS
           for value in (*args, *kwargs.values())):
        raise SecurityError(f"a number past {RENDER_CHARS:,} given to a function")


def bounded(function):
    """A filter that refuses a number past RENDER_CHARS (check_sizes)."""
    @functools.wraps(function)
    def checked(*args, **kwargs):
        check_sizes(args[1:], kwargs)  # (its first argument is the value filtered)
        return function(*args, **kwargs)
    return checked


@functools.lru_cache(maxsize=4)
def compiled(jinja: str) -> jinja2.Template:
    """The environment of transformers' chat templates (chat_template_utils.py): blocks trimmed,
    {% break %}, {% generation %}, raise_exception, strftime_now, and a tojson that keeps non-ASCII
    text."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[loopcontrols, GenerationBlock])
    env.filters["tojson"] = (
        lambda value, ensure_ascii=False, indent=None, separators=None, sort_keys=False:
        json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                   sort_keys=sort_keys))
    env.globals.update(raise_exception=raise_template_error,
                       strftime_now=lambda format: datetime.now().strftime(format))
    env.filters = {name: bounded(f) for name, f in env.filters.items()}
    try:
        return env.from_string(jinja)
    except jinja2.TemplateError as e:
        raise CLIError(f"the model's chat template is not valid Jinja: {e}") from None


class GenerationBlock(Extension):
    """{% generation %}...{% endgeneration %}: transformers marks an assistant's text with it (for
    its loss mask); laid out for a prompt, its body renders as it is."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def export_template(facts: dict) -> dict | None:
    """The chat template an HF or GGUF export carries, as read_chat_template (toolkit/hf.py) holds
    one: this toolkit's for a model instruction-tuned here, else a downloaded folder's own."""
    if chat_end_id(facts) is not None:
        # a BOS (Llama 3's) opens each conversation, as in its training
        tokenizer = load_tokenizer(facts)
        jinja = CHAT_TEMPLATE if tokenizer.bos_id is None else "{{ bos_token }}" + CHAT_TEMPLATE
        return {"jinja": jinja, "bos_token": tokenizer.bos_text or tokenizer.eot_text,
                "eos_token": tokenizer.eot_text,
                "stop_ids": [i for i in (facts.get("eot_id"), chat_end_id(facts)) if i is not None]}
    return facts.get("chat_template")
