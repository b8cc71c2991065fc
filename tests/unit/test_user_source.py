"""Where generated programs find make_batch and loss_fn (Note [user code travels] in
partitioner/frontend/user_source.py): derived from the functions, and refused before tracing, with the fix,
for what no rank can import. Plus keyword-input batches (Note [keyword inputs] in runtime/data/synthetic.py)."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import time

import pytest
import torch

from partitioner.config.cluster import ClusterSpec
from partitioner.frontend.user_source import derive_one, derive_sources
from partitioner.frontend.workload import Workload
from runtime.data import synthetic as data
from runtime.data.synthetic import batch_inputs


def module_level(step, batch_size):
    return (torch.zeros(batch_size, 4),), torch.zeros(batch_size, 2)


def _workload(**overrides) -> Workload:
    fields = dict(model=torch.nn.Linear(4, 2), example_args=(torch.zeros(2, 4),), loss_fn=data.mse_loss,
                  make_batch=module_level, name="w")
    fields.update(overrides)
    return Workload(**fields)


def test_an_importable_module_is_named_by_module():
    spec, files = derive_one(functools.partial(data.token_batch, vocab=8, seq=4), "make_batch")
    assert spec == ("runtime.data.synthetic:token_batch", {"vocab": 8, "seq": 4}) and files == {}


def test_a_file_loaded_by_path_travels_into_the_folder(tmp_path):
    path = tmp_path / "my_data.py"
    path.write_text("def batches(step, batch_size, scale=1.0):\n    return (), None\n")
    spec = importlib.util.spec_from_file_location("my_data", path)  # as `compile my_data.py:build` loads it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    got, files = derive_one(functools.partial(module.batches, scale=2.0), "make_batch")
    assert got == ("user/my_data.py:batches", {"scale": 2.0})
    assert files == {"user/my_data.py": str(path)}


@pytest.mark.parametrize("make, words", [
    (lambda: (lambda step, b: None), "is a lambda"),
    (lambda: _closure(), "defined inside another function"),
    (lambda: _Batches().method, "is a bound method"),
    (lambda: _Batches(), "_Batches object"),
    (lambda: functools.partial(module_level, 3), "positional arguments"),
    (lambda: functools.partial(module_level, table=torch.zeros(2)), "not all JSON values"),
])
def test_what_no_rank_can_import_is_refused_with_the_fix(make, words):
    with pytest.raises(ValueError, match=words) as info:
        derive_one(make(), "make_batch", "w")
    assert "make_batch" in str(info.value) and ("def" in str(info.value) or "keyword" in str(info.value)
                                                 or "plain values" in str(info.value))


def test_a_module_found_only_through_the_current_directory_is_refused(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "feed.py").write_text("def batches(step, batch_size):\n    return (), None\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("")  # `python -m partitioner` puts the current directory first
    monkeypatch.delenv("PYTHONPATH", raising=False)
    import mypkg.feed

    try:
        with pytest.raises(ValueError, match="pip install -e .*PYTHONPATH"):
            derive_one(mypkg.feed.batches, "make_batch")
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # ranks inherit PYTHONPATH: then it is importable
        assert derive_one(mypkg.feed.batches, "make_batch")[0] == ("mypkg.feed:batches", {})
    finally:
        for name in ("mypkg.feed", "mypkg"):
            sys.modules.pop(name, None)


def _write(root, files: dict):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_local_modules_a_file_imports_travel_with_it(tmp_path):
    """Note [local modules travel] holds: statements anywhere in the file (a function body too),
    transitively, packages with their __init__.py and relative imports; installed modules and an
    optional import that exists nowhere stay plain imports."""
    from partitioner.frontend.local_modules import local_modules

    _write(tmp_path, {
        "my_model.py": "import torch\nimport my_blocks\ntry:\n    import apex_not_here\nexcept ImportError:\n    pass\n"
                       "def make_batch(step, size):\n    from feeds.synthetic import batch\n    return batch(step, size)\n",
        "my_blocks.py": "from layers import mix\n",
        "layers/__init__.py": "from .mix import Mix\n",
        "layers/mix.py": "from . import util\nclass Mix: pass\n",
        "layers/util.py": "",
        "feeds/synthetic.py": "def batch(step, size):\n    return (), None\n",  # a folder without __init__.py
        "unused.py": "raise AssertionError('never imported')\n",
    })
    got = local_modules(str(tmp_path / "my_model.py"), str(tmp_path), "w")
    assert sorted(got) == ["user/feeds/synthetic.py", "user/layers/__init__.py", "user/layers/mix.py",
                           "user/layers/util.py", "user/my_blocks.py", "user/my_model.py"]
    assert got["user/layers/mix.py"] == str((tmp_path / "layers" / "mix.py").resolve())


def test_a_compiled_extension_of_the_folder_is_refused_with_the_fix(tmp_path):
    import importlib.machinery

    from partitioner.frontend.local_modules import local_modules

    _write(tmp_path, {"my_model.py": "import fastops\n",
                      "fastops" + importlib.machinery.EXTENSION_SUFFIXES[0]: "not really a binary"})
    with pytest.raises(ValueError, match=r"my_model\.py:1 imports fastops, a compiled extension .*pip install -e .*"
                                         rf"PYTHONPATH={tmp_path}"):
        local_modules(str(tmp_path / "my_model.py"), str(tmp_path), "w")


def test_a_loaded_file_named_like_an_installed_module_is_refused(tmp_path):
    """The ranks append DIR/user/ to sys.path (Note [one user root] in runtime/program/user_code.py): a
    colorsys.py of the user's that the model loaded would lose to Python's own colorsys there."""
    from partitioner.models.builtin import load_workload

    _write(tmp_path, {"colorsys.py": "SCALE = 2\n", "my_model.py": _model_file("import colorsys", "colorsys.SCALE")})
    assert "colorsys" not in sys.modules or sys.modules.pop("colorsys")
    try:
        with pytest.raises(ValueError, match=r"imports colorsys, and your .*colorsys\.py has the name of the installed "
                                             r".*rename your file"):
            derive_sources(load_workload(f"{tmp_path / 'my_model.py'}:build"))
    finally:
        sys.modules.pop("colorsys", None)


def _model_file(imports: str, scale: str) -> str:
    return (f"import torch\n{imports}\nfrom partitioner import Workload\n"
            "def make_batch(step, size):\n    return (torch.zeros(size, 4),), torch.zeros(size, 2)\n"
            "def loss(out, target):\n    return (out - target).pow(2).mean()\n"
            f"def build():\n    return Workload(model=torch.nn.Linear(4, 2), example_args=(torch.zeros(2, 4),), "
            f"loss_fn=loss, make_batch=make_batch, name=str({scale}))\n")


def test_two_model_files_each_import_their_own_sibling_of_one_name(tmp_path):
    """A model file runs as `python my_model.py` would: its folder first on sys.path, and its
    local modules imported afresh, so a second model's my_blocks is never the first one's."""
    from partitioner.models.builtin import load_workload

    for name, scale in (("a", 1), ("b", 2)):
        _write(tmp_path / name, {"my_blocks.py": f"SCALE = {scale}\n",
                                 "my_model.py": _model_file("from my_blocks import SCALE", "SCALE")})
    try:
        assert [load_workload(f"{tmp_path / n / 'my_model.py'}:build").name for n in "aba"] == ["1", "2", "1"]
        assert derive_sources(load_workload(f"{tmp_path / 'b' / 'my_model.py'}:build")).files == {
            "user/my_blocks.py": str((tmp_path / "b" / "my_blocks.py").resolve()),
            "user/my_model.py": str((tmp_path / "b" / "my_model.py").resolve())}
    finally:
        sys.modules.pop("my_blocks", None)


def test_a_model_file_that_fails_to_run_is_one_line_naming_its_line(tmp_path):
    from partitioner.models.builtin import load_workload

    _write(tmp_path, {"my_model.py": "import torch\nfrom my_missing_blocks import Block\n"})
    with pytest.raises(ValueError) as info:
        load_workload(f"{tmp_path / 'my_model.py'}:build")
    message = str(info.value)
    assert "ModuleNotFoundError" in message and "my_model.py:2 `from my_missing_blocks import Block`" in message
    assert "put my_missing_blocks.py next to my_model.py" in message and "\n" not in message


def test_given_source_wins_and_a_missing_loss_says_what_to_write():
    w = _workload(source={"make_batch": ("runtime.data.synthetic:regression_batch", {"features": 4})})
    sources = derive_sources(w)
    assert sources.specs["make_batch"] == ("runtime.data.synthetic:regression_batch", {"features": 4})
    assert sources.specs["loss_fn"] == ("runtime.data.synthetic:mse_loss", {})
    with pytest.raises(ValueError, match="no loss_fn.*return output"):
        derive_sources(_workload(loss_fn=None))


def test_compile_refuses_a_lambda_before_tracing():
    import partitioner

    class Untraceable(torch.nn.Module):  # a trace would fail on it: the source check comes first
        def forward(self, x):
            raise AssertionError("traced")

    started = time.perf_counter()
    with pytest.raises(ValueError, match="loss_fn is a lambda"):
        partitioner.compile(_workload(model=Untraceable(), loss_fn=lambda out, target: out.sum()),
                            cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=4)
    assert time.perf_counter() - started < 60  # (no trace, no solve: nothing slow ran)


def test_batch_inputs_orders_keyword_inputs_and_names_mismatches():
    ids, mask = torch.zeros(2, 3), torch.ones(2, 3)
    assert batch_inputs({"attention_mask": mask, "input_ids": ids}, ("input_ids", "attention_mask"))[0] is ids
    assert batch_inputs(ids) == (ids,)
    with pytest.raises(ValueError, match=r"missing \['attention_mask'\]"):
        batch_inputs({"input_ids": ids}, ("input_ids", "attention_mask"))
    with pytest.raises(ValueError, match="return a dict with those keys"):
        batch_inputs((ids, mask), ("input_ids", "attention_mask"))
    with pytest.raises(ValueError, match="compiled for positional inputs"):
        batch_inputs({"input_ids": ids})


def _closure():
    seed = 3

    def batches(step, batch_size):
        return (torch.full((batch_size, 4), seed),), None

    return batches


class _Batches:
    def method(self, step, batch_size):
        return (), None

    def __call__(self, step, batch_size):
        return (), None


class _KeywordModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask):
        return self.out(self.emb(input_ids) * attention_mask.unsqueeze(-1))


class _Positional(torch.nn.Module):  # the same model, taking the inputs in the program's order
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, attention_mask, input_ids):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


def _keyword_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 8, (batch_size, 3), generator=g)
    return {"input_ids": ids, "attention_mask": (ids % 2).float()}, torch.randn(batch_size, 3, 2, generator=g)


def test_the_oracle_calls_the_users_module_by_keyword():
    from runtime.execute.reference import train_reference

    torch.manual_seed(0)
    model = _KeywordModel()
    keywords = ("attention_mask", "input_ids")  # the order the program records (Note [keyword inputs])
    opt = {"lr": 1e-2, "total_steps": 3}
    by_name = train_reference(model, _keyword_batch, data.mse_loss, opt, 4, 2, 3, keywords=keywords,
                              call_with_keywords=True)
    by_position = train_reference(_Positional(model), _keyword_batch, data.mse_loss, opt, 4, 2, 3,
                                  keywords=keywords)
    assert by_name[0] == by_position[0]
    with pytest.raises(RuntimeError, match="indices"):  # fed by position in that order, the user's module would get them swapped
        train_reference(model, _keyword_batch, data.mse_loss, opt, 4, 2, 1, keywords=keywords)


# Note [constant inputs] in runtime/data/synthetic.py: inputs that hold no tensor are baked in by the trace.

def test_batch_inputs_checks_and_drops_constant_inputs():
    from runtime.errors import InputMismatchError

    x = torch.zeros(2, 3)
    assert batch_inputs({"x": x, "pool": "first"}, ("x",), [["pool", "first"]]) == (x,)
    assert batch_inputs((x, (1, 2), None), (), [[1, [1, 2]], [2, None]]) == (x,)  # a tuple is its list
    with pytest.raises(InputMismatchError, match=r"returned pool='mean' at step 3, but the program was specialised "
                                                 r"to pool='first'.*recompile"):
        batch_inputs({"x": x, "pool": "mean"}, ("x",), [["pool", "first"]], step=3)
    with pytest.raises(InputMismatchError, match=r"input 1=1 at step 0.*input 1=True"):
        batch_inputs((x, 1), (), [[1, True]], step=0)  # True is no 1: the graph may differ
    with pytest.raises(InputMismatchError, match=r"missing \['pool'\]"):
        batch_inputs({"x": x}, ("x",), [["pool", "first"]])


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x, scale, act="tanh"):
        h = self.fc(x) * scale
        return torch.tanh(h) if act == "tanh" else torch.relu(h)


def _scaled_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(batch_size, 4, generator=g), 0.5), torch.randn(batch_size, 2, generator=g)


def test_a_positional_constant_input_is_baked_in_and_the_program_trains_as_the_users_module(tmp_path):
    """forward(x, 0.5): the stage takes x alone; the stage chain (the program's own files) trains
    exactly as the user's module called with 0.5 in place."""
    import partitioner
    from runtime.execute.reference import train_reference, train_reference_from_folder

    torch.manual_seed(0)
    workload = _workload(model=_Scaled(), example_args=_scaled_batch(0, 2)[0], make_batch=_scaled_batch)
    assert workload.constants == [[1, 0.5]] and workload.keywords == ()
    compiled = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(1, "cpu"), global_batch=4)
    compiled.save(tmp_path / "prog")
    program = json.loads((tmp_path / "prog" / "plan.json").read_text())["program"]
    assert program["data"]["constants"] == [[1, 0.5]] and len(program["stages"][0]["inputs"]) == 1
    chain, _, _ = train_reference_from_folder(str(tmp_path / "prog"), 2)
    opt = program["optimizer"]
    users, _, _ = train_reference(workload.model, _scaled_batch, data.mse_loss, opt, 4, 1, 2,
                                  call_with_keywords=True, constants=[[1, 0.5]])
    assert chain == users


