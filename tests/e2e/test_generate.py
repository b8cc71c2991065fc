"""`partitioner generate` end to end: a tiny built-in GPT compiled for one rank, trained 3 steps by
`partitioner run`, sampled from its checkpoint (partitioner/models/generate.py); greedy text equal
to a reference computed here from the exported weights; the refusals, one line each."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from partitioner.cli.commands import main as cli
from partitioner.models.export import export
from partitioner.models.generate import SamplingSettings, generate
from runtime.data.corpus.prepare import prepare

REPO = Path(__file__).resolve().parents[2]
SPEC = "gpt:layers=2,width=32,heads=2,seq=32,vocab=257"
PROMPT = "def "


def _partitioner(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "partitioner", *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    folder = root / "gpt"
    assert cli(["compile", SPEC, "-o", str(folder), "--devices", "1", "--global-batch", "4", "-q"]) == 0
    shutil.copytree(folder, root / "untrained")  # the same program before any run: no checkpoint
    (root / "code.txt").write_text("def add(a, b):\n    return a + b\n\ndef one():\n    return 1\n")
    prepare([str(root / "code.txt")], str(root / "data"), tokenizer="bytes")
    assert cli(["run", str(folder), "--steps", "3", "--quiet"]) == 0
    return root


def test_generate_prints_the_prompt_then_the_text(trained):
    done = _partitioner("generate", str(trained / "gpt"), "--prompt", PROMPT, "--max-new-tokens", "20",
                        "--tokenizer-from", str(trained / "data"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(PROMPT) and len(done.stdout) > len(PROMPT)
    assert "note:" not in done.stderr and "step 3 of" in done.stderr  # the tokenizer was named: no guess to note


def _reference_greedy(root: Path, prompt_ids: list[int], new_tokens: int, vocab: int) -> list[int]:
    """The same checkpoint's weights, by `export`, as transformers' GPT-2 (Note [the built-in gpt is
    GPT-2] in partitioner/models/gpt_as_gpt2.py) loaded by from_pretrained, argmax after argmax."""
    transformers = pytest.importorskip("transformers")
    report = export(root / "gpt", root / "exported")
    assert "config.json" in report.files and report.architecture == "GPT2LMHeadModel"
    assert f"load it: transformers.GPT2LMHeadModel.from_pretrained('{root / 'exported'}')" in report.text()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root / "exported"))
    assert type(model).__name__ == "GPT2LMHeadModel"
    model.eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids[-32:]])).logits[0, -1, :vocab]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids):]


def test_greedy_is_deterministic_and_is_the_reference(trained):
    settings = SamplingSettings(max_new_tokens=40, temperature=0)  # 4 + 40 tokens: past the 32 of context
    first = generate(trained / "gpt", PROMPT, settings, tokenizer_from=str(trained / "data"))
    second = generate(trained / "gpt", PROMPT, settings, tokenizer_from=f"tokens:{trained / 'data'}")
    assert first.text == second.text and first.new_ids == second.new_ids and len(first.new_ids) == 40
    assert first.prompt_ids == tuple(PROMPT.encode())
    # the corpus's byte tokenizer has 256 ids; the model's 257th is never drawn (Note [sampling
    # within the tokenizer's vocabulary])
    assert list(first.new_ids) == _reference_greedy(trained, list(first.prompt_ids), 40, 256)
    assert first.text == PROMPT + bytes(first.new_ids).decode("utf-8", errors="replace")


def test_sampling_is_seeded(trained):
    def text(seed):
        settings = SamplingSettings(max_new_tokens=16, temperature=0.8, top_k=20, seed=seed)
        return generate(trained / "gpt", PROMPT, settings, tokenizer_from=str(trained / "data")).new_ids

    assert text(1) == text(1)
    assert text(1) != text(2) or text(1) != text(3)


def test_synthetic_tokens_decode_as_bytes_with_a_note(trained, capsys):
    assert cli(["generate", str(trained / "gpt"), "--prompt", PROMPT, "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(PROMPT)
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "synthetic tokens" in notes[0] and "noise" in notes[0]


def test_no_checkpoint_yet_is_one_line_naming_the_fix(trained):
    folder = trained / "untrained"
    done = _partitioner("generate", str(folder), "--prompt", PROMPT)
    assert done.returncode != 0 and done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert str(folder) in lines[0] and f"partitioner run {folder}" in lines[0]


def test_a_model_that_is_no_causal_lm_is_refused(trained, capsys):
    folder = trained / "mlp"
    assert cli(["compile", "mlp", "-o", str(folder), "--devices", "1", "--global-batch", "4", "-q"]) == 0
    capsys.readouterr()
    assert cli(["generate", str(folder), "--prompt", PROMPT]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "no causal language model" in err[0], err


def test_a_prompt_outside_the_models_vocabulary_is_refused(trained, capsys):
    """A word-level tokenizer of 300 ids against the model's 257: the error names the id and both sizes."""
    # lazy: only this test builds a tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i + 1 for i in range(299)}}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(trained / "words.json"))
    (trained / "words.txt").write_text("w1 w2 w290 w3\n")
    prepare([str(trained / "words.txt")], str(trained / "words"), tokenizer=str(trained / "words.json"))
    assert cli(["generate", str(trained / "gpt"), "--prompt", "w1 w290", "--tokenizer-from",
                str(trained / "words")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert "token id 291" in err[0] and "'w290'" in err[0] and "vocabulary of 257" in err[0] and "has 300" in err[0]
    # ids inside both vocabularies are fine: the text decodes with the word-level tokenizer
    done = generate(trained / "gpt", "w1 w2", SamplingSettings(max_new_tokens=3, temperature=0),
                    tokenizer_from=str(trained / "words"))
    assert done.prompt_ids == (2, 3) and done.text.startswith("w1 w2") and max(done.new_ids) < 257
