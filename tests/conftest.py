from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SEEDS = ROOT.parent / "shared" / "seeds"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Bytecode caching on, whatever PYTHONDONTWRITEBYTECODE says (some images set it): without it every xdist
# worker rewrites and compiles every test module again (about 3 s of CPU each), and every `python -m
# forwarder` the tests start compiles the product again. The workers write the caches (__pycache__, git-
# ignored) as they import; the subprocesses read them.
sys.dont_write_bytecode = False


def pytest_sessionstart(session: pytest.Session) -> None:
    """A parallel run compiles once, before the workers start (xdist starts them after this hook): the
    product, and each test module rewritten the way pytest imports it. Otherwise on a fresh checkout
    every worker rewrites every test module at the same moment (about 3 s of CPU each). Uses pytest's
    own rewriting functions; with another pytest that lacks them, the workers simply do it themselves."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    import compileall

    for package in ("forwarder", "sinks", "benchmarks", "deploy"):  # what the agents and tools the tests start import
        compileall.compile_dir(str(ROOT / package), quiet=2)
    try:
        from _pytest.assertion.rewrite import (PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc, assertstate_key,
                                               get_cache_dir, try_makedirs)
        state = config.stash[assertstate_key]
    except (ImportError, KeyError):  # another pytest, or --assert=plain: nothing to prepare
        return
    for source in sorted((ROOT / "tests").rglob("test_*.py")):
        cache_dir = get_cache_dir(source)
        pyc = cache_dir / (source.name[:-3] + PYC_TAIL)
        if try_makedirs(cache_dir) and _read_pyc(source, pyc) is None:
            source_hash, code = _rewrite_test(source, config)
            _write_pyc(state, code, source_hash, pyc)


# Hypothesis profiles, chosen by SEFWD_HYPOTHESIS: "ci" (the default, what the README's test command
# and CI run) gives every property the example count its test asks for; "dev" (the inner loop) a tenth.
# A test with its own count writes `@settings(max_examples=examples(2000))`.
HYPOTHESIS_PROFILES = {"ci": 1.0, "dev": 0.1}
HYPOTHESIS_PROFILE = os.environ.get("SEFWD_HYPOTHESIS", "ci")
if HYPOTHESIS_PROFILE not in HYPOTHESIS_PROFILES:
    raise RuntimeError(f"SEFWD_HYPOTHESIS must be one of {', '.join(HYPOTHESIS_PROFILES)}, got {HYPOTHESIS_PROFILE!r}")
settings.register_profile("ci", print_blob=True)
settings.register_profile("dev", max_examples=10)
settings.load_profile(HYPOTHESIS_PROFILE)


def examples(count: int) -> int:
    """``count`` Hypothesis examples in the "ci" profile, a tenth (at least 10) in "dev"."""
    return max(10, round(count * HYPOTHESIS_PROFILES[HYPOTHESIS_PROFILE]))


# -- parallel runs (pytest -n N, pytest-xdist) ----------------------------------------------------
# Tests are handed to the workers one unit at a time: a test function (all its parametrizations
# together, so a module-scoped fixture only they use is set up once), or a whole file when it defines
# a module- or class-scoped fixture. The longest units go first (longest-processing-time-first), so
# that a long one never starts last and holds the run up alone at the end: their seconds come from
# tests/durations.json, written by a run with SEFWD_RECORD_DURATIONS=1 (a unit it does not know counts
# half a second per test). Stale figures only make the order less good, never a test wrong.

WORKERS_PER_CORE = 6  # most tests wait on processes and sockets, not on the CPU (2 cores: 12 workers)
MAX_WORKERS = 24


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """The worker count of ``-n auto`` (the default, pyproject.toml's addopts): SEFWD_TEST_WORKERS if
    set; none (this process) for a run of one test file or of named tests, where starting workers
    costs more than it saves; else WORKERS_PER_CORE per core, at most MAX_WORKERS."""
    if os.environ.get("SEFWD_TEST_WORKERS"):
        return int(os.environ["SEFWD_TEST_WORKERS"])
    named = [a for a in config.args if not Path(a.split("::", 1)[0]).is_dir()]
    if named and len(named) == len(config.args) and len({a.split("::", 1)[0] for a in named}) == 1:
        return 0
    return min(MAX_WORKERS, WORKERS_PER_CORE * _cores())


def _cores() -> int:
    """The cores this process may use: its CPU affinity, and a container's CPU quota (cgroup v2 cpu.max)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _function_of(nodeid: str) -> str:
    """The test function: the node id less its parametrization."""
    return nodeid.split("[", 1)[0]


_SHARES_FIXTURES: dict[str, bool] = {}


def _shares_fixtures(path: str) -> bool:
    """Whether the test file defines a fixture shared by its tests (module or class scope)."""
    if path not in _SHARES_FIXTURES:
        try:
            text = (ROOT / path).read_text(encoding="utf-8")
        except OSError:
            text = 'scope="module"'  # unknown: the safe choice, one worker
        _SHARES_FIXTURES[path] = any(f"scope={q}{s}{q}" in text for q in "\"'" for s in ("module", "class", "package"))
    return _SHARES_FIXTURES[path]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "load":  # an explicit --dist loadfile, loadscope, ... is obeyed
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFunctionOrSharingFile(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

    config.option.loadscopereorder = False  # the workers' collection order already says what goes first
    return ByFunctionOrSharingFile(config, log)


DURATIONS = Path(__file__).resolve().parent / "durations.json"
UNKNOWN_TEST_SECONDS = 0.5


def _unit_of(nodeid: str) -> str:
    """The unit the scheduler hands out: the whole file if it shares a fixture, else the test function."""
    path = _file_of(nodeid)
    return path if _shares_fixtures(path) else _function_of(nodeid)


def _recorded_durations() -> dict[str, float]:
    try:
        data = json.loads(DURATIONS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput") or _random_order(config):  # a plain or random-order run keeps its order
        return
    recorded = _recorded_durations()
    functions: dict[str, int] = {}  # test function -> its items in this run
    for item in items:
        function = _function_of(item.nodeid)
        functions[function] = functions.get(function, 0) + 1
    estimate: dict[str, float] = {}  # a unit's seconds: recorded per test function, summed over a file that is one unit
    for function, count in functions.items():
        unit = _unit_of(function)
        estimate[unit] = estimate.get(unit, 0.0) + recorded.get(function, UNKNOWN_TEST_SECONDS * count)
    # A stable sort: each unit's tests stay together and in their order.
    items.sort(key=lambda item: -estimate[_unit_of(item.nodeid)])


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With SEFWD_RECORD_DURATIONS=1, add up each test function's seconds (setup, call, teardown)."""
    if os.environ.get("SEFWD_RECORD_DURATIONS") == "1":
        function = _function_of(report.nodeid)
        _measured[function] = _measured.get(function, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With SEFWD_RECORD_DURATIONS=1, the controller (or a plain run) rewrites tests/durations.json: each
    function's longest time seen (a first run on a fresh checkout, where mypy has no cache, counts: a
    test that is only sometimes long must still start early). Delete the file to start over."""
    if os.environ.get("SEFWD_RECORD_DURATIONS") != "1" or hasattr(session.config, "workerinput") or not _measured:
        return
    recorded = _recorded_durations()
    merged = recorded | {k: round(max(v, recorded.get(k, 0.0)), 2) for k, v in _measured.items()}
    DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n", encoding="utf-8")


def _random_order(config: pytest.Config) -> bool:
    """Whether pytest-random-order shuffles this run (--random-order, --random-order-bucket/-seed)."""
    try:
        from random_order.config import Config
    except ImportError:
        return False
    try:
        return bool(Config(config).is_enabled)
    except ValueError:  # the plugin is installed but not loaded (-p no:random_order)
        return False
