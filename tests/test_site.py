"""The lessons' site (scripts/build_site.py): a GPU run imported from check.sh's executed.tgz, and the pages built.

The whole site, built from every notebook and opened in a browser, is tested in test_browser.py; here a fake GPU
run (one lesson's notebook with outputs as a CUDA machine prints them) goes through the import and the renderer.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import nbformat
import pytest

import conftest

ROOT = Path(__file__).resolve().parent.parent
LESSON = "00_setup_and_devices"
REMOTE = "/scratch/job-1234/checkout"  # where the fake GPU machine kept its checkout
FOOTER = "[NVIDIA H100 80GB HBM3, 16 cores, 16 torch threads, torch 2.11.0+cu130, device cuda, allocator]"


build_site = conftest.load_site_builder()


def _executed(stem: str = LESSON, *, stop_at: int | None = None, error_at: int | None = None):
    """The stored notebook with outputs as papermill leaves them on the GPU machine: every code cell run, a ✓ line,
    machine paths, a rig footer, a PNG, papermill's and the widgets' metadata."""
    nb = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    for count, cell in enumerate(code, start=1):
        if stop_at is not None and count > stop_at:
            break
        cell.execution_count = count
        cell.metadata["papermill"] = {"status": "completed", "duration": 0.5}
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"✓ cell {count} checked\n")]
    code[1].outputs.append(
        nbformat.v4.new_output(
            "stream",
            name="stdout",
            text=f"wrote {REMOTE}/runs/trace.json\nfrom /tmp/site/torch/nn/modules/module.py\n{FOOTER}\n",
        )
    )
    code[2].outputs.append(
        nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})
    )
    if error_at is not None:
        code[error_at].outputs.append(
            nbformat.v4.new_output(
                "error", ename="RuntimeError", evalue="CUDA out of memory", traceback=[f"{REMOTE}/helpers/x.py"]
            )
        )
    nb.metadata["papermill"] = {
        "input_path": "notebooks/00_setup_and_devices.ipynb",
        "output_path": f"/tmp/nb/{stem}.ipynb",
        "end_time": "2026-11-27T10:11:12.000000",
        "duration": 42.3,
    }
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _tgz(folder: Path, notebooks: dict, gpu_log: str | None = None) -> Path:
    """An executed.tgz as check.sh packs it (./NAME.ipynb), with its gpu.log beside it when given."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "executed.tgz"
    with tarfile.open(path, "w:gz") as archive:
        for stem, nb in notebooks.items():
            data = nbformat.writes(nb).encode()
            info = tarfile.TarInfo(f"./{stem}.ipynb")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    if gpu_log is not None:
        (folder / "gpu.log").write_text(gpu_log)
    return path


GPU_LOG = "NVIDIA H200, 143771 MiB, 570.124.06\ntorch 2.12.0+cu130 cuda 13.0 available True\n=== notebook 00 rc=0 20s\n"


def test_a_gpu_run_is_stored_with_its_gpu_torch_and_date_and_without_machine_paths(tmp_path):
    tgz = _tgz(tmp_path / "out", {LESSON: _executed()}, GPU_LOG)
    stored = build_site.import_gpu_run(tgz, tmp_path / "gpu")
    assert stored == [LESSON]
    nb = nbformat.read(tmp_path / "gpu" / f"{LESSON}.ipynb", as_version=4)
    stamp = nb.metadata["course_site"]
    assert stamp["machine"] == "NVIDIA H200" and stamp["torch"] == "2.12.0+cu130", "gpu.log names the GPU and torch"
    assert stamp["date"] == "2026-11-27" and stamp["run"] == "gpu"
    assert "papermill" not in nb.metadata and "widgets" not in nb.metadata
    text = json.dumps([cell.get("outputs", []) for cell in nb.cells], ensure_ascii=False)
    assert REMOTE not in text and "/tmp/site/" not in text, "machine-specific paths are removed"
    assert "wrote runs/trace.json" in text and "from site-packages/torch/nn/modules/module.py" in text
    assert "✓ cell 1 checked" in text and "iVBORw0KGgo=" in text, "outputs and plots are kept"
    assert all("papermill" not in cell.metadata for cell in nb.cells)


