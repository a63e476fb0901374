"""The smallest `vime train` command line that parses: for tests of flags and start-up checks, which
read only the model folder's config.json (see the ``config_dir`` fixture in tests/conftest.py)."""


def minimal_train_argv(model_dir: str, *extra: str) -> list[str]:
    return [
        "--hf-checkpoint",
        model_dir,
        "--prompt-data",
        "data.jsonl",
        "--rm-type",
        "exact_match",
        "--run-dir",
        "/tmp/vime-test-run",
        *extra,
    ]


def refused_against_config_json(model_dir: str, *extra: str) -> str:
    """The message of the ConfigError with which the Megatron model flags ``extra`` are refused against
    ``model_dir``'s config.json (the flags parse; the cross-check refuses them). Fails if nothing is refused."""
    import pytest
    from transformers import AutoConfig

    from vime.config import ConfigError, parse_train_args

    settings = parse_train_args(minimal_train_argv(model_dir, *extra))
    with pytest.raises(ConfigError) as error:
        settings.megatron.check_against_hf(AutoConfig.from_pretrained(model_dir))
    return str(error.value)
