import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pins(text):
    return sorted(m.group(1) for m in re.finditer(r"^\s*(?:- )?([A-Za-z0-9_.\-]+==[^\s#]+)", text, re.M))


def test_environment_yml_mirrors_requirements():
    req = _pins((ROOT / "requirements.txt").read_text())
    env = _pins((ROOT / "environment.yml").read_text())
    assert req and req == env


def test_every_dependency_is_pinned():
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        spec = line.split("#")[0].strip()
        assert not spec or "==" in spec, spec
    pins = dict(p.split("==") for p in _pins((ROOT / "requirements.txt").read_text()))
    import torch
    assert torch.__version__.split("+")[0] == pins["torch"]  # the installed torch is the pinned one (a +cpu build counts)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