def test_without_gpu_log_the_rig_footer_names_the_gpu_and_arguments_override_it(tmp_path):
    tgz = _tgz(tmp_path / "out", {LESSON: _executed()})
    build_site.import_gpu_run(tgz, tmp_path / "gpu")
    stamp = nbformat.read(tmp_path / "gpu" / f"{LESSON}.ipynb", as_version=4).metadata["course_site"]
    assert (stamp["machine"], stamp["torch"]) == ("NVIDIA H100 80GB HBM3", "2.11.0+cu130")
    build_site.import_gpu_run(tgz, tmp_path / "gpu", gpu="NVIDIA L4", torch="2.13.0", date="2026-12-01")
    stamp = nbformat.read(tmp_path / "gpu" / f"{LESSON}.ipynb", as_version=4).metadata["course_site"]
    assert (stamp["machine"], stamp["torch"], stamp["date"]) == ("NVIDIA L4", "2.13.0", "2026-12-01")


def test_an_incomplete_or_failed_run_and_a_stranger_are_not_imported(tmp_path, capsys):
    runs = {
        LESSON: _executed(stop_at=3),
        "03_training_loop": _executed("03_training_loop", error_at=4),
        "99_not_a_lesson": _executed(),
    }
    assert build_site.import_gpu_run(_tgz(tmp_path / "out", runs, GPU_LOG), tmp_path / "gpu") == []
    said = capsys.readouterr().out
    assert re.search(rf"{LESSON}: not imported, cell \d+ never ran", said)
    assert "03_training_loop: not imported, cell" in said and "raised RuntimeError: CUDA out of memory" in said
    assert "99_not_a_lesson: not a lesson" in said
    assert not (tmp_path / "gpu").exists()


def test_a_run_whose_plots_went_missing_is_imported_and_says_so(tmp_path, capsys):
    """check.sh exports MPLBACKEND=Agg, under which a kernel's plt.show() shows nothing: the run's tables and checks
    are still worth showing, and its page says why there is no plot."""
    nb = _executed()
    nb.cells.append(nbformat.v4.new_code_cell("plt.show()", execution_count=99))
    for cell in nb.cells:
        cell["outputs"] = [o for o in cell.get("outputs", []) if "image/png" not in o.get("data", {})]
    assert build_site.import_gpu_run(_tgz(tmp_path / "out", {LESSON: nb}, GPU_LOG), tmp_path / "gpu") == [LESSON]
    assert "its plots are missing" in capsys.readouterr().out
    stamp = nbformat.read(tmp_path / "gpu" / f"{LESSON}.ipynb", as_version=4).metadata["course_site"]
    assert "MPLBACKEND=Agg" in stamp["plots_missing"] and "MPLBACKEND=Agg" in build_site.describe_run(stamp)


def test_an_unknown_gpu_is_refused_with_what_to_pass(tmp_path):
    nb = _executed()
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                output["text"] = output["text"].replace(FOOTER, "")
    with pytest.raises(SystemExit, match="--gpu NAME --torch VERSION"):
        build_site.import_gpu_run(_tgz(tmp_path / "out", {LESSON: nb}), tmp_path / "gpu")


