"""How close llama.cpp runs a model exported as GGUF: for each --outtype, the file's size, and on
the first block of the val split the relative error of llama.cpp's logits against this toolkit's
(the norm of the difference over the norm of ours) and the share of positions whose likeliest token
agrees. Needs llama-cpp-python (the test install builds it).

    python benchmarks/bench_gguf.py --ckpt ckpt/ckpt.pt --data-dir data/pydoc_char
"""
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from toolkit import cli
from toolkit.data import load_corpus
from toolkit.gguf_export import WEIGHT_TYPES, save_gguf
from toolkit.model_sources import load_model


def llama_cpp_logits(path: str, ids: list[int]) -> torch.Tensor:
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=max(64, len(ids)), logits_all=True, verbose=False,
                n_threads=os.cpu_count())
    llm.eval(ids)
    logits = torch.tensor(np.array(llm.scores[: len(ids)]))
    llm.close()
    return logits


def main(argv: list[str] | None = None) -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--ckpt", default="ckpt/ckpt.pt", help="the model (default: ckpt/ckpt.pt)")
    parser.add_argument("--data-dir", default="data/pydoc_char", help="its data, for the val ids")
    args = parser.parse_args(argv)
    model, facts = load_model(args.ckpt)
    ids = [int(i) for i in load_corpus(args.data_dir).val[: model.config.block_size]]
    with torch.no_grad():
        ours = model.eval()(torch.tensor([ids]))[0][0]
    print(f"{'outtype':8} {'file bytes':>12} {'rel. error':>10} {'argmax agrees':>14}")
    with tempfile.TemporaryDirectory() as folder:
        for outtype in WEIGHT_TYPES:
            path = os.path.join(folder, f"{outtype}.gguf")
            save_gguf(model, path, facts, outtype)
            theirs = llama_cpp_logits(path, ids)
            error = ((theirs - ours).norm() / ours.norm()).item()
            agree = int((theirs.argmax(-1) == ours.argmax(-1)).sum())
            print(f"{outtype:8} {os.path.getsize(path):>12,} {error:>10.2e} {agree:>8}/{len(ids)}",
                  flush=True)


if __name__ == "__main__":
    cli.run(main)
