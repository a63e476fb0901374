import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Ray and vLLM read these at import/start time; tests only ever talk to loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# wandb never tries the network in tests: offline, whatever the machine's environment says.
os.environ["WANDB_MODE"] = "offline"
os.environ.pop("WANDB_API_KEY", None)
os.environ.setdefault("WANDB_SILENT", "true")
# OpenMP threads (torch's intra-op pool in the trainers and in the pytest workers' in-process tests) sleep between
# parallel regions instead of spinning: the suite's three workers keep both cores busy, and a thread that spins on a
# core while the thread it waits for is descheduled takes that core from everyone. Measured with the cores kept
# busy by two other processes, one fault test: its trainer 12.4-14.5 CPU-s and 275-294 s with libgomp's default
# policy, 6.3-7.9 CPU-s and 110-225 s with PASSIVE; on an idle machine no difference (5.0-6.5 CPU-s either way).
# Read by libgomp when torch loads it, so it must be set before anything imports torch; every process the tests
# start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture
def config_dir(tmp_path):
    """An HF model folder with only a config.json (vocabulary 12): enough for flag checks."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 12}))
    return str(tmp_path)


@pytest.fixture(scope="session")
def juicefs_mount(tmp_path_factory):
    """A real JuiceFS volume mounted for the test session (tests/juicefs.py); each test uses a folder of its own
    in it. Unmounted at the session's end, whatever the tests did."""
    from tests.juicefs import juicefs_volume

    with juicefs_volume(str(tmp_path_factory.mktemp("juicefs"))) as mount_point:
        yield mount_point


# Scheduling only. `make test` hands whole files to three pytest-xdist workers (--dist loadfile) in collection order
# (--no-loadscope-reorder; xdist's default would start the files with the most tests first, which put these
# long end-to-end files last, with one worker idle while the others finished them). The files measured longest
# (seconds per file summed over its tests, in a whole clean-clone run: 2026-12-06, its pytest time 35 minutes)
# start first, longest first; the rest keep their order.
LONGEST_FIRST = (
    "tests/faults/test_fault_injection.py",
    "tests/faults/test_trainer_restart.py",
    "tests/e2e/test_elastic.py",
    "tests/e2e/test_main_job.py",
    "tests/e2e/test_bench_smoke_engine.py",
    "tests/faults/test_full_queue_volume.py",
    "tests/e2e/test_sessions_and_hooks.py",
    "tests/faults/test_juicefs_storage_faults.py",
    "tests/e2e/test_kill_resume.py",
    "tests/faults/test_online_gc.py",
    "tests/integration/test_bench_smoke.py",
    "tests/e2e/test_engine_faults.py",
    "tests/integration/test_trainer_group.py",
    "tests/faults/test_hard_kill.py",
    "tests/e2e/test_colocated_engine.py",
    "tests/e2e/test_moe_engine_weights.py",
    "tests/integration/test_replay_cli.py",
    "tests/integration/test_estimators_run.py",
    "tests/integration/test_data_hooks_run.py",
    "tests/unit/test_data_parallel.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files stay whole
