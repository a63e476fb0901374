"""The repository layout: subsystem folders install as vime.* and never shadow the stdlib."""

import os
import subprocess
import sys

import tomllib

from tests.conftest import REPO


def run_from_root(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_stdlib_queue_is_not_shadowed_from_the_repository_root():
    result = run_from_root(
        "import queue, concurrent.futures, logging.handlers\n"
        "q = queue.Queue(); q.put(1); assert q.get() == 1\n"
        "assert queue.__file__.endswith('queue.py'), queue.__file__\n"
        "with concurrent.futures.ThreadPoolExecutor(1) as ex: assert ex.submit(lambda: 2).result() == 2\n"
        "print('ok')"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_subsystems_import_as_vime_subpackages_from_the_root():
    result = run_from_root(
        "import vime.queue.records, vime.workers.controller, vime.recovery.checkpoint, vime.tools.make_tiny_model\n"
        "import queue; assert hasattr(queue, 'Queue')\n"
        "print(vime.queue.records.__file__)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(os.path.join("queue", "records.py"))


def test_every_package_folder_is_declared_for_the_wheel():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)["tool"]["setuptools"]
    declared = set(config["packages"])
    found = {"vime"}
    for root, dirs, files in os.walk(os.path.join(REPO, "vime")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if root != os.path.join(REPO, "vime") and any(f.endswith(".py") for f in files):
            found.add("vime." + os.path.relpath(root, os.path.join(REPO, "vime")).replace(os.sep, "."))
    for folder, package in (
        ("workers", "vime.workers"),
        ("queue", "vime.queue"),
        ("recovery", "vime.recovery"),
        ("tools", "vime.tools"),
    ):
        assert config["package-dir"][package] == folder
        assert not os.path.exists(os.path.join(REPO, folder, "__init__.py")), f"{folder}/__init__.py would shadow"
        found.add(package)
    assert found == declared


def test_train_py_and_console_script_share_the_entry_point():
    result = subprocess.run(
        [sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "--rollout-num-gpus" in text and "Without GPUs this counts CPU slots" in text
    for group in (
        "Cluster resources",
        "vLLM engines (--vllm-*)",
        "vllm-router (--router-*)",
        "Megatron-style model and parallelism flags",
    ):
        assert group in text
    vime = os.path.join(os.path.dirname(sys.executable), "vime")
    result2 = subprocess.run([vime, "train", "--help"], capture_output=True, text=True, timeout=120)
    assert result2.returncode == 0, result2.stderr
    assert result2.stdout == result.stdout
