"""What a step trains on: make_batch's input contract and the built-in batches and losses.

synthetic.py        deterministic batches and losses of the built-in workloads; keyword and constant
                    inputs (Notes [data is a function of the step], [constant inputs])
hf_tasks.py         the same for the Hugging Face tasks other than causal LM
"""
