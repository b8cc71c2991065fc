"""Where `partitioner generate` finds its tokenizer (Note [where the tokenizer comes from] in
partitioner/models/text_codec.py), which programs it samples from, and the sampling loop, on
objects built here: no compile, no checkpoint."""

from __future__ import annotations

import pytest
import torch

from partitioner.models.generate import SamplingSettings, refuse_unless_causal, sample
from partitioner.models.text_codec import codec_for, corpus_source
from runtime.data.corpus.prepare import prepare
from runtime.program.parts import DataSpec

CORPUS_BATCH = "runtime.data.corpus.batches:make_batch"
SYNTHETIC = ["runtime.data.synthetic:token_batch", {"vocab": 257, "seq": 32, "seed": 0}]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("codec")
    (root / "a.txt").write_text("héllo wörld\n")
    prepare([str(root / "a.txt")], str(root / "data"), tokenizer="bytes", append_eod=True)
    return root / "data"


def test_a_prepared_corpus_in_make_batch_gives_its_tokenizer(corpus):
    """What compile's --data tokens:DIR writes, in plan.json and as the Program's frozen DataSpec."""
    spec = [CORPUS_BATCH, {"source": f"tokens:{corpus}", "seq": 32, "seed": 0}]
    data = DataSpec(make_batch=spec, loss_fn="runtime.data.synthetic:causal_lm_loss")
    assert isinstance(data.make_batch, tuple) and corpus_source(data.make_batch) == f"tokens:{corpus}"
    for make_batch in (spec, data.make_batch):
        codec, notes = codec_for(make_batch, None, 257)
        assert notes == () and codec.meta_dir == str(corpus) and codec.kind == "bytes"
        assert codec.vocab_size == 257 and codec.eod_id == 256  # --append-eod: bytes and one EOD id
    ids = codec.encode("hé")
    assert ids == list("hé".encode()) and codec.decode(ids) == "hé"
    assert codec.continuation(codec.encode("h"), codec.encode("é!")) == "é!"


def test_tokenizer_from_names_it_outright(corpus):
    codec, notes = codec_for(SYNTHETIC, str(corpus), 257)
    assert codec.meta_dir == str(corpus) and notes == ()
    with pytest.raises(ValueError, match=r"--tokenizer-from .*nowhere: no meta.json in .*partitioner data prepare"):
        codec_for(SYNTHETIC, "/nowhere", 257)


def test_synthetic_tokens_are_bytes_with_a_note_or_refused():
    codec, notes = codec_for(SYNTHETIC, None, 257)
    assert codec.kind == "bytes" and codec.meta_dir is None and codec.vocab_size == 256
    assert len(notes) == 1 and "synthetic tokens (runtime.data.synthetic:token_batch)" in notes[0] and "noise" in notes[0]
    with pytest.raises(ValueError, match=r"vocabulary of 100 is under the 256 byte ids: pass --tokenizer-from"):
        codec_for(SYNTHETIC, None, 100)
    assert codec.decode([0xc3]) == "\ufffd"  # half a character: replaced, never an exception


@pytest.mark.parametrize("source", ["megatron:/data/corpus_text_document", "tokens:/data/train.bin,dtype=uint16"])
def test_a_source_without_a_tokenizer_is_refused(source):
    with pytest.raises(ValueError, match="records no tokenizer: pass --tokenizer-from DATA_DIR"):
        codec_for([CORPUS_BATCH, {"source": source, "seq": 32}], None, 50304)


def test_a_prompt_past_the_models_vocabulary_names_both(corpus):
    codec, _ = codec_for(SYNTHETIC, str(corpus), 257)
    codec.check_fits(codec.encode("az"), "az", 123)
    with pytest.raises(ValueError, match=r"token id 122 \('z'\), outside the model's vocabulary of 100 "
                                         r"\(the tokenizer has 257\)"):
        codec.check_fits(codec.encode("az"), "az", 100)


def _plan(loss="runtime.data.synthetic:causal_lm_loss", weights=None, spec="gpt"):
    program = {"data": {"make_batch": SYNTHETIC, "loss_fn": [loss, {}]}}
    if weights:
        program["init"] = {"weights": weights}
    return {"program": program, "training": {"model_spec": spec}}


def test_only_causal_language_models_are_sampled():
    refuse_unless_causal(_plan(), "out")
    refuse_unless_causal(_plan(loss="x:y", weights=["runtime.execute.pretrained:hf_weights",
                                                    {"architecture": "GPT2LMHeadModel"}]), "out")
    with pytest.raises(ValueError, match=r"generate out: mlp trains with runtime.data.synthetic:mse_loss, not "
                                         r"runtime.data.synthetic:causal_lm_loss: it is no causal language model"):
        refuse_unless_causal(_plan(loss="runtime.data.synthetic:mse_loss", spec="mlp"), "out")
    with pytest.raises(ValueError, match="its model is a BertForMaskedLM, not a causal language model"):
        refuse_unless_causal(_plan(weights=["runtime.execute.pretrained:hf_weights",
                                            {"architecture": "BertForMaskedLM"}]), "out")


class _Counting(torch.nn.Module):
    """Logits that favour (last token + 1) mod 8, and token 9 most of all (past the tokenizer's 8)."""

    def forward(self, tokens):
        logits = torch.nn.functional.one_hot((tokens + 1) % 8, 10).float() * 5.0
        logits[..., 9] = 100.0
        return logits


def test_sample_greedy_top_k_crop_and_end_of_document():
    model = _Counting()
    greedy = SamplingSettings(max_new_tokens=6, temperature=0)
    assert sample(model, [3], greedy, seq_len_tokens=2, vocab_size=8) == [4, 5, 6, 7, 0, 1]
    assert sample(model, [3], greedy, seq_len_tokens=2, vocab_size=8, eod_id=6) == [4, 5]  # stops at EOD
    top1 = SamplingSettings(max_new_tokens=6, temperature=1.5, top_k=1, seed=7)
    assert sample(model, [3], top1, seq_len_tokens=2, vocab_size=8) == [4, 5, 6, 7, 0, 1]
    drawn = SamplingSettings(max_new_tokens=20, temperature=50.0, seed=3)
    ids = sample(model, [3], drawn, seq_len_tokens=4, vocab_size=8)
    assert ids == sample(model, [3], drawn, seq_len_tokens=4, vocab_size=8) and max(ids) < 8


@pytest.mark.parametrize("kwargs, flag", [({"max_new_tokens": -1}, "--max-new-tokens -1"),
                                          ({"temperature": -0.5}, "--temperature -0.5"),
                                          ({"top_k": -2}, "--top-k -2")])
def test_sampling_settings_refuse_negatives(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SamplingSettings(**kwargs)


def test_a_transformers_causal_lm_samples_through_its_logits():
    """A transformers model answers an output object: its .logits are what is sampled."""
    # lazy: loads transformers (the [hf] extra)
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=8)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = [1, 2, 3]
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids[-8:]])).logits[0, -1].argmax()))
    got = sample(model, [1, 2, 3], SamplingSettings(max_new_tokens=10, temperature=0), seq_len_tokens=8, vocab_size=40)
    assert got == ids[3:]
