"""The program folders the one-GPU check runs (benchmarks/gpu_check.py), and ``prepare``, which
compiles them on a CPU machine (OR-Tools lives there; the GPU machine has none).

Note [folders compiled on meta]: every GPT is compiled with ``device=meta``, so no folder holds
weights: each rank makes its own from the plan's init recipes (Note [materialize per rank] in
runtime/execute/materialize.py). A ~170M-parameter folder is ~100 KB, and all of them together
with their token corpus travel to the GPU machine in a few MB (its `run` tool carries 64 MiB).

The corpus: plan.json names it by absolute path, so ``prepare`` writes it at ``corpus_at`` (an
absolute path that exists on both machines, /tmp/... by default), compiles against it, and keeps
a copy in the folders' directory; ``ensure_corpus`` puts that copy back at ``corpus_at`` on the
GPU machine before anything runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS_AT = "/tmp/partitioner-gpu-check/corpus"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Folder:
    name: str
    real: tuple[str, ...] | None   # compile arguments for the GPU kind (None: not compiled)
    dry: tuple[str, ...] | None    # for the CPU dry run
    corpus: bool = False           # trains on the token corpus (eval, generate)
    fp32_fallback: bool = False    # compile again at fp32 when the default precision fails


BIG = "gpt:layers=8,width=1024,heads=16,vocab=32000,seq=1024,device=meta"  # ~170M parameters
TINY = "gpt:layers=1,width=32,heads=2,vocab=64,seq=16,device=meta"

FOLDERS = (
    # P2: eager bf16, kill and resume, eval, generate
    Folder("gpt_bf16", (BIG, "--global-batch", "16", "--steps", "30"),
           ("gpt:layers=2,width=32,heads=2,vocab=256,seq=16,device=meta", "--global-batch", "4", "--steps", "8",
            "--precision", "bf16-mixed"), corpus=True),
    # P3 and P5: fp16 with clipping; the memory tier, lossless checkpoints and export on the same folder
    Folder("gpt_fp16_clip", ("gpt:layers=4,width=512,heads=8,vocab=32000,seq=1024,device=meta", "--global-batch", "16",
                             "--steps", "20", "--precision", "fp16-mixed", "--clip-grad-norm", "1.0"),
           (TINY, "--global-batch", "4", "--steps", "8", "--precision", "fp16-mixed", "--clip-grad-norm", "1.0")),
    # P4: held to the oracle (dropout: keyed masks must agree)
    Folder("gpt_dropout", ("gpt:layers=2,width=256,heads=4,vocab=1024,seq=128,dropout=0.1,device=meta",
                           "--global-batch", "8", "--steps", "3"),
           ("gpt:layers=1,width=32,heads=2,vocab=64,seq=16,dropout=0.1,device=meta", "--global-batch", "4",
            "--steps", "3"), fp32_fallback=True),
    Folder("hf_llama", ("hf-llama:layers=2,width=64,heads=4,vocab=256,seq=32,batch=2", "--global-batch", "4",
                        "--steps", "3"), None, fp32_fallback=True),
    # P7: two data-parallel ranks on the one GPU (Note [every rank on one GPU] in runtime/launch/world.py)
    Folder("gpt_dp2", ("gpt:layers=2,width=256,heads=4,vocab=1024,seq=128,dropout=0.1,device=meta", "--global-batch",
                       "8", "--steps", "4", "--devices", "2", "--dp", "2", "--stages", "1", "--shard-optimizer", "off",
                       "--sdc-every", "2"),
           ("gpt:layers=1,width=32,heads=2,vocab=64,seq=16,dropout=0.1,device=meta", "--global-batch", "4",
            "--steps", "4", "--devices", "2", "--dp", "2", "--stages", "1", "--shard-optimizer", "off",
            "--sdc-every", "2")),
    # P6: compiled stages
    Folder("gpt_compiled", ("gpt:layers=4,width=1024,heads=16,vocab=32000,seq=1024,device=meta", "--global-batch",
                            "16", "--steps", "20", "--compile-stages"),
           (TINY, "--global-batch", "4", "--steps", "4", "--compile-stages")),
)


def _corpus_text(dry_run: bool) -> list[Path]:
    """The corpus's documents: this repository's own text (tokenized as bytes), about 1.5 MB for the
    real run (seq 1024 x batch 16 x 30 steps is 0.5M tokens; the batches wrap around), less for
    the dry run."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "runtime").rglob("*.py")),
             *sorted((REPO / "partitioner").rglob("*.py"))]
    limit, picked, total = (60_000 if dry_run else 1_500_000), [], 0
    for f in files:
        if total >= limit:
            break
        picked.append(f)
        total += f.stat().st_size
    return picked


