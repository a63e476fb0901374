"""User-facing errors cross Ray actor boundaries (pickled) and keep their message."""

import pickle

import pytest

from vime.config.base import ConfigError
from vime.engines.http import EngineError
from vime.engines.router import RouterError
from vime.engines.vllm_server import EngineStartError
from vime.runtime.ports import PortInUseError


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("--lr", "must be > 0"),
        EngineError("http://127.0.0.1:1", "POST /pause timed out"),
        EngineStartError("http://127.0.0.1:2", "exited; last lines:\nboom"),
        RouterError("http://127.0.0.1:3", "not serving"),
        PortInUseError("127.0.0.1", 4242, "vllm-router"),
    ],
)
def test_error_pickles_with_its_message(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
