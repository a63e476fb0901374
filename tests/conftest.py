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
