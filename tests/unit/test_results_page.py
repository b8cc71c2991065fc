"""`make bench` writes its results to docs/results.md (issue 43: the README keeps a link, not the
tables), and the committed page is what it writes from the committed benchmarks/results/results.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import run_all  # noqa: E402


def test_the_page_keeps_what_the_tests_assert_and_takes_the_new_summary(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# Results\n\nCorrectness is what the tests assert: every plan.\nSecond line.\n\nold table\n")
    run_all.update_results_page("new summary\n", page)
    assert page.read_text() == ("# Results\n\nCorrectness is what the tests assert: every plan.\nSecond line.\n\n"
                                "new summary\n")
    fresh = tmp_path / "fresh.md"  # no page yet: the title and the summary
    run_all.update_results_page("only this\n", fresh)
    assert fresh.read_text() == "# Results\n\nonly this\n"


def test_make_bench_writes_docs_results_md_and_not_the_readme():
    assert run_all.RESULTS_PAGE == REPO / "docs" / "results.md"
    assert "## Results" not in (REPO / "README.md").read_text()


def test_the_committed_page_is_the_render_of_the_committed_results():
    results = json.loads((REPO / "benchmarks/results/results.json").read_text())
    images = [name for name in ("solver_time.png", "plan_quality.png", "cost_model.png")
              if (run_all.RESULTS / name).is_file()]
    page = (REPO / "docs/results.md").read_text()
    kept = page[page.index(run_all.KEPT):].split("\n\n", 1)[0]
    want = "# Results\n\n" + kept + "\n\n" + run_all.summary_markdown(results, images, "../benchmarks/results/")
    assert page == want, "docs/results.md is not what `benchmarks/run_all.py --render` writes: rerun it"
