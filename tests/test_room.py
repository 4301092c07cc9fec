"""The room's server (workshop mode): lessons use it when COURSE_SERVER_URL is set, and refuse clearly when it
is wrong, unreachable or refuses the key; a learner's stop() leaves it running; the simulated room reports its
figures; lesson 10 runs top to bottom against it."""
from pathlib import Path

import httpx
import pytest

from course_lib.measure import workshop
from course_lib.serve import room
from course_lib.serve.serving import ServerHandle, free_port, start_server


@pytest.fixture(scope="module")
def keyed(tiny, tokenizer):
    server = room.room_server(tiny, tokenizer, free_port(), api_key="room-key", max_tokens_cap=8)
    yield server
    server.stop()


def env(url=None, key=None):
    return {k: v for k, v in {room.ROOM_URL: url, room.ROOM_KEY: key}.items() if v is not None}


def test_without_the_setting_a_lesson_starts_its_own_server(tiny, tokenizer):
    server = room.lesson_server(tiny, tokenizer, environ={}, max_tokens_cap=4)
    try:
        assert isinstance(server, ServerHandle) and not server.shared and server.url.startswith("http://127.0.0.1:")
        assert server.headers == {} and httpx.get(server.url + "/health").json()["status"] == "ok"
    finally:
        server.stop()


def test_with_the_setting_a_lesson_uses_the_room_and_leaves_it_running(keyed, tiny, tokenizer, capsys):
    server = room.lesson_server(tiny, tokenizer, environ=env(keyed.url + "/", "room-key"), max_tokens_cap=4)
    said = capsys.readouterr().out
    assert server.shared and server.url == keyed.url and "room's server" in said and "max_tokens_cap" in said
    reply = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    server.stop()
    assert "keeps running" in capsys.readouterr().out
    assert httpx.get(keyed.url + "/health").json()["status"] == "ok"  # still serving the others
    assert httpx.get(keyed.url + "/health").json()["kv_blocks"]["total"] > 0  # the room runs the paged cache


def test_a_wrong_key_an_absent_server_and_a_bad_address_are_refused_clearly(keyed, tiny, tokenizer):
    with pytest.raises(room.RoomUnreachable, match="refuses the key"):
        room.lesson_server(tiny, tokenizer, environ=env(keyed.url, "wrong"))
    with pytest.raises(room.RoomUnreachable, match="none was set"):
        room.lesson_server(tiny, tokenizer, environ=env(keyed.url))
    with pytest.raises(room.RoomUnreachable, match=f"unset {room.ROOM_URL}"):
        room.lesson_server(tiny, tokenizer, environ=env(f"http://127.0.0.1:{free_port()}"))
    for bad in ("192.168.1.20:8000", "ftp://host:21", "http://host:8000/v1", "http://:8000"):
        with pytest.raises(ValueError, match="not a server address"):
            room.room_url(env(bad))
    assert room.room_url(env("  ")) is None and room.room_url({}) is None
    with pytest.raises(ValueError, match="one of"):
        room.room_server(tiny, tokenizer, free_port(), fmt="int2")


def test_something_that_is_not_a_course_server_is_refused(tiny, tokenizer):
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Teapot(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the standard library's name
            self.send_response(418)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = HTTPServer(("127.0.0.1", 0), Teapot)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(room.RoomUnreachable, match="HTTP 418"):
            room.lesson_server(tiny, tokenizer, environ=env(f"http://127.0.0.1:{other.server_port}"))
    finally:
        other.shutdown()


def test_learners_scripts_and_the_room_figures(keyed, tiny, tokenizer):
    script = workshop.learner_script(2, requests=4)
    assert script == workshop.learner_script(2, requests=4) and script != workshop.learner_script(3, requests=4)
    assert [r.kind for r in script] == ["chat", "story", "shared_prefix", "chat"]
    assert script[1].max_tokens == 2 * script[0].max_tokens
    with pytest.raises(ValueError):
        workshop.learner_script(0, requests=0)
    with pytest.raises(ValueError, match="loopback"):
        workshop.room_load("http://10.0.0.1:8000", 2)
    open_server = start_server(tiny, tokenizer, free_port(), kv_cache="paged", max_tokens_cap=8, max_concurrent=8)
    try:  # room_load sends no key: an unkeyed server, and the keyed one refuses every request visibly
        row = workshop.room_load(open_server.url, 3, requests=2, max_tokens=4, think=(0.0, 0.05))
        refused = workshop.room_load(keyed.url, 1, requests=1, max_tokens=4, think=(0.0, 0.0))
    finally:
        open_server.stop()
    assert row["learners"] == 3 and row["requests"] == 6 and row["finished"] == 6 and not row["errors"]
    assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and row["itl_p99_s"] > 0
    assert refused["finished"] == 0 and "401" in refused["errors"][0]


def test_the_learner_count_within_targets():
    row = lambda n, ttft, itl, done=None: {"learners": n, "requests": 4 * n, "finished": 4 * n if done is None else done,  # noqa: E731
                                           "ttft_p99_s": ttft, "itl_p99_s": itl}
    rows = [row(1, 0.3, 0.05), row(4, 0.9, 0.1), row(8, 1.9, 0.2), row(16, 4.0, 0.3)]
    assert workshop.learners_within(rows) == 8
    assert workshop.learners_within(rows[:2] + [row(8, 1.0, 0.1, done=31)] + rows[3:]) == 4  # a lost answer fails
    assert workshop.learners_within([row(1, 2.5, 0.05), row(4, 1.0, 0.1)]) == 0  # a smaller count failed first


@pytest.mark.slow
def test_lesson_10_runs_against_the_room_server(model, tokenizer, monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    server = room.room_server(model, tokenizer, free_port(), api_key="room-key")
    try:
        monkeypatch.setenv(room.ROOM_URL, server.url)
        monkeypatch.setenv(room.ROOM_KEY, "room-key")
        monkeypatch.setenv("COURSE_PROGRESS", "0")
        monkeypatch.setenv("MPLBACKEND", "agg")
        path = Path(__file__).parents[1] / "notebooks" / "10_serving.ipynb"
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=600, kernel_name="llm-course",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        served = httpx.get(server.url + "/health").json()["served"]
    finally:
        server.stop()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "using the room's server" in text and "keeps running" in text
    assert "same as above: True" in text  # the room's float32 paged server gives the lesson's own server's answer
    assert served >= 12  # sections 1-4 went to the room (2 + 2 streams + 1 + 8 clients + the clamp ...)


@pytest.mark.skipif(__import__("sys").platform == "win32", reason="SIGINT to a child process is POSIX")
def test_the_room_command_serves_until_interrupted():
    import signal
    import subprocess
    import sys
    assert subprocess.run([sys.executable, "-m", "course_lib", "room", "--port", "0"], capture_output=True,
                          text=True).returncode == 2
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "course_lib", "room", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:  # the model loads, then the server says where it is
            lines.append(line)
            if line.startswith("room: serving"):
                break
        assert f"COURSE_SERVER_URL=http://127.0.0.1:{port}" in proc.stdout.readline(), lines
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert health["status"] == "ok" and health["kv_blocks"]["total"] > 0
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 0 and "room: stopped" in rest
