"""Sample text from a model trained by train_ds.py (any layout: ZeRO, pipeline or tensor parallel),
or export it as a plain ckpt.pt (--export-ckpt, what test.py and train.py read), an HF folder of its
family (--export-hf) or a GGUF file for llama.cpp (--export-gguf).

--ckpt is either
  * the DeepSpeed checkpoint folder itself (OUT_DIR/ds): the weights of its `latest` checkpoint (or
    --tag) are gathered in memory, no conversion step needed (deepspeed.utils.zero_to_fp32 for ZeRO;
    DeepSpeed's universal checkpoint, in a temporary folder, for pipeline or tensor parallel); or
  * the output of DeepSpeed's converter, as in `cd ckpt/ds && python zero_to_fp32.py . ckpt_ds.pt`
    (a folder holding pytorch_model.bin, shards with an index, or model.safetensors; or one such
    file).
The default is ckpt/ds/ckpt_ds.pt when it was converted from the newest checkpoint, else ckpt/ds.
The model config and the tokenizer come from the checkpoint folder (train_state.json, written by
train_ds.py; for a converted output, the folder above it or --ds-dir), so no training flags need
repeating. The line printed first names the weights actually loaded. Sampling options are those of
test.py (toolkit/sampling.py).
"""
import os
import sys

from toolkit import cli
from toolkit.ds_checkpoint import default_deepspeed_source, load_deepspeed_model
from toolkit.exports import add_export_arguments, check_exports, export
from toolkit.sampling import add_sampling_arguments, check_sampling_args, run_sampling
from toolkit.tokenizers import load_tokenizer

DEFAULT_DS_DIR = os.path.join("ckpt", "ds")
CONVERTED_NAME = "ckpt_ds.pt"  # the seed's `python zero_to_fp32.py . ckpt_ds.pt`


def main(argv: list[str] | None = None) -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--ckpt", default=None,
                        help=f"DeepSpeed checkpoint folder or zero_to_fp32 output (default: "
                             f"{os.path.join(DEFAULT_DS_DIR, CONVERTED_NAME)} if converted from "
                             f"the newest checkpoint, else {DEFAULT_DS_DIR})")
    parser.add_argument("--ds-dir", default=None,
                        help="the DeepSpeed checkpoint folder holding the model config, when "
                             "--ckpt is converted output stored elsewhere (default: the folder "
                             "above it)")
    parser.add_argument("--tag", default=None,
                        help="checkpoint tag, e.g. global_step2000 (default: latest)")
    add_export_arguments(parser)
    add_sampling_arguments(parser)
    args = parser.parse_args(argv)
    outputs = {"--export-hf": args.export_hf, "--export-gguf": args.export_gguf,
               "--export-ckpt": args.export_ckpt}
    check_exports(outputs, [args.ckpt or DEFAULT_DS_DIR, args.ds_dir], args)
    check_sampling_args(args, [args.ckpt or DEFAULT_DS_DIR, args.ds_dir])
    if args.ckpt is None:
        args.ckpt = (DEFAULT_DS_DIR if args.tag else
                     default_deepspeed_source(DEFAULT_DS_DIR, CONVERTED_NAME))
    model, state, label = load_deepspeed_model(args.ckpt, args.ds_dir, args.tag,
                                               attn_kernel=args.attn_kernel)
    print(f"loaded {label}", file=sys.stderr, flush=True)
    facts = state["tokenizer"]
    export(model, facts, args, state)
    if any(outputs.values()):
        return
    run_sampling(model, load_tokenizer(facts), args, args.ckpt)


if __name__ == "__main__":
    cli.run(main)
