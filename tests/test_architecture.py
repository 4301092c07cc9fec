"""The engine's shape, as tests that read the code (ENGINE.md's invariants): the import graph has no cycle,
function-local imports included; the runner and the caches never import the loop; and one place,
forward.run_model, calls a model with a cache."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "course_lib"
MODEL_NAMES = {"model", "runner", "hf_model", "ours", "library", "short"}  # what the code calls a runner


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    """course_lib modules this module imports anywhere (top level and inside functions)."""
    package = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("course_lib")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("course_lib"):
                continue
            found.add(target)
            for alias in node.names:  # `from . import x` imports the module course_lib.x
                found.add(f"{target}.{alias.name}")
    return found


def graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: modules it imports}, only modules present in `sources` ({name: (source, is_package)})."""
    edges = {}
    for name, (source, is_package) in sources.items():
        edges[name] = {m for m in imports_of(ast.parse(source), name, is_package) if m in sources and m != name}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(edges, start) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.fixture(scope="module")
def sources():
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in ROOT.rglob("*.py")}


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    fake = {"course_lib": ("", True),
            "course_lib.a": ("from .b import x\n", False),
            "course_lib.b": ("def f():\n    from .c import y\n", False),
            "course_lib.c": ("def g():\n    from . import a\n", False)}
    assert find_cycle(graph(fake)) == ["course_lib.a", "course_lib.b", "course_lib.c", "course_lib.a"]
    fake["course_lib.c"] = ("import torch\n", False)
    assert find_cycle(graph(fake)) is None


def test_no_import_cycle_function_local_imports_included(sources):
    edges = graph(sources)
    assert edges["course_lib.runner.forward"] == set()  # the runner call sits at the bottom
    assert find_cycle(edges) is None, f"import cycle: {' -> '.join(find_cycle(edges))}"


@pytest.mark.parametrize("module", ["runner.forward", "engine.request", "engine.sampling", "runner.kv_cache",
                                    "runner.paged", "runner.layout", "runner.model", "runner.formats",
                                    "engine.stages", "engine.schedulers", "engine.paged_scheduler"])
def test_runner_caches_pickers_and_schedulers_never_reach_the_loop(sources, module):
    """ENGINE.md's layers: a runner, a cache, a picker or a scheduler knows no loop (not even through another
    module): generation.step sits above what it drives."""
    below = reachable(graph(sources), f"course_lib.{module}")
    assert not below & {"course_lib.engine.generation", "course_lib.engine.speculative", "course_lib.serve.serving",
                        "course_lib.serve.engine_thread"}, below


# The floors of the house, lowest first: a module imports only from its own floor or the ones below it (function-local
# imports included). The top-level modules are named one by one; a wing is every module under its folder.
FLOORS = [
    ("runtime",),
    ("loading",),
    ("text",),
    ("runner",),
    ("inside",),
    ("engine",),
    ("serve",),
    ("views",),
    ("measure",),
    ("exercises",),
    ("doctor", "__main__", ""),  # "" is course_lib/__init__.py
]


