"""Load user functions named on the command line: ``package.module.attr`` or ``path/to/file.py:attr``."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable


class PluginError(ValueError):
    """A user function could not be loaded; the message names the flag, the path and the reason."""


def load_function(path: str, flag: str, *, min_params: int = 0) -> Callable[..., Any]:
    if ":" in path and path.split(":", 1)[0].endswith(".py"):
        file, attr = path.split(":", 1)
        if not os.path.isfile(file):
            raise PluginError(f"{flag} {path}: no such file {file!r}")
        name = "vime_plugin_" + os.path.splitext(os.path.basename(file))[0]
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            raise PluginError(f"{flag} {path}: importing {file!r} failed: {type(error).__name__}: {error}") from error
    else:
        module_name, _, attr = path.rpartition(".")
        if not module_name:
            raise PluginError(f"{flag} {path}: expected 'module.attr' or 'file.py:attr'")
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())  # user modules next to where the run was started
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            raise PluginError(f"{flag} {path}: module {module_name!r} not found ({error})") from None
    if not hasattr(module, attr):
        raise PluginError(f"{flag} {path}: module has no attribute {attr!r}")
    function = getattr(module, attr)
    if not callable(function):
        raise PluginError(f"{flag} {path}: {attr!r} is not callable")
    if min_params:
        try:
            params = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):
            return function
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < min_params and not any(p.kind == p.VAR_POSITIONAL for p in params):
            raise PluginError(f"{flag} {path}: {attr} takes {len(positional)} positional parameters, "
                              f"expected {min_params}")
    return function


def absolute_plugin_path(path: str | None) -> str | None:
    """Make a 'file.py:attr' path absolute so that workers started elsewhere find it."""
    if path and ":" in path and path.split(":", 1)[0].endswith(".py"):
        file, attr = path.split(":", 1)
        return f"{os.path.abspath(file)}:{attr}"
    return path
