"""Every notebook runs top to bottom on the CPU, is committed without outputs, and matches its source."""
import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ARTIFACTS = ROOT / "test-artifacts" / "notebooks"
# appended to the executed copy only: the kernel's own peak resident memory, for the instructor guide's seats.
# note: VmHWM, the peak of this address space; getrusage's ru_maxrss survives exec on Linux, so a kernel started
# by a big pytest process would report pytest's peak
PEAK_CELL = ("import sys\n"
             "def _peak_mib():\n"
             "    try:\n"
             "        for line in open('/proc/self/status'):\n"
             "            if line.startswith('VmHWM:'):\n"
             "                return int(line.split()[1]) / 1024\n"
             "    except OSError:\n"
             "        pass\n"
             "    import resource\n"
             "    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20 if sys.platform == 'darwin' else 1 << 10)\n"
             "print('kernel peak MiB', _peak_mib())")


def record_run(stem, seconds, peak_mib):
    """test-artifacts/notebooks/runs.json: seconds and kernel peak memory per notebook, from this suite run."""
    path = ARTIFACTS / "runs.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[stem] = {"seconds": round(seconds, 1), "kernel_peak_mib": round(peak_mib)}
    path.write_text(json.dumps(runs, indent=1, sort_keys=True))


def test_there_are_notebooks():
    assert NOTEBOOKS and NOTEBOOKS[0].name == "00_pipeline_tour.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    assert not any(c.get("outputs") or c.get("execution_count") for c in nb["cells"] if c["cell_type"] == "code")


def test_notebooks_match_their_sources():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_notebooks.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_notebook_shape():
    tool = ROOT.parent / "shared" / "tools" / "notebook_shape.py"
    if not tool.exists():
        pytest.skip("the house shape checker (../shared/tools) is not beside this checkout")
    proc = subprocess.run([sys.executable, str(tool)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    monkeypatch.setenv("COURSE_PROGRESS", "0")  # the executed copies keep results, not finished progress bars
    # the inline backend, as a learner's JupyterLab has: the executed copies keep their figures (Agg would draw
    # them to nowhere), so they can be looked at after a run
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="llm-course", resources={"metadata": {"path": str(path.parent)}})
    measure = sys.platform != "win32"  # the resource module is POSIX-only
    if measure:
        nb.cells.append(nbformat.v4.new_code_cell(PEAK_CELL))
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[0]["ename"] + ": " + errors[0]["evalue"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    if measure:
        peak = nb.cells.pop().outputs[0]["text"].split()[-1]
        record_run(path.stem, seconds, float(peak))
    nbformat.write(nb, ARTIFACTS / path.name)  # the executed copy, figures included, for a look after the run
    shows = sum(c.source.count("plt.show()") for c in nb.cells if c.cell_type == "code")
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images >= shows, f"{shows} plt.show() calls but {images} figures kept"
    # an exercise check ending a cell prints its verdict line and shows nothing else (no bare True/False)
    bare = [o["data"]["text/plain"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "execute_result" and o["data"].get("text/plain") in ("True", "False", "0", "1")]
    assert not bare, f"{len(bare)} cells end by showing a bare {bare[0]}"
