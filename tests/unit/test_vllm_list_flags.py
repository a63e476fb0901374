"""A list-valued vLLM flag (``--vllm-cudagraph-capture-sizes 1 2 4 8``) reaches the server whole (issue 19, point 8)."""

import pytest

from tests.train_args import minimal_train_argv as base
from vime.config import ConfigError, parse_train_args
from vime.config.passthrough import split_prefixed, to_cli
from vime.config.vllm import check_against_vllm
from vime.engines.vllm_server import build_vllm_command


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_several_values_after_one_flag_are_kept_whole_and_in_order():
    forwarded, rest = split_prefixed(
        ["--vllm-cudagraph-capture-sizes", "1", "2", "4", "8", "--lr", "1", "--vllm-max-model-len", "64"],
        "vllm-",
        set(),
    )
    assert forwarded == {"cudagraph-capture-sizes": ["1", "2", "4", "8"], "max-model-len": "64"}
    assert rest == ["--lr", "1"]
    assert to_cli(forwarded) == ["--cudagraph-capture-sizes", "1", "2", "4", "8", "--max-model-len", "64"]


def test_the_last_flag_of_the_line_takes_all_the_values_after_it():
    forwarded, rest = split_prefixed(["--lr", "1", "--vllm-cudagraph-capture-sizes", "1", "2"], "vllm-", set())
    assert forwarded == {"cudagraph-capture-sizes": ["1", "2"]} and rest == ["--lr", "1"]


def test_the_train_parser_forwards_the_list_to_the_server_argv(model_dir):
    s = parse_train_args(base(model_dir, "--vllm-cudagraph-capture-sizes", "1", "2", "4", "8", "--lr", "1e-5"))
    assert s.vllm.vllm_args["cudagraph-capture-sizes"] == ["1", "2", "4", "8"]
    assert s.train.lr == 1e-5  # the values did not swallow the next vime flag
    argv = build_vllm_command("/models/m", 8000, vllm_args=s.vllm.vllm_args)
    at = argv.index("--cudagraph-capture-sizes")
    assert argv[at : at + 5] == ["--cudagraph-capture-sizes", "1", "2", "4", "8"]
    assert argv.count("--cudagraph-capture-sizes") == 1


def test_the_installed_vllm_takes_the_list_and_refuses_several_values_for_a_single_value_flag():
    pytest.importorskip("vllm")
    check_against_vllm({"cudagraph-capture-sizes": ["1", "2", "4", "8"], "max-model-len": "64"})
    with pytest.raises(ConfigError, match=r"^--vllm-max-model-len: takes one value, got 2: 64 128"):
        check_against_vllm({"max-model-len": ["64", "128"]})
