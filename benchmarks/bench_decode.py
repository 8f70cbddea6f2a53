"""
Decoding speed, side by side in one run: this toolkit's generation (model.py's generate_stream: the
KV cache; its linears in eager PyTorch, and on oneDNN as test.py runs them on a CPU in float32,
toolkit/device.py's generation_linears; with int8 or int4 weights, `--quantize int8|int4`,
toolkit/quantize.py;
its one-token step compiled, `--compile`, toolkit/device.py) and llama.cpp (llama-cpp-python) on
the toolkit's own GGUF export of the same weights in the same precision. For each batch size: the
prefill's latency, the decode rate, and the model bandwidth utilisation (MBU) against the machine's
memory bandwidth, measured here.

    python benchmarks/bench_decode.py            # 12 x 768 llama family, GPT-2's vocabulary
    python benchmarks/bench_decode.py --batch-sizes 1 4 16 64 --rounds 2
    python benchmarks/bench_decode.py --ckpt ckpt/ckpt.pt   # a checkpoint's model instead
    python benchmarks/bench_decode.py --device cuda        # a GPU: eager and compiled, bfloat16

On a GPU the rows are ours alone, in bfloat16 weights: eager, and the step compiled (a CUDA graph).

The decode rate is (long - short) new tokens over the time between their arrival in one run, so
the prefill and the start-up are left out; greedy, no end-of-text. MBU: the bytes one decode step
reads (every weight but the input embedding's table, of which it gathers a row, and the KV cache so
far, on average) times steps a second, over the bandwidth of reading a 1 GiB float32 tensor.
llama.cpp decodes one sequence here (batch 1). Rounds are interleaved; the best of them is shown.
"""
import argparse
import copy
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import GPT, GPTConfig  # noqa: E402
from toolkit.train_config import PRESETS  # noqa: E402
from toolkit.device import (cpu_kind, generation_linears,  # noqa: E402
                            read_bandwidth)
from toolkit.gguf_export import save_gguf  # noqa: E402
from toolkit.device import compile_decoding  # noqa: E402
from toolkit.gpt2_vocab import GPT2_FACTS  # noqa: E402
from toolkit.model_sources import load_model  # noqa: E402
from toolkit.quantize import quantize_model  # noqa: E402


def step_bytes(model: GPT, batch: int, context: float, element: int) -> float:
    """The bytes a decode step reads: the weights as stored (int8 or int4 ones with their scales;
    the input table's one row a sequence aside) and the KV cache of context positions for each
    sequence, of element bytes a number."""
    c = model.config
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    weights = sum(t.numel() * t.element_size() for name, t in tensors
                  if not name.startswith("transformer.wte."))
    cache = 2 * c.n_layer * c.kv_heads * c.head_size * context * batch * element
    return weights + cache


def stamps(tokens, short: int, long: int, sync=lambda: None) -> tuple[float, float]:
    """(seconds to the first new token, decode tokens/s between new tokens short and long) of
    one run of a token stream, read as the tokens arrive (sync: waits for a GPU's queue)."""
    start = time.perf_counter()
    times = {}
    for made, _ in enumerate(tokens, start=1):
        if made in (1, short, long):
            sync()
            times[made] = time.perf_counter() - start
        if made == long:
            break
    return times[1], (long - short) / (times[long] - times[short])


