"""`dvc plots show` end to end: the HTML report of the declared training curves and confusion
matrix, opened in Debian's headless Chromium, must draw every chart without a script error.

dvc-render's page loads vega, vega-lite and vega-embed from a CDN, and tests have no network,
so the page is rendered with DVC's own `--html-template` option and a template that inlines the
same three libraries from vl-convert-python's bundle (PyPI). A screenshot is kept in
test-artifacts/ for a human to look at."""
import re
import shutil
from pathlib import Path

import pytest

from tests.servers import require_module
from tests.test_experiments import declared_plots
from tests.test_pipeline import REPO, dvc, settle

ARTIFACTS = REPO / "test-artifacts"
VEGA_LITE = "5.21"  # DVC's templates are Vega-Lite v5 specs; the newest v5 vl-convert ships
CDN_LIBRARIES = {"vega", "vega-lite", "vega-embed"}  # what dvc-render's default page loads
CHROMIUM = ("/usr/lib/chromium/chromium", "/usr/bin/chromium")  # the binary, then Debian's wrapper
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
RENDER_TIMEOUT_MS = 60_000


def offline_template(bundle):
    """A page for `dvc plots show --html-template`: the libraries inline, and no {scripts}
    placeholder, which is where dvc-render would put its CDN <script> tags."""
    assert "</script" not in bundle.lower()  # it could not sit inside a <script> element
    return ("<!DOCTYPE html>\n<html>\n<head>\n<meta charset=\"utf-8\">\n<title>DVC Plot</title>\n"
            f"<script>\n{bundle}\n</script>\n</head>\n<body>\n{{plot_divs}}\n</body>\n</html>\n")


def script_sources(page):
    return re.findall(r'<script[^>]*\ssrc\s*=\s*"([^"]+)"', page)


def chromium_path(playwright):
    """Debian's Chromium, else the one Playwright installed itself (on Ubuntu, whose chromium
    package is a snap; scripts/test.sh sets up either)."""
    for candidate in (*CHROMIUM, shutil.which("chromium"), playwright.chromium.executable_path):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.fail("chromium not found: run the tests with `bash scripts/test.sh`, which installs it "
                "(Debian: apt-get install chromium)", pytrace=False)


@pytest.fixture(scope="module")
def plotted(tmp_path_factory, pipeline):
    """The session's pipeline repo (conftest.py) at its settings, after `dvc repro`: a run of its own
    would only repeat that one. Yields (repo, the offline template's path)."""
    vl_convert = require_module("vl_convert", "vl-convert-python")
    repo, _ = pipeline
    settle(repo)
    template = tmp_path_factory.mktemp("plots") / "offline.html"
    template.write_text(offline_template(vl_convert.javascript_bundle(vl_version=VEGA_LITE)))
    yield repo, template


def test_default_report_needs_only_the_libraries_the_template_inlines(plotted):
    # guards the substitution below: if dvc-render ever loads anything else, this says so
    repo, _ = plotted
    dvc("plots", "show", "-o", "default_plots", cwd=repo)
    sources = script_sources((repo / "default_plots/index.html").read_text())
    names = {re.sub(r"@.*", "", src.rsplit("/npm/", 1)[-1]) for src in sources}  # .../npm/vega-lite@5.2.0
    assert names == CDN_LIBRARIES, sources


def test_plots_report_renders_in_headless_chromium(plotted):
    sync_playwright = require_module("playwright.sync_api", "playwright").sync_playwright
    repo, template = plotted
    dvc("plots", "show", "--html-template", str(template), "-o", "offline_plots", cwd=repo)
    page_file = repo / "offline_plots/index.html"
    assert script_sources(page_file.read_text()) == [], "the offline page still loads scripts"
    expected = declared_plots(repo)

    ARTIFACTS.mkdir(exist_ok=True)
    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(p), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            page.on("console", lambda m: errors.append(f"console.error: {m.text}") if m.type == "error" else None)
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_file.as_uri())
            # vegaEmbed marks each target div .vega-embed and draws the chart in it as svg.marks (or canvas)
            page.wait_for_function(
                "n => document.querySelectorAll('.vega-embed svg.marks, .vega-embed canvas.marks').length >= n",
                arg=len(expected), timeout=RENDER_TIMEOUT_MS)
            charts = page.evaluate("""() => [...document.querySelectorAll('.vega-embed')].map(div => ({
                id: div.id,
                marks: div.querySelectorAll('.mark-line path, .mark-rect path, .mark-symbol path').length,
                drawn: [...div.querySelectorAll('.mark-line path, .mark-rect path')]
                       .filter(el => (el.getAttribute('d') || '').length > 0).length}))""")
            page.screenshot(path=str(ARTIFACTS / "plots-show.png"), full_page=True)
        finally:
            browser.close()
    shutil.copy(page_file, ARTIFACTS / "plots-show.html")

    assert not errors, errors
    assert all(url.startswith("file://") for url in requests), f"the page reached out: {requests}"
    ids = {chart["id"] for chart in charts}
    for plot in expected:
        # a declared folder (the train stage's eval curves) is one chart per file, each id starting with its path
        assert any(i.startswith(re.sub(r"[^A-Za-z0-9_-]", "_", plot)) for i in ids), f"{plot} not drawn; charts: {sorted(ids)}"
    for chart in charts:
        assert chart["drawn"] > 0, f"{chart['id']}: no line or cell drawn"
    assert (ARTIFACTS / "plots-show.png").stat().st_size > 10_000  # a real picture, not a blank page
