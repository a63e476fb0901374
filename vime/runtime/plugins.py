"""Load user functions named on the command line: ``package.module.attr`` or ``path/to/file.py:attr``.

Every hook flag is described once in :data:`HOOKS` (how vime calls it), and :func:`load_hook` checks
a user object against that call with ``inspect.signature(...).bind`` before any process starts. A
failure raises :class:`PluginError` naming the flag, the path and what was wrong: the file or module
is missing, importing it failed, the attribute is missing or not callable, or its parameters do
not accept vime's call.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from vime.errors import UserError


class PluginError(UserError, ValueError):
    """A user function could not be loaded; the message names the flag, the path and the reason."""


@dataclasses.dataclass(frozen=True)
class Hook:
    """How vime calls one kind of user hook."""

    call: str  # the call as the error messages show it
    positional: int  # positional arguments vime passes
    keywords: tuple[str, ...] = ()  # keyword arguments vime passes (by name)
    is_class: bool = False  # instantiated with the arguments (a data source)
    must_be_async: bool = False


HOOKS: dict[str, Hook] = {
    "--rollout-function-path": Hook("generate_rollout(args, rollout_id, data_source)", 3),
    "--custom-generate-function-path": Hook("await generate(args, sample, sampling_params)", 3),
    "--custom-rm-path": Hook("rm(args, sample)", 2),
    "--dynamic-sampling-filter-path": Hook("filter(args, samples)", 2),
    "--custom-reward-post-process-path": Hook("post_process(args, samples)", 2),
    "--eval-function-path": Hook(
        "generate_rollout(args, rollout_id, data_source, evaluation=True)", 3, ("evaluation",)
    ),
    "--data-source-path": Hook("DataSource(args)", 1, is_class=True),
    "--custom-loss-function-path": Hook("loss_fn(args, batch, logits, sum_of_sample_mean)", 4),
    "--custom-advantage-function-path": Hook("custom_fn(args, rollout_data)", 2),
    "--custom-pg-loss-reducer-function-path": Hook(
        "get_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss)", 4
    ),
    "--custom-convert-samples-to-train-data-path": Hook("convert_samples_to_train_data(args, samples)", 2),
    "--rollout-all-samples-process-path": Hook("process(args, all_samples, data_source)", 3),
    "--custom-rollout-log-function-path": Hook(
        "log(rollout_id, args, samples, rollout_extra_metrics, rollout_time)", 5
    ),
    "--custom-eval-rollout-log-function-path": Hook("log(rollout_id, args, data, extra_metrics)", 4),
}


def _import_module(path: str, flag: str) -> tuple[Any, str]:
    """(module, attribute name) for ``path``."""
    if ":" in path and path.split(":", 1)[0].endswith(".py"):
        file, attr = path.split(":", 1)
        if not attr:
            raise PluginError(f"{flag} {path}: no attribute after ':' (expected 'file.py:attr')")
        if not os.path.isfile(file):
            raise PluginError(f"{flag} {path}: no such file {file!r}")
        name = "vime_plugin_" + os.path.splitext(os.path.basename(file))[0]
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as error:  # SystemExit from a script body as well
            sys.modules.pop(name, None)
            raise PluginError(f"{flag} {path}: importing {file!r} failed: {type(error).__name__}: {error}") from error
        return module, attr
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{flag} {path}: expected 'package.module.attr' or 'path/to/file.py:attr'")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # user modules next to where the run was started
    try:
        return importlib.import_module(module_name), attr
    except ModuleNotFoundError as error:
        # Missing: the module itself (or a parent package), or something it imports.
        if error.name and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise PluginError(f"{flag} {path}: module {module_name!r} not found") from None
        raise PluginError(f"{flag} {path}: importing module {module_name!r} failed: {error}") from None
    except BaseException as error:
        raise PluginError(
            f"{flag} {path}: importing module {module_name!r} failed: {type(error).__name__}: {error}"
        ) from error


def load_object(path: str, flag: str) -> Any:
    """The object ``path`` names (function, class, ...); errors name the flag and the path."""
    if not isinstance(path, str) or not path.strip():
        raise PluginError(f"{flag}: empty path")
    module, attr = _import_module(path, flag)
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        hint = f"; it has {', '.join(public[:12])}" if public else ""
        raise PluginError(f"{flag} {path}: module has no attribute {attr!r}{hint}")
    return getattr(module, attr)


def check_call(function: Any, flag: str, path: str, hook: Hook) -> None:
    """Refuse ``function`` when its parameters cannot accept vime's call."""
    if hook.is_class and not inspect.isclass(function) and not callable(function):
        raise PluginError(f"{flag} {path}: {type(function).__name__} is not a class; vime calls {hook.call}")
    if not callable(function):
        raise PluginError(f"{flag} {path}: a {type(function).__name__} is not callable; vime calls {hook.call}")
    if hook.must_be_async and not _is_async(function):
        raise PluginError(f"{flag} {path}: must be an async function; vime calls {hook.call}")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to check
    try:
        signature.bind(*range(hook.positional), **{name: None for name in hook.keywords})
    except TypeError as error:
        raise PluginError(
            f"{flag} {path}: its parameters {signature} do not accept vime's call {hook.call} ({error})"
        ) from None


def _is_async(function: Any) -> bool:
    # An instance whose __call__ is async: that method is what is asked about (B004's callable() cannot say).
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None))  # noqa: B004


def load_hook(flag: str, path: str) -> Any:
    """Load the hook given to ``flag`` and check it against the call vime makes (:data:`HOOKS`)."""
    function = load_object(path, flag)
    check_call(function, flag, path, HOOKS[flag])
    return function


def load_function(path: str, flag: str, *, min_params: int = 0) -> Callable[..., Any]:
    """Load a function; a flag of :data:`HOOKS` is checked against its call, any other flag only for
    accepting ``min_params`` positional arguments."""
    if flag in HOOKS:
        return load_hook(flag, path)
    function = load_object(path, flag)
    if not callable(function):
        raise PluginError(f"{flag} {path}: a {type(function).__name__} is not callable")
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return function
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < min_params and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise PluginError(
            f"{flag} {path}: it takes {len(positional)} positional parameter(s), vime passes {min_params}"
        )
    return function


def absolute_plugin_path(path: str | None) -> str | None:
    """Make a 'file.py:attr' path absolute so that workers started elsewhere find it."""
    if path and ":" in path and path.split(":", 1)[0].endswith(".py"):
        file, attr = path.split(":", 1)
        return f"{os.path.abspath(file)}:{attr}"
    return path


async def call_maybe_async(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a user hook from async code: a coroutine function is awaited, a plain function runs in a
    thread (it may block, e.g. on HTTP), and an awaitable it returns is awaited."""
    import asyncio

    if _is_async(function):
        return await function(*args, **kwargs)
    result = await asyncio.to_thread(function, *args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result
