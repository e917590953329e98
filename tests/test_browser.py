"""The notebooks as a learner uses them: JupyterLab in a real (headless) browser.

nbval runs every cell but never renders a widget or moves a slider. This test starts JupyterLab on a
temporary copy of `notebooks/`, opens each notebook in Chromium through Playwright, checks that its
knobs render, then runs notebook 03 in full, moves a knob, presses Run and checks that every cell below
ran again with the new value, down to the notebook's last section.
It also builds the lessons' site (`make site`: scripts/build_site.py) and opens it from disk, with every request
to anything but a file refused and recorded: the index links every lesson, and each lesson's page shows its plots,
its ✓ lines and where its GPU run is.
Screenshots land in `.screenshots/` (git-ignored).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / ".screenshots"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TRAINING_NOTEBOOK = "03_training_loop.ipynb"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
CELL_TIMEOUT_MS = 180_000


def _chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM_PATH"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_settings(folder: Path) -> None:
    settings = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false",
            "checkForUpdates": False,
        },
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    }
    for name, value in settings.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


@pytest.fixture(scope="module")
def browser():
    path = _chromium()
    if path is None:
        pytest.skip(
            "Chromium is not installed (Debian: apt-get install chromium; or set CHROMIUM_PATH); "
            "`make test` tries to install it"
        )
    playwright_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1 over a copy of notebooks/, no token, fresh settings; stopped whatever happens."""
    base = tmp_path_factory.mktemp("lab")
    served = base / "notebooks"
    shutil.copytree(ROOT / "notebooks", served)
    _write_settings(base / "settings")
    port = _free_port()
    # A learner's kernel draws inline; the Agg backend the unit tests set would turn plots into text.
    env = {key: value for key, value in os.environ.items() if key != "MPLBACKEND"}
    env = {
        **env,
        "JUPYTER_CONFIG_DIR": str(base / "config"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "JUPYTER_PLATFORM_DIRS": "1",
    }
    command = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        "--ServerApp.disable_check_xsrf=True",
        f"--ServerApp.root_dir={served}",
        f"--LabApp.user_settings_dir={base / 'settings'}",
        f"--LabApp.workspaces_dir={base / 'workspaces'}",
        "--LabApp.news_url=",
        "--ServerApp.open_browser=False",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")
    log = open(base / "jupyter.log", "w")  # noqa: SIM115 - the server writes to it until the fixture ends
    server = subprocess.Popen(
        command, cwd=served, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as response:
                    if response.status == 200:
                        break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not start: {(base / 'jupyter.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield {"url": url, "root": served}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def _shutdown_kernels(url: str) -> None:
    with urllib.request.urlopen(f"{url}/api/kernels", timeout=10) as response:
        kernels = json.load(response)
    for kernel in kernels:
        request = urllib.request.Request(f"{url}/api/kernels/{kernel['id']}", method="DELETE")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(request, timeout=10).close()


class Session:
    """One notebook open in one browser page; every step is named so a failure says where it happened."""

    def __init__(self, browser, lab: dict, notebook: str) -> None:
        self.notebook, self.lab = notebook, lab
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.set_default_timeout(60_000)
        self.shots = 0

    @contextlib.contextmanager
    def step(self, name: str):
        try:
            yield
        except Exception as error:
            self.screenshot(f"FAILED-{name}")
            raise AssertionError(f"{self.notebook}: step '{name}' failed: {error}") from error

    def screenshot(self, label: str) -> Path:
        SCREENSHOTS.mkdir(exist_ok=True)
        self.shots += 1
        path = SCREENSHOTS / f"{Path(self.notebook).stem}-{self.shots}-{re.sub(r'[^A-Za-z0-9_-]+', '-', label)}.png"
        with contextlib.suppress(Exception):
            self.page.screenshot(path=str(path), full_page=False)
        return path

    def open(self) -> None:
        with self.step("open notebook"):
            self.page.goto(f"{self.lab['url']}/lab/tree/{self.notebook}?reset")
            self.page.wait_for_selector(".jp-NotebookPanel .jp-Cell", state="attached")
            expected = len(nbformat.read(self.lab["root"] / self.notebook, as_version=4).cells)
            self.page.wait_for_function(
                f"document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell').length >= {expected}"
            )
            self.wait_kernel_ready()

    def wait_kernel_ready(self, timeout_s: float = 120) -> None:
        """Run the first code cell (the parameters) until the kernel answers: key presses made while the
        kernel is still connecting are dropped, and the status indicator alone does not tell."""
        cells = nbformat.read(self.lab["root"] / self.notebook, as_version=4).cells
        first = next(i for i, c in enumerate(cells) if c.cell_type == "code")
        deadline = time.monotonic() + timeout_s
        while True:
            self.select(first)
            self.page.keyboard.press("Control+Enter")
            with contextlib.suppress(TimeoutError):
                self.wait_executed(first, timeout_ms=5_000)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the kernel did not answer within {timeout_s:.0f} s")

    def cell(self, index: int):
        return self.page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").nth(index)

    def select(self, index: int) -> None:
        self.cell(index).locator(".jp-InputPrompt").click()
        self.page.keyboard.press("Escape")

    def run_through(self, index: int) -> None:
        """Run cells 0..index as a learner does: Shift+Enter from the top, Ctrl+Enter on the last one."""
        self.select(0)
        for _ in range(index):
            self.page.keyboard.press("Shift+Enter")
        self.page.keyboard.press("Control+Enter")

    def wait_executed(self, index: int, timeout_ms: int = CELL_TIMEOUT_MS) -> None:
        prompt = self.cell(index).locator(".jp-InputPrompt")
        deadline = time.monotonic() + timeout_ms / 1000
        while not re.fullmatch(r"\[\d+\]:", prompt.inner_text().strip()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell {index} did not finish within {timeout_ms / 1000:.0f} s")
            time.sleep(0.25)

    def execution_count(self, index: int) -> int:
        match = re.fullmatch(r"\[(\d+)\]:", self.cell(index).locator(".jp-InputPrompt").inner_text().strip())
        return int(match.group(1)) if match else -1

    def output_text(self, index: int) -> str:
        return "\n".join(self.cell(index).locator(".jp-OutputArea").all_inner_texts())

    def assert_no_errors(self) -> None:
        text = self.page.locator(".jp-NotebookPanel .jp-OutputArea").all_inner_texts()
        joined = "\n".join(text)
        assert "Error displaying widget" not in joined, "a widget failed to render"
        assert "Traceback (most recent call last)" not in joined, (
            f"a cell shows an error: {joined[joined.find('Traceback') - 300 :][:800]}"
        )

    def close(self) -> None:
        self.page.close()
        _shutdown_kernels(self.lab["url"])


def _knob_cell(path: Path) -> int:
    cells = nbformat.read(path, as_version=4).cells
    return next(
        i
        for i, c in enumerate(cells)
        if c.cell_type == "code" and "nbval-ignore-output" in c.metadata.get("tags", []) and "knob_panel" in c.source
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_knobs_render_in_jupyterlab(browser, lab, path):
    session = Session(browser, lab, path.name)
    try:
        session.open()
        knobs = _knob_cell(path)
        with session.step("run the cells up to the knobs"):
            session.run_through(knobs)
            session.wait_executed(knobs)
        with session.step("knobs render"):
            panel = session.cell(knobs).locator(".jp-OutputArea")
            panel.locator(".widget-vbox").first.wait_for(state="visible", timeout=30_000)
            assert panel.locator("button", has_text="Run").count() == 1, "no Run button under the knobs"
            controls = panel.locator(".widget-slider, .widget-dropdown, .widget-checkbox").count()
            assert controls >= 1, "no slider, dropdown or checkbox rendered"
            session.cell(knobs).scroll_into_view_if_needed()
            session.assert_no_errors()
        session.screenshot("knobs")
    finally:
        session.close()


def _slider(panel, pattern: str):
    sliders = panel.locator(".widget-slider")
    for index in range(sliders.count()):
        slider = sliders.nth(index)
        if re.search(pattern, slider.locator(".widget-label").inner_text(), re.IGNORECASE):
            return slider
    raise AssertionError(f"no slider whose label matches {pattern!r}")


def _cell_index(cells, text: str) -> int:
    return next(i for i, c in enumerate(cells) if c.cell_type == "code" and text in c.source)


@pytest.mark.skipif(not (ROOT / "notebooks" / TRAINING_NOTEBOOK).exists(), reason=f"{TRAINING_NOTEBOOK} not present")
def test_a_knob_change_reaches_every_section_below(browser, lab):
    """Run notebook 03, move the epochs knob, press Run: the whole notebook below re-runs with the new value,
    down to the TensorBoard check in its last section."""
    path = ROOT / "notebooks" / TRAINING_NOTEBOOK
    cells = nbformat.read(path, as_version=4).cells
    last = max(i for i, c in enumerate(cells) if c.cell_type == "code")
    knobs = _knob_cell(path)
    loop = _cell_index(cells, "plot = LivePlot(")  # section 2, the hand-written loop and its live plot
    tensorboard = _cell_index(cells, "the event file holds all")  # the TensorBoard check, far below the panel
    assert tensorboard - knobs > 20, "the TensorBoard check is no longer far below the knobs"
    session = Session(browser, lab, TRAINING_NOTEBOOK)
    try:
        session.open()
        with session.step("run all cells"):
            session.run_through(last)
            session.wait_executed(last, timeout_ms=240_000)
            session.page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")
        with session.step("no cell shows an error"):
            session.assert_no_errors()
        session.screenshot("ran-all")
        first_run = session.execution_count(last)
        panel = session.cell(knobs).locator(".jp-OutputArea")
        with session.step("move the epochs knob with the keyboard"):
            slider = _slider(panel, r"epoch")
            before = int(slider.locator(".widget-readout").inner_text())
            slider.locator(".noUi-handle").focus()
            session.page.keyboard.press("ArrowRight" if before == 1 else "ArrowLeft")
            after = int(slider.locator(".widget-readout").inner_text())
            assert after != before, f"the slider stayed at {before}"
        with session.step("press Run: every cell below runs again"):
            panel.locator("button", has_text="Run").click()
            deadline = time.monotonic() + 300
            while session.execution_count(last) <= first_run:
                if time.monotonic() > deadline:
                    raise TimeoutError("the last cell did not run again within 300 s")
                time.sleep(0.5)
            session.page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")
            session.assert_no_errors()
        with session.step("the last section shows the new value"):
            text = session.output_text(tensorboard)
            assert re.search(rf"holds all {after} epochs", text), (
                f"the TensorBoard section does not report {after} epochs: {text}"
            )
        with session.step("the hand-written loop used it and drew its live plot"):
            text = session.output_text(loop)
            assert re.search(rf"\b{after} epochs\b", session.output_text(loop + 1)), "section 2 missed the new value"
            picture = session.cell(loop).locator(".jp-OutputArea img").first
            picture.wait_for(state="visible", timeout=30_000)
            assert picture.evaluate("img => img.complete && img.naturalWidth > 100"), "the live plot is not an image"
            assert "Figure size" not in text, "the plot was printed as text instead of drawn"
            assert "Warning" not in text, f"a warning box under the plot: {text}"
            assert re.search(rf"^epoch {after}: train_loss", text, re.MULTILINE), f"no summary line: {text}"
            images = session.cell(loop).locator(".jp-OutputArea img").count()
            assert images == 1, f"{images} pictures: the live widget should give way to one static figure"
        with session.step("the notebook runs on the project's named kernel"):
            with urllib.request.urlopen(f"{lab['url']}/api/sessions", timeout=10) as response:
                kernels = {s["kernel"]["name"] for s in json.load(response) if s["path"].endswith(TRAINING_NOTEBOOK)}
            assert kernels == {"torch-course"}, f"the notebook ran on {kernels}, not 'torch-course (.venv)'"
        session.cell(tensorboard).scroll_into_view_if_needed()
        session.screenshot("knob-moved")
    finally:
        session.close()


# ----------------------------------------------------------------------------------------------------- the site

SITE = ROOT / "build" / "site"
EXECUTED = ROOT / "build" / "executed"
GPU_RUNS = ROOT / "site" / "gpu"
# `make test` runs the notebooks first and keeps their executed copies (conftest.py's --keep-executed), so the
# build renders the pages in seconds; without them it executes every notebook (5-8 minutes on 2 cores).
SITE_BUILD_TIMEOUT_S = 2400
# A lesson whose page shows no plot yet, and what one would show: an expected failure until its notebook draws one.
LESSONS_WITHOUT_A_PLOT: dict[str, str] = {}


@pytest.fixture(scope="module")
def site() -> Path:
    """The site as `make site` builds it: stale notebooks executed again, pages rendered again where they changed."""
    for module in ("sphinx", "myst_nb", "furo", "nbclient"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: `make site` (and `make test`) install pyproject's site extra")
    env = {key: value for key, value in os.environ.items() if key != "MPLBACKEND"}
    build = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_site.py"), "build"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SITE_BUILD_TIMEOUT_S,
    )
    assert build.returncode == 0, f"the site did not build:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
    return SITE


class OfflinePage:
    """One page of the site opened from disk in its own browser context: every request but a file's is refused
    and recorded, and so is every script error."""

    def __init__(self, browser, path: Path) -> None:
        self.path = path
        self.context = browser.new_context(viewport={"width": 1300, "height": 1000})
        self.context.set_default_timeout(30_000)
        self.refused: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.goto(path.as_uri())
        self.page.wait_for_load_state("load")

    def _route(self, route) -> None:
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            self.refused.append(route.request.url)
            route.abort()

    def article_text(self) -> str:
        return self.page.locator("article").inner_text()

    def check_offline(self) -> None:
        self.page.wait_for_timeout(300)  # requests a script starts after the load event
        assert not self.refused, f"{self.path.name} asked the network for {self.refused}"
        assert not self.errors, f"{self.path.name} raised script errors: {self.errors}"

    def screenshot(self, label: str) -> None:
        SCREENSHOTS.mkdir(exist_ok=True)
        with contextlib.suppress(Exception):
            self.page.screenshot(path=str(SCREENSHOTS / f"site-{self.path.stem}-{label}.png"))

    def close(self) -> None:
        self.context.close()


def _tick_lines(path: Path) -> list[str]:
    """The ✓ lines an executed notebook printed (streams, and plain-text results shown as text)."""
    nb = nbformat.read(path, as_version=4)
    lines = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                text = output.get("text", "")
            elif set(output.get("data", {})) == {"text/plain"}:
                text = output["data"]["text/plain"]
            else:
                continue
            lines += [line.strip() for line in text.splitlines() if line.strip().startswith("✓")]
    return lines


def _check_lesson_page(browser, page_path: Path, executed: Path) -> tuple[str, int]:
    """Opens one page of a lesson: every ✓ line of its run, plots that load, nothing from the network.
    Returns the page's text and how many plots it shows."""
    page = OfflinePage(browser, page_path)
    try:
        text = page.article_text()
        ticks = _tick_lines(executed)
        assert ticks, f"{executed.name} printed no ✓ line"
        missing = [line for line in ticks if line not in text]
        assert not missing, f"{page_path.name} lacks {len(missing)} of its {len(ticks)} ✓ lines, e.g. {missing[:3]}"
        plots = page.page.locator("article .cell_output img[src$='.png']")
        for index in range(plots.count()):
            plots.nth(index).scroll_into_view_if_needed()
            loaded = plots.nth(index).evaluate("img => img.complete && img.naturalWidth > 100")
            assert loaded, f"{page_path.name}: plot {index} did not load"
        page.check_offline()
        page.screenshot("top")
        return text, plots.count()
    finally:
        page.close()


def _check_plots(lesson: str, plots: dict[str, int]) -> None:
    """At least one plot on each page of the lesson (the CPU run's, and the GPU run's where there is one)."""
    if lesson in LESSONS_WITHOUT_A_PLOT:
        assert not any(plots.values()), f"{lesson} draws a plot now: take it out of LESSONS_WITHOUT_A_PLOT"
        pytest.xfail(LESSONS_WITHOUT_A_PLOT[lesson])
    bare = [name for name, count in plots.items() if count == 0]
    assert not bare, f"{bare} show no plot (an <img> of a PNG among the outputs)"


def _lessons() -> list[str]:
    return [path.stem for path in NOTEBOOKS]


@pytest.mark.timeout(SITE_BUILD_TIMEOUT_S + 300)
def test_site_index_links_every_lesson_with_its_study_time(browser, site):
    page = OfflinePage(browser, site / "index.html")
    try:
        links = page.page.locator("article table a")
        hrefs = {links.nth(i).get_attribute("href") for i in range(links.count())}
        missing = {f"lessons/{stem}.html" for stem in _lessons()} - hrefs
        assert not missing, f"the index does not link {sorted(missing)}"
        rows = page.page.locator("article table tbody tr")
        assert rows.count() == len(NOTEBOOKS), f"{rows.count()} rows for {len(NOTEBOOKS)} lessons"
        for index in range(rows.count()):
            cells = rows.nth(index).locator("td").all_inner_texts()
            assert len(cells) == 4 and all(cell.strip() for cell in cells), f"an empty cell in row {index}: {cells}"
        for stem in _lessons():
            on_gpu = (GPU_RUNS / f"{stem}.ipynb").exists()
            assert (f"gpu/{stem}.html" in hrefs) == on_gpu, f"the index's GPU column is wrong for {stem}"
        page.check_offline()
        page.screenshot("index")
    finally:
        page.close()


@pytest.mark.timeout(SITE_BUILD_TIMEOUT_S + 300)
@pytest.mark.parametrize("lesson", _lessons())
def test_site_lesson_page_shows_its_plots_checks_and_gpu_run(browser, site, lesson):
    page = site / "lessons" / f"{lesson}.html"
    text, plots = _check_lesson_page(browser, page, EXECUTED / f"{lesson}.ipynb")
    assert "A run on a CPU:" in text, "the page does not say which run its outputs come from"
    gpu_run = GPU_RUNS / f"{lesson}.ipynb"
    if not gpu_run.exists():
        assert "no GPU run of this lesson is committed yet" in text
        _check_plots(lesson, {page.name: plots})
        return
    stamp = nbformat.read(gpu_run, as_version=4).metadata["course_site"]
    assert f"the same lesson run on {stamp['machine']}" in text, "the lesson page does not name its GPU run"
    gpu_page = site / "gpu" / f"{lesson}.html"
    gpu_text, gpu_plots = _check_lesson_page(browser, gpu_page, gpu_run)
    assert f"A run on a GPU: {stamp['machine']}" in gpu_text and stamp["date"] in gpu_text
    if stamp.get("plots_missing"):  # a run whose kernel drew with MPLBACKEND=Agg: its page says so instead
        assert stamp["plots_missing"] in gpu_text
        _check_plots(lesson, {page.name: plots})
        return
    _check_plots(lesson, {page.name: plots, f"gpu/{gpu_page.name}": gpu_plots})


@pytest.mark.timeout(SITE_BUILD_TIMEOUT_S + 300)
def test_site_search_page_works_offline(browser, site):
    """Sphinx's search reads its index from a script file, so it works from disk too."""
    page = OfflinePage(browser, site / "search.html")
    try:
        page.page.goto((site / "search.html").as_uri() + "?q=DataLoader")
        page.page.wait_for_selector("#search-results li", timeout=30_000)
        assert page.page.locator("#search-results li").count() >= 1, "searching DataLoader found no page"
        page.check_offline()
    finally:
        page.close()
