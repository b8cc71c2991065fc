"""Models in and out: the built-in workloads and the command line's MODEL spec, Hugging Face configs
in, trained checkpoints out as from_pretrained-ready weights.

builtin.py          built-in workloads and the MODEL spec of the command line
hf.py               ``hf:CONFIG_DIR``: a Workload from a Hugging Face config, local files only
export.py           a verified checkpoint as from_pretrained-ready weights
"""
