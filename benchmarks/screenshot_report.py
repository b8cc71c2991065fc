"""Render `partitioner inspect --html` for the demo model and screenshot it with headless Chromium.

    .venv/bin/python benchmarks/screenshot_report.py            # writes docs/report.html, docs/report.png

Compiles gpt:layers=4,width=128,heads=4,vocab=512,seq=64 on 4 CPU devices (global batch 16),
pinned to 4 pipeline stages (left alone, the solver picks plain data parallelism for a model
this small, and the page would show a one-stage pipeline), writes the self-contained page, and asks Chromium (Debian: `apt-get install chromium`) for a
1400x1000 screenshot. The page makes no network request, so the screenshot works offline.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "gpt:layers=4,width=128,heads=4,vocab=512,seq=64"
MAX_PNG_BYTES = 300 * 1024


def main() -> int:
    import partitioner
    from partitioner import inspect
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import load_workload

    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    started = time.perf_counter()
    # compile() returns Compiled, whose .workload is the Workload object: the page wants the Plan.
    plan = partitioner.compile(load_workload(MODEL), cluster=ClusterSpec.homogeneous(4, "cpu"), global_batch=16,
                               num_stages=4).plan
    page = inspect.write_html(plan, docs / "report.html")
    print(f"compiled {MODEL} in {time.perf_counter() - started:.1f} s: {plan.num_stages} stages x dp {plan.dp}, "
          f"{plan.num_microbatches} microbatches; wrote {page} ({page.stat().st_size / 1024:.0f} KiB)")
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        print("no chromium on PATH: apt-get install -y chromium, then rerun", file=sys.stderr)
        return 1
    png = docs / "report.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={png}", "--window-size=1400,1000", page.resolve().as_uri()],
                   check=True, timeout=120, capture_output=True)
    size = png.stat().st_size
    print(f"wrote {png} ({size / 1024:.0f} KiB)")
    if size > MAX_PNG_BYTES:
        print(f"{png} is {size / 1024:.0f} KiB, over {MAX_PNG_BYTES // 1024} KiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
