"""What a step trains on: make_batch's input contract, the built-in batches and losses, and a real
corpus on disk.

synthetic.py        deterministic batches and losses of the built-in workloads; keyword and constant
                    inputs (Notes [data is a function of the step], [constant inputs])
hf_tasks.py         the same for the Hugging Face tasks other than causal LM
corpus/             the on-disk token corpus: prepare, read (prepared folder, flat .bin, Megatron
                    .bin/.idx, hf-disk), windows in a layout-independent order, one rank's rows
"""
