"""The workshop hub (deploy/hub) runs: JupyterHub and its proxy on loopback, three learners created and their servers
started through the hub's REST API, a lesson's code run in each learner's kernel through the hub (kernels REST API
and the kernel's websocket, behind the proxy), the answers equal, each learner's memory read from their cgroup, and a
learner whose server dies leaves the others working. Skips, with the command that installs them, where jupyterhub or
configurable-http-proxy is missing (set-up never installs them)."""
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HUB = ROOT / "deploy" / "hub"
INSTALL = ".venv/bin/pip install -r deploy/hub/requirements.txt && npm install --prefix deploy/hub"
USERS = ("ada", "brook", "chen")
LESSON = ROOT / "notebooks" / "00_pipeline_tour.ipynb"
ANSWER = ("from course_lib.loading import load_model\nfrom course_lib.engine.generation import generate\n"
          "m, t = load_model()\nprint('ANSWER', repr(generate(m, t, t('The capital of France is')['input_ids'], "
          "12).text))")


def _proxy() -> str | None:
    local = HUB / "node_modules" / ".bin" / "configurable-http-proxy"
    return str(local) if local.exists() else shutil.which("configurable-http-proxy")


def _missing() -> str | None:
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        return "jupyterhub"
    if shutil.which("node") is None:
        return "node"
    return None if _proxy() else "configurable-http-proxy"


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="the hub's spawner and cgroups are Linux's"),
              pytest.mark.skipif(_missing() is not None, reason=f"the hub test needs {_missing()}: {INSTALL}")]


def _free_port() -> int:
    from course_lib.runtime import free_port
    return free_port()


class Hub:
    """The hub as a learner's browser would see it: REST calls with the admin service's token."""

    def __init__(self, port: int, token: str):
        import httpx
        self.url, self.token = f"http://127.0.0.1:{port}", token
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"token {token}"}, timeout=30)

    def api(self, method: str, path: str, **kwargs):
        return self.http.request(method, "/hub/api" + path, **kwargs)

    def wait_ready(self, user: str, timeout: float = 180) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            model = self.api("GET", f"/users/{user}").json()
            server = model.get("servers", {}).get("", {})
            if server.get("ready"):
                return server
            time.sleep(0.5)
        raise AssertionError(f"{user}'s server was not ready in {timeout} s")


