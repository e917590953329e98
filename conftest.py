"""Shared by the unit tests and the notebook run: plots draw off-screen, executed notebooks count as slow, each
notebook's exercise check runs on the reference solution while the learner's stub is in place, no notebook cell
prints a wall of text, and every ✓ line is short."""

import importlib.util
import os
import time
from pathlib import Path

import matplotlib
import pytest

# Plots draw off-screen in the tests' own process. The notebooks' kernels keep Jupyter's inline plots, so a
# notebook run kept with --keep-executed shows its figures on the site as a learner sees them.
matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parent
# The notebooks are stored with the learner's stubs; their kernels inherit this, so each exercise's check cell
# runs the reference solution through the same check (helpers/exercises/__init__.py).
os.environ.setdefault("COURSE_EXERCISES", "reference")

# A cell's text output (printed text and the text of displayed results) stays readable at a glance: a short
# table, a summary line, a plot. Beyond this it is a wall a learner scrolls past, or a saved notebook bloats.
MAX_CELL_TEXT = 3000
# A check cell ends with one line saying what it showed, read at a glance: "✓ ..." of at most this many characters.
MAX_TICK_LINE = 120


def pytest_addoption(parser):
    parser.addoption(
        "--keep-executed",
        metavar="DIR",
        default=None,
        help="write each notebook whose every cell passed, with its outputs, to DIR as the site's build reads it "
        "(`make test` passes build/executed, so the site renders this run instead of executing every lesson again)",
    )


