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
