"""Every error class of vime has exactly one of the three roots of vime/errors.py (docs/decisions.md,
"Errors"), and `vime train` reads the root: a UserError is one line and exit status 1."""

import importlib
import inspect
import os
import signal

import pytest

from tests.conftest import REPO
from vime.errors import InternalError, MemberDied, UserError

ROOTS = (UserError, MemberDied, InternalError)
# Where each folder of the repository is installed (pyproject.toml's package-dir).
PACKAGE_DIRS = {
    "vime": "vime",
    "workers": "vime.workers",
    "queue": "vime.queue",
    "recovery": "vime.recovery",
    "tools": "vime.tools",
}
# Exceptions that are no error anyone reports: control flow, caught by vime itself and never shown.
NO_ROOT = {
    # A Ctrl-C during the teardown: a BaseException so that no `except Exception` of a clean-up step
    # swallows it on its way to the final sweep.
    "vime.runtime.interrupts.StopNow",
    # A retryable HTTP status inside the engine client's tenacity loop; what leaves the loop is an EngineError.
    "vime.engines.http._RetryableStatus",
    # The same inside the --rm-url client's loop; what leaves it is a RemoteRewardError.
    "vime.rollout.rm_hub.remote._TryAgain",
}


def package_modules() -> list[str]:
    """The dotted name of every module of the package, from the source tree (vime/, workers/, ...)."""
    names = []
    for folder, package in PACKAGE_DIRS.items():
        for directory, subdirs, files in os.walk(os.path.join(REPO, folder)):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
            relative = os.path.relpath(directory, os.path.join(REPO, folder))
            parts = [package, *([] if relative == "." else relative.split(os.sep))]
            names.extend(
                ".".join(parts if f == "__init__.py" else [*parts, f[: -len(".py")]])
                for f in sorted(files)
                if f.endswith(".py")
            )
    return names


@pytest.fixture(scope="module")
def error_classes() -> dict[str, type]:
    """Qualified name -> class, for every exception class a module of the package defines."""
    found = {}
    for name in package_modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name:
                found[f"{name}.{value.__qualname__}"] = value
    return found


def test_every_error_class_has_exactly_one_root(error_classes):
    assert len(error_classes) > 20, sorted(error_classes)  # the walk found the package
    wrong = {
        name: [root.__name__ for root in ROOTS if issubclass(cls, root)]
        for name, cls in error_classes.items()
        if name not in NO_ROOT
    }
    wrong = {name: roots for name, roots in wrong.items() if len(roots) != 1}
    assert not wrong, (
        "each error class derives from exactly one of UserError, MemberDied, InternalError "
        f"(vime/errors.py), beside its builtin base; these have {wrong}"
    )


def test_the_classes_without_a_root_exist_and_have_none(error_classes):
    for name in NO_ROOT:  # an entry no longer needed fails, so that the list only shrinks
        assert name in error_classes, f"{name} is gone: remove it from NO_ROOT"
        assert not any(issubclass(error_classes[name], root) for root in ROOTS), f"{name} has a root now"


def test_what_the_driver_stops_on_and_what_a_group_heals():
    # The classes `vime train` reported as one line before the roots existed still are (its exit status 1),
    # and the deaths the trainer's restart and the engine fleet handle are members', not the user's.
    from vime.config.base import ConfigError
    from vime.data.source import DataError
    from vime.engines.http import EngineError
    from vime.queue.fence import QueueBusy
    from vime.recovery.checkpoint import CheckpointError
    from vime.runtime.plugins import PluginError
    from vime.runtime.ports import PortInUseError
    from vime.train import RunError
    from vime.workers.engine_members import EnginesLost
    from vime.workers.trainer_group import TrainerDied
    from vime.workers.trainer_restart import TrainerLost, TrainerStepFailed
    from vime.workers.trainer_worker import CorruptGroup

    for cls in (
        ConfigError,
        CorruptGroup,
        DataError,
        PluginError,
        RunError,
        TrainerLost,
        EngineError,
        PortInUseError,
        QueueBusy,
        CheckpointError,
    ):
        assert issubclass(cls, UserError), cls
    for cls in (TrainerDied, TrainerStepFailed, EnginesLost):
        assert issubclass(cls, MemberDied) and not issubclass(cls, UserError), cls
    # Each keeps its builtin base: an `except ValueError` / `except RuntimeError` catches what it did.
    assert issubclass(ConfigError, ValueError) and issubclass(TrainerDied, RuntimeError)


def test_a_user_error_raised_in_a_ray_task_is_still_the_users():
    import ray.exceptions

    from vime.train import _unwrap
    from vime.workers.trainer_group import TrainerDied
    from vime.workers.trainer_worker import CorruptGroup

    def wrapped(cause):  # what ray.get raises for an actor method that raised ``cause``
        return ray.exceptions.RayTaskError("TrainerWorker.train_rollout", "Traceback ...", cause).as_instanceof_cause()

    corrupt = CorruptGroup("accepted group g1 (queue position 3) cannot be read")
    assert isinstance(_unwrap(wrapped(corrupt)), UserError) and _unwrap(wrapped(corrupt)) is corrupt
    assert not isinstance(_unwrap(wrapped(TrainerDied("a trainer rank died"))), UserError)
    assert not isinstance(_unwrap(wrapped(ZeroDivisionError("a bug"))), UserError)


@pytest.fixture
def own_signal_handlers():
    """main() installs its SIGINT/SIGTERM handlers; give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)


def test_vime_train_prints_a_user_error_as_one_line_and_exits_1(tmp_path, config_dir, capsys, own_signal_handlers):
    # A replay whose archives start at rollout 1: the flags parse (an archive matches), and the run itself
    # raises the debug archives' UserError (ArchiveError) before it starts anything.
    from vime.recovery.debug_archive import ArchiveError
    from vime.train import main

    assert issubclass(ArchiveError, UserError)
    (tmp_path / "batch_1.pt").write_bytes(b"")
    argv = [
        "--hf-checkpoint",
        config_dir,
        "--prompt-data",
        str(tmp_path / "prompts.jsonl"),
        "--rm-type",
        "exact_match",
        "--run-dir",
        str(tmp_path / "run"),
        "--load-debug-rollout-data",
        str(tmp_path / "batch_{rollout_id}.pt"),
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == (
        f"vime train: error: --load-debug-rollout-data: no archive for rollout 0: "
        f"{tmp_path / 'batch_0.pt'} does not exist\n"
    ), err
