import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pins(text):
    """Every 'name==version' line, with its environment marker where it has one ('name==version ; marker')."""
    found = re.finditer(r"^\s*(?:- )?([A-Za-z0-9_.\-]+==[^\s#;]+)\s*(?:;\s*([^#\n]*?))?\s*(?:#.*)?$", text, re.M)
    return sorted(m.group(1) + (f" ; {m.group(2)}" if m.group(2) else "") for m in found)


def test_environment_yml_mirrors_requirements():
    req = _pins((ROOT / "requirements.txt").read_text())
    env = _pins((ROOT / "environment.yml").read_text())
    assert req and req == env


def test_every_dependency_is_pinned():
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        spec = line.split("#")[0].strip()
        assert not spec or "==" in spec, spec
    pins = dict(p.split(" ;")[0].split("==") for p in _pins((ROOT / "requirements.txt").read_text()))
    import torch
    assert torch.__version__.split("+")[0] == pins["torch"]  # the installed torch is the pinned one (a +cpu build counts)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_pyproject_declares_the_same_pins():
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(project["dependencies"]) == _pins((ROOT / "requirements.txt").read_text())


def test_the_stated_licence_ships():
    import tomllib
    stated = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    assert stated == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert "Version 2.0" in (ROOT / "LICENSE").read_text()[:200]


def test_every_package_folder_is_listed_for_installation():
    """pyproject lists its packages by name: a wing missing there would be left out of a non-editable install."""
    block = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    listed = set(re.findall(r'"([^"]+)"', block))  # note: no tomllib, which Python 3.10 lacks
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "course_lib").rglob("__init__.py")}
    assert listed == folders, (sorted(folders - listed), sorted(listed - folders))
