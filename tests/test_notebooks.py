"""Every notebook runs top to bottom on the CPU, is committed without outputs, and matches its source."""
import json
import re
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


# A number typed into a lesson's prose is either computed by that lesson's code, or one of these: a fact the
# lesson defines or quotes (the model's shapes, a format's layout, a seed's claim, a protocol), never a
# measurement. Measured numbers belong in outputs; the prose says where to read them.
PROSE_NUMBERS = {
    "00": {"135": "the model's name", "80": "a seed's \"80+ layers\"", "70": "the 70B model it describes",
           "11": "lesson map", "13": "lesson map", "15": "lesson map", "16": "lesson map", "17": "lesson map",
           "18": "lesson map"},
    "01": {"0.75": "the seed's rule under test", "256": "the bytes byte-level BPE starts from"},
    "02": {"400": "an HTTP status", "200": "the rescue check's budget", "135": "the model's name"},
    "03": {"576": "hidden size", "30": "layers", "32": "Q4_1/Q8_0 block", "16": "levels in 4 bits",
           "255": "levels in 8 bits", "64": "the exercise's sequence length"},
    "04": {"135": "the model's name", "10": "the colour scale's floor"},
    "06": {"135": "the model's name"},
    "07": {"8192": "the window", "48": "the exercise's answer length"},
    "08": {"1.5": "the exercise's tolerance", "100": "the exercise's answer length"},
    "10": {"127.0": "the loopback address", "12": "lesson map", "13": "lesson map", "16": "block size",
           "50": "the request's max_tokens"},
    "11": {"49152": "vocabulary", "1200": "a test's prompt", "256": "a test's story",
           "4000": "the bench's context", "100000": "the model's rope theta"},
    "12": {"20": "Q4_1 block bytes", "64": "group size", "4.5": "bits per weight of those groups"},
    "13": {"20": "the figure's made-up sequences", "40": "the figure's made-up sequences", "33": "a test's chunk"},
    "14": {"1.6": "the committed bench named beside it", "20000": "the test's draws"},
    "15": {"49152": "vocabulary", "400": "an HTTP status", "20": "the schema's bound",
           "100000000": "the schema's bound"},
    "16": {"30": "layers", "4000": "the bench's context"},
    "17": {"135": "the model's name", "46": "KB per token in float32 (30 x 2 x 3 x 64 x 4 bytes)",
           "8193": "one past the window", "127": "the int8 range",
           "16": "bits of the float cache; the needle's tokens"},
    "18": {"70": "the 70B model the calculator sizes"},
}
NUMBER = re.compile(r"(?<![\w.])(\d[\d,_]*(?:\.\d+)?)")


def prose_numbers_not_from_code(source: str, allowed: dict) -> list[str]:
    """Numbers in a lesson source's markdown cells that its code does not contain and `allowed` does not name.
    Skipped: one-digit integers, years, and references to lessons, sections and exercises."""
    markdown, code = [], []
    for block in re.split(r"^# %%", source, flags=re.M):
        if block.startswith(" [markdown]"):
            markdown.append("\n".join(line[2:] for line in block.splitlines()[1:]))
        else:
            code.append(block)
    in_code = {n.replace(",", "").replace("_", "") for n in NUMBER.findall("\n".join(code))}
    found = []
    for text in markdown:
        for match in NUMBER.finditer(text):
            n, before = match.group(1).rstrip(",").replace(",", ""), text[:match.start()]
            if n in in_code or n in allowed or re.fullmatch(r"(19|20)\d\d", n) or ("." not in n and int(n) < 10):
                continue
            if re.search(r"(lessons?|sections?|exercises?|seed|part|#|\*\*next:\*\*)\s*$", before, re.I):
                continue
            lesson_list = r"lessons? \d\d((, | and | to |-)\d\d)*(, | and | to |-)$"  # "lessons 07, 08 and 09"
            if re.match(r"\s*·", text[match.end():]) or re.search(lesson_list, before):
                continue
            found.append(f"{n}: ...{text[max(0, match.start() - 40):match.end() + 20]}...".replace("\n", " "))
    return found


SOURCES = sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_numbers_in_prose_come_from_the_lessons_code(source):
    allowed = PROSE_NUMBERS.get(source.name[:2], {})
    found = prose_numbers_not_from_code(source.read_text(), allowed)
    assert not found, "a number typed into the prose, not computed by a cell (print it, or name what defines it):\n" + \
        "\n".join(found)
    unused = set(allowed) - {f.split(":")[0] for f in prose_numbers_not_from_code(source.read_text(), {})}
    assert not unused, f"PROSE_NUMBERS names numbers this lesson's prose no longer types: {sorted(unused)}"


def test_the_prose_number_check_catches_a_typed_measurement():
    lesson = "# %% [markdown]\n# Decode took 46.5 ms here, in lesson 08 and section 3.\n\n# %%\nx = 12\n"
    assert [f.split(":")[0] for f in prose_numbers_not_from_code(lesson, {})] == ["46.5"]
    assert prose_numbers_not_from_code(lesson, {"46.5": "a fact"}) == []
    assert prose_numbers_not_from_code(lesson.replace("46.5 ms", "12 ms"), {}) == []  # the code computes it


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
