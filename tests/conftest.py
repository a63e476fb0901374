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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Scheduling under `make test` (pytest-xdist, --dist loadgroup): a test file's tests run one after
    another in one worker, so that its module-scoped fixtures (a trainer, a router, an engine) are set up
    once; a file marked `spread` lets its tests go to different workers, side by side. Such a file's tests
    each start their own job and share no module fixture, and several of them take minutes, which on one
    worker would make the suite's tail (README, Tests)."""
    for item in items:
        if item.get_closest_marker("spread") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


@pytest.fixture
def config_dir(tmp_path):
    """An HF model folder with only a config.json (vocabulary 12): enough for flag checks."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 12}))
    return str(tmp_path)