async def _execute(hub: Hub, user: str, kernel: str, code: str, timeout: float = 600) -> dict:
    """Run code in a kernel through the hub's proxy (the kernel protocol as JSON over the websocket)."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect
    # note: three kernels that have just started, on 2 cores, can take longer than tornado's default 20 s to take
    # their channels (the suite once timed out here under load, 2026-12-07): the wait is the code's, not the socket's
    request = HTTPRequest(f"ws://127.0.0.1:{hub.url.rsplit(':', 1)[1]}/user/{user}/api/kernels/{kernel}/channels",
                          headers={"Authorization": f"token {hub.token}"}, connect_timeout=120, request_timeout=120)
    ws = await websocket_connect(request)
    msg_id, out = uuid.uuid4().hex, {"stdout": "", "error": None, "status": None}
    ws.write_message(json.dumps({
        "header": {"msg_id": msg_id, "username": user, "session": uuid.uuid4().hex, "msg_type": "execute_request",
                   "version": "5.3", "date": ""},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True}}))
    end = time.monotonic() + timeout
    replied = idle = False
    while not (replied and idle):
        raw = await asyncio.wait_for(ws.read_message(), max(1.0, end - time.monotonic()))
        assert raw is not None, f"{user}'s kernel websocket closed"
        msg = json.loads(raw)
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content.get("execution_state") in ("restarting", "dead"):
            out["status"] = content["execution_state"]  # the kernel died under the code (its server restarts it)
            break
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        if kind == "stream" and content.get("name") == "stdout":
            out["stdout"] += content["text"]
        elif kind == "error":
            out["error"] = f"{content['ename']}: {content['evalue']}"
        elif kind == "execute_reply":
            replied, out["status"] = True, content["status"]
        elif kind == "status" and content["execution_state"] == "idle":
            idle = True
    ws.close()
    return out


def _lesson_code(path: Path) -> str:
    """The lesson's code cells, as one script (the widgets' cells build their views; nothing waits for a click)."""
    cells = json.loads(path.read_text())["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def _cgroup_peak(user: str) -> int | None:
    for path in (Path("/sys/fs/cgroup/memory/llm-course-hub") / user / "memory.max_usage_in_bytes",
                 Path("/sys/fs/cgroup/llm-course-hub") / user / "memory.peak"):
        if path.exists():
            return int(path.read_text())
    return None


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    homes = tmp_path_factory.mktemp("hub")
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "HUB_HOMES": str(homes), "HUB_PORT": str(port), "HUB_API_PORT": str(_free_port()),
           "HUB_PROXY_API_PORT": str(_free_port()), "HUB_ADMIN_TOKEN": token, "HUB_SEAT_MEMORY": "3G"}
    env.pop("COURSE_SERVER_URL", None)
    log = open(homes / "hub.log", "w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "jupyterhub"), "-f", str(HUB / "jupyterhub_config.py")],
                            cwd=homes, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    the_hub = Hub(port, token)
    try:
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (homes / "hub.log").read_text()[-3000:]
            try:
                if the_hub.api("GET", "/").status_code == 200:
                    break
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            assert time.monotonic() < end, (homes / "hub.log").read_text()[-3000:]
            time.sleep(0.5)
        the_hub.log, the_hub.homes = homes / "hub.log", homes
        yield the_hub
    finally:
        for user in USERS:
            try:
                the_hub.api("DELETE", f"/users/{user}/server")
            except Exception:  # noqa: BLE001 - the hub may be gone already
                pass
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        groups = [base / "llm-course-hub" / user for base in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup"))
                  for user in USERS]
        end = time.monotonic() + 20
        while any(g.exists() for g in groups) and time.monotonic() < end:  # the learners' memory cgroups, once
            for group in groups:                                            # their last processes have exited
                try:
                    group.rmdir()
                except OSError:
                    pass
            time.sleep(0.5)


def test_three_learners_run_a_lesson_through_the_hub(hub):
    assert hub.api("POST", "/users", json={"usernames": list(USERS)}).status_code == 201
    for user in USERS:
        assert hub.api("POST", f"/users/{user}/server").status_code in (201, 202), hub.log.read_text()[-2000:]
    kernels = {}
    for user in USERS:
        hub.wait_ready(user)
        reply = hub.http.post(f"/user/{user}/api/kernels", json={"name": "llm-course"})
        assert reply.status_code == 201, reply.text
        kernels[user] = reply.json()["id"]
        assert (hub.homes / user / "notebooks" / LESSON.name).exists()  # each learner has a copy of the lessons

    async def everyone(code):
        return await asyncio.gather(*(_execute(hub, u, kernels[u], code) for u in USERS))

    lesson = asyncio.run(everyone(_lesson_code(LESSON)))
    for user, out in zip(USERS, lesson):
        assert out["status"] == "ok", f"{user}: {out['error']}"
    answers = asyncio.run(everyone(ANSWER))
    texts = [out["stdout"].split("ANSWER", 1)[1].strip() for out in answers]
    assert texts[0] and texts == [texts[0]] * len(USERS), texts  # greedy: the same answer in every seat
    where = asyncio.run(everyone("import course_lib.loading as L, sys, torch; "
                                 "print(L.cache_root(), sys.prefix, torch.get_num_threads())"))
    assert where[0]["stdout"].split()[-1] == "1", where[0]  # one thread per seat (HUB_SEAT_CPUS)
    assert {out["stdout"] for out in where} == {where[0]["stdout"]}  # one model cache, one environment for all
    peaks = {user: _cgroup_peak(user) for user in USERS}
    if all(peak is not None for peak in peaks.values()):
        for user, peak in peaks.items():  # a seat holds the model (538 MB in float32) and stays under its limit
            assert 538e6 < peak <= 3 * 2**30, (user, peak)
        print("peak memory per learner (GiB):", {u: round(p / 2**30, 2) for u, p in peaks.items()})


def test_a_learner_whose_server_dies_leaves_the_others_working(hub):
    for user in USERS[:2]:
        hub.wait_ready(user, timeout=5)
    pid = int(hub.api("GET", f"/users/{USERS[1]}").json()["servers"][""]["state"]["pid"])
    os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 60
    while hub.api("GET", f"/users/{USERS[1]}").json().get("servers", {}).get("", {}).get("ready"):
        reply = hub.http.get(f"/user/{USERS[1]}/api/kernels")
        if reply.status_code != 200:
            break
        assert time.monotonic() < end, "the hub still routes to a dead server after 60 s"
        time.sleep(1)
    dead = hub.http.get(f"/user/{USERS[1]}/api/kernels")
    assert dead.status_code != 200  # the learner sees an error (the hub's page), never a hang
    kernel = hub.http.post(f"/user/{USERS[0]}/api/kernels", json={"name": "llm-course"}).json()["id"]
    out = asyncio.run(_execute(hub, USERS[0], kernel, "print(6 * 7)"))
    assert out["status"] == "ok" and out["stdout"].strip() == "42"


def test_a_learner_over_the_seat_memory_loses_only_their_kernel(hub):
    """A kernel that fills more than its seat's 3 GiB is killed inside its own cgroup; the others keep running."""
    if _cgroup_peak(USERS[2]) is None:
        pytest.skip("this machine let the hub make no memory cgroup, so the seat's limit is not enforced here")
    kernels = {u: hub.http.post(f"/user/{u}/api/kernels", json={"name": "llm-course"}).json()["id"]
               for u in (USERS[0], USERS[2])}
    greedy = asyncio.run(_execute(hub, USERS[2], kernels[USERS[2]], "import torch\nx = torch.ones(2**30)  # 4 GiB",
                                  timeout=120))
    assert greedy["status"] in ("restarting", "dead"), greedy
    out = asyncio.run(_execute(hub, USERS[0], kernels[USERS[0]], "print(6 * 7)"))
    assert out["status"] == "ok" and out["stdout"].strip() == "42"
