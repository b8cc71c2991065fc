"""The program object and its folder: what plan.json says, which rank holds what, the user code a
program names, the schedules it may name.

spec.py             plan.json's "program" object as the frozen dataclass ``Program`` (every field
                    documented there), ``load_program``, ``seal_plan``
parts.py            its parts: stages and the tensors crossing them, ranks, ties, data, optimizer,
                    memory tier, randomness and init recipes; ``Precision``
layout.py           which rank holds what; the process groups every rank creates (``Layout``)
user_code.py        the callables and files a program names, made objects (Note [one user root])
schedules.py        each schedule torch runs, one class: its refusal, in-flight microbatches, action
                    order (Note [one class per schedule])
"""