def floor_of(module: str) -> int:
    """The floor of a course_lib module: its wing's, or its own for a top-level module."""
    parts = module.split(".")[1:]
    name = parts[0] if parts else ""
    for i, floor in enumerate(FLOORS):
        if name in floor:
            return i
    raise KeyError(f"{module} is on no floor: add its wing or name to FLOORS")


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every import that runs up a floor."""
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if floor_of(b) > floor_of(a))


def test_the_floor_check_finds_a_planted_upward_import():
    fake = {"course_lib": ("", True), "course_lib.runner": ("", True), "course_lib.engine": ("", True),
            "course_lib.views": ("", True), "course_lib.measure": ("", True),
            "course_lib.runner.model": ("def f():\n    from ..engine import generation\n", False),
            "course_lib.engine.generation": ("from ..runner import model\n", False),
            "course_lib.views.plots": ("from ..measure import peers\n", False),
            "course_lib.measure.peers": ("from ..views import plots\n", False)}
    assert upward_imports(graph(fake)) == ["course_lib.runner.model -> course_lib.engine",
                                           "course_lib.runner.model -> course_lib.engine.generation",
                                           "course_lib.views.plots -> course_lib.measure",
                                           "course_lib.views.plots -> course_lib.measure.peers"]


def test_no_import_runs_up_a_floor(sources):
    """The runner never imports the engine, views never import measure, nothing imports a floor above its own."""
    edges = graph(sources)
    assert all(floor_of(m) is not None for m in edges)  # every module sits on a floor
    assert not upward_imports(edges), upward_imports(edges)


def test_every_module_is_one_stage_of_a_few_hundred_lines():
    """A module over 300 lines is split, or listed here with why it is one stage all the same."""
    long = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    over = {name: n for name, n in long.items() if n > 300 and name not in LONG_MODULES}
    assert not over, over
    assert all(long.get(name, 0) > 300 for name in LONG_MODULES), "stale entries in LONG_MODULES"


LONG_MODULES = {  # module -> why it stays whole
    "views/plots_perf.py": "lessons 08-13's performance figures: one small function per figure, none over 60 lines",
    "views/plots.py": "the shared drawing helpers and Part I's figures: one small function per figure",
    "runner/model.py": "SmolLM2 written out, read beside lesson 11 as one file: layer parts, the model, loading",
    "runner/formats.py": "lesson 12's weight formats, each a linear layer, and convert(): one stage, read beside it",
}


def model_calls_with_a_cache(source: str) -> list[str]:
    """'function:line' of every call of a runner with a cache: a call passing input_ids= or made on a name that
    holds a runner, with a cache= (or past_key_values=) keyword."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            words = {k.arg for k in node.keywords}
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            is_model = "input_ids" in words or callee in MODEL_NAMES
            if is_model and words & {"cache", "past_key_values"}:
                found.append(f"{func.name}:{node.lineno}")
    return found


def test_the_call_finder_sees_a_bypass():
    bypass = "def sneaky(model, ids, c):\n    return model(ids, cache=c)\n"
    assert model_calls_with_a_cache(bypass) == ["sneaky:2"]
    assert model_calls_with_a_cache("def fine(model, ids):\n    return model(input_ids=ids)\n") == []


def test_one_place_calls_a_model_with_a_cache(sources):
    calls = {name: model_calls_with_a_cache(src) for name, (src, _) in sources.items()}
    calls = {name: found for name, found in calls.items() if found}
    assert list(calls) == ["course_lib.runner.forward"] and len(calls["course_lib.runner.forward"]) == 1, calls
    assert calls["course_lib.runner.forward"][0].startswith("run_model:")


def test_both_runners_and_every_cache_meet_the_declared_contracts(tiny):
    from course_lib.runner.forward import Runner
    from course_lib.runner.kv_cache import Cache, KVCache, new_cache
    from course_lib.runner.model import Model
    from course_lib.runner.paged import BlockPool
    from course_lib.runner.blocks import Sequence
    ours = Model.from_transformers(tiny)
    assert isinstance(tiny, Runner) and isinstance(ours, Runner)
    pool = BlockPool.for_model(ours, 4)
    caches = [new_cache(ours, 1, 8), pool.view([Sequence([1, 2])])]
    assert all(isinstance(c, Cache) for c in caches) and isinstance(caches[0], KVCache)
    assert not isinstance(new_cache(tiny, 1, 8), Cache)  # transformers' own: kv_cache.length_of / rollback translate


