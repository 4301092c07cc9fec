"""scripts/gpu_check.py: one command for a GPU owner. Here (no GPU): its refusal, and its per-lesson runner."""
import importlib.util
import os
from pathlib import Path

import nbformat
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the refusal does not apply")
def test_without_a_gpu_it_says_so_and_how_to_get_one(capsys):
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "COURSE_TORCH_INDEX=default make setup" in err


@pytest.mark.slow
def test_each_lesson_is_recorded_with_its_first_error(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    good, bad = tmp_path / "good.ipynb", tmp_path / "bad.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os\nassert os.environ['COURSE_DEVICE'] == 'probe'")]), good)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")]), bad)
    ok = gpu_check.run_notebook(good, {"COURSE_DEVICE": "probe"}, timeout=120)
    assert ok["ok"] and ok["error"] is None and ok["seconds"] > 0  # the kernel saw the device it was given
    failed = gpu_check.run_notebook(bad, {"COURSE_DEVICE": "probe"}, timeout=120)
    assert not failed["ok"] and "ZeroDivisionError" in failed["error"]
    assert os.environ["COURSE_DEVICE"] == "cpu"  # put back after each lesson
