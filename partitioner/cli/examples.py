"""The examples each of commands.py's subcommands shows under its --help (data.py and
generate.py keep their own beside their parsers)."""

EXAMPLES = {
    "compile": """examples:
  partitioner compile gpt -o out --devices 4
  partitioner compile gpt:layers=12,width=256 -o out --devices 8 --device h100 --global-batch 64
  partitioner compile mypkg.models:build -o out --cluster cluster.toml --stages 4 --dp 2
  partitioner compile my_model.py:build -o out --job job.toml --lr 3e-4
  partitioner compile gpt -o out --devices 4 --calibrate --profile-out cpu.profile.json
  partitioner compile gpt:layers=8 -o out8 --devices 4 --profile cpu.profile.json
  partitioner compile gpt -o out --devices 4 --no-calibrate               # the cpu preset's figures
  partitioner compile gpt:layers=96,width=4096,heads=32,vocab=50257,seq=2048 -o big --devices 64 --device h100""",
    "inspect": """examples:
  partitioner inspect out                     # per-stage table, cut edges, balance, baselines
  partitioner inspect out/plan.json --json    # docs/design.md §11 fields, for scripts
  partitioner inspect out --dot | dot -Tsvg > plan.svg
  partitioner inspect out --html report.html  # one self-contained page: stage graph, timeline, memory
  partitioner inspect out --node linear_3     # why a node sits on its stage, and what moving it costs
  partitioner inspect out --rank 5            # rank 5's stages, peers and one step's actions (from plan.json)
  partitioner inspect out --checkpoints       # out/checkpoints: valid or why not, and what a resume picks
  partitioner inspect /scratch/ckpt --json    # any checkpoint folder (or one step_N in it)""",
    "run": """examples:
  partitioner run out --steps 20
  partitioner run out --steps 50 --max-restarts 3 --checkpoint-every 10
  partitioner run out --steps 50 --mtbf 6h --checkpoint-dir /scratch/ckpt
  partitioner run out --steps 20 --max-restarts 1 --fail-at 1:7:kill   # recovery drill
  partitioner run out --steps 20 --memory-tier copy --hosts 0,0,1,1 --max-restarts 1 --fail-host 1:5
  partitioner run out --steps 1000 --quiet                             # every 100th step and a summary""",
    "calibrate": """examples:
  partitioner calibrate                          # this machine's cpu profile (measured once, then cached)
  partitioner calibrate --machine --refresh      # measure it again (after a hardware or load change)
  partitioner calibrate --from-run out/demo/run  # refit it to what a finished run measured""",
    "verify": """examples:
  partitioner verify out --steps 3""",
    "export": """examples:
  partitioner export out -o trained          # newest committed checkpoint of out/checkpoints
  partitioner export /scratch/ckpt/step_000000100 --program out -o trained-100""",
}
