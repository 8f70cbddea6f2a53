"""Conversations about Python's documentation topics, answered from their text, for the offline
instruction-tuning recipe of docs/finetune.md: the embedded corpus (pydoc_data.topics) has 79
topics; for each, two questions:

    user: Title of augassign?        assistant: Augmented assignment statements
    user: How does augassign begin?  assistant: Augmented assignment is the combination, in a single

A fifth of the topics (every fifth, sorted by name) are held out for validation, with both their
questions, so the val conversations ask about topics never seen in fine-tuning (their text was seen
in pretraining).

    python examples/pydoc_chat.py --out-dir data/pydoc_chat     # -> train.jsonl, val.jsonl
"""
import argparse
import json
import os
import re
from pydoc_data.topics import topics

# "How does ... begin?" is answered with the first words of the topic's first paragraph
ANSWER_CHARS = 48


def conversations(key: str, text: str) -> list[dict]:
    lines = text.strip().splitlines()
    title = lines[0].strip()
    paragraphs = [p for p in re.split(r"\n\s*\n", "\n".join(lines[2:]))
                  if p.strip() and not p.startswith(" ")]
    first = " ".join(paragraphs[0].split()) if paragraphs else title
    beginning = first[:ANSWER_CHARS].rsplit(" ", 1)[0] if len(first) > ANSWER_CHARS else first
    return [{"messages": [{"role": "user", "content": f"Title of {key}?"},
                          {"role": "assistant", "content": title}]},
            {"messages": [{"role": "user", "content": f"How does {key} begin?"},
                          {"role": "assistant", "content": beginning}]}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="data/pydoc_chat",
                        help="where train.jsonl and val.jsonl go")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    splits = {"train": [], "val": []}
    for i, key in enumerate(sorted(topics)):
        splits["val" if i % 5 == 4 else "train"] += conversations(key, topics[key])
    for name, rows in splits.items():
        with open(os.path.join(args.out_dir, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{os.path.join(args.out_dir, name + '.jsonl')}: {len(rows)} conversations")


if __name__ == "__main__":
    main()
