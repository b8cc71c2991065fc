"""Every fix a refusal names can be typed: the flags a refusal's message suggests exist in the parser
of the command it names (`partitioner compile`: partitioner/cli/commands.py's build_parser; `partitioner
run`: runtime/launch/run_options.py's flag table), and a suggested value is one that parser takes.
The compute-canary and replica-check refusals are run for every reason they give; every other message is read from the
source: each string literal of partitioner/, runtime/ and passes/ that mentions a flag."""

from __future__ import annotations

import argparse
import ast
import difflib
import re
from pathlib import Path

import pytest

from partitioner.cli.commands import build_parser
from runtime.launch.run_options import flag_names
from runtime.program.schedules import schedule_named
from runtime.resilience.canary_rules import program_refusal, refusal

ROOT = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])(?:[ =]([a-z0-9][\w.]*))?")
# flags of other programs that messages tell the user to give them (each one's program named)
EXTERNAL = {
    "--nnodes": "torchrun", "--nproc-per-node": "torchrun", "--node-rank": "torchrun", "--standalone": "torchrun",
    "--rdzv-backend": "torchrun", "--rdzv-endpoint": "torchrun", "--rdzv-conf": "torchrun",
    "--monitor-interval": "torchrun", "--local-addr": "torchrun", "--shm-size": "docker run", "--local-dir": "huggingface-cli download",
    "--valid-data-path": "Megatron-LM's pretrain_gpt.py",
}
# ``--chekpoint-every``: run_options.py's docstring, the misspelling its unknown-flag refusal catches;
# ``--flag``: a placeholder in a docstring
NOT_FLAGS = {"--chekpoint-every", "--flag"}


def _subparsers(parser: argparse.ArgumentParser, path: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its words ("compile", "data prepare")."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                words = f"{path} {name}".strip()
                out[words] = sub
                out.update(_subparsers(sub, words))
    return out


SUB = _subparsers(build_parser())
COMPILE, RUN = SUB["compile"], SUB["run"]
EVERY_FLAG = ({o for p in SUB.values() for o in p._option_string_actions} | set(flag_names("run"))
              | set(flag_names("rank")))


def _takes(parser: argparse.ArgumentParser, flag: str, value: str | None) -> str | None:
    """Why ``parser`` refuses ``flag [value]``, or None. A value in capitals (a placeholder: ``--data
    tokens:DIR``) or the sentence's next word (``--dp 2 or more``: only "2" is read; ``another --schedule
    than``) is not checked, only the flag."""
    action = parser._option_string_actions.get(flag)
    if action is None:
        return f"{flag} is not a flag of `{parser.prog}`"
    if not value or action.nargs == 0:
        return None
    if action.choices is not None and value not in action.choices:
        # a value of the flag's kind ("1F1B", "zb-v") rather than the next word of the sentence ("than")
        if re.search(r"[\d-]", value) or difflib.get_close_matches(value, list(action.choices), n=1):
            return f"{flag} {value}: `{parser.prog}` takes one of {sorted(action.choices)}"
    if action.type in (int, float):
        try:
            action.type(value)
        except ValueError:
            return None  # a word after the flag, not its value
    return None


def _canary_refusals() -> list[str]:
    program = {"dp": 2, "num_stages": 2, "world_size": 4, "tensor_parallel": 1}
    messages = [refusal(3, dp=1), refusal(3, dp=2, tensor_parallel=2), refusal(3, dp=2, schedule=schedule_named("zb")),
                refusal(3, dp=2, schedule=schedule_named("zbv")), refusal(3, dp=2, local_stages=2), refusal(3, dp=2, sharded=True),
                refusal(-1, dp=2), program_refusal({**program, "dp": 1, "world_size": 2}, 2),
                program_refusal({**program, "num_stages": 4}, 2), program_refusal({**program, "tensor_parallel": 2}, 2)]
    from runtime.resilience.sdc import sharded_refusal  # loads torch: only this list needs it

    messages.append(sharded_refusal("--sdc-every 5"))  # the replica check's refusal, beside the canary's
    assert all(messages)
    return messages


@pytest.mark.parametrize("message", _canary_refusals())
def test_each_canary_refusal_names_compile_flags_that_exist(message):
    """"recompile with ..." names `partitioner compile` flags (the message's own --sdc-canary-every K is one
    of both commands)."""
    flags = FLAG.findall(message)
    assert flags, message
    assert [why for flag, value in flags if (why := _takes(COMPILE, flag, value))] == [], message
    if "recompile with" in message:  # the suggestion, typed: `partitioner compile gpt -o out <it>` parses
        suggested = message.split("recompile with", 1)[1].split(", or drop it")[0]
        argv = [word for flag, value in FLAG.findall(suggested) for word in _typed(COMPILE, flag, value)]
        assert argv, message
        COMPILE.parse_args(["gpt", "-o", "out", *argv])


def _typed(parser: argparse.ArgumentParser, flag: str, value: str) -> list[str]:
    """``flag value`` as typed: a word of the sentence after it (``--devices twice ...``) stands for
    a value of the flag's kind."""
    action = parser._option_string_actions[flag]
    if action.nargs == 0:
        return [flag]
    try:
        given = value and (value in action.choices if action.choices else (action.type or str)(value) is not None)
    except ValueError:
        given = False
    return [flag, value if given else (sorted(action.choices)[0] if action.choices else "4")]


def _literals(path: Path):
    """(line, text) of each string literal, an f-string's parts joined around ``{}``."""
    tree = ast.parse(path.read_text(), str(path))
    inside_fstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inside_fstrings.update(id(v) for v in node.values)
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside_fstrings:
            yield node.lineno, node.value


def _sources():
    for top in ("partitioner", "runtime", "passes"):
        yield from sorted((ROOT / top).rglob("*.py"))


# "compile with --x", "recompile with --x", "compile it again ... with --x", "partitioner compile M --x",
# "compile without --x": to the end of the clause, or to where a run's flags begin ("... to run it
# --elastic", "or rerun --hosts ..."); a run's likewise to where a compile's begin
CLAUSE_END = r"(?:(?!\b(?:re)?run\b)[^;.\n()`])*"
COMPILE_CLAUSE = re.compile(rf"\b(?:re)?compile(?:d)?\b(?! stages)({CLAUSE_END})")
RUN_CLAUSE = re.compile(r"\b(?:partitioner run|rerun|run it)\b((?:(?!\b(?:re)?compile)[^;.\n()`])*)")


def test_every_flag_a_message_names_exists():
    unknown = []
    for path in _sources():
        for line, text in _literals(path):
            for flag, _value in FLAG.findall(text):
                if flag not in EVERY_FLAG and flag not in EXTERNAL and flag not in NOT_FLAGS:
                    unknown.append(f"{path.relative_to(ROOT)}:{line}: {flag}")
    assert unknown == [], "flags no parser here takes (fix the message, or name the tool in EXTERNAL):\n" + \
        "\n".join(unknown)


def test_compile_and_run_fixes_name_flags_of_that_command():
    wrong = []
    for path in _sources():
        for line, text in _literals(path):
            for parser, clause in ((COMPILE, COMPILE_CLAUSE), (RUN, RUN_CLAUSE)):
                for match in clause.finditer(text):
                    for flag, value in FLAG.findall(match.group(1)):
                        if flag in EXTERNAL or flag in NOT_FLAGS:
                            continue
                        if why := _takes(parser, flag, value):
                            wrong.append(f"{path.relative_to(ROOT)}:{line}: {why} ({match.group(0).strip()!r})")
    assert wrong == [], "\n".join(wrong)
