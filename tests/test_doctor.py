import subprocess
import sys

import pytest

from course_lib.doctor import Check, format_table, run_checks


@pytest.mark.slow
def test_doctor_passes_on_a_set_up_machine(smol):
    checks = run_checks()
    failed = [c for c in checks if not c.ok]
    assert not failed, format_table(checks)
    names = {c.name for c in checks}
    assert {"python", "torch", "transformers", "tiktoken", "ipywidgets", "jupyterlab", "device", "model file",
            "weight cache", "generation", "jupyter kernel", "widgets extension", "router (lesson 18)"} <= names
    assert "Paris" in next(c.detail for c in checks if c.name == "generation")


@pytest.mark.slow
def test_doctor_fails_with_fixes_when_the_model_is_missing(tmp_path):
    env = {"COURSE_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "course_lib", "doctor"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "fix: make setup" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_table_lists_fixes_only_for_failures():
    table = format_table([Check("a", True, "fine", "never shown"), Check("b", False, "broken", "do this")])
    assert "never shown" not in table and "fix: do this" in table and "1/2 checks passed" in table


def test_a_missing_router_fails_only_where_it_has_a_wheel(monkeypatch):
    from course_lib import doctor
    from course_lib.serve import replicas

    def missing():
        raise replicas.RouterMissing("not installed")
    monkeypatch.setattr(replicas, "router_command", missing)
    monkeypatch.setattr(doctor.sys, "platform", "linux")
    monkeypatch.setattr(doctor.platform, "machine", lambda: "x86_64")
    check = doctor.check_router()
    assert not check.ok and check.fix == "make setup"
    monkeypatch.setattr(doctor.platform, "machine", lambda: "ppc64le")
    check = doctor.check_router()
    assert check.ok and "committed run" in check.detail
