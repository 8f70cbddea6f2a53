"""eval.py's scoring throughput, side by side with a plain forward pass over the same batches and
with lm-evaluation-harness's own `hf` model on the same weights (the folder test.py --export-hf
writes).

Items: HellaSwag-format multiple choice built from the embedded corpus (a 160-character context,
four 60-character endings), GPT-2 vocabulary; the model: random weights of --preset's shape (default
gpt2, 124M), in float32. Each round times, interleaved: (1) toolkit/evaluation.py's log-likelihoods
of every ending (what eval.py runs), (2) the same length-sorted batches through model(idx) alone
(the forward that any scorer needs), (3) lm_eval.simple_evaluate with `hf` on a task YAML over the
same items. Throughput is tokens scored per second (context and ending tokens of every request); the
accuracies printed must agree.

--generate N times generation tasks instead (lm-eval's generate_until): the items' contexts, N
new tokens each, greedy, decoded by toolkit/harness.py (on oneDNN's linears, as eval.py in float32
on a CPU) one request at a time and in batches of --batch-size (left-padded, what eval.py runs), and
by the `hf` model in batches of the same size; throughput is new tokens per second, and the replies
must agree.

    python benchmarks/bench_eval.py --items 100 --rounds 2
    python benchmarks/bench_eval.py --generate 32 --items 32 --rounds 2
"""
import json
import os
import random
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

from model import GPT, GPTConfig
from toolkit.train_config import PRESETS
from toolkit import cli
from toolkit.device import cpu_kind, generation_linears
from toolkit.evaluation import ChoiceTask, gpt_logits_at
from toolkit.gpt2_vocab import GPT2_FACTS
from toolkit.hf import save_gpt2
from toolkit.prepare import default_corpus_documents
from toolkit.tokenizers import load_tokenizer


def write_items(path: str, n: int) -> None:
    documents = [d for d in default_corpus_documents() if len(d) > 400]
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            doc = rng.choice(documents)
            start = rng.randrange(len(doc) - 220)
            endings = [(o := rng.choice(documents))[(s := rng.randrange(len(o) - 60)):s + 60]
                       for _ in range(3)]
            label = rng.randrange(4)
            endings.insert(label, doc[start + 160:start + 220])
            f.write(json.dumps({"ctx": doc[start:start + 160], "endings": endings,
                                "label": label}) + "\n")


def write_yaml(folder: str, items: str) -> None:
    import lm_eval
    utils = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "hellaswag", "utils.py")
    with open(utils) as f, open(os.path.join(folder, "utils.py"), "w") as g:
        g.write(f.read() + "\n\ndef process_plain(dataset):\n"
                "    return dataset.map(lambda d: {'query': preprocess(d['ctx']),"
                " 'choices': [preprocess(e) for e in d['endings']]})\n")
    with open(os.path.join(folder, "bench_items.yaml"), "w") as f:
        f.write(f"task: bench_items\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    validation: {items}\nvalidation_split: validation\n"
                "output_type: multiple_choice\nprocess_docs: !function utils.process_plain\n"
                "doc_to_text: '{{query}}'\ndoc_to_target: '{{label}}'\ndoc_to_choice: choices\n"
                "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")


