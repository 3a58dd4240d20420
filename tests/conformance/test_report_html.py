"""The HTML matrix page: self-contained (inline CSS, the chart a data URI), every cell marked in the
grid, the trend in time order, the margin strips; rendered in a real headless browser where
chromium is installed."""

import base64
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

import report_samples as samples
from shardcheck.conformance.cli import main as cli
from shardcheck.conformance.report import reading
from shardcheck.conformance.report.page import html_page


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.images = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.images.append(dict(attrs))


def test_the_grid_marks_every_cell_and_the_trend_follows_runs_in_time(tmp_path):
    old = samples.report([samples.cell("a", "test_c0", "failed", message="E   AssertionError: step 0 loss"),
                   samples.cell("a", "test_c1", "passed")], day=1)
    new = samples.report([samples.cell("a", "test_c0", "passed"), samples.cell("a", "test_c1", "unsupported",
                                                           message="a does not declare full_shard")], day=2)
    text = html_page([reading.upgrade(new), reading.upgrade(old)])
    grid = text[text.index('<table class="grid">'):]
    assert grid.count("<tr><th><code>") == 2
    # c0: the newer run's pass over the older failure; c1: the older pass over the newer unsupported
    assert grid.split("</table>")[0].count('title="a: passed">✓</td>') == 2
    trend = text[text.index('<table class="trend">'):].split("</table>")[0]
    assert trend.index("2026-01-01") < trend.index("2026-01-02")  # oldest first, whatever the order given
    assert "<b>50.0%</b> of 100.0% reached" in trend and "<b>100.0%</b> of 50.0% reached" in trend


def test_margin_strips_show_each_implementation_and_dtype_worst_first_in_red():
    cells = [samples.cell("a", f"test_c{i}", "passed") for i in range(3)] + [samples.cell("b", "test_c0", "failed")]
    for cell, margin, tolerance in zip(cells, (0.5, 2.0, None, 0.01), ([1.3e-06, 1e-05], [1e-3, 1e-5]) * 2):
        cell["max_margin"], cell["tolerances"] = margin, [tolerance]
    text = html_page([reading.upgrade(samples.report(cells))])
    strips = text[text.index('<table class="strips">'):].split("</table>")[0]
    rows = [row.split("</th>")[0].rsplit(">", 1)[-1] + " " + row.split("<td>")[1].split("<")[0]
            for row in strips.split("<tr>")[2:]]
    assert rows == ["a float16", "a float32", "b float16"]  # c2 compared nothing: no bar
    assert '<td class="low">2</td>' in strips and 'fill="#c33"><title>test_clip_grad.py::test_c1' in strips


def test_matrix_html_is_self_contained_with_table_and_chart(tmp_path):
    out = tmp_path / "m" / "matrix.html"
    assert cli.main(["matrix", *samples.two_runs(tmp_path), "--html", str(out)]) == 0
    page = _Page()
    page.feed(out.read_text())
    # impls, families, the cell grid of each family (clip_grad), the trend, failing; inline CSS
    assert page.tags.count("table") == 5 and "style" in page.tags
    assert "link" not in page.tags and "script" not in page.tags  # nothing fetched
    [img] = page.images
    assert img["src"].startswith("data:image/png;base64,")
    assert base64.b64decode(img["src"].split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")
    assert "AssertionError: grads: 2 mismatch(es)" in out.read_text()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_matrix_html_renders_in_a_headless_browser(tmp_path):
    page = tmp_path / "matrix.html"
    assert cli.main(["matrix", *samples.two_runs(tmp_path), "--html", str(page)]) == 0
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run",
               f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,900"]
    dom = subprocess.run(browser + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=60)
    assert "<table class=\"matrix\">" in dom.stdout and "data:image/png;base64," in dom.stdout, dom.stderr
    shot = tmp_path / "shot.png"
    subprocess.run(browser + [f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=60)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (900, 1200)
    assert len({tuple(p) for p in pixels[::7, ::7].reshape(-1, pixels.shape[2]).tolist()}) > 20  # not blank
