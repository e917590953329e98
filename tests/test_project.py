"""The project's own files: dependencies in step, notebooks stored clean and well formed."""

import re
import sys
from pathlib import Path

import nbformat
import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    conda_pins = {_name(r) for r in pip_section if not r.startswith("-e")}
    assert conda_pins == declared, (
        f"only in pyproject: {declared - conda_pins}; only in environment.yml: {conda_pins - declared}"
    )
    ranges = {_name(r): r.replace(" ", "") for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    assert all(ranges[_name(r)] == r.replace(" ", "") for r in pip_section if not r.startswith("-e"))
    assert any("python=3.11" in str(d) for d in env["dependencies"])


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs_or_widget_state(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; run nbstripout"
    assert "widgets" not in nb.metadata, f"{path.name}: widget state stored in metadata; run nbstripout"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_follows_the_house_layout(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    first = code[0]
    assert "parameters" in first.metadata.get("tags", []), f"{path.name}: first code cell must be tagged 'parameters'"
    assignments = [line for line in first.source.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert all(re.match(r"^[A-Z][A-Z0-9_]* = ", line) for line in assignments), (
        f"{path.name}: the parameters cell holds only CAPITALISED assignments"
    )
    assert any("nbval-ignore-output" in c.metadata.get("tags", []) and "knob_panel" in c.source for c in code), (
        f"{path.name}: needs a knobs cell (knob_panel) tagged nbval-ignore-output"
    )
    assert nb.metadata.get("kernelspec", {}).get("name") == "torch-course", (
        f"{path.name}: the notebooks ask for the project's named kernel, 'torch-course (.venv)'"
    )


def test_the_project_environment_is_registered_as_the_named_kernel():
    """`make lab` / `make test` register .venv as 'torch-course (.venv)'; it must run this very Python."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"not running in the project's .venv ({sys.prefix}): the Makefile registers the kernel there")
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("torch-course")
    assert spec.display_name == "torch-course (.venv)"
    assert Path(spec.argv[0]).resolve() == Path(sys.executable).resolve()


def test_data_folder_explains_itself_and_is_ignored_but_its_readme():
    readme = ROOT / "data" / "README.md"
    assert readme.is_file(), "data/README.md says what goes in data/"
    assert "COURSE_DATA_DIR" in readme.read_text()
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/data/*" in ignored and "!/data/README.md" in ignored


def test_every_marker_the_tests_use_is_declared():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    declared = {marker.split(":")[0].strip() for marker in options["markers"]}
    assert {"slow", "browser"} <= declared
    assert "--strict-markers" in options["addopts"].split(), "an undeclared (misspelt) marker must be an error"
    builtin = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings", "timeout"}
    used = {
        name
        for path in (ROOT / "tests").glob("*.py")
        for name in re.findall(r"pytest\.mark\.([A-Za-z_]\w*)", path.read_text())
    }
    assert used - builtin <= declared, f"undeclared markers: {sorted(used - builtin - declared)}"


def test_a_notebook_cell_that_prints_a_wall_of_text_or_a_long_tick_line_fails_the_notebook_run(tmp_path):
    """The root conftest fails an executed cell whose text output is longer than a screenful, or whose ✓ line
    is longer than 120 characters."""
    import shutil
    import subprocess

    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("print('x' * 5000)"),
        nbformat.v4.new_code_cell("print('short')"),
        nbformat.v4.new_code_cell("print('evidence ' * 20)\nprint('✓ ' + 'y' * 118)"),  # 120 characters: fine
        nbformat.v4.new_code_cell("print('✓ ' + 'z' * 119)"),
    ]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, tmp_path / "wall.ipynb")
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--nbval-lax",
            "--nbval-current-env",
            "wall.ipynb",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout[-2000:]
    assert "2 failed, 2 passed" in run.stdout and "printed 5001 characters of text" in run.stdout
    assert "printed a ✓ line of 121 characters (limit 120)" in run.stdout


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_sizes_chosen_by_device_are_stated_in_the_parameters_cell(path):
    """A notebook that fills sizes by device leaves them None in its parameters cell and says both sizes there."""
    from helpers.sizes import LESSON_SIZES

    code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    lessons = re.findall(r'fill_sizes\(globals\(\), "(\w+)"', code[1].source)
    expected = {
        "06_mixed_precision": ["mixed_precision"],
        "10_activation_checkpointing": ["checkpointing"],
        "15_serving": ["inference"],
        "13_faster_training": ["faster"],
        "14_gpu_memory": ["gpu_memory"],
        "16_capstone_gpt": ["capstone"],
    }.get(path.stem, [])
    assert lessons == expected, f"{path.name}: the knobs cell fills the sizes of {expected}, found {lessons}"
    parameters = {
        line.split("=")[0].strip(): line
        for line in code[0].source.splitlines()
        if re.match(r"^[A-Z][A-Z0-9_]* = ", line)
    }
    for lesson in lessons:
        for name, sizes in LESSON_SIZES[lesson].items():
            line = parameters.get(name, "")
            assert re.match(rf"^{name} = None\b", line), f"{path.name}: {name} must default to None (chosen by device)"
            assert f"{sizes['cpu']} on CPU" in line and f"{sizes['cuda']} on CUDA" in line, (
                f"{path.name}: the comment on {name} must state its sizes, {sizes['cpu']} on CPU and {sizes['cuda']} on CUDA"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_lesson_says_how_long_it_takes_in_its_first_cell(path):
    """The intro states the study time ('Study time: about an hour.'), which the site's index shows too."""
    first = nbformat.read(path, as_version=4).cells[0]
    assert re.search(r"^Study time: about [\w ]+\.$", first.source, re.M), f"{path.name}: no 'Study time: about ...'"


# A lesson is read in one sitting (STYLE.md): at most this much code and prose, in short cells.
BUDGET = {"code lines": 400, "markdown words": 2500, "median code cell": 12}


def reading_load(path: Path) -> dict[str, float]:
    """Non-blank code lines, markdown words and the median code cell's lines of one notebook."""
    import statistics

    cells = nbformat.read(path, as_version=4).cells
    sizes = [sum(1 for line in c.source.splitlines() if line.strip()) for c in cells if c.cell_type == "code"]
    words = sum(len(c.source.split()) for c in cells if c.cell_type == "markdown")
    return {"code lines": sum(sizes), "markdown words": words, "median code cell": statistics.median(sizes)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_fits_the_reading_budget(path):
    load = reading_load(path)
    over = {key: f"{load[key]:g} > {limit}" for key, limit in BUDGET.items() if load[key] > limit}
    assert not over, f"{path.name} is over the reading budget: {over}. Move plumbing into helpers, or split the lesson"


def test_a_notebook_whose_needs_this_torch_lacks_is_skipped_with_the_reason(monkeypatch):
    """09 declares it needs FSDP2 on its ranks: on torch 2.6 without a GPU per rank the run skips it, saying why."""
    import conftest

    sharded = ROOT / "notebooks" / "09_sharded_data_parallel.ipynb"
    assert "fsdp2" in nbformat.read(sharded, as_version=4).metadata["course"]["needs"]
    monkeypatch.setitem(conftest.NOTEBOOK_NEEDS, "fsdp2", lambda: (False, "FSDP2 on CPU ranks needs torch 2.7"))
    assert conftest.notebook_skip_reason(sharded) == "FSDP2 on CPU ranks needs torch 2.7"
    monkeypatch.setitem(conftest.NOTEBOOK_NEEDS, "fsdp2", lambda: (True, "shards here"))
    assert conftest.notebook_skip_reason(sharded) is None
    assert conftest.notebook_skip_reason(ROOT / "notebooks" / "00_setup_and_devices.ipynb") is None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_notebook_declares_only_needs_the_test_run_knows(path):
    import conftest

    needs = nbformat.read(path, as_version=4).metadata.get("course", {}).get("needs", [])
    assert set(needs) <= set(conftest.NOTEBOOK_NEEDS), (
        f"{path.name}: unknown needs {set(needs) - set(conftest.NOTEBOOK_NEEDS)}"
    )


def test_each_xdist_worker_gets_its_share_of_the_cores(monkeypatch):
    """`pytest -n 8` on a 16-core GPU machine: 2 torch threads per worker, not 16, and no compile pool per worker."""
    import torch

    import conftest

    before = torch.get_num_threads()
    monkeypatch.setattr(conftest.os, "cpu_count", lambda: 16)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "8")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    try:
        conftest.pytest_configure(None)
        assert torch.get_num_threads() == 2
        assert conftest.os.environ["OMP_NUM_THREADS"] == "2"
        assert conftest.os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


# Lessons whose device is chosen per rank by the process group's backend, not by the notebook.
DEVICE_BY_RANKS = {
    "07_processes_and_collectives.ipynb",
    "08_data_parallel.ipynb",
    "09_sharded_data_parallel.ipynb",
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_lesson_that_picks_a_device_has_a_device_knob_and_uses_it(path):
    """A learner on a GPU machine can rerun any lesson on the CPU to compare: DEVICE, its knob, pick_device(DEVICE)."""
    nb = nbformat.read(path, as_version=4)
    code = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    if path.name in DEVICE_BY_RANKS or not any("pick_device(" in source for source in code):
        return
    assert re.search(r'^DEVICE = "auto"', code[0], re.MULTILINE), f'{path.name}: DEVICE = "auto" in the parameters'
    assert any('"DEVICE": device_knob()' in source for source in code), f"{path.name}: a DEVICE knob"
    # the lesson's device, and the sizes chosen for it, follow DEVICE (00 also calls pick_device to show it)
    lines = [line for source in code for line in source.splitlines() if "pick_device(" in line]
    chosen = [line for line in lines if re.search(r"\bdevice = |sizes_for\(", line)]
    filled = [line for source in code for line in source.splitlines() if "fill_sizes(globals()" in line]
    assert chosen and all("pick_device(DEVICE)" in line for line in chosen), f"{path.name}: {chosen}"
    assert all(line.split("#")[0].rstrip().endswith(", DEVICE)") for line in filled), f"{path.name}: {filled}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_library_code_a_notebook_prints_is_a_whole_function_that_exists(path):
    """`print(inspect.getsource(x))` names a function the notebook's imports reach, printed whole: a cut at a
    literal line (`.split("    return {")`) breaks silently when the function changes."""
    import ast

    code = [cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
    calls = [call for source in code for call in re.findall(r"inspect\.getsource\(([^()]+)\)(\S*)", source)]
    if not calls:
        return
    assert all(not rest.startswith((".split", "[", ".index")) for _, rest in calls), f"{path.name}: cut at {calls}"
    imports = []
    for source in code:
        for node in ast.parse("\n".join(line for line in source.splitlines() if not line.startswith("%"))).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imports.append(ast.unparse(node))
    namespace: dict = {}
    exec("\n".join(imports), namespace)  # only the notebook's imports: modules, not its cells
    for name, _ in calls:
        assert callable(eval(name, namespace)), f"{path.name}: inspect.getsource({name}) names no function"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_notebook_code_line_is_longer_than_100_characters(path):
    """The formatter wraps code at 100 but leaves long strings, comments and docstrings as they are."""
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    long = [line for c in cells for line in c.source.splitlines() if len(line) > 100]
    assert not long, f"{path.name}: {len(long)} code line(s) over 100 characters, e.g. {long[0]!r}"


def _ruff(*arguments: str):
    """ruff from this environment (the dev extra), run on the given arguments; the test skips without it."""
    import shutil
    import subprocess

    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed here (the dev extra)")
    return subprocess.run([ruff, *arguments], capture_output=True, text=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_is_formatted_at_100_characters(path):
    done = _ruff("format", "--isolated", "--line-length", "100", "--check", str(path))
    assert done.returncode == 0, f"{path.name}: run `ruff format --isolated --line-length 100 {path}`\n{done.stdout}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_comment_trails_a_bracket_the_formatter_wrapped_a_statement_around(path):
    """`x = f(\n    a\n)  # why` is a one-line statement the formatter broke up to keep its comment on the line: the
    comment belongs on its own line above it, and the statement on one line."""
    wrapped = [
        f"cell {cell.get('id')}: {line.strip()}"
        for cell in nbformat.read(path, as_version=4).cells
        if cell.cell_type == "code"
        for line in cell.source.splitlines()
        if re.match(r"^\s*[)\]]\s+#", line)
    ]
    assert not wrapped, f"{path.name}: put the comment on its own line above the statement: {wrapped}"


# Pyflakes (unused imports, undefined names, f-strings without fields), bugbear (minus the closures over a loop
# variable that timing cells call at once, and zip() without strict= over equal-length sequences), and one claim per
# assert (PT018: `assert a and b` is two asserts, unless a noqa says why it is one fact).
NOTEBOOK_LINT = ["--select", "F,E9,B,PT018", "--ignore", "B023,B905"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_passes_pyflakes_bugbear_and_one_claim_per_assert(path):
    done = _ruff("check", "--isolated", "--output-format", "concise", *NOTEBOOK_LINT, str(path))
    assert done.returncode == 0, f"{path.name}: ruff check {' '.join(NOTEBOOK_LINT)}\n{done.stdout}"
