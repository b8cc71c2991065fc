"""A model whose import fails is one line naming the real error (Note [the real import error] in
runtime/errors.py): a torchvision that raises at import (as the CUDA wheel does on a CPU torch)
under transformers' lazy modules, reached from an hf: config, from a user's model file and from a
module:function (`partitioner compile` exits 2 with no traceback), and on a rank that builds the
hf: model (a MissingPackageError, which a rank prints as one line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REAL = "RuntimeError: operator torchvision::nms does not exist"

# One process for every case (each would import torch and transformers again): the CLI's main,
# as `partitioner compile MODEL -o out` runs it, then the rank's build_meta.
SCRIPT = """
import sys
from partitioner.cli.commands import main
for spec in ("hf:gpt2cfg", "my_model.py:build", "my_pkg_model:build"):
    print("rc", main(["compile", spec, "-o", "out", "-q"]), flush=True)
from runtime.errors import MissingPackageError
from runtime.execute.pretrained import build_meta
try:
    build_meta({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}, "GPT2LMHeadModel")
except MissingPackageError as exc:
    print("rank error:", exc, file=sys.stderr)
"""


def _broken_torchvision(site: Path) -> None:
    """An installed torchvision (dist-info and all) whose import raises, as a wheel built for another torch does."""
    (site / "torchvision").mkdir(parents=True)
    init = 'raise RuntimeError("operator torchvision::nms does not exist")\n'
    (site / "torchvision" / "__init__.py").write_text(init)
    info = site / "torchvision-0.28.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    (info / "top_level.txt").write_text("torchvision\n")


def test_a_broken_package_under_transformers_is_one_line_naming_the_real_error(tmp_path):
    _broken_torchvision(tmp_path / "site")
    (tmp_path / "gpt2cfg").mkdir()
    (tmp_path / "gpt2cfg" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_embd": 8, "n_head": 2,
         "vocab_size": 32, "n_positions": 16, "bos_token_id": 0, "eos_token_id": 0}))
    (tmp_path / "my_model.py").write_text("import torch\nfrom transformers import GPT2LMHeadModel\n\n\ndef build():\n"
                                          "    pass\n")
    (tmp_path / "site" / "my_pkg_model.py").write_text("from transformers import GPT2LMHeadModel\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path / "site")]),
           "PARTITIONER_NO_CALIBRATE": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.stdout.count("rc 2") == 3, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith(("error:", "rank error:"))]
    assert len(errors) == 4, done.stderr
    for line in errors:
        assert REAL in line and f"{tmp_path / 'site' / 'torchvision' / '__init__.py'}:1" in line, line
        assert "which transformers.image_utils imports" in line and "pip uninstall torchvision" in line, line
    hf, own, module, rank = errors
    assert hf.startswith("error: MODEL 'hf:gpt2cfg': transformers cannot import GPT2LMHeadModel: "), hf
    assert "my_model.py:2 `from transformers import GPT2LMHeadModel` raised " + REAL in own, own
    assert module.startswith("error: MODEL 'my_pkg_model:build': cannot import my_pkg_model: " + REAL), module
    assert rank.startswith("rank error: transformers cannot import GPT2LMHeadModel: " + REAL), rank
    assert not (tmp_path / "out").exists()


def test_the_real_error_is_the_bottom_of_the_chain_with_its_module_and_importer(tmp_path, monkeypatch):
    from runtime.errors import import_failure

    (tmp_path / "zoo_outer.py").write_text("import zoo_inner\n")
    (tmp_path / "zoo_inner.py").write_text("x = 1\nimport zoo_missing_package.sub\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        try:
            import zoo_outer  # noqa: F401
        except ImportError as exc:
            raise ModuleNotFoundError("Could not import module 'Model'. Are this object's requirements defined "
                                      "correctly?") from exc
    except ImportError as wrapped:
        assert import_failure(wrapped) == (
            f"ModuleNotFoundError: No module named 'zoo_missing_package', at {tmp_path / 'zoo_inner.py'}:2 (importing "
            "zoo_inner, which zoo_outer imports): install the package that provides zoo_missing_package")
    finally:
        for name in ("zoo_outer", "zoo_inner"):
            sys.modules.pop(name, None)
    assert import_failure(ValueError("two\nlines")) == "ValueError: two"