def test_every_module_imports_and_every_imported_name_exists():
    """A module moved or a name renamed shows here at once, not in a notebook twenty minutes into the suite."""
    import importlib
    import pkgutil
    import course_lib
    for info in pkgutil.walk_packages(course_lib.__path__, "course_lib."):
        importlib.import_module(info.name)
    top = ROOT.parent
    missing = []
    for path in [*top.glob("notebooks/src/*.py"), *top.glob("solutions/*.py"), *top.glob("tests/*.py"),
                 *top.glob("scripts/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("course_lib"):
                module = importlib.import_module(node.module)
                missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and not _is_submodule(node.module, a.name)]
    assert not missing, missing


def _is_submodule(package: str, name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(f"{package}.{name}") is not None


def test_every_generator_names_its_device():
    """torch refuses a generator of another device than the tensor it draws for (CUDA, MPS): a bare
    torch.Generator() is a CPU one, so every one in the package, the lessons and the solutions names its device."""
    assert bare_generators("g = torch.Generator().manual_seed(0)\nh = torch.Generator(device=x.device)") == [1]
    bare = lines_everywhere(bare_generators)
    assert not bare, bare


def bare_generators(source: str) -> list[int]:
    """Lines that make a torch.Generator without naming its device."""
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", None) == "Generator" and not any(k.arg == "device" for k in n.keywords)]


def test_every_numpy_call_moves_its_tensor_to_the_cpu_first():
    """.numpy() refuses a tensor on a GPU: every one in the package, the lessons and the solutions reads from
    .cpu() (a no-op on the CPU), or from a tensor made right there with no device (on the CPU by definition)."""
    assert device_numpy_calls("a = x.numpy()\nb = x.cpu().numpy()\nc = torch.tensor([1]).numpy()\n"
                              "d = torch.tensor([1], device=dev).numpy()") == [1, 4]
    found = lines_everywhere(device_numpy_calls)
    assert not found, found


def lines_everywhere(finder) -> list[str]:
    """path:line for every line `finder` reports in the package, the lessons' sources and the solutions."""
    top = ROOT.parent
    return [f"{path.relative_to(top)}:{line}"
            for path in [*ROOT.rglob("*.py"), *top.glob("notebooks/src/*.py"), *top.glob("solutions/*.py")]
            for line in finder(path.read_text())]


def device_numpy_calls(source: str) -> list[int]:
    """Lines that call .numpy() on a tensor that may not be on the CPU."""
    def safe(receiver) -> bool:
        if not isinstance(receiver, ast.Call):
            return False
        made_here = getattr(receiver.func, "attr", None) in ("tensor", "as_tensor") and not any(
            k.arg == "device" for k in receiver.keywords)
        return getattr(receiver.func, "attr", None) == "cpu" or made_here
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", None) == "numpy" and not safe(n.func.value)]


# Timings that need no synchronize(), each with its reason. A new timing must synchronize the device around the
# timed work (runtime.synchronize, runtime.time_it, measure.timers.best_of) or be added here with a reason.
UNSYNCHRONIZED_TIMINGS = {
    "course_lib/engine/schedulers.py::__init__": "a scheduler's clock start",
    "course_lib/engine/schedulers.py::now": "a stamp taken after tokens were read on the CPU (int(): a sync)",
    "course_lib/doctor.py::check_generation": "generate() returns tokens read on the CPU",
    "course_lib/measure/serving_peers.py::wait_ready": "a readiness deadline over HTTP, no device work timed",
    "course_lib/measure/fork.py::n_fork": "run_paged ends with every token picked on the CPU (int(): a sync)",
    "course_lib/runner/tensor_parallel.py::_rank": "CPU processes only (gloo); each step ends with int(argmax)",
    "course_lib/runner/tensor_parallel.py::reduce": "gloo's all_reduce on CPU tensors returns with the sum in place",
    "course_lib/serve/disagg.py::ask": "bytes read from a socket: the prefill process has finished",
    "course_lib/serve/disagg.py::prefill_blocks": "ends with int(argmax) of the logits: a sync",
    "course_lib/measure/fleet.py::shipped_gaps": "each stamp follows side.step, which returns int(argmax): a sync",
    "course_lib/measure/fleet.py::trace_gaps": "each stamp follows step(), whose pick reads the token on the CPU",
    "course_lib/engine/long_context.py::stream_loss": "the end time is taken after .cpu() of the losses",
    "course_lib/views/widgets.py::update": "a widget redraw on the CPU",
    "course_lib/runner/attention.py::score_times": "CPU tensors made in the function",
    "course_lib/measure/fast_path.py::rows_cost": "CPU kernels only (formats.Int4Linear refuses any other device)",
    "course_lib/loading.py::time_cached_load": "loading ends with the weights in place (a blocking copy)",
    "course_lib/loading.py::load_model": "loading ends with the weights in place (a blocking copy)",
    "course_lib/engine/structured.py::masked": "the mask is computed on the CPU",
    "course_lib/measure/trace.py::run_trace": "the scheduler reads every token on the CPU",
    "course_lib/measure/speed.py::throughput_latency": "generation reads every token on the CPU",
    "course_lib/measure/loop.py::detokenize_ms_per_token": "the detokenizer runs on the CPU",
    "course_lib/measure/loop.py::_widgets_section": "widget redraws on the CPU",
    "course_lib/measure/speculative.py::speculative_section": "generation reads every token on the CPU",
    "course_lib/measure/memory.py::read_bandwidth": "float(sum) reads the result (a sync)",
    "course_lib/measure/memory.py::kernel_bandwidth": "the weight formats' kernels are CPU kernels",
    "course_lib/measure/peers_llama.py::llama_decode": "llama.cpp on the CPU",
    "course_lib/measure/peers_llama.py::llama_prefill": "llama.cpp on the CPU",
    "course_lib/measure/load.py::_send": "a client's wall clock over HTTP",
    "course_lib/measure/load.py::replay": "a client's wall clock over HTTP",
    "course_lib/measure/load.py::decode_gaps": "a client's wall clock over HTTP",
    "course_lib/measure/workshop.py::_learner": "a client's wall clock over HTTP",
    "course_lib/measure/workshop.py::room_load": "a client's wall clock over HTTP",
    "notebooks/src/10_serving.py::<module>": "a client's wall clock over HTTP",
    "notebooks/src/10_serving.py::one_client": "a client's wall clock over HTTP",
    "notebooks/src/10_serving.py::load_test": "a client's wall clock over HTTP",
    "notebooks/src/13_paged_memory.py::<module>": "step(batch) picks tokens on the CPU (a sync)",
}
SYNCS = ("synchronize", "time_it", "best_of")


def unsynchronized_timings(source: str) -> list[str]:
    """Scopes (functions, or <module> for top-level code) that read time.perf_counter() but call none of SYNCS."""
    def calls(scope) -> list[str]:
        names, todo = [], list(ast.iter_child_nodes(scope))
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue  # a nested function is a scope of its own
            if isinstance(node, ast.Call):
                names.append(getattr(node.func, "attr", None) or getattr(node.func, "id", ""))
            todo.extend(ast.iter_child_nodes(node))
        return names

    tree = ast.parse(source)
    scopes = [("<module>", tree)] + [(n.name, n) for n in ast.walk(tree)
                                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = []
    for name, scope in scopes:
        made = calls(scope)
        if "perf_counter" in made and not any(s in made for s in SYNCS):
            found.append(name)
    return found


def test_every_timing_synchronizes_the_device_or_says_why_not():
    """On a GPU a kernel launch returns at once: a timing must wait for the device (synchronize) or read a result
    on the CPU. Every perf_counter() timing in the package, the lessons and the solutions does, or is listed."""
    assert unsynchronized_timings("import time\ndef a():\n    t = time.perf_counter()\n    f()\n"
                                  "def b():\n    synchronize(d)\n    t = time.perf_counter()\n") == ["a"]
    top = ROOT.parent
    found = {f"{path.relative_to(top)}::{scope}"
             for path in [*ROOT.rglob("*.py"), *top.glob("notebooks/src/*.py"), *top.glob("solutions/*.py")]
             for scope in unsynchronized_timings(path.read_text())}
    assert not found - set(UNSYNCHRONIZED_TIMINGS), sorted(found - set(UNSYNCHRONIZED_TIMINGS))
    assert not set(UNSYNCHRONIZED_TIMINGS) - found, f"stale entries: {sorted(set(UNSYNCHRONIZED_TIMINGS) - found)}"
