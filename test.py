"""Sample text from a trained GPT, or export it as an HF folder (GPT-2, Llama or Qwen3) or a GGUF
file.

Reads any model the toolkit reads (default ckpt/ckpt.pt; the tokenizer is stored in it): a
checkpoint of train.py, train_ddp.py or finetune.py, a DeepSpeed checkpoint folder, or an HF GPT-2
folder or cached name, or an HF Llama or Qwen3 folder. Prints samples as they are generated, writes
Megatron-style JSONL with --genfile, or reads prompts with --interactive. The options and the
printing are toolkit/sampling.py's, the generation loop model.py's. --export-hf DIR writes a folder
of the model's family that transformers (AutoModelForCausalLM, AutoTokenizer) and lm-eval's `hf`
model load alone, offline (toolkit/hf.py, toolkit/hf_llama.py); --export-gguf FILE one file that
llama.cpp, ollama and LM Studio run (toolkit/gguf_export.py).
"""
from toolkit import cli
from toolkit.checkpoint import newest_checkpoint
from toolkit.lora import lora_base
from toolkit.exports import add_export_arguments, check_exports, export
from toolkit.model_sources import load_model
from toolkit.sampling import add_sampling_arguments, check_sampling_args, run_sampling
from toolkit.tokenizers import load_tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--ckpt", default="ckpt/ckpt.pt",
                        help="checkpoint file or folder, or an HF GPT-2, Llama or Qwen3 folder / "
                             "cached name (default: ckpt/ckpt.pt)")
    add_export_arguments(parser)
    add_sampling_arguments(parser)
    args = parser.parse_args(argv)
    base = lora_base(args.ckpt)  # LoRA adapters' base model: an input too
    outputs = {"--export-hf": args.export_hf, "--export-gguf": args.export_gguf,
               "--export-ckpt": args.export_ckpt}
    check_exports(outputs, [args.ckpt, *base], args)
    # a genfile may go beside ckpt.pt
    check_sampling_args(args, [newest_checkpoint(args.ckpt), *base])
    model, facts = load_model(args.ckpt, attn_kernel=args.attn_kernel)
    if any(outputs.values()):
        export(model, facts, args)
        return
    run_sampling(model, load_tokenizer(facts), args, args.ckpt)


if __name__ == "__main__":
    cli.run(main)
