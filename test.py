"""Sample text from a trained GPT, or export it as an HF folder (GPT-2, Llama or Qwen3).

Reads any model the toolkit reads (default ckpt/ckpt.pt; the tokenizer is stored in it): a
checkpoint of train.py, train_ddp.py or finetune.py, a DeepSpeed checkpoint folder, or an HF GPT-2
folder or cached name, or an HF Llama or Qwen3 folder. Prints samples as they are generated, writes
Megatron-style JSONL with --genfile, or reads prompts with --interactive. The options and the
printing are toolkit/sampling.py's, the generation loop model.py's. --export-hf DIR writes a folder
of the model's family that transformers (AutoModelForCausalLM, AutoTokenizer) and lm-eval's `hf`
model load alone, offline (toolkit/hf.py, toolkit/hf_llama.py).
"""
from toolkit import cli
from toolkit.files import check_output
from toolkit.model_sources import load_model, save_hf
from toolkit.sampling import add_sampling_arguments, check_sampling_args, run_sampling
from toolkit.tokenizers import load_tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--ckpt", default="ckpt/ckpt.pt",
                        help="checkpoint file or folder, or an HF GPT-2 folder / cached name "
                             "(default: ckpt/ckpt.pt)")
    parser.add_argument("--export-hf", metavar="DIR",
                        help="write the model as an HF folder of its family (weights, config, tokenizer "
                             "files) and exit")
    add_sampling_arguments(parser)
    args = parser.parse_args(argv)
    check_sampling_args(args, [args.ckpt])
    if args.export_hf:
        check_output(args.export_hf, [args.ckpt], "--export-hf")
    model, facts = load_model(args.ckpt, attn_kernel=args.attn_kernel)
    if args.export_hf:
        print(save_hf(model, args.export_hf, facts))
        return
    run_sampling(model, load_tokenizer(facts), args, args.ckpt)


if __name__ == "__main__":
    cli.run(main)
