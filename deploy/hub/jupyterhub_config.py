"""A JupyterHub for a workshop on one machine: `.venv/bin/jupyterhub -f deploy/hub/jupyterhub_config.py`.

What it does: every learner gets a JupyterLab on this machine, started from the course's own .venv, so the kernel
"LLM course (.venv)" is installed once for everyone and the model's cache (.course_cache, or COURSE_CACHE_DIR) is
one copy on disk that every kernel reads. Each learner's server runs in a memory cgroup of its own with a limit
(HUB_SEAT_MEMORY, default 5G: the instructor guide's measured seat, lesson 12 included) where this machine lets the
hub make cgroups (root, cgroup v1 or v2); elsewhere the limit is printed as not enforced. A learner's home is
HUB_HOMES/<name> (default /tmp/llm-course-hub), with a copy of the lessons made at the first start.
What it does not do: isolate learners from one another (the servers run as the hub's user: SimpleLocalProcessSpawner
is JupyterHub's spawner for tests and trusted rooms; The Littlest JupyterHub makes a system user per learner), or
serve over TLS. Log-in: DummyAuthenticator with HUB_PASSWORD (any name; set a password for a room), or the
admin token HUB_ADMIN_TOKEN through the REST API (the tests do that).

Settings (environment): HUB_IP (127.0.0.1), HUB_PORT (8000), HUB_API_PORT (8081), HUB_STATE (folder for the
database and secrets, default HUB_HOMES/.hub), HUB_SEAT_MEMORY, HUB_SEAT_CPUS (torch threads per kernel, default 1:
thirty kernels each taking every core would all crawl; lessons that time kernels set their own), HUB_PASSWORD,
HUB_ADMIN_TOKEN,
HUB_PROXY (configurable-http-proxy's path; default deploy/hub/node_modules/.bin/ then PATH).
"""
import os
import shutil
import sys
from pathlib import Path

from jupyterhub.spawner import SimpleLocalProcessSpawner

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VENV_BIN = Path(sys.executable).parent
HOMES = Path(os.environ.get("HUB_HOMES", "/tmp/llm-course-hub"))
STATE = Path(os.environ.get("HUB_STATE", HOMES / ".hub"))
SEAT = os.environ.get("HUB_SEAT_MEMORY", "5G")
CGROUP_NAME = "llm-course-hub"
c = get_config()  # noqa: F821 - JupyterHub's config loader provides it


def _bytes(size: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(size[:-1]) * units[size[-1].upper()]) if size[-1].upper() in units else int(size)


def _cgroup_dir(user: str) -> tuple[Path, str] | None:
    """(folder, limit file) of this user's memory cgroup, made if this machine allows it; None where it does not."""
    for base, limit in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"), (Path("/sys/fs/cgroup"), "memory.max")):
        if not (base / "cgroup.procs").exists() or (limit == "memory.max" and not (base / "cgroup.controllers").exists()):
            continue
        folder = base / CGROUP_NAME / user
        try:
            if folder.exists():  # a fresh group per start, so its peak is this server's
                try:
                    folder.rmdir()
                except OSError:  # a process of the last start is still exiting: keep the group, restart its peak
                    if limit == "memory.limit_in_bytes":
                        (folder / "memory.max_usage_in_bytes").write_text("0")
            if limit == "memory.max":  # cgroup v2: the parent must hand the memory controller down
                (base / CGROUP_NAME).mkdir(exist_ok=True)
                (base / CGROUP_NAME / "cgroup.subtree_control").write_text("+memory")
            folder.mkdir(parents=True, exist_ok=True)
            return folder, limit
        except OSError:
            continue
    return None


class CourseSpawner(SimpleLocalProcessSpawner):
    """SimpleLocalProcessSpawner with a home per learner holding a copy of the lessons, and mem_limit enforced by a
    memory cgroup where the hub can make one (`memory_enforced` says which)."""

    memory_enforced = False

    def make_preexec_fn(self, name):
        parent = super().make_preexec_fn(name)
        group = _cgroup_dir(name) if self.mem_limit else None
        if group is not None:
            folder, limit = group
            (folder / limit).write_text(str(self.mem_limit))
            self.memory_enforced = True
        else:
            self.log.warning("memory limit %s for %s is not enforced: this hub cannot make memory cgroups "
                             "(run it as root on Linux, or use The Littlest JupyterHub's systemd spawner)",
                             self.mem_limit, name)

        def preexec():
            if group is not None:
                (group[0] / "cgroup.procs").write_text(str(os.getpid()))
            parent()
        return preexec

    async def start(self):
        lessons = Path(self.home_dir) / "notebooks"
        if not lessons.exists():
            lessons.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(ROOT / "notebooks", lessons, ignore=shutil.ignore_patterns("src", ".ipynb_checkpoints"))
            for folder in ("data", "solutions"):  # the lessons read ../data; the exercises point to ../solutions
                (Path(self.home_dir) / folder).symlink_to(ROOT / folder)
        return await super().start()


STATE.mkdir(parents=True, exist_ok=True)
proxy = os.environ.get("HUB_PROXY") or str(HERE / "node_modules" / ".bin" / "configurable-http-proxy")
if not Path(proxy).exists():
    proxy = shutil.which("configurable-http-proxy") or proxy

c.JupyterHub.ip = os.environ.get("HUB_IP", "127.0.0.1")
c.JupyterHub.port = int(os.environ.get("HUB_PORT", "8000"))
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = int(os.environ.get("HUB_API_PORT", "8081"))
c.ConfigurableHTTPProxy.command = [proxy]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{int(os.environ.get('HUB_PROXY_API_PORT', '8001'))}"
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")
c.JupyterHub.cleanup_servers = True

c.JupyterHub.authenticator_class = "dummy"
if os.environ.get("HUB_PASSWORD"):
    c.DummyAuthenticator.password = os.environ["HUB_PASSWORD"]
c.Authenticator.allow_all = True

c.JupyterHub.spawner_class = CourseSpawner
c.CourseSpawner.home_dir_template = str(HOMES / "{username}")
c.Spawner.cmd = [str(VENV_BIN / "jupyterhub-singleuser")]
# A kernel whose tab was closed keeps its model in memory: shut it down after 10 idle minutes (kernels with a tab
# open are never culled), so a seat's memory limit holds one lesson at a time.
c.Spawner.args = ["--MappingKernelManager.cull_idle_timeout=600", "--MappingKernelManager.cull_interval=60",
                  "--MappingKernelManager.cull_connected=False"] + (["--ServerApp.allow_root=True"] if os.getuid() == 0 else [])
c.Spawner.default_url = "/lab/tree/notebooks/00_pipeline_tour.ipynb"
c.Spawner.mem_limit = SEAT
CPUS = os.environ.get("HUB_SEAT_CPUS", "1")  # threads per learner's kernel: a seat shares the machine's cores
c.Spawner.environment = {"COURSE_CACHE_DIR": os.environ.get("COURSE_CACHE_DIR", str(ROOT / ".course_cache")),
                         "MEM_LIMIT_BYTES": str(_bytes(SEAT)), "OMP_NUM_THREADS": CPUS, "MKL_NUM_THREADS": CPUS}
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120

if os.environ.get("HUB_ADMIN_TOKEN"):
    c.JupyterHub.services = [{"name": "course-admin", "api_token": os.environ["HUB_ADMIN_TOKEN"]}]
    c.JupyterHub.load_roles = [{"name": "course-admin", "services": ["course-admin"],
                                "scopes": ["admin:users", "admin:servers", "admin:server_state", "access:servers", "read:users"]}]
