"""Hand-made program folders (the codegen contract of runtime/__init__.py) for runtime tests.

Two models: a 4-layer MLP (regression) and a tiny GPT-like model whose output head reuses the
token embedding (a tie across the first and last stage). Stage files are written here as text,
in the FX-codegen style codegen emits: parameters read by their original dotted names.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from runtime.launch.entry_files import write_entry_files
from runtime.program.spec import seal_folder
from runtime.program.spec import Program
from tests.drivers import RUN_MANY
from runtime.launch.torchrun import run_env, torchrun_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OPTIMIZER = {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
             "warmup_steps": 2, "lr_schedule": "cosine", "total_steps": 6}


# --------------------------------------------------------------------------------------------
# Models


class MLP(torch.nn.Module):
    def __init__(self, sizes=(8, 32, 32, 32, 4)):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class Block(torch.nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.d, self.heads, self.p = d, heads, dropout
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.Module()
        self.attn.qkv = torch.nn.Linear(d, 3 * d, bias=False)  # a key bias has zero gradient: Adam would amplify noise
        self.attn.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d, h = x.shape[0], x.shape[1], self.d, self.heads
        y = F.layer_norm(x, (d,), self.ln1.weight, self.ln1.bias, 1e-5)
        q, k, v = F.linear(y, self.attn.qkv.weight).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + F.dropout(F.linear(a, self.attn.proj.weight, self.attn.proj.bias), self.p, self.training)
        y = F.layer_norm(x, (d,), self.ln2.weight, self.ln2.bias, 1e-5)
        y = F.linear(F.gelu(F.linear(y, self.fc1.weight, self.fc1.bias)), self.fc2.weight, self.fc2.bias)
        return x + F.dropout(y, self.p, self.training)


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=64, seq=8, d=16, heads=2, layers=2, dropout=0.0):
        super().__init__()
        self.d = d
        self.tok_emb = torch.nn.Embedding(vocab, d)
        self.pos_emb = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)

    def forward(self, tokens):
        x = F.embedding(tokens, self.tok_emb.weight) + self.pos_emb
        for blk in self.blocks:
            x = blk(x)
        x = F.layer_norm(x, (self.d,), self.ln_f.weight, self.ln_f.bias, 1e-5)
        return F.linear(x, self.tok_emb.weight)  # tied output head


class Skip(torch.nn.Module):
    """Stage 1 needs the model input again (a float that needs no gradient) and an int64 mask:
    stage 0 forwards both, so the stage boundary carries three tensors."""

    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(8, 4)

    def forward(self, x):
        mask = (x > 0).long()
        return self.l1(torch.tanh(self.l0(x))) + self.l2(x) + mask[:, :4].float()


# --------------------------------------------------------------------------------------------
# Stage sources (what FX codegen would emit, written by hand)


def _stage_file(k: int, params: list[str], inputs: list[str], outputs: list[str], body: list[str]) -> str:
    lines = ["import torch", "",
             f"PARAMETERS = {params!r}", f"INPUTS = {inputs!r}", f"OUTPUTS = {outputs!r}", "", "",
             f"class Stage{k}(torch.nn.Module):",
             f"    def forward(self, {', '.join(inputs)}):"]
    lines += ["        " + b for b in body]
    lines.append(f"        return {outputs[0] if len(outputs) == 1 else '(' + ', '.join(outputs) + ')'}")
    return "\n".join(lines) + "\n"


def mlp_stage_sources(model: MLP, splits: list[list[int]]):
    """One stage per list of layer indices; returns [(source, params, in_name, out_name)]."""
    last = len(model.layers) - 1
    out = []
    for k, layers in enumerate(splits):
        body, params = [], []
        src = "x" if k == 0 else f"h{k}"
        cur = src
        for i in layers:
            params += [f"layers.{i}.weight", f"layers.{i}.bias"]
            body.append(f'layer_{i} = getattr(self.layers, "{i}")')
            body.append(f"linear_{i} = torch.nn.functional.linear({cur}, layer_{i}.weight, layer_{i}.bias)")
            cur = f"linear_{i}"
            if i < last:
                body.append(f"tanh_{i} = torch.tanh({cur})")
                cur = f"tanh_{i}"
        out.append((_stage_file(k, params, [src], [cur], body), params, src, cur))
    return out


def gpt_stage_sources(model: TinyGPT, splits: list[list[int]]):
    """Stage 0 starts with the embeddings, the last stage ends with ln_f and the tied head."""
    d, h, p = model.d, model.blocks[0].heads, model.blocks[0].p
    out = []
    for k, blocks in enumerate(splits):
        body, params = [], []
        src = "tokens" if k == 0 else f"x{k}"
        if k == 0:
            params += ["tok_emb.weight", "pos_emb"]
            body += ["embedding = torch.nn.functional.embedding(tokens, self.tok_emb.weight)",
                     "x = embedding + self.pos_emb"]
        else:
            body.append(f"x = {src}")
        for i in blocks:
            params += [f"blocks.{i}.{n}" for n in ("ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.proj.weight", "attn.proj.bias",
                                                    "ln2.weight", "ln2.bias", "fc1.weight", "fc1.bias",
                                                    "fc2.weight", "fc2.bias")]
            body += [
                f'blk = getattr(self.blocks, "{i}")',
                "b, t = x.shape[0], x.shape[1]",
                f"y = torch.nn.functional.layer_norm(x, ({d},), blk.ln1.weight, blk.ln1.bias, 1e-05)",
                f"q, k, v = torch.nn.functional.linear(y, blk.attn.qkv.weight).split({d}, dim=-1)",
                f"q, k, v = (z.view(b, t, {h}, {d // h}).transpose(1, 2) for z in (q, k, v))",
                f"a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, {d})",
                f"x = x + torch.nn.functional.dropout(torch.nn.functional.linear(a, blk.attn.proj.weight, blk.attn.proj.bias), {p}, self.training)",
                f"y = torch.nn.functional.layer_norm(x, ({d},), blk.ln2.weight, blk.ln2.bias, 1e-05)",
                "y = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(y, blk.fc1.weight, blk.fc1.bias)), blk.fc2.weight, blk.fc2.bias)",
                f"x = x + torch.nn.functional.dropout(y, {p}, self.training)",
            ]
        if k == len(splits) - 1:
            params += ["ln_f.weight", "ln_f.bias", "tok_emb.weight"]
            body += [f"x = torch.nn.functional.layer_norm(x, ({d},), self.ln_f.weight, self.ln_f.bias, 1e-05)",
                     "logits = torch.nn.functional.linear(x, self.tok_emb.weight)"]
            res = "logits"
        else:
            res = f"add_{k}"
            body.append(f"{res} = x")
        # tok_emb.weight listed once per stage
        params = list(dict.fromkeys(params))
        out.append((_stage_file(k, params, [src], [res], body), params, src, res))
    return out


# --------------------------------------------------------------------------------------------
# Folder


def write_folder(folder, model, sources, *, in_spec, out_spec, ranks, dp, num_microbatches,
                 global_batch, schedule, data, steps=3, ties=(), seed=0, timeout_s=30, extra=None,
                 plan_hash=None):
    """Write plan.json, stage_<k>.py, weights/, train.py. ``in_spec(k)`` and
    ``out_spec(k)`` give (shape, dtype) of stage k's input/output for one microbatch, or a list of
    them when the stage has several (then the source entry names a list too). ``extra``: more keys
    of the program object (precision, clip_grad_norm, shard_optimizer, optimizer overrides)."""
    os.makedirs(os.path.join(folder, "weights"), exist_ok=True)
    state = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    stages = []
    for k, (src, params, in_name, out_name) in enumerate(sources):
        with open(os.path.join(folder, f"stage_{k}.py"), "w") as f:
            f.write(src)
        save_file({n: state[n] for n in params}, os.path.join(folder, "weights", f"stage_{k}.safetensors"))
        def specs(names, shapes):
            names = [names] if isinstance(names, str) else names
            shapes = [shapes] if isinstance(shapes, tuple) else shapes
            return [{"name": n, "shape": sh, "dtype": dt, "batch_dim": 0} for n, (sh, dt) in zip(names, shapes)]

        stages.append({"index": k, "module": f"stage_{k}", "class": f"Stage{k}", "params": params,
                       "inputs": specs(in_name, in_spec(k)), "outputs": specs(out_name, out_spec(k))})
    program = Program.from_dict({"world_size": len(ranks), "num_stages": len(sources), "dp": dp,
               "num_microbatches": num_microbatches, "global_batch": global_batch,
               "schedule": schedule, "device": "cpu", "backend": "gloo",
               "ranks": [{"rank": r, "stages": s, "replica": rep} for r, (s, rep) in enumerate(ranks)],
               "stages": stages, "ties": [dict(t) for t in ties], "data": data,
               "optimizer": OPTIMIZER, "seed": seed, "collective_timeout_s": timeout_s,
               "steps": steps, **(extra or {})})
    plan_hash = plan_hash or "test-" + schedule
    with open(os.path.join(folder, "plan.json"), "w") as f:
        json.dump({"plan_hash": plan_hash, "program": program.to_dict()}, f, indent=1)
    write_entry_files(folder, program)
    seal_folder(folder)  # the file map and program_hash, as the compiler writes them
    return program


def mlp_folder(folder, *, splits, ranks, dp=1, num_microbatches=4, global_batch=16,
               schedule="1f1b", steps=3, seed=0, timeout_s=30, extra=None, plan_hash=None):
    torch.manual_seed(seed)
    model = MLP()
    sizes = [model.layers[0].in_features] + [l.out_features for l in model.layers]
    micro = global_batch // (dp * num_microbatches)
    srcs = mlp_stage_sources(model, splits)
    data = {"make_batch": ["runtime.data.synthetic:regression_batch", {"features": sizes[0], "outputs": sizes[-1],
                                                             "seed": seed}],
            "loss_fn": ["runtime.data.synthetic:mse_loss", {}]}
    program = write_folder(
        folder, model, srcs,
        in_spec=lambda k: ([micro, sizes[splits[k][0]]], "torch.float32"),
        out_spec=lambda k: ([micro, sizes[splits[k][-1] + 1]], "torch.float32"),
        ranks=ranks, dp=dp, num_microbatches=num_microbatches, global_batch=global_batch,
        schedule=schedule, data=data, steps=steps, seed=seed, timeout_s=timeout_s, extra=extra,
        plan_hash=plan_hash)
    return model, program


def skip_folder(folder, *, schedule="gpipe", num_microbatches=4, global_batch=8, steps=3):
    torch.manual_seed(0)
    model = Skip()
    lin = "torch.nn.functional.linear"
    p0, p1 = ["l0.weight", "l0.bias"], ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    s0 = _stage_file(0, p0, ["x"], ["tanh", "x", "mask"],
                     ["mask = (x > 0).long()", f"tanh = torch.tanh({lin}(x, self.l0.weight, self.l0.bias))"])
    s1 = _stage_file(1, p1, ["tanh", "x", "mask"], ["add_1"],
                     [f"add = {lin}(tanh, self.l1.weight, self.l1.bias) + {lin}(x, self.l2.weight, self.l2.bias)",
                      "add_1 = add + mask[:, :4].float()"])
    micro = global_batch // num_microbatches
    boundary = [([micro, 16], "torch.float32"), ([micro, 8], "torch.float32"), ([micro, 8], "torch.int64")]
    data = {"make_batch": ["runtime.data.synthetic:regression_batch", {"features": 8, "outputs": 4}],
            "loss_fn": ["runtime.data.synthetic:mse_loss", {}]}
    program = write_folder(
        folder, model, [(s0, p0, "x", ["tanh", "x", "mask"]), (s1, p1, ["tanh", "x", "mask"], "add_1")],
        in_spec=lambda k: ([micro, 8], "torch.float32") if k == 0 else boundary,
        out_spec=lambda k: boundary if k == 0 else ([micro, 4], "torch.float32"),
        ranks=[([0], 0), ([1], 0)], dp=1, num_microbatches=num_microbatches, global_batch=global_batch,
        schedule=schedule, data=data, steps=steps)
    return model, program


def gpt_folder(folder, *, splits, ranks, dp=1, num_microbatches=2, global_batch=4,
               schedule="1f1b", steps=3, seed=0, dropout=0.0, vocab=64, seq=8, d=16, extra=None):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=vocab, seq=seq, d=d, layers=sum(len(s) for s in splits), dropout=dropout)
    micro = global_batch // (dp * num_microbatches)
    last = len(splits) - 1
    data = {"make_batch": ["runtime.data.synthetic:token_batch", {"vocab": vocab, "seq": seq, "seed": seed}],
            "loss_fn": ["runtime.data.synthetic:causal_lm_loss", {}]}
    program = write_folder(
        folder, model, gpt_stage_sources(model, splits),
        in_spec=lambda k: ([micro, seq], "torch.int64") if k == 0 else ([micro, seq, d], "torch.float32"),
        out_spec=lambda k: ([micro, seq, vocab] if k == last else [micro, seq, d], "torch.float32"),
        ranks=ranks, dp=dp, num_microbatches=num_microbatches, global_batch=global_batch,
        schedule=schedule, data=data, steps=steps, seed=seed,
        ties=[{"param": "tok_emb.weight", "stages": [0, last]}], extra=extra)
    return model, program


# --------------------------------------------------------------------------------------------
# Running and reading back


def child_env() -> dict:
    """run_env with this checkout first on PYTHONPATH: workers import the code under test."""
    return run_env(pythonpath=REPO)


def torchrun(folder, nproc, *, timeout=120, also=()):
    """Run DIR/train.py under torchrun (how users run it). ``also``: more folders of the same world
    size, trained after ``folder`` in the same workers (tests/drivers/run_many.py)."""
    if also:
        cmd = torchrun_command(RUN_MANY, nproc, args=[folder] + [arg for more in also for arg in ("--", more)])
    else:
        cmd = torchrun_command(os.path.join(folder, "train.py"), nproc)
    return subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)


def read_metrics(folder):
    with open(os.path.join(folder, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_final(folder, rank):
    return load_file(os.path.join(folder, "run", "final", f"rank_{rank}.safetensors"))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Two cores shared with worker processes: torch's intra-op threads only oversubscribe them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
