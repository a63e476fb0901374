"""User hooks named on the command line: every way loading can fail names the flag, the path and
what was wrong, and each hook is checked against the call vime makes (inspect.signature)."""

from __future__ import annotations

import asyncio

import pytest

from vime.runtime.plugins import HOOKS, PluginError, absolute_plugin_path, call_maybe_async, load_function, load_hook

GOOD = """
def generate_rollout(args, rollout_id, data_source, evaluation=False):
    return []
async def generate(args, sample, sampling_params):
    return sample
def rm(args, sample):
    return 1.0
def keep(args, samples, **kwargs):
    return True
class Source:
    def __init__(self, args):
        pass
def two(args, sample):
    return 0
def four(args, a, b, c):
    return 0
def keyword_only(args, sample, *, scale):
    return 0
NOT_CALLABLE = 3
"""


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_hooks.py"
    path.write_text(GOOD)
    return str(path)


@pytest.mark.parametrize(
    "flag, attr",
    [
        ("--rollout-function-path", "generate_rollout"),
        ("--custom-generate-function-path", "generate"),
        ("--custom-rm-path", "rm"),
        ("--dynamic-sampling-filter-path", "keep"),
        ("--eval-function-path", "generate_rollout"),
        ("--data-source-path", "Source"),
    ],
)
def test_each_hook_loads_from_a_file_and_a_module(plugin, flag, attr):
    assert callable(load_hook(flag, f"{plugin}:{attr}"))


def test_module_paths_load():
    assert load_hook("--dynamic-sampling-filter-path", "vime.rollout.filters.check_reward_nonzero_std")
    assert load_hook("--rollout-function-path", "vime.rollout.sft.generate_rollout")


@pytest.mark.parametrize(
    "path, reason",
    [
        ("{dir}/absent.py:f", r"no such file '.*absent\.py'"),
        ("{plugin}:", r"no attribute after ':'"),
        ("{plugin}:nope", r"module has no attribute 'nope'; it has .*generate_rollout"),
        ("{plugin}:NOT_CALLABLE", r"a int is not callable"),
        ("no_such_package_xyz.module.fn", r"module 'no_such_package_xyz.module' not found"),
        ("vime.rollout.no_such_module.fn", r"module 'vime.rollout.no_such_module' not found"),
        ("vime.rollout.filters.nope", r"module has no attribute 'nope'"),
        ("justaname", r"expected 'package.module.attr' or 'path/to/file.py:attr'"),
        ("{dir}/raises.py:f", r"importing '.*raises\.py' failed: RuntimeError: boom at import"),
        ("{dir}/syntax.py:f", r"importing '.*syntax\.py' failed: SyntaxError"),
        (
            "{dir}/needs_dep.py:f",
            r"importing '.*needs_dep\.py' failed: ModuleNotFoundError: No module named "
            r"'missing_dependency_xyz'",
        ),
    ],
)
def test_loading_errors_name_flag_path_and_reason(tmp_path, plugin, path, reason):
    (tmp_path / "raises.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "syntax.py").write_text("def f(:\n")
    (tmp_path / "needs_dep.py").write_text("import missing_dependency_xyz\ndef f(args, samples): pass\n")
    path = path.format(dir=tmp_path, plugin=plugin)
    with pytest.raises(PluginError) as error:
        load_hook("--dynamic-sampling-filter-path", path)
    message = str(error.value)
    assert message.startswith(f"--dynamic-sampling-filter-path {path}: "), message
    assert __import__("re").search(reason, message), message


def test_dependency_missing_inside_a_module_is_not_reported_as_the_module_missing(tmp_path, monkeypatch):
    (tmp_path / "pkg_with_dep.py").write_text("import missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        PluginError,
        match=r"importing module 'pkg_with_dep' failed: No module named "
        r"'missing_dependency_xyz'",
    ):
        load_hook("--custom-rm-path", "pkg_with_dep.rm")


@pytest.mark.parametrize(
    "flag, attr, reason",
    [
        ("--custom-rm-path", "four", r"its parameters \(args, a, b, c\) do not accept vime's call rm\(args, sample\)"),
        (
            "--rollout-function-path",
            "two",
            r"do not accept vime's call generate_rollout\(args, rollout_id, data_source\)",
        ),
        (
            "--eval-function-path",
            "four",
            r"do not accept vime's call generate_rollout\(args, rollout_id, data_source, "
            r"evaluation=True\)",
        ),
        ("--dynamic-sampling-filter-path", "keyword_only", r"missing a required argument: 'scale'"),
        ("--data-source-path", "rm", r"its parameters \(args, sample\) do not accept vime's call DataSource\(args\)"),
        (
            "--custom-generate-function-path",
            "rm",
            r"do not accept vime's call await generate\(args, sample, "
            r"sampling_params\)",
        ),
    ],
)
def test_wrong_signatures_are_refused(plugin, flag, attr, reason):
    with pytest.raises(PluginError, match=reason) as error:
        load_hook(flag, f"{plugin}:{attr}")
    assert str(error.value).startswith(f"{flag} {plugin}:{attr}: ")


def test_every_hook_flag_is_a_flag_of_vime_train():
    from vime.config import build_parser

    flags = {option for action in build_parser()._actions for option in action.option_strings}
    assert set(HOOKS) <= flags


def test_other_flags_keep_the_positional_count_check(plugin):
    assert load_function(f"{plugin}:keyword_only", "--custom-tis-function-path", min_params=1)
    with pytest.raises(PluginError, match="--custom-tis-function-path .*: it takes 2 positional parameter"):
        load_function(f"{plugin}:two", "--custom-tis-function-path", min_params=3)


def test_absolute_paths_and_async_calls(plugin, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_plugin_path("my_hooks.py:rm") == f"{tmp_path}/my_hooks.py:rm"
    assert absolute_plugin_path("pkg.mod.fn") == "pkg.mod.fn"
    rm, generate = (
        load_hook("--custom-rm-path", f"{plugin}:rm"),
        load_hook("--custom-generate-function-path", f"{plugin}:generate"),
    )
    assert asyncio.run(call_maybe_async(rm, None, None)) == 1.0
    assert asyncio.run(call_maybe_async(generate, None, "s", {})) == "s"