def pytest_configure(config):
    """Under pytest-xdist (`-n N`), each of the N worker processes gets its share of the cores: torch's default, a
    thread per core in every worker, oversubscribes a many-core machine N times over, and so would torch.compile's
    pool of a compiling process per core in every worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def _fsdp2_here() -> tuple[bool, str]:
    from helpers.compat import fsdp2_runs_on
    from helpers.distributed import default_backend, rank_device

    return fsdp2_runs_on(rank_device(default_backend(2), 0).type)


# What a notebook may declare in its metadata ("course": {"needs": [...]}) that this torch or machine may lack:
# each name maps to a check giving (available, why). The notebook itself stops with the same reason.
NOTEBOOK_NEEDS = {"fsdp2": _fsdp2_here}


def notebook_skip_reason(path) -> str | None:
    """Why the notebook at `path` cannot run with this torch on this machine (its declared needs), or None."""
    import nbformat

    needs = nbformat.read(path, as_version=4).metadata.get("course", {}).get("needs", [])
    for need in needs:
        available, why = NOTEBOOK_NEEDS[need]()
        if not available:
            return why
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be on the item by then
def pytest_collection_modifyitems(items):
    """Every executed notebook cell (nbval items from .ipynb files) is a slow test; a notebook whose declared needs
    this torch or machine lacks is skipped, with the reason in the report; browser tests come last."""
    reasons: dict = {}
    # The browser test renders the site from the notebooks' executed copies: it runs after the notebooks.
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
            if item.path not in reasons:
                reasons[item.path] = notebook_skip_reason(item.path)
            if reasons[item.path]:
                item.add_marker(pytest.mark.skip(reason=reasons[item.path]))


def cell_texts(outputs) -> list[str]:
    """The text a cell showed: streams, and the text/plain of results and displays (not images)."""

    def text(value) -> str:  # a string from a kernel message, a list of lines in a stored .ipynb
        return "".join(value) if isinstance(value, list) else str(value)

    texts = []
    for output in outputs or []:
        if output.get("output_type") == "stream":
            texts.append(text(output.get("text", "")))
        elif "data" in output:
            texts.append(text(output["data"].get("text/plain", "")))
    return texts


def cell_text_length(outputs) -> int:
    """Characters of text a cell showed."""
    return sum(len(text) for text in cell_texts(outputs))


def long_tick_lines(outputs) -> list[str]:
    """The "✓ ..." lines a cell printed that are longer than MAX_TICK_LINE."""
    lines = [line.strip() for text in cell_texts(outputs) for line in text.splitlines()]
    return [line for line in lines if line.startswith("✓") and len(line) > MAX_TICK_LINE]


def load_site_builder():
    """scripts/build_site.py as a module (the site's build is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("build_site", ROOT / "scripts" / "build_site.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NotebookRun:
    """The outputs of one notebook's cells as nbval runs them, kept as an executed copy once every cell passed."""

    def __init__(self, path: Path, code_cells: int) -> None:
        self.path, self.code_cells = path, code_cells
        self.outputs: dict[int, list] = {}
        self.started, self.failed = time.perf_counter(), False

    def passed(self, cell_num: int, outputs: list) -> bool:
        """Records a cell that passed; whether the notebook is now complete, every cell passed."""
        self.outputs[cell_num] = outputs
        return not self.failed and len(self.outputs) == self.code_cells

    def keep(self, folder: Path) -> None:
        import nbformat

        nb = nbformat.read(self.path, as_version=4)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        for number, cell in enumerate(code):
            cell.outputs, cell.execution_count = self.outputs[number], number + 1
            for output in cell.outputs:
                if output.get("output_type") == "execute_result":
                    output["execution_count"] = number + 1
        builder = load_site_builder()
        builder.store_executed(self.path, nb, time.perf_counter() - self.started, folder / self.path.name)


def _notebook_run(item) -> NotebookRun:
    runs = item.config.stash.setdefault(NOTEBOOK_RUNS, {})
    if item.path not in runs:
        code_cells = sum(cell.cell_type == "code" for cell in item.parent.nb.cells)
        runs[item.path] = NotebookRun(item.path, code_cells)
    return runs[item.path]


NOTEBOOK_RUNS = pytest.StashKey[dict]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After an nbval cell has run, fail it when its text output is a wall of text; with --keep-executed, a
    notebook whose every cell passed is written out with its outputs."""
    if item.path.suffix != ".ipynb":
        return (yield)
    run = _notebook_run(item)
    try:
        result = yield
        _check_cell_text(item)
    except BaseException:
        run.failed = True
        raise
    folder = item.config.getoption("--keep-executed")
    if run.passed(item.cell_num, item.test_outputs or []) and folder:
        run.keep(Path(folder) if Path(folder).is_absolute() else ROOT / folder)
    return result


def _check_cell_text(item) -> None:
    outputs = getattr(item, "test_outputs", None)
    if outputs is not None:
        length = cell_text_length(outputs)
        if length > MAX_CELL_TEXT:
            raise AssertionError(
                f"{item.name} printed {length} characters of text (limit {MAX_CELL_TEXT}): show a table, a "
                f"summary line or a plot instead. It began: {str(outputs)[:300]}"
            )
        too_long = long_tick_lines(outputs)
        if too_long:
            raise AssertionError(
                f"{item.name} printed a ✓ line of {len(too_long[0])} characters (limit {MAX_TICK_LINE}): say what was "
                f"shown in one short line, and print the evidence above it: {too_long[0]}"
            )


@pytest.fixture()
def one_thread():
    """Bit-identical runs need the same CPU thread count in every run (the command-line runs use --threads 1)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """A small corpus of made-up Python for the GPT's runs, about 60 KB, so every split holds enough windows."""
    lines = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(1500)]
    path = tmp_path_factory.mktemp("corpus") / "code.py"
    path.write_text("".join(lines))
    return path


# The command-line run of helpers.cli.resume that the checkpoint tests resume, kill and damage: 36 steps per epoch
# (1145 training samples after the validation split, batch 32), a checkpoint every 10 steps.
REFERENCE_RUN = {"steps": 120, "save_every": 10, "seed": 3}


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory):
    """REFERENCE_RUN trained once without a stop, on one thread: what every resumed run must end at, bit for bit."""
    import torch

    from helpers.cli.resume import train

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(tmp_path_factory.mktemp("straight"), **REFERENCE_RUN)
    finally:
        torch.set_num_threads(previous)