def main() -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--preset", default="gpt2", choices=sorted(PRESETS))
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--generate", type=int, metavar="N",
                        help="time generation tasks of N new tokens instead of scoring")
    args = parser.parse_args()
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PRESETS[args.preset])).eval()
    device = torch.device("cpu")
    work = tempfile.mkdtemp(prefix="bench_eval_")
    items = os.path.join(work, "items.jsonl")
    write_items(items, args.items)
    write_yaml(work, items)
    save_gpt2(model, os.path.join(work, "hf"), dict(GPT2_FACTS))
    task = ChoiceTask(items, load_tokenizer(GPT2_FACTS), model.config.block_size)
    if args.generate:
        return generation(args, model, [item.query for item in task.items],
                          HFLM(pretrained=os.path.join(work, "hf"), device="cpu", dtype="float32",
                               batch_size=args.batch_size))
    tokens = sum(len(c) + len(e) for c, e in task.requests)
    block = model.config.block_size
    batches = sorted(((c + e)[-(block + 1):][:-1] for c, e in task.requests), key=len, reverse=True)
    manager = TaskManager(include_path=work, include_defaults=False)
    hf = HFLM(pretrained=os.path.join(work, "hf"), device="cpu", dtype="float32",
              batch_size=args.batch_size)

    def ours():
        return task.score(gpt_logits_at(model, device, torch.float32), args.batch_size, device)

    @torch.no_grad()
    def forward():
        for i in range(0, len(batches), args.batch_size):
            chunk = batches[i:i + args.batch_size]
            idx = torch.zeros(len(chunk), len(chunk[0]), dtype=torch.long)
            for row, ids in enumerate(chunk):
                idx[row, :len(ids)] = torch.tensor(ids)
            model(idx)

    def theirs():
        out = simple_evaluate(model=hf, tasks=["bench_items"], task_manager=manager,
                              bootstrap_iters=0)
        return {k.split(",")[0]: v for k, v in out["results"]["bench_items"].items()
                if k in ("acc,none", "acc_norm,none")}

    print(f"CPU {cpu_kind()}, {torch.get_num_threads()} threads; {args.preset}, float32, "
          f"{args.items} items = {len(task.requests)} requests, {tokens:,} tokens, "
          f"batch {args.batch_size}")
    times = {"eval.py scoring": [], "plain forward": [], "lm-eval hf": []}
    for round_ in range(args.rounds):
        for name, work_ in (("eval.py scoring", ours), ("plain forward", forward),
                            ("lm-eval hf", theirs)):
            start = time.perf_counter()
            result = work_()
            times[name].append(time.perf_counter() - start)
            print(f"round {round_ + 1} {name}: {times[name][-1]:.2f} s" +
                  (f", {result}" if result else ""), flush=True)
    print("| scorer | median s | tokens/s |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | "
              f"{tokens / statistics.median(values):,.0f} |")


def generation(args, model: GPT, contexts: list[str], hf) -> None:
    """Interleaved rounds of generate_until over the same requests: ours one at a time, ours in
    batches, the hf model's."""
    from toolkit.harness import GPTHarness
    tok, cpu = load_tokenizer(GPT2_FACTS), torch.device("cpu")
    model = generation_linears(model, cpu, torch.float32)  # as eval.py runs the harness
    # (an until string random weights never write: every request makes its N tokens)
    options = {"until": ["\u2603\u2603"], "max_gen_toks": args.generate, "do_sample": False}
    requests = [SimpleNamespace(args=(context, options)) for context in contexts]
    ours = {size: GPTHarness(model, tok, size, cpu, torch.float32).generate_until
            for size in (1, args.batch_size)}
    decoders = {"eval.py, one at a time": ours[1],
                f"eval.py, batches of {args.batch_size}": ours[args.batch_size],
                f"lm-eval hf, batches of {args.batch_size}": hf.generate_until}
    tokens = len(requests) * args.generate
    print(f"CPU {cpu_kind()}, {torch.get_num_threads()} threads; {args.preset}, float32, "
          f"{len(requests)} requests of {min(map(len, contexts))}-{max(map(len, contexts))} "
          f"characters, {args.generate} new tokens each, greedy")
    times, replies = {name: [] for name in decoders}, {}
    for round_ in range(args.rounds):
        for name, decode in decoders.items():
            start = time.perf_counter()
            replies[name] = decode(requests, disable_tqdm=True)
            times[name].append(time.perf_counter() - start)
            print(f"round {round_ + 1} {name}: {times[name][-1]:.2f} s", flush=True)
    first = next(iter(replies.values()))
    print("| decoder | median s | new tokens/s | replies as one at a time's |\n|---|---|---|---|")
    for name, values in times.items():
        same = sum(a == b for a, b in zip(replies[name], first))
        print(f"| {name} | {statistics.median(values):.2f} | "
              f"{tokens / statistics.median(values):,.1f} | {same} of {len(first)} |")


if __name__ == "__main__":
    cli.run(main)
