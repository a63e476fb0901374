"""The import layers (docs/decisions.md, "Layers and lint"): which part of vime may import which.

Every module of the package (vime/, workers/, queue/, recovery/, tools/) is parsed with ``ast``, imports
inside functions included (vime imports lazily a lot), and each import of ``vime.*`` is checked against
the table below. Plugins loaded by path (``--custom-*-path``) are strings, not imports: not checked.
"""

import ast
import dataclasses
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

# Where each folder of the repository is installed (pyproject.toml's package-dir).
PACKAGE_DIRS = {
    "vime": "vime",
    "workers": "vime.workers",
    "queue": "vime.queue",
    "recovery": "vime.recovery",
    "tools": "vime.tools",
}

# Lowest first. A unit (a sub-package, or a module right under vime/) may import its own modules and every
# unit of a lower layer; between two units of one layer only the SIDEWAYS imports are allowed.
LAYERS = [
    ("errors", ["vime.errors"]),  # the roots of every error class (imports nothing of vime)
    ("base", ["vime", "vime.runtime", "vime.sample", "vime.metrics"]),
    ("config", ["vime.config"]),
    (
        "components",
        [
            "vime.data",
            "vime.engines",
            "vime.weights",
            "vime.queue",
            "vime.rollout",
            "vime.rl",
            "vime.backends",
            "vime.recovery",
            "vime.tracking",  # wandb and TensorBoard behind one step axis
        ],
    ),
    ("workers", ["vime.workers"]),
    # The drivers: `vime train`, its pre-flight checks, its debug-replay mode (which trains with the run's own
    # trainer worker), its rollout-only mode, the user's tools and the command line.
    ("entry points", ["vime.preflight", "vime.replay", "vime.rollout_only", "vime.train", "vime.tools", "vime.cli"]),
]
SIDEWAYS = {
    ("vime.rollout", "vime.data"),  # rollout functions read the prompt data
    ("vime.rollout", "vime.engines"),  # an engine that fails a rollout request raises engines.http.EngineError
    ("vime.rl", "vime.rollout"),  # R3's engine flags (rl/algorithm_checks.py)
    ("vime.backends", "vime.rl"),  # the objective and the batch live in rl/; backends own the model
    ("vime.recovery", "vime.queue"),  # debug archives hold the queue's encoded groups
    ("vime.train", "vime.preflight"),  # the checks before any process starts
    ("vime.train", "vime.replay"),  # --save/--load-debug-rollout-data
    ("vime.train", "vime.rollout_only"),  # --debug-rollout-only
    ("vime.cli", "vime.train"),
    ("vime.cli", "vime.tools"),
}
# Imports that break the layers today: config's checks that reach up into the components (STYLE.md: keep
# config at the bottom), and one check in rl/ that asks the Megatron backend. Keyed by file and imported
# module, not by line. An entry no longer needed fails the test, so that this list only ever shrinks.
KNOWN_EXCEPTIONS = {
    ("vime/config/__init__.py", "vime.rl.algorithm_checks"),
    ("vime/config/__init__.py", "vime.backends.lr_schedule"),
    ("vime/config/__init__.py", "vime.weights.nccl"),
    ("vime/config/algorithm.py", "vime.rl.algorithm_checks"),
    ("vime/config/weight_sync.py", "vime.weights.nccl"),
    ("vime/config/run.py", "vime.recovery.debug_archive"),
    ("vime/config/megatron.py", "vime.backends.megatron_args"),
    ("vime/config/megatron.py", "vime.backends.megatron_hooks"),
    ("vime/config/megatron_lm.py", "vime.backends.megatron_model"),
    ("vime/config/router.py", "vime.engines.router"),
    ("vime/rl/algorithm_checks.py", "vime.backends.megatron_checkpoint"),
}
# Optional extras (vllm: cpu/gpu, megatron-core: gpu/dev): imported only inside the functions that need
# them, so that every module of a plain install imports.
ONLY_INSIDE_FUNCTIONS = {"vllm", "megatron"}
# `vime --help`, `vime train --help` and every flag error come before any of these loads.
HEAVY = ["torch", "ray", "transformers", "vllm", "megatron", "aiohttp", "straw"]


@dataclasses.dataclass(frozen=True)
class Import:
    path: str  # relative to the repository root
    line: int
    module: str  # absolute dotted name
    in_function: bool


def layer_of(unit: str) -> int:
    for index, (_, units) in enumerate(LAYERS):
        if unit in units:
            return index
    raise KeyError(unit)


def unit_of(module: str) -> str:
    """``vime.config.base`` -> ``vime.config``; ``vime.train`` -> ``vime.train``."""
    return ".".join(module.split(".")[:2])


