"""Start-up: the entry files' text, a rank's one call, the run flags, and every torchrun launch on this host.

entry_files.py      the text of train.py, the folder's one entry point (``entry_files``,
                    ``write_entry_files``: one emitter for codegen and hand-made test folders), and a
                    rank's role computed from plan.json (``rank_role``, ``role_text``; Note [roles from the plan])
rank.py             ``main(folder, rank=None, *, steps=None, run_dir=None, exit_on_error=True)``: the
                    one call of train.py (env, the rank's role, process groups, training, final save)
world.py            a rank's device (set before any group talks) and the default process group it
                    joins (Note [every rank on one GPU]: the one-GPU check's override)
run_options.py      the run flags as one table and one frozen ``RunOptions`` (`partitioner run` and
                    a program's entry file parse the same; Note [one flag table])
torchrun.py         ``torchrun_command``, ``run_env``, ``free_port``: every launch on this host
agent_output.py     torchrun's failure traceback and box said in one line (Note [torchrun's failure box])
elastic.py          `run --elastic`: one torchrun agent per host; a worker's move to the re-planned folder
signed_rendezvous.py  multi-host torchrun with the rendezvous state signed by a per-run key (Note
                    [signed rendezvous state])
"""