def test_the_index_takes_each_lessons_line_from_the_readme_and_a_stated_study_time():
    lines = build_site.readme_lines()
    stems = [path.stem for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
    assert set(stems) <= set(lines), f"the README's notebook table misses {set(stems) - set(lines)}"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 99 · X\n\nStudy time: about 90 minutes.")])
    assert build_site.study_time(nb) == "about 90 minutes"
    nb.metadata["course"] = {"study_time": "45 minutes"}
    assert build_site.study_time(nb) == "45 minutes"
    assert build_site.study_time(nbformat.v4.new_notebook()) == "about an hour"


def _article(html: str) -> str:
    """A page's own content, without the navigation around it."""
    match = re.search(r"<article\b.*?</article>", html, re.DOTALL)
    assert match, "no <article> on the page"
    return match.group(0)


@pytest.mark.slow
def test_a_lesson_page_links_its_gpu_run_and_a_lesson_without_one_says_so(tmp_path):
    """Two lessons rendered by Sphinx from fake executed copies, one with a GPU run imported."""
    for module in ("sphinx", "myst_nb", "furo"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (`make site` installs pyproject's site extra)")
    executed = tmp_path / "executed"
    executed.mkdir()
    for stem in (LESSON, "03_training_loop"):
        nb = _executed(stem)
        nb.metadata["course_site"] = {
            "run": "cpu",
            "machine": "Test CPU, 2 cores",
            "torch": "2.14.1",
            "date": "2026-11-26",
        }
        nbformat.write(nb, executed / f"{stem}.ipynb")
    build_site.import_gpu_run(_tgz(tmp_path / "out", {LESSON: _executed()}, GPU_LOG), tmp_path / "gpu")
    sources, out = tmp_path / "src", tmp_path / "site"
    build_site.assemble(executed, tmp_path / "gpu", sources, names=[LESSON, "03_training_loop"])
    build_site.render(sources, out)
    with_gpu = _article((out / "lessons" / f"{LESSON}.html").read_text())
    assert f'href="../gpu/{LESSON}.html"' in with_gpu and "NVIDIA H200" in with_gpu
    gpu_page = _article((out / "gpu" / f"{LESSON}.html").read_text())
    assert "NVIDIA H200, torch 2.12.0+cu130, 2026-11-27" in gpu_page
    assert f'href="../lessons/{LESSON}.html"' in gpu_page and "✓ cell 1 checked" in gpu_page
    without = _article((out / "lessons" / "03_training_loop.html").read_text())
    assert "no GPU run of this lesson is committed yet" in without
    assert 'class="reference internal" href="../gpu/' not in without, "a lesson without a GPU run links to none"
    index = (out / "index.html").read_text()
    stated = [
        build_site.study_time(nbformat.read(executed / f"{stem}.ipynb", as_version=4))
        for stem in (LESSON, "03_training_loop")
    ]
    assert index.count('href="lessons/') >= 2
    assert all(time in index for time in stated), f"the index shows each lesson's study time, {stated}"
    assert "none yet" in index
    pages = [(out / name).read_text() for name in ("index.html", f"lessons/{LESSON}.html", f"gpu/{LESSON}.html")]
    assert not re.search(r"""<(?:script|link|img)[^>]+(?:src|href)="https?://""", "".join(pages)), (
        "nothing from the web"
    )


def test_every_committed_gpu_run_is_a_lesson_that_names_its_gpu_torch_and_date():
    """What site/gpu/ holds (make site-gpu-import) stays a complete run the site can show, free of machine paths."""
    lessons = {path.stem for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    for path in sorted((ROOT / "site" / "gpu").glob("*.ipynb")):
        assert path.stem in lessons, f"site/gpu/{path.name} is no lesson in notebooks/"
        nb = nbformat.read(path, as_version=4)
        stamp = nb.metadata.get("course_site", {})
        assert stamp.get("run") == "gpu" and all(stamp.get(key) for key in ("machine", "torch", "date")), path.name
        assert build_site.run_problem(nb) is None, f"site/gpu/{path.name}: {build_site.run_problem(nb)}"
        text = json.dumps([cell.get("outputs", []) for cell in nb.cells])
        assert not re.search(r"/home/|/root/|/tmp/site/|/tmp/nb/", text), f"site/gpu/{path.name} holds machine paths"


@pytest.mark.slow
def test_the_notebook_run_keeps_each_notebook_whose_cells_all_passed_for_the_site(tmp_path):
    """`make test` passes --keep-executed (conftest.py): nbval's run of a notebook becomes its executed copy, with
    the kernel's inline plots, so the site's build renders it instead of executing the notebook a second time."""
    v4 = nbformat.v4
    good = v4.new_notebook(cells=[v4.new_markdown_cell("# good")])
    good.cells += [v4.new_code_cell("import matplotlib.pyplot as plt\n\nprint('hello from', 'the kernel')")]
    good.cells += [v4.new_code_cell("plt.plot([1, 3, 2])\nplt.show()"), v4.new_code_cell("6 * 7")]
    bad = v4.new_notebook(cells=[v4.new_code_cell("print('first')"), v4.new_code_cell("raise ValueError('planted')")])
    for name, nb in (("good", good), ("bad", bad)):
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
    kept = tmp_path / "kept"
    command = [sys.executable, "-m", "pytest", "-p", "conftest", "-c", str(ROOT / "pyproject.toml"), "-q"]
    command += ["--keep-executed", str(kept), str(tmp_path / "good.ipynb"), str(tmp_path / "bad.ipynb")]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "1 failed, 4 passed" in run.stdout, run.stdout[-3000:]
    assert sorted(path.name for path in kept.iterdir()) == ["good.ipynb"], "a notebook with a failing cell is not kept"
    copy = nbformat.read(kept / "good.ipynb", as_version=4)
    assert build_site.is_current(tmp_path / "good.ipynb", kept / "good.ipynb")
    assert build_site.run_problem(copy) is None and build_site.plots_problem(copy) is None
    code = [cell for cell in copy.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == [1, 2, 3]
    assert code[0].outputs[0]["text"] == "hello from the kernel\n"
    assert "image/png" in code[1].outputs[-1]["data"], "the kernel draws inline, as in JupyterLab"
    assert code[2].outputs[0]["data"]["text/plain"] == "42" and code[2].outputs[0]["execution_count"] == 3
