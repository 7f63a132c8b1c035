import atexit
import os
import shutil
import tempfile

import pytest

# Tests run on the CPU; a few simulate several devices (see tests that set their own flags in subprocesses).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


def _session_compilation_cache() -> None:
    """One JAX compilation cache for the session, this process and every subprocess it starts (they
    inherit the variable): the tests train the same tiny models in many fresh processes, and a
    program compiled once is then loaded instead of compiled again. A directory of our own, removed at
    exit; a cache the caller set up (JAX_COMPILATION_CACHE_DIR already set) is used and kept."""
    # JAX caches only programs that took over a second to compile by default; a training process also
    # compiles dozens of small ones (initialisation, optimizer state, evaluation), ~1 s of its ~20 s
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="qkvflow-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


_session_compilation_cache()


def _cheap_compiles() -> None:
    """Cheaper XLA CPU compiles for the session and its subprocesses: the suite is bound by compiling a
    thousand small programs that each run for milliseconds. LLVM at -O0
    (`--xla_backend_optimization_level=0`) and, on the jaxlib these flags were measured with (0.10),
    XLA's classic fusion emitters (`--xla_cpu_use_fusion_emitters=false`; another jaxlib may not know
    the flag, and XLA aborts on an unknown one). A subset of the suite took 631 s of user CPU with both,
    805 s with -O0 alone and 1,007 s at XLA's defaults (2026-11-27, a niced study beside it; docs/contributing.md,
    "Keeping the suite fast"), measured by setting XLA_FLAGS to each choice in

        /usr/bin/time -f %U .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile \
            tests/test_faults.py tests/models/test_lm.py tests/test_accelerator_script.py tests/integrate tests/nn

    With both flags one test failed and was wrong: tests/integrate/test_scan.py held a gradient that
    cancels to ~1e-14 to 1e-4 of its own size instead of the round-off of the gradients that cancel in
    it (fixed there); every other test passed unchanged. HLO passes run as always;
    only code generation changes, so results can differ from the default build in the last bits, which
    the tests' round-off tolerances allow. Flags the caller set in XLA_FLAGS are kept and win:
    `XLA_FLAGS="--xla_backend_optimization_level=3 --xla_cpu_use_fusion_emitters=true" pytest` tests
    XLA's default build."""
    from importlib.metadata import version

    if "QKVFLOW_TESTS_XLA_FLAGS" in os.environ:  # set by the pytest process that started this one
        return
    flags = os.environ.get("XLA_FLAGS", "")
    ours = ["--xla_backend_optimization_level=0"]
    if version("jaxlib").startswith("0.10."):
        ours.append("--xla_cpu_use_fusion_emitters=false")
    chosen = [f for f in ours if f.split("=")[0] not in flags]
    if len(chosen) < len(ours):
        os.environ["QKVFLOW_TESTS_CALLER_XLA_FLAGS"] = "1"  # tests/test_suite_setup.py
    os.environ["XLA_FLAGS"] = " ".join([flags, *chosen]).strip()
    os.environ["QKVFLOW_TESTS_XLA_FLAGS"] = os.environ["XLA_FLAGS"]


_cheap_compiles()


def _collect_less() -> None:
    """The test processes collect garbage as seldom as a `qkvflow` process does (qkvflow.cli.collect_less):
    a test process holds the traced programs of every test before it, and at Python's default thresholds
    tests/models/test_node_lm.py and tests/integrate spent 13.6 s of their 117 s collecting, 5.6 s of 108 s
    at qkvflow's (`python benchmarks/gc_time.py [--thresholds 700,10,10] -m pytest -q -p no:cacheprovider
    tests/models/test_node_lm.py tests/integrate`, one process, 2026-11-28)."""
    from qkvflow.cli import collect_less

    collect_less()


_collect_less()


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory):
    """The offline pydoc corpus and its tokenizer, built once per test session (its Levanter cache,
    built by the first training run, is then shared by every test that trains)."""
    from qkvflow.data.corpora import prepare_corpus

    root = tmp_path_factory.getbasetemp() / "shared_corpora"
    prepare_corpus("pydoc", str(root))  # reuses a finished build, publishes atomically
    return root


