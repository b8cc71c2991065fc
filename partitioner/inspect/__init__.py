"""Plans and checkpoints for people: what `partitioner inspect` prints, one module per view.

Everything here reads plan.json or a checkpoint folder only (plain data, no model, nothing
executed): a plan copied off a cluster can be inspected anywhere.

    units.py        SI counts, byte units, milliseconds, padded columns, stage colours
    table.py        the terminal table (`inspect DIR`, ``compile(...).summary()``)
    json_view.py    `inspect --json` (docs/design.md §11 fields and more)
    layout.py       which ranks form each tensor group, stage and replica (table and --json)
    graph.py        the region graph coloured by stage: Graphviz (`--dot`) and the page's SVG
    mfu.py          the predicted MFU beside the best published one for the device kind (its source)
    timeline.py     the predicted pipeline timeline (runtime/execute/schedule.py's simulation, timed)
    page.py         `inspect --html`: one self-contained page
    explain.py      `inspect --node`: where a node sits and what moving it costs, priced by the
                    solver on the problem plan.json stores
    checkpoints.py  `inspect CKPT_DIR` / `--checkpoints`: valid or why not, and what a resume picks
"""

from partitioner.inspect import checkpoints
from partitioner.inspect.explain import explain_node, explain_text, find_region, load_priced
from partitioner.inspect.graph import dot, region_graph_edges
from partitioner.inspect.json_view import inspect_json, to_json_text
from partitioner.inspect.page import html_page, write_html
from partitioner.inspect.table import balance, memory_tier_line, samples_per_s, table
from partitioner.inspect.timeline import timeline
from partitioner.inspect.units import human_bytes

__all__ = [
    "balance", "checkpoints", "dot", "explain_node", "explain_text", "find_region", "html_page", "human_bytes",
    "inspect_json", "load_priced", "memory_tier_line", "region_graph_edges", "samples_per_s", "table",
    "timeline", "to_json_text", "write_html",
]
