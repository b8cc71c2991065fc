"""`partitioner generate DIR --prompt TEXT`: a causal LM's newest verified checkpoint, sampled in one
process (partitioner/models/generate.py). Registered by commands.py's parser through ``add_parser``."""

from __future__ import annotations

import sys

EXAMPLES = """examples:
  partitioner generate out --prompt "def " --max-new-tokens 40
  partitioner generate out --prompt "Once upon" --temperature 0.8 --top-k 50 --seed 1
  partitioner generate out --prompt "x = " --temperature 0            # greedy: the same text every time
  partitioner generate out --prompt "The" --step 200 --checkpoint-dir /scratch/ckpt
  partitioner generate out --prompt "The" --tokenizer-from corpus    # the program trained on its own make_batch"""


def cmd_generate(args) -> int:
    # lazy: loads torch
    from partitioner.models.generate import SamplingSettings, generate

    settings = SamplingSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                seed=args.seed, device=args.device)
    done = generate(args.dir, args.prompt, settings, checkpoint_dir=args.checkpoint_dir, step=args.step,
                    tokenizer_from=args.tokenizer_from)
    for note in done.notes:
        print(f"note: {note}", file=sys.stderr)
    print(done.text)
    print(f"[generate] {len(done.new_ids)} tokens after {len(done.prompt_ids)} of the prompt, step {done.step} of "
          f"{done.checkpoint}", file=sys.stderr)
    return 0


def add_parser(sub, fmt) -> None:
    g = sub.add_parser("generate", help="sample text from a causal LM's newest verified checkpoint", epilog=EXAMPLES,
                       formatter_class=fmt, description="Sample text from the newest verified checkpoint of a "
                       "program folder's causal language model, in this process. This imports the folder's model "
                       "code: generate only from folders you trust (README \"Trust model\").")
    g.add_argument("dir", help="program folder (`partitioner compile -o DIR`), trained by `partitioner run DIR`")
    g.add_argument("--prompt", required=True, help="the text the model continues")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64; fewer "
                   "when the model writes the data's end-of-document id)")
    g.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default 1.0; 0: greedy, "
                   "the most likely token every time)")
    g.add_argument("--top-k", type=int, default=0, help="draw among the K most likely tokens only (default 0: all)")
    g.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (default 0)")
    g.add_argument("--step", type=int, help="this committed checkpoint step, not the newest")
    g.add_argument("--checkpoint-dir", metavar="CKPT_DIR", help="where the checkpoints are (default DIR/checkpoints)")
    g.add_argument("--tokenizer-from", metavar="DATA_DIR", help="a prepared corpus folder (`partitioner data "
                   "prepare`) whose tokenizer encodes the prompt and decodes the text (default: the program's data)")
    g.add_argument("--device", default="cpu", help="torch device to run the model on (default cpu; e.g. cuda)")
    g.set_defaults(func=cmd_generate)