def test_a_constant_input_that_is_no_plain_value_is_refused_before_the_trace():
    with pytest.raises(ValueError, match=r"the keyword input 'act' is Linear .*not a tensor.*attribute of the model"
                                         r".*functools.partial"):
        _workload(model=_Scaled(), example_args=(), example_kwargs={"x": torch.zeros(2, 4), "scale": 1.0,
                                                                    "act": torch.nn.Linear(1, 1)})


def test_make_batch_and_the_example_must_agree_on_a_constant_input():
    def other(step, batch_size):
        return (torch.zeros(batch_size, 4), 0.25), torch.zeros(batch_size, 2)

    workload = _workload(model=_Scaled(), example_args=(torch.zeros(2, 4), 0.5), make_batch=other)
    with pytest.raises(ValueError, match=r"make_batch\(0, 4\) returns input 1=0.25 but the example inputs have "
                                         r"input 1=0.5"):
        workload.example_args_at(4)


def test_a_model_file_runs_once_in_the_process_that_loaded_it(tmp_path):
    """Verify's oracle (see Note [a model file runs once]) loads the model file and then resolves the
    program's make_batch ("user/my_model.py", the folder's identical copy) by its name: the module
    that built the model, not a second run of the file (which would re-register a custom op it
    defines and leave the model calling a dropped one)."""
    import shutil

    from partitioner.models.builtin import load_workload
    from runtime.program.user_code import leave_user_root, resolve_callable

    runs = "import builtins\nbuiltins.__dict__.setdefault('_partitioner_model_runs', []).append(__file__)\n"
    home, program = tmp_path / "home", tmp_path / "program"
    _write(home, {"my_model.py": runs + _model_file("", "1")})
    (program / "user").mkdir(parents=True)
    shutil.copy(home / "my_model.py", program / "user" / "my_model.py")
    import builtins

    builtins.__dict__["_partitioner_model_runs"] = []
    try:
        workload = load_workload(f"{home / 'my_model.py'}:build")
        make_batch = resolve_callable("user/my_model.py:make_batch", str(program))
        assert builtins._partitioner_model_runs == [str(home / "my_model.py")]
        assert make_batch.__globals__ is workload.make_batch.__globals__  # one module
    finally:
        leave_user_root()
        sys.modules.pop("my_model", None)
        del builtins.__dict__["_partitioner_model_runs"]
