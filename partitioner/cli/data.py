"""`partitioner data prepare | check`: the token corpus a run trains on (runtime/data/corpus/prepare.py
writes it, runtime/data/corpus/ reads it). Registered by commands.py's parser through ``add_parser``."""

from __future__ import annotations

import argparse
import sys
import time

from runtime.launch.run_options import unknown_flag_message

EXAMPLES = """examples:
  partitioner data prepare notes.txt book.txt -o corpus --tokenizer bytes
  partitioner data prepare docs.jsonl -o corpus --tokenizer ./gpt2-tokenizer --json-key text --append-eod
  partitioner data prepare *.txt -o corpus --tokenizer tokenizer.json --val-fraction 0.01 --overwrite
  partitioner data check tokens:corpus                  # every .bin against meta.json's sha256
  partitioner data check megatron:/data/my-corpus_text_document
  partitioner data check tokens:/data/train.bin,dtype=uint16"""


class PercentLine:
    """``prepare``'s progress callback: one ``\\r`` percentage line on a terminal, a line per
    tenth otherwise (a log file gets ten lines, not thousands)."""

    def __init__(self, stream=None, every_s: float = 0.1):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", None) and self.stream.isatty())
        self.every_s, self.last_s, self.last_tenth, self.open = every_s, 0.0, -1, False

    def __call__(self, done_bytes: int, total_bytes: int) -> None:
        percent = 100.0 * done_bytes / total_bytes if total_bytes else 100.0
        text = f"[data] tokenizing {percent:5.1f}% of {total_bytes / 1e6:.1f} MB"
        if self.tty:
            now = time.perf_counter()
            if now - self.last_s >= self.every_s or done_bytes >= total_bytes:
                self.stream.write("\r" + text)
                self.stream.flush()
                self.last_s, self.open = now, True
        elif int(percent // 10) > self.last_tenth:
            self.last_tenth = int(percent // 10)
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False


def cmd_data_prepare(args) -> int:
    from runtime.data.corpus.prepare import prepare  # lazy: numpy and tokenizers, only when the command runs

    progress = PercentLine()
    try:
        meta = prepare(args.files, args.output, tokenizer=args.tokenizer, json_key=args.json_key,
                       val_fraction=args.val_fraction, append_eod=args.append_eod, overwrite=args.overwrite,
                       progress=None if args.quiet else progress)
    finally:
        progress.close()
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    docs = (lambda split: "one document split by tokens") if meta["split_by"] == "tokens" else \
        (lambda split: f"{split['num_documents']} documents")
    print(f"{args.output}: {train['num_tokens']:,} train tokens ({docs(train)}), "
          f"{val['num_tokens']:,} val tokens ({docs(val)}), vocab {meta['vocab_size']}, "
          f"{meta['dtype']}, tokenizer {meta['tokenizer']['path'] or 'bytes'}"
          + (f", EOD id {meta['eod_id']}" if meta["eod_id"] is not None else ""))
    print(f"  train on it: --data tokens:{args.output}")
    return 0


def cmd_data_check(args) -> int:
    from runtime.data.corpus import CorpusSpec, open_source  # lazy: numpy, only when the command runs

    source = open_source(CorpusSpec.parse(args.spec))
    source.verify()
    splits = ", ".join(f"{name} {array.shape[0]:,} tokens" for name, array in source.splits.items())
    print(f"{args.spec}: ok: {splits}, vocab {source.vocab_size}")
    return 0


class _ActionParser(argparse.ArgumentParser):
    """`data prepare` / `data check`: an unknown flag is refused here, naming the nearest of this
    action's own flags (commands.py's main would only know `data`'s)."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, unknown = super().parse_known_args(args, namespace)
        if unknown:
            print(f"error: {unknown_flag_message(unknown, list(self._option_string_actions), self.prog)}",
                  file=sys.stderr)
            raise SystemExit(2)
        return parsed, unknown


def add_parser(sub, fmt) -> None:
    d = sub.add_parser("data", help="prepare or check a token corpus to train on", epilog=EXAMPLES,
                       formatter_class=fmt)
    actions = d.add_subparsers(dest="data_command", required=True, parser_class=_ActionParser)
    p = actions.add_parser("prepare", help="tokenize text or .jsonl files into a corpus folder", epilog=EXAMPLES,
                           formatter_class=fmt)
    p.add_argument("files", nargs="+", metavar="FILE", help="text files (one document each) or .jsonl (one per line)")
    p.add_argument("-o", "--output", required=True, metavar="DATA_DIR", help="folder to write (train.bin, val.bin, "
                   "meta.json); must not exist unless --overwrite")
    p.add_argument("--tokenizer", required=True, help="bytes (ids = UTF-8 bytes), a folder holding tokenizer.json, "
                   "or the tokenizer.json file (local files only)")
    p.add_argument("--json-key", default="text", help="the field of each .jsonl line holding its text (default text)")
    p.add_argument("--val-fraction", type=float, default=0.005, help="the last fraction of the documents held out "
                   "as val.bin (default 0.005; at least one document when there are two)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's end-of-text "
                   "id (bytes: 256)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing corpus folder at DATA_DIR")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    p.set_defaults(func=cmd_data_prepare)
    c = actions.add_parser("check", help="open a corpus and verify it (prepared folders: every sha256)",
                           epilog=EXAMPLES, formatter_class=fmt)
    c.add_argument("spec", help="tokens:DATA_DIR, tokens:FILE.bin,dtype=uint16, megatron:PREFIX or hf-disk:DIR")
    c.set_defaults(func=cmd_data_check)
    for each in (p, c):  # as commands.py adds to its own subcommands: `partitioner data prepare ... -v`
        each.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                          help="show tracebacks on errors")