@torch.no_grad()
def ours(model: GPT, batch: int, prompt: int, short: int, long: int) -> tuple[float, float]:
    """(seconds to the first new token, decode tokens/s over all sequences)."""
    device = model.lm_head.weight.device
    idx = torch.randint(0, model.config.vocab_size, (batch, prompt),
                        generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    first, rate = stamps(model.generate_stream(idx, long, temperature=0.0), short, long, sync)
    return first, batch * rate


def llama_cpp(path: str, prompt: int, short: int, long: int,
              vocab_size: int) -> tuple[float, float]:
    """llama.cpp's (seconds to the first new token, decode tokens/s), one sequence, greedy."""
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=prompt + long + 8, n_threads=os.cpu_count(),
                verbose=False)
    ids = torch.randint(0, vocab_size, (prompt,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    result = stamps(llm.generate(ids, top_k=1, temp=0.0, reset=True), short, long)
    llm.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="a model the toolkit reads (default: a random 12 x 768 llama "
                                  "family model of GPT-2's vocabulary)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (default: %(default)s)")
    p.add_argument("--short", type=int, default=16, help="(default: %(default)s new tokens)")
    p.add_argument("--long", type=int, default=80, help="(default: %(default)s new tokens)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="leave out test.py --compile's rows (each batch size compiles for seconds)")
    args = p.parse_args()
    if not 1 <= args.short < args.long:
        p.error("--short must be at least 1 and less than --long")
    if args.ckpt:
        model, facts = load_model(args.ckpt)
    else:
        torch.manual_seed(0)
        shape = {key: PRESETS["gpt2"][key] for key in ("n_layer", "n_head", "n_embd")}
        model = GPT(GPTConfig(**shape, vocab_size=50257, block_size=1024, arch="llama",
                              bias=False, tie_embeddings=False))
        facts = dict(GPT2_FACTS)
    device = torch.device(args.device)
    cuda, dtype = device.type == "cuda", torch.bfloat16 if device.type == "cuda" else torch.float32
    model = model.to(device, dtype).eval()
    decoders = {"ours (eager, KV cache)": model}  # name: the model it decodes with
    if not cuda:
        decoders["ours (oneDNN linears)"] = generation_linears(copy.deepcopy(model), device, dtype)
        decoders["ours (int8 weights)"] = quantize_model(copy.deepcopy(model), "int8")
        decoders["ours (int4 weights)"] = quantize_model(copy.deepcopy(model), "int4")
    compiled = [("ours (compiled step)", None)]
    if not cuda:  # (int8 and int4 weights: CPU kernels)
        compiled += [("ours (int8, compiled step)", "int8"), ("ours (int4, compiled step)", "int4")]
    for name, quantize in compiled if args.compile else []:
        decoders[name] = copy.deepcopy(model) if quantize is None else \
            quantize_model(copy.deepcopy(model), quantize)
        compile_decoding(decoders[name], dtype)  # (a CUDA graph on a GPU)
    quantized = {kind: decoders[f"ours ({kind} weights)"]  # whose bytes a row's MBU counts
                 for kind in ("int8", "int4") if not cuda}
    bandwidth = read_bandwidth(device)
    where = torch.cuda.get_device_name(device) if cuda else \
        f"CPU {cpu_kind()}, {torch.get_num_threads()} threads"
    print(f"{where}, torch {torch.__version__}; {str(dtype)[6:]}; {model.config.n_layer} x "
          f"{model.config.n_embd} {model.config.arch}, vocab "
          f"{model.config.vocab_size:,}; prompt {args.prompt}, decode {args.short} -> {args.long} "
          f"new tokens; memory read bandwidth {bandwidth:.1f} GB/s", flush=True)
    best = {}
    with tempfile.TemporaryDirectory() as folder:
        gguf = os.path.join(folder, "model.gguf")
        if not cuda:  # (llama.cpp's row: on a CPU)
            save_gguf(model, gguf, facts, "f32")
        for _ in range(args.rounds):
            runs = [] if cuda else [("llama.cpp (f32 GGUF)", 1, None)]
            runs += [(name, b, decoder) for b in args.batch_sizes
                     for name, decoder in decoders.items()]
            for name, batch, decoder in runs:
                first, rate = (llama_cpp(gguf, args.prompt, args.short, args.long,
                                         model.config.vocab_size) if decoder is None
                               else ours(decoder, batch, args.prompt, args.short, args.long))
                old = best.get((name, batch), (float("inf"), 0.0))
                best[name, batch] = (min(first, old[0]), max(rate, old[1]))
                print(f"  {name}, batch {batch}: first token {first * 1000:.0f} ms, decode "
                      f"{rate:.1f} tokens/s", flush=True)
    context = args.prompt + (args.short + args.long) / 2
    print("| decoder | batch | first token (ms) | decode tokens/s | MBU |\n|---|---|---|---|---|")
    for (name, batch), (first, rate) in best.items():
        read = step_bytes(next((q for kind, q in quantized.items() if kind in name), model),
                          batch, context, dtype.itemsize)
        mbu = read * rate / batch / (bandwidth * 1e9)
        print(f"| {name} | {batch} | {first * 1000:.0f} | {rate:.1f} | {mbu:.0%} |")


if __name__ == "__main__":
    main()