def _partitioner(argv: list[str]) -> tuple[int, str]:
    """`partitioner ARGV` in this process (one import of the compiler for every folder): exit code, output."""
    # lazy: loads torch and OR-Tools, which only `prepare` needs
    from partitioner.cli.commands import main

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
        try:
            code = main(argv)
        except Exception as exc:  # noqa: BLE001 - recorded in the manifest, the other folders go on
            print(f"error: {type(exc).__name__}: {exc}")
            code = 1
    return code, buf.getvalue()


def prepare(out: Path, *, dry_run: bool, kind: str = "h100", corpus_at: str = DEFAULT_CORPUS_AT) -> dict:
    """Compile every folder into ``out`` (replaced); returns the manifest written to out/manifest.json."""
    corpus_at = str(Path(corpus_at).resolve())
    if out.exists():
        if not (out / MANIFEST).is_file() and any(out.iterdir()):  # never wipe a folder prepare did not write
            raise ValueError(f"--out {out}: it exists and holds no {MANIFEST} of an earlier prepare: pass a new "
                             "folder (prepare replaces only its own)")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    manifest = {"dry_run": dry_run, "kind": "cpu" if dry_run else kind, "corpus_at": corpus_at, "folders": {}}
    code, text = _partitioner(["data", "prepare", *map(str, _corpus_text(dry_run)), "-o", corpus_at,
                               "--tokenizer", "bytes", "--val-fraction", "0.1", "--overwrite", "-q"])
    if code != 0:
        raise RuntimeError(f"the corpus at {corpus_at} could not be prepared:\n{text[-2000:]}")
    shutil.copytree(corpus_at, out / "corpus")
    for folder in FOLDERS:
        args = folder.dry if dry_run else folder.real
        entry = manifest["folders"][folder.name] = {"ok": False, "args": list(args) if args else None}
        if args is None:
            entry["error"] = "not compiled for the dry run" if dry_run else "not compiled"
            continue
        device = ["--device", "cpu", "--no-calibrate"] if dry_run else ["--device", kind]
        data = ["--data", f"tokens:{corpus_at}"] if folder.corpus else []
        command = ["compile", args[0], "-o", str(out / folder.name), "--devices", "1", *device, *data, *args[1:], "-q"]
        code, text = _partitioner(command)
        if code != 0 and folder.fp32_fallback and "--precision" not in args:
            # the oracle phase needs the folder more than its precision (compile bug B1 of the audit)
            entry["error"] = _first_error(text, code)
            entry["fallback"] = "compiled with --precision fp32: the default precision failed"
            code, text = _partitioner(command + ["--precision", "fp32"])
        entry["ok"] = code == 0
        if code != 0:
            entry["error"] = _first_error(text, code)
        print(f"[prepare] {folder.name}: {'ok' if code == 0 else entry['error']}"
              + (f" ({entry['fallback']}: {entry['error']})" if code == 0 and entry.get("fallback") else ""),
              file=sys.stderr)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _first_error(text: str, code: int) -> str:
    lines = text.strip().splitlines()
    return next((line for line in lines if "error" in line.lower()), lines[-1] if lines else f"exit {code}")[:500]


def ensure_corpus(folders: Path, manifest: dict) -> None:
    """The corpus the folders were compiled against, at the absolute path their plans name."""
    at = Path(manifest["corpus_at"])
    mine = folders / "corpus" / "meta.json"
    if (at / "meta.json").is_file() and (at / "meta.json").read_bytes() == mine.read_bytes():
        return
    if at.exists():
        shutil.rmtree(at)
    at.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(folders / "corpus", at)
