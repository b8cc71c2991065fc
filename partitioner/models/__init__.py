"""Models in and out: the built-in workloads and the command line's MODEL spec, Hugging Face configs
in, trained checkpoints out as from_pretrained-ready weights and as generated text.

builtin.py          built-in workloads and the MODEL spec of the command line
hf.py               ``hf:CONFIG_DIR``: a Workload from a Hugging Face config, local files only
export.py           a verified checkpoint as from_pretrained-ready weights
gpt_as_gpt2.py      the built-in gpt's weights as transformers' GPT2LMHeadModel (for export)
generate.py         `partitioner generate`: a causal LM's checkpoint rebuilt in one process, sampled
text_codec.py       the prompt's and the text's tokenizer: the program's corpus's, or bytes
"""