# The longest test files first. Seconds of one xdist worker, from `pytest -n 2 --durations=120` on the 2-core
# machine (2026-11-26, load 3-5 from a study running beside it): models/test_lm 381, inference/test_cached_decoding
# 364, evaluation/test_harness 342, bench/test_compare 340, test_faults 327, test_train 301 (with the shared
# reference run, tests/train_utils.reference_run), test_accelerator_script 278, test_multiprocess 246,
# test_dial_resume 212 (one test), test_finetune 162, models/test_depth_dial 134, the rest under 110 each.
# pytest-xdist's `--dist loadfile` hands each file to whichever worker is free, in collection order
# (pyproject's addopts turn off its reordering by test count, which put the long files with few tests
# last): starting them first keeps both workers busy to the end instead of one worker finishing a long
# file alone. test_train and test_faults stay first: both wait on the reference run, built once.
LONGEST_FIRST = [
    "tests/test_train.py",
    "tests/test_faults.py",
    "tests/models/test_lm.py",
    "tests/inference/test_cached_decoding.py",
    "tests/evaluation/test_harness.py",
    "tests/bench/test_compare.py",
    "tests/test_accelerator_script.py",
    "tests/test_multiprocess.py",
    "tests/test_dial_resume.py",
    "tests/test_finetune.py",
    "tests/models/test_depth_dial.py",
    "tests/models/test_official_verbs.py",
    "tests/data/test_tokenizer.py",
    "tests/evaluation/test_perplexity.py",
    "tests/inference/test_generate_cli.py",
    "tests/test_bad_input.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
    _per_test_timeouts(config, items)


def _per_test_timeouts(config, items) -> None:
    """pytest-timeout's limit on every test that sets none of its own: `timescale.PER_TEST` seconds times
    QKVFLOW_TEST_TIME_SCALE (tests/timescale.py), so that a hang fails its test instead of freezing CI. A
    limit the caller chose (`--timeout`, PYTEST_TIMEOUT or a `timeout` ini setting) wins; without the
    plugin (not the `test` extra) nothing is added."""
    from tests.timescale import PER_TEST, limit

    if not config.pluginmanager.hasplugin("timeout"):
        return
    if config.getoption("timeout", None) is not None or os.environ.get("PYTEST_TIMEOUT") or config.getini("timeout"):
        return
    mark = pytest.mark.timeout(limit(PER_TEST))
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(mark)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """No "bringing up nodes..." lines under `-q`. pytest-xdist (3.8) writes its status line as each
    worker is set up and again when collection is done; on a terminal it rewrites one line in place,
    but when the output is a file or a pipe (CI, a log) each is a new line, and under `-q` both read
    "bringing up nodes...". Quiet mode shows neither, as pytest -q without xdist shows no header (what
    xdist's maintainers chose for -q in pytest-xdist#375). The reporter is xdist's own
    `TerminalDistReporter`, registered before the session starts; without xdist nothing changes."""
    reporter = session.config.pluginmanager.getplugin("terminaldistreporter")
    if reporter is not None and session.config.option.verbose < 0 and hasattr(reporter, "ensure_show_status"):
        reporter.ensure_show_status = lambda: None


def pytest_sessionfinish(session):
    """Collect the session's garbage while the session still runs, then freeze what is left (`gc.freeze`:
    later collections skip it). A test process collects rarely (`_collect_less`), so its garbage, traced
    and compiled JAX programs among it, waited for pytest's last collection in `pytest_unconfigure`,
    which also walked every live object (about a million in a worker that ran one test file). In an
    xdist worker that comes after the worker has told the controller it finished; once every worker has, the
    controller shuts their execnet gateways down, and execnet, when a worker's main thread is still busy
    5 s later, sends that worker a SIGINT (execnet.gateway_base.WorkerGateway._terminate_execution). It
    arrived during that collection, as a KeyboardInterrupt inside a weakref callback: the suite's
    PytestUnraisableExceptionWarning (tests/test_suite_setup.py reproduces it). Here the collection
    happens before xdist reports the end (its `pytest_sessionfinish` wrapper reports after every
    implementation), and the last one has only what was allocated since."""
    import gc

    gc.collect()
    gc.freeze()