def module_name(root: str, path: str) -> str:
    """The installed dotted name of a source file below ``root``."""
    parts = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
    name = ".".join([PACKAGE_DIRS[parts[0]], *parts[1:]])
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def imports_of(root: str, path: str) -> list[Import]:
    """Every import in the file at any depth, relative ones resolved, ``from vime import x`` as ``vime.x``."""
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    rel, name = os.path.relpath(path, root), module_name(root, path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend(Import(rel, child.lineno, alias.name, inside) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in child.names] if base == "vime" else [base]
                found.extend(Import(rel, child.lineno, module, inside) for module in names)
            visit(child, inside)

    visit(tree, False)
    return found


def source_files(root: str) -> list[str]:
    files = []
    for folder in PACKAGE_DIRS:
        for directory, subdirs, names in os.walk(os.path.join(root, folder)):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            files.extend(os.path.join(directory, n) for n in sorted(names) if n.endswith(".py"))
    return files


def layer_violations(root: str, exceptions: set[tuple[str, str]]) -> tuple[list[str], set[tuple[str, str]]]:
    """The imports that break the layers (one line each: file:line, the import, the rule), and the
    exceptions that were used."""
    problems, used = [], set()
    for path in source_files(root):
        importer = unit_of(module_name(root, path))
        try:
            own = layer_of(importer)
        except KeyError:
            problems.append(
                f"{os.path.relpath(path, root)}: {importer} is in no layer of "
                f"tests/unit/test_import_layers.py's LAYERS: place it there"
            )
            continue
        for imp in imports_of(root, path):
            if imp.module != "vime" and not imp.module.startswith("vime."):
                continue
            imported = unit_of(imp.module)
            if imported in (importer, "vime"):
                continue
            try:
                theirs = layer_of(imported)
            except KeyError:
                continue  # not a part of vime (a typo fails when the module runs, not here)
            if theirs < own or (theirs == own and (importer, imported) in SIDEWAYS):
                continue
            if (imp.path, imp.module) in exceptions:
                used.add((imp.path, imp.module))
                continue
            where = "the same layer" if theirs == own else f"a higher layer ({LAYERS[theirs][0]})"
            problems.append(
                f"{imp.path}:{imp.line}: imports {imp.module}: {importer} ({LAYERS[own][0]}) may not "
                f"import {imported}, {where}"
            )
    return problems, used


def test_every_import_of_vime_follows_the_layers():
    problems, used = layer_violations(REPO, KNOWN_EXCEPTIONS)
    assert not problems, 'imports across the layers (docs/decisions.md, "Layers and lint"):\n' + "\n".join(problems)
    stale = sorted(KNOWN_EXCEPTIONS - used)
    assert not stale, f"KNOWN_EXCEPTIONS no longer needed (remove them): {stale}"


def test_optional_extras_are_imported_only_inside_functions():
    problems = [
        f"{imp.path}:{imp.line}: imports {imp.module} at module level; import it in the function that "
        f"needs it (an optional extra)"
        for path in source_files(REPO)
        for imp in imports_of(REPO, path)
        if imp.module.split(".")[0] in ONLY_INSIDE_FUNCTIONS and not imp.in_function
    ]
    assert not problems, "\n".join(problems)


def test_the_command_line_and_the_config_import_no_heavy_library():
    code = f"import sys, vime.cli, vime.config; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [], f"`import vime.cli, vime.config` loads {result.stdout.strip()}"


def test_the_controller_process_imports_no_torch():
    """The queue's controller (an actor at every start and restart) needs no tensor library until it decodes a
    group; torch's import cost it ~1.5 CPU-seconds each time (queue/records.py)."""
    code = "import sys, vime.workers.controller; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"], result.stdout


def test_the_sideways_imports_make_no_circle():
    graph: dict[str, set[str]] = {}
    for importer, imported in SIDEWAYS:
        assert layer_of(importer) == layer_of(imported), (importer, imported)
        graph.setdefault(importer, set()).add(imported)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    assert not [u for u in graph if reaches(u, u, set())]


def write(root, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    "rel, text, expected",
    [
        # the rules: config below rl/backends/workers; the core never imports workers
        (
            "vime/config/base.py",
            "def check():\n    from vime.workers.controller import Controller\n",
            "vime/config/base.py:2: imports vime.workers.controller: vime.config (config) may not import vime.workers, "
            "a higher layer (workers)",
        ),
        (
            "vime/config/base.py",
            "from vime import rl\n",
            "vime/config/base.py:1: imports vime.rl: vime.config (config) may not import vime.rl, a higher layer",
        ),
        (
            "queue/records.py",
            "import vime.backends.torch_backend\n",
            "queue/records.py:1: imports vime.backends.torch_backend: vime.queue (components) may not import "
            "vime.backends, the same layer",
        ),
        (
            "vime/rl/kl.py",
            "from .. import train\n",
            "vime/rl/kl.py:1: imports vime.train: vime.rl (components) may not import vime.train, a higher layer",
        ),
        ("vime/newpart/x.py", "import os\n", "vime/newpart/x.py: vime.newpart is in no layer"),
    ],
)
def test_a_forbidden_import_is_named_with_its_file_and_line(tmp_path, rel, text, expected):
    write(tmp_path, "vime/rollout/generate.py", "from vime.data.source import PromptRecord\n")  # sideways: allowed
    write(tmp_path, "workers/controller.py", "def f():\n    from vime.queue.tasks import PromptTask\n")
    write(tmp_path, rel, text)
    problems, _ = layer_violations(str(tmp_path), set())
    assert len(problems) == 1 and problems[0].startswith(expected), problems
