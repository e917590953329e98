"""The lessons with their outputs, as a static site that opens from disk: `make site`, then build/site/index.html.

    python scripts/build_site.py build                      execute what changed, render build/site/
    python scripts/build_site.py import-gpu executed.tgz    store a GPU run (../shared/gpu/check.sh) in site/gpu/

`build` executes each notebook in notebooks/ (its working directory) on this machine's defaults with
COURSE_EXERCISES=reference, into build/executed/; a copy whose notebook, helpers/ and torch are unchanged is
reused, and a failing cell fails the build. The stored notebooks are never written. Sphinx with MyST-NB then
renders each executed lesson as a page (prose, code, outputs), an index of the lessons, and, where site/gpu/
holds a GPU run of a lesson, that run as a page of its own linked from the lesson's page.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
EXECUTED = ROOT / "build" / "executed"  # the CPU run, one executed copy per notebook
SOURCES = ROOT / "build" / "site-src"  # the pages as Sphinx reads them, assembled here
SITE = ROOT / "build" / "site"  # the HTML: open build/site/index.html
CONF = ROOT / "site"  # conf.py and the static files
GPU_RUNS = ROOT / "site" / "gpu"  # committed GPU runs, one executed notebook per lesson
CELL_TIMEOUT_S = 600
DEFAULT_STUDY_TIME = "about an hour"
KNOBS_NOTE = (
    "The knobs panel (sliders, dropdowns and a Run button) shows here when the notebook runs in JupyterLab; "
    "this page shows the run with the parameters as stored."
)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
STAMP_KEY = "course_site"  # where the executed copies keep what run made them


# ---------------------------------------------------------------------------------------------- the CPU run


def lesson_paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def inputs_digest(notebook: Path) -> str:
    """What an executed copy depends on: the notebook as stored, every file of helpers/, torch's version."""
    digest = hashlib.sha256(notebook.read_bytes())
    for path in sorted((ROOT / "helpers").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    digest.update(metadata.version("torch").encode())
    return digest.hexdigest()


def cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    names = re.findall(r"^model name\s*:\s*(.+)$", info.read_text(), re.MULTILINE) if info.exists() else []
    return names[0].strip() if names else platform.processor() or platform.machine()


def machine_paths() -> dict[str, str]:
    """Absolute paths of this checkout and this user that an output may print, and what a page shows instead."""
    return {f"{ROOT}/": "", f"{Path.home()}/": "~/"}


def scrub_text(text: str, replacements: dict[str, str]) -> str:
    """A site-packages folder, then each machine-specific prefix, replaced by its relative or neutral form."""
    text = re.sub(r"/[^\s'\"<>()]*?/(?:site|dist)-packages/", "site-packages/", text)
    for prefix, replacement in sorted(replacements.items(), key=lambda item: -len(item[0])):
        text = text.replace(prefix, replacement)
    return text


def scrub_outputs(notebook: Any, replacements: dict[str, str]) -> None:
    """Machine-specific paths out of every text an output holds (streams, text/* data, tracebacks)."""

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return scrub_text(value, replacements)
        if isinstance(value, list):
            return [clean(item) for item in value]
        return value

    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                output["text"] = clean(output["text"])
            if "traceback" in output:
                output["traceback"] = clean(output["traceback"])
            for mime, value in output.get("data", {}).items():
                if mime.startswith("text/") or mime == "application/json":
                    output["data"][mime] = clean(value)


def execute(notebook: Path, target: Path) -> float:
    """Runs `notebook` top to bottom in notebooks/ and writes the executed copy to `target`; seconds taken."""
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    kernel = nb.metadata.get("kernelspec", {}).get("name", "python3")
    # The kernel inherits this environment: the reference solutions behind the exercise checks, and inline
    # plots (a non-interactive MPLBACKEND such as the tests' Agg would turn every plot into text).
    os.environ["COURSE_EXERCISES"] = "reference"
    os.environ.pop("MPLBACKEND", None)
    started = time.perf_counter()
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        startup_timeout=120,
        kernel_name=kernel,
        allow_errors=False,
        store_widget_state=False,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    # What the kernel and the processes it starts write to their own stderr (tracebacks of worker processes a
    # lesson provokes on purpose, warnings) goes to a log beside the executed copy, not into the build's output.
    with open(target.with_suffix(".kernel.log"), "w") as kernel_log:
        client.execute(stdout=kernel_log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    store_executed(notebook, nb, seconds, target)
    return seconds


def store_executed(notebook: Path, nb: Any, seconds: float, target: Path) -> None:
    """Writes `nb`, the run of `notebook` that took `seconds`, to `target` as the site reads it: machine paths out,
    stamped with what made it (the notebook, helpers/, torch), written whole or not at all. `build` calls it after
    executing a notebook, and so does the notebook run of `make test` (conftest.py's --keep-executed)."""
    scrub_outputs(nb, machine_paths())
    nb.metadata[STAMP_KEY] = {
        "run": "cpu",
        "inputs": inputs_digest(notebook),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "torch": metadata.version("torch"),
        "python": platform.python_version(),
        "date": dt.date.today().isoformat(),
        "seconds": round(seconds, 1),
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    nbformat.write(nb, partial)
    partial.replace(target)


def is_current(notebook: Path, executed: Path) -> bool:
    if not executed.exists():
        return False
    stamp = nbformat.read(executed, as_version=4).metadata.get(STAMP_KEY, {})
    return stamp.get("inputs") == inputs_digest(notebook)


def execute_changed() -> None:
    """Executes every notebook whose executed copy is missing or stale."""
    for notebook in lesson_paths():
        target = EXECUTED / notebook.name
        if is_current(notebook, target):
            print(f"  {notebook.stem}: executed copy is up to date")
            continue
        print(f"  {notebook.stem}: executing...", flush=True)
        try:
            seconds = execute(notebook, target)
        except Exception as error:
            target.unlink(missing_ok=True)
            raise SystemExit(f"build_site: {notebook.name} failed, so the site was not built:\n{error}") from None
        print(f"  {notebook.stem}: {seconds:.0f} s", flush=True)


# ------------------------------------------------------------------------------------------- the GPU runs


def _gpu_log_facts(log: Path) -> dict[str, str]:
    """GPU name and torch version from the header that ../shared/gpu/run.sh writes at the top of gpu.log."""
    facts: dict[str, str] = {}
    if not log.exists():
        return facts
    for line in log.read_text(errors="replace").splitlines()[:20]:
        torch_line = re.match(r"torch (\S+) cuda (\S+)", line)
        if torch_line and "torch" not in facts:
            facts["torch"] = torch_line.group(1)
        elif "gpu" not in facts and re.search(r", \d+ MiB, ", line):  # nvidia-smi: name, memory, driver
            facts["gpu"] = line.split(",")[0].strip()
    return facts


def _output_facts(notebook: Any) -> dict[str, str]:
    """GPU name and torch version as the rig prints them under its tables: [NVIDIA ..., torch 2.11.0+cu130, ...]."""
    facts: dict[str, str] = {}
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            text = output.get("text", "") or output.get("data", {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            for footer in re.findall(r"^\[(.*\btorch \d\S*.*\bdevice cuda.*)\]$", text, re.MULTILINE):
                facts.setdefault("gpu", footer.split(",")[0].strip())
                facts.setdefault("torch", re.search(r"\btorch (\d\S*?),", footer).group(1))  # type: ignore[union-attr]
    return facts


def _run_date(notebook: Any, fallback: float) -> str:
    end = notebook.metadata.get("papermill", {}).get("end_time") or ""
    return end[:10] if re.match(r"\d{4}-\d\d-\d\d", end) else dt.date.fromtimestamp(fallback).isoformat()


def run_problem(notebook: Any) -> str | None:
    """Why an executed notebook is not a complete, clean run, or None."""
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        if cell.get("execution_count") is None:
            return f"cell {index} never ran (the run stopped before it)"
        tolerated = "raises-exception" in cell.metadata.get("tags", [])
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors and not tolerated:
            return f"cell {index} raised {errors[0].get('ename')}: {str(errors[0].get('evalue'))[:200]}"
    return None


def plots_problem(notebook: Any) -> str | None:
    """Why a run that should have drawn plots holds none, or None: a kernel started with a non-interactive
    MPLBACKEND (check.sh and run.sh export MPLBACKEND=Agg for the tests) turns every plt.show() into nothing."""
    draws = any(re.search(r"plt\.show\(\)|\.chart\(|LivePlot\(", cell.source) for cell in notebook.cells)
    images = any(
        any(mime.startswith("image/") for mime in output.get("data", {}))
        for cell in notebook.cells
        for output in cell.get("outputs", [])
    )
    if draws and not images:
        return "its plots are missing (the kernel ran with MPLBACKEND=Agg: run papermill under `env -u MPLBACKEND`)"
    return None


def remote_roots(notebook: Any) -> dict[str, str]:
    """The other machine's checkout and scratch folders, as its outputs print them, mapped to what a page shows."""
    text = json.dumps([cell.get("outputs", []) for cell in notebook.cells])
    roots = set(re.findall(r"(/[\w.+@-]+(?:/[\w.+@-]+)*?)/(?:notebooks|helpers|runs|data)/", text))
    replacements = {f"{root}/": "" for root in roots if not root.endswith("-packages")}
    replacements.update({"/tmp/nb/": "", "/tmp/site/": "site-packages/"})
    for home in set(re.findall(r"(/home/[\w.-]+/|/root/)", text)):
        replacements[home] = "~/"
    return replacements


def import_gpu_run(
    tgz: Path, store: Path = GPU_RUNS, *, gpu: str | None = None, torch: str | None = None, date: str | None = None
) -> list[str]:
    """Stores the executed notebooks of a GPU run (check.sh's executed.tgz) in `store`: machine paths removed,
    the GPU, torch version and date in each notebook's metadata. Returns the names stored; says what it skipped."""
    lessons = {path.stem for path in lesson_paths()}
    log = _gpu_log_facts(tgz.parent / "gpu.log")
    stored: list[str] = []
    with tarfile.open(tgz) as archive:
        members = [m for m in archive.getmembers() if m.isfile() and m.name.endswith(".ipynb")]
        if not members:
            raise SystemExit(f"import-gpu: {tgz} holds no .ipynb files")
        for member in sorted(members, key=lambda m: m.name):
            stem = Path(member.name).stem
            if stem not in lessons:
                print(f"  {stem}: not a lesson in notebooks/, skipped")
                continue
            handle = archive.extractfile(member)
            assert handle is not None
            nb = nbformat.reads(handle.read().decode(), as_version=4)
            problem = run_problem(nb)
            if problem:
                print(f"  {stem}: not imported, {problem}")
                continue
            without_plots = plots_problem(nb)  # imported all the same: its page says so
            facts = {**_output_facts(nb), **log}
            facts.update({key: value for key, value in (("gpu", gpu), ("torch", torch)) if value})
            missing = [key for key in ("gpu", "torch") if not facts.get(key)]
            if missing:
                raise SystemExit(
                    f"import-gpu: cannot tell the {' and '.join(missing)} of {member.name}: put check.sh's gpu.log "
                    "beside the archive, or pass --gpu NAME --torch VERSION"
                )
            scrub_outputs(nb, remote_roots(nb))
            run_date = date or _run_date(nb, member.mtime)
            seconds = nb.metadata.get("papermill", {}).get("duration")
            for key in ("papermill", "widgets"):
                nb.metadata.pop(key, None)
            for cell in nb.cells:
                cell.metadata.pop("papermill", None)
                cell.metadata.pop("execution", None)
            nb.metadata[STAMP_KEY] = {
                "run": "gpu",
                "machine": facts["gpu"],
                "torch": facts["torch"],
                "date": run_date,
                **({"seconds": round(float(seconds), 1)} if seconds else {}),
                **({"plots_missing": without_plots} if without_plots else {}),
            }
            store.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, store / f"{stem}.ipynb")
            stored.append(stem)
            print(
                f"  {stem}: stored ({facts['gpu']}, torch {facts['torch']}, {run_date})"
                + (f"; {without_plots}" if without_plots else "")
            )
    return stored


# --------------------------------------------------------------------------------------------- the pages


def readme_lines(readme: Path = ROOT / "README.md") -> dict[str, str]:
    """Each notebook's line of the README's notebook table: | `00_setup_and_devices` | what it teaches |."""
    rows = re.findall(r"^\| `(\d\d_\w+)` \| (.+) \|$", readme.read_text(), re.MULTILINE)
    return dict(rows)


def study_time(nb: Any) -> str:
    """The study time a notebook states (metadata course.study_time, or a 'Study time: ...' line), else the default."""
    stated = nb.metadata.get("course", {}).get("study_time")
    if stated:
        return str(stated)
    for cell in nb.cells[:6]:
        if cell.cell_type == "markdown":
            match = re.search(r"[Ss]tudy time\**:?\**\s*([^\n.;]+)", cell.source)
            if match:
                return match.group(1).strip()
    return DEFAULT_STUDY_TIME


def title_of(nb: Any, stem: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            match = re.match(r"#\s+(.+)", cell.source.strip())
            if match:
                return match.group(1).strip()
    return stem


def describe_run(stamp: dict[str, Any]) -> str:
    seconds = f", run in {stamp['seconds']:.0f} s" if stamp.get("seconds") else ""
    plots = f" ({stamp['plots_missing']})" if stamp.get("plots_missing") else ""
    return (
        f"{stamp.get('machine', 'unknown machine')}, torch {stamp.get('torch', '?')}, {stamp.get('date', '?')}"
        f"{seconds}{plots}"
    )


def page_ready(nb: Any) -> Any:
    """An executed notebook as a static page shows it: widgets (the knobs, progress bars, a live plot's canvas) need
    a kernel, and their text stand-ins show their first state (a bar at 0%), so they are left out; the knobs panel
    gives way to a note. Whatever a live widget ends in (a plot's last frame, a summary line) is an output of its own.
    """
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = [output for output in cell.get("outputs", []) if WIDGET_VIEW not in output.get("data", {})]
        if "knob_panel" in cell.source:
            cell.outputs.insert(0, nbformat.v4.new_output("display_data", data={"text/markdown": f"*{KNOBS_NOTE}*"}))
    return nb


def banner(text: str) -> Any:
    return nbformat.v4.new_markdown_cell(f"```{{admonition}} Outputs on this page\n:class: run-banner\n{text}\n```")


def with_banner(nb: Any, text: str) -> Any:
    """The notebook with a note under its title cell."""
    nb.cells.insert(1 if nb.cells and nb.cells[0].cell_type == "markdown" else 0, banner(text))
    return nb


def write_if_changed(path: Path, text: str) -> None:
    """Leaves an unchanged file untouched, so that Sphinx rebuilds only the pages that changed."""
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def assemble(
    executed: Path = EXECUTED, gpu_runs: Path = GPU_RUNS, sources: Path = SOURCES, names: list[str] | None = None
) -> list[str]:
    """Writes the pages Sphinx reads into `sources`: index.md, lessons/*.ipynb, gpu/*.ipynb. Returns the lessons."""
    lines = readme_lines()
    names = names if names is not None else [path.stem for path in lesson_paths()]
    lessons = [executed / f"{name}.ipynb" for name in names]
    missing = [path.name for path in lessons if not path.exists()]
    if missing or not lessons:
        raise SystemExit(f"build_site: no executed copy of {missing or 'any lesson'} in {executed}")
    rows, gpu_pages = [], []
    wanted = {f"lessons/{p.name}" for p in lessons} | {f"gpu/{p.name}" for p in lessons if (gpu_runs / p.name).exists()}
    for old in [*sources.glob("lessons/*.ipynb"), *sources.glob("gpu/*.ipynb")]:
        if f"{old.parent.name}/{old.name}" not in wanted:
            old.unlink()
    for path in lessons:
        stem = path.stem
        cpu = nbformat.read(path, as_version=4)
        cpu_stamp = cpu.metadata.get(STAMP_KEY, {})
        title = title_of(cpu, stem)
        gpu_path = gpu_runs / path.name
        gpu = nbformat.read(gpu_path, as_version=4) if gpu_path.exists() else None
        if gpu is not None:
            gpu_stamp = gpu.metadata.get(STAMP_KEY, {})
            elsewhere = (
                f"On a GPU: [the same lesson run on {gpu_stamp.get('machine')}](../gpu/{path.name}) "
                f"({describe_run(gpu_stamp)})."
            )
            back = (
                f"On a CPU: [the same lesson run on {cpu_stamp.get('machine')}](../lessons/{path.name}) "
                f"({describe_run(cpu_stamp)})."
            )
            gpu_page = with_banner(page_ready(gpu), f"A run on a GPU: {describe_run(gpu_stamp)}.\n\n{back}")
            gpu_page.cells[0].source = re.sub(
                r"^(#\s+.+)$", r"\1, on a GPU", gpu_page.cells[0].source, count=1, flags=re.M
            )
            write_if_changed(sources / "gpu" / path.name, nbformat.writes(gpu_page))
            gpu_pages.append(f"gpu/{stem}")
            gpu_cell = f"[{gpu_stamp.get('machine')}, {gpu_stamp.get('date')}](gpu/{path.name})"
        else:
            elsewhere = (
                "On a GPU: no GPU run of this lesson is committed yet (`../shared/gpu/check.sh` on a CUDA machine, "
                "then `make site-gpu-import TGZ=executed.tgz`)."
            )
            gpu_cell = "none yet"
        note = (
            f"A run on a CPU: {describe_run(cpu_stamp)}, the parameters as stored, "
            f"the exercise checks run on the reference solutions.\n\n{elsewhere}"
        )
        write_if_changed(sources / "lessons" / path.name, nbformat.writes(with_banner(page_ready(cpu), note)))
        rows.append(f"| [{title}](lessons/{path.name}) | {lines.get(stem, '')} | {study_time(cpu)} | {gpu_cell} |")
    stamps = [nbformat.read(p, as_version=4).metadata.get(STAMP_KEY, {}) for p in lessons]
    machines = sorted({s.get("machine", "?") for s in stamps})
    dates = sorted({s.get("date", "?") for s in stamps})
    index = [
        "# Training neural networks with PyTorch, hands-on",
        "",
        "Every lesson as it ran, before you run it: its prose, its code and what each cell showed (tables, plots, "
        "the ✓ line of every check). The outputs come from a real run of the notebooks as stored, made by "
        f"`make site` on {', '.join(machines)} ({' to '.join(dict.fromkeys([dates[0], dates[-1]]))}), not edited "
        "by hand. Where a lesson was also run on a CUDA GPU, its page links to that run.",
        "",
        "To run them yourself: `make lab` (see the project's README).",
        "",
        "```{table} The lessons, in order",
        ":class: lesson-index",
        "",
        "| lesson | what it teaches | study time | on a GPU |",
        "|---|---|---|---|",
        *rows,
        "```",
        "",
        "```{toctree}",
        ":hidden:",
        ":caption: Lessons",
        "",
        *[f"lessons/{p.stem}" for p in lessons],
        "```",
        "",
    ]
    if gpu_pages:
        index += ["```{toctree}", ":hidden:", ":caption: On a GPU", "", *gpu_pages, "```", ""]
    write_if_changed(sources / "index.md", "\n".join(index))
    return [p.stem for p in lessons]


def render(sources: Path = SOURCES, out: Path = SITE) -> None:
    """Sphinx over the assembled pages, into `out` (incremental: unchanged pages are not rendered again)."""
    command = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-c", str(CONF), str(sources), str(out)]
    command += ["-d", str(out.parent / "site-doctrees")]
    run = subprocess.run(command, cwd=ROOT)
    if run.returncode:
        raise SystemExit(f"build_site: sphinx failed (exit {run.returncode})")


def build() -> None:
    started = time.perf_counter()
    print("build_site: executing the notebooks (build/executed/)")
    execute_changed()
    print("build_site: rendering the pages (build/site/)")
    assemble()
    render()
    print(f"build_site: done in {time.perf_counter() - started:.0f} s: open {SITE / 'index.html'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="execute what changed and render build/site/")
    gpu_cmd = commands.add_parser("import-gpu", help="store a GPU run's executed notebooks in site/gpu/")
    gpu_cmd.add_argument("tgz", type=Path, help="executed.tgz from ../shared/gpu/check.sh (gpu.log beside it is read)")
    gpu_cmd.add_argument("--gpu", help="the GPU's name, where gpu.log is not beside the archive")
    gpu_cmd.add_argument("--torch", help="the torch version of the run, likewise")
    gpu_cmd.add_argument("--date", help="the run's date, YYYY-MM-DD (default: from the notebooks)")
    gpu_cmd.add_argument("--store", type=Path, default=GPU_RUNS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command == "build":
        build()
    else:
        stored = import_gpu_run(args.tgz, args.store, gpu=args.gpu, torch=args.torch, date=args.date)
        print(f"import-gpu: {len(stored)} lesson(s) in {args.store}; `make site` shows them")


if __name__ == "__main__":
    main()
