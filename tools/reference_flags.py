"""Flag coverage of the reference framework's launch scripts (issue 19): how many of the ``--flag`` uses in its
``scripts/run-*.sh`` and ``scripts/models/*.sh`` `vime train` accepts, and how many scripts pass unchanged.

    python -m vime.tools.reference_flags <folder holding scripts/> [--sglang-as-vllm] [--json]

Nothing is started and no script is executed: the scripts are read as text. A small reader of bash
(:class:`ShellReader`) follows what the launch scripts do: ``NAME=(...)`` / ``NAME+=(...)`` arrays (MODEL_ARGS,
CKPT_ARGS, ROLLOUT_ARGS, ...), plain ``NAME=value`` assignments, ``${NAME:-default}``, ``$(( arithmetic ))``,
``source .../models/<preset>.sh``, and the ``train.py`` / ``train_async.py`` command line with its
``${NAME[@]}`` expansions (lines holding only such expansions right after it belong to it: a forgotten
backslash, as in run-kimi-k2-Instruct.sh; the command ends at a pipe, its redirections and ``"$@"`` dropped), a
wrapper's ``exec bash other.sh`` (the other script read with the wrapper's variables), quoted values over several
lines, and heredocs (skipped). Approximations: an ``if``'s first branch is read, and a later branch (elif/else)
only sets what the first left alone (the scripts are written for GPU nodes, where the first branch of a GPU
detection runs); a fallback ``[ test ] && NAME=value`` is taken; what it cannot evaluate (``$(command)``,
``${NAME:?message}``, variables set by loops or ``printf -v``) becomes a placeholder value (``1``; a path of its
kind for path flags).

Each argument list goes through ``vime.config.parse_train_args`` (parsing, start-up validation, defaults) and
``check_against_vllm`` (forwarded ``--vllm-*`` flags against the installed vLLM's parser), the checks
`vime train` makes before it starts anything. Absolute paths become placeholders under a temporary folder
(``--hf-checkpoint``: a folder with a config.json). The scripts target GPU nodes, so the checks that this
machine has CUDA (``--train-backend megatron``, ``--update-weight-transport nccl``) are skipped and the default
trainer is the one a GPU node gets (Megatron, where megatron-core is installed) unless ``--check-local-cuda`` is
given. A flag that a check refuses (argparse's error or a ``ConfigError`` naming it)
is recorded with the reason and removed, and the list is checked again, until it passes: the uses removed are
the refused ones. A run script's uses are its own; its preset's MODEL_ARGS count once, in the preset.

``--sglang-as-vllm`` spells ``--sglang-<x>`` as ``--vllm-<x>``, as the reference's vLLM port does (the flags
then reach the installed vLLM's parser); without it the ``--sglang-*`` uses are counted as refused.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import sys
import tempfile
import unittest.mock

PLACEHOLDER = "1"  # what an expression the reader cannot evaluate becomes
_ASSIGN = re.compile(r"^(?:export\s+|local\s+|readonly\s+|declare\s+)?([A-Za-z_]\w*)(\+?)=(.*)$", re.S)
_SOURCE = re.compile(r"^((?:[A-Za-z_]\w*=\S*\s+)*)(?:source|\.)\s+(\S+)")  # NAME=value ... source file
_TRAIN = re.compile(r"(?:^|\s)(?:\S*/)?train(?:_async)?\.py[\"']?(?=\s|$)")
_FLAG = re.compile(r"--[A-Za-z0-9][\w-]*")
_ARRAY_EXPANSION = re.compile(r'"?\$\{([A-Za-z_]\w*)\[[@*]\]\}"?')
# ${NAME[@]+"${NAME[@]}"}: the array's words if it is set (what `set -u` scripts write for an empty one)
_ARRAY_IF_SET = re.compile(r'\$\{([A-Za-z_]\w*)\[[@*]\]\+"?\$\{\1\[[@*]\]\}"?\}')
_COMMAND_END = {"|", "||", "&&", ";", "&", "|&"}  # what ends the train.py command (a pipe to tee, a next command)
_REDIRECT = re.compile(r"^(?:\d*>>?|&>>?|\d*<)(&?\d+|.+)?$")  # 2>&1, >log, 2> log, &>log, <input
_QUOTED_ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?[A-Za-z_]\w*\+?=[\"']")
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
_RUN_OTHER = re.compile(r"^(?:exec\s+)?(?:bash|sh)\s+(\S+\.sh)\b")  # a wrapper handing over to another script
_IF = re.compile(r"^if\b")
_BRANCH = re.compile(r"^(?:else|elif\b)")
_FI = re.compile(r"^fi\b")
_AND_ASSIGN = re.compile(r"(?:&&|\|\|)\s*([A-Za-z_]\w*=\S*)\s*$")  # [ test ] && NAME=value


# ---------------------------------------------------------------- reading the scripts


def _strip_comment(line: str) -> str:
    """The line without a ``#`` comment (a ``#`` at the start of a word, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
            elif char == "\\" and quote == '"':
                continue
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1] in " \t(") and not line[max(0, i - 1) : i + 1] == "$#":
            return line[:i]
    return line


def _logical_lines(text: str) -> list[str]:
    """Lines with comments removed, backslash continuations joined, and a quoted value that spans lines (a
    JSON runtime env in ``NAME="{ ... }"``) kept in one line."""
    out, current = [], ""
    for raw in text.splitlines():
        line = _strip_comment(raw)
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        if _QUOTED_ASSIGNMENT.match(current + line) and _open_quote(current + line) and current.count("\n") < 200:
            current += line + "\n"
            continue
        out.append(current + line)
        current = ""
    if current:
        out.append(current)
    return out


def _open_quote(text: str) -> bool:
    """Whether ``text`` ends inside a quoted string."""
    quote, escaped = None, False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
    return quote is not None


def _depth(text: str) -> int:
    """Open parentheses minus closed ones, outside quotes."""
    depth, quote = 0, None
    for char in text:
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
    return depth


def _arithmetic(expression: str) -> str:
    expression = expression.strip()
    if not re.fullmatch(r"[\d\s+\-*/%()]+", expression):
        return PLACEHOLDER
    try:
        return str(int(eval(expression.replace("/", "//"), {"__builtins__": {}}, {})))  # digits and operators only
    except Exception:  # noqa: BLE001 - a malformed expression: a placeholder, as anything unevaluated
        return PLACEHOLDER


def _matching(text: str, start: int, opening: str, closing: str) -> int:
    """Index just past the ``closing`` that balances the ``opening`` at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == opening:
            depth += 1
        elif text[i] == closing:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _first_branch_assigns(name: str, branches: list[set[str] | None], first_branch: list[set[str]]) -> bool:
    """Whether an assignment to ``name`` is read: always outside an if and in its first branch (noted there);
    in a later branch (elif/else) only if the first branch left ``name`` alone."""
    if not branches:
        return True
    if branches[-1] is None:
        first_branch[-1].add(name)
        return True
    return name not in branches[-1]


def _only_expansions(line: str) -> bool:
    """Whether ``line`` holds only ${ARRAY[@]} expansions, up to a redirection or a pipe."""
    words = _ARRAY_EXPANSION.sub(" ", line).split()
    return not _command_words([(word, "") for word in words])


def _command_words(words: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The command's own words: up to a pipe or a next command, without redirections and empty words."""
    out: list[tuple[str, str]] = []
    skip_target = False
    for word, origin in words:
        if skip_target:
            skip_target = False
            continue
        if word in _COMMAND_END:
            break
        redirect = _REDIRECT.match(word)
        if redirect:
            skip_target = redirect.group(1) is None  # `> file`: the target is the next word
            continue
        if word:
            out.append((word, origin))
    return out


@dataclasses.dataclass
class ShellReader:
    """Variables and arrays of one script, read top to bottom (``read``). Every word of an array and of the
    train.py command line keeps the file it is written in."""

    scripts_dir: str
    variables: dict[str, str] = dataclasses.field(default_factory=dict)
    arrays: dict[str, list[tuple[str, str]]] = dataclasses.field(default_factory=dict)  # name -> [(word, file)]
    command: list[tuple[str, str]] | None = None  # the train.py command line's arguments, (word, file)
    sourced: list[str] = dataclasses.field(default_factory=list)

    def expand(self, text: str) -> str:
        """``text`` with its expansions replaced; array expansions become shell-quoted words."""
        out, i = [], 0
        while i < len(text):
            if text[i] != "$":
                out.append(text[i])
                i += 1
                continue
            rest = text[i:]
            if rest.startswith("$(("):
                end = _matching(text, i + 1, "(", ")")
                inner = re.sub(  # bare names in $(( )) are variables too
                    r"(?<![$\w])([A-Za-z_]\w*)", lambda m: self.variables.get(m.group(1), "0"), text[i + 3 : end - 2]
                )
                out.append(_arithmetic(self.expand(inner)))
                i = end
            elif rest.startswith("$("):
                i = _matching(text, i + 1, "(", ")")
                out.append(PLACEHOLDER)
            elif rest[:2] in ("$@", "$*"):  # the script's own arguments: none when it runs as written
                i += 2
            elif rest.startswith("${"):
                end = _matching(text, i + 1, "{", "}")
                out.append(self._parameter(text[i + 2 : end - 1]))
                i = end
            elif match := re.match(r"\$([A-Za-z_]\w*)", rest):
                out.append(self.variables.get(match.group(1), PLACEHOLDER))
                i += match.end()
            else:
                out.append("$")
                i += 1
        return "".join(out)

    def _parameter(self, body: str) -> str:
        if match := re.fullmatch(r"([A-Za-z_]\w*)\[[@*]\]", body):
            return " ".join(shlex.quote(word) for word, _ in self.arrays.get(match.group(1), []))
        if match := re.fullmatch(r"([A-Za-z_]\w*):?-(.*)", body, re.S):
            value = self.variables.get(match.group(1))
            return value if value not in (None, "") else self.expand(match.group(2))
        if re.fullmatch(r"[A-Za-z_]\w*", body):
            return self.variables.get(body, PLACEHOLDER)
        return PLACEHOLDER

    def words(self, text: str) -> list[str]:
        expanded = self.expand(text)
        try:
            return shlex.split(expanded)
        except ValueError:  # an unbalanced quote after expansion: split on blanks
            return expanded.split()

    def located_words(self, text: str, name: str) -> list[tuple[str, str]]:
        """Words of ``text``; those of a ``${ARRAY[@]}`` keep the file their array's words come from."""
        out: list[tuple[str, str]] = []
        position = 0
        text = _ARRAY_IF_SET.sub(r"${\1[@]}", text)
        for match in _ARRAY_EXPANSION.finditer(text):
            out += [(word, name) for word in self.words(text[position : match.start()])]
            out += self.arrays.get(match.group(1), [])
            position = match.end()
        return out + [(word, name) for word in self.words(text[position:])]

    def read(self, text: str, name: str, depth: int = 0) -> None:
        lines = _logical_lines(text)
        i = 0
        # Assignments in an if's later branches (elif/else) do not override the first branch's: the scripts
        # are written for GPU nodes, where the first branch (GPUs detected) is the one that runs.
        branches: list[set[str] | None] = []  # per open if: None in its first branch, else what it set there
        first_branch: list[set[str]] = []
        while i < len(lines):
            line = lines[i].strip()
            i += 1
            if not line:
                continue
            heredoc = _HEREDOC.search(line)
            if heredoc:  # its body is data (a JSON runtime env, say), not script
                while i < len(lines) and lines[i].strip() != heredoc.group(1):
                    i += 1
                i += 1
                continue
            if _IF.match(line) and not re.search(r"[;\s]fi$", line):  # a one-line if is left as it is
                branches.append(None)
                first_branch.append(set())
            elif _FI.match(line) and branches:
                branches.pop()
                first_branch.pop()
            elif _BRANCH.match(line) and branches:
                branches[-1] = first_branch[-1]
            conditional = _AND_ASSIGN.search(line)
            if conditional and not _ASSIGN.match(line):
                line = conditional.group(1)  # taken: the fallback value the script sets when a test fails
            other = _RUN_OTHER.match(line)
            if other and self.command is None and depth < 3:
                self._run_other(other.group(1), depth)
                continue
            source = _SOURCE.match(line)
            if source:
                for assignment in source.group(1).split():  # NAME=value before `source`: set for the file
                    name_, _, value = assignment.partition("=")
                    self.variables[name_] = " ".join(self.words(value))
                self._source(source.group(2))
                continue
            match = _ASSIGN.match(line)
            if match and match.group(3).startswith("("):
                body = match.group(3)
                while _depth(body) > 0 and i < len(lines):
                    body += "\n" + lines[i]
                    i += 1
                if not _first_branch_assigns(match.group(1), branches, first_branch):
                    continue
                inner = body[1 : body.rfind(")")] if ")" in body else body[1:]
                words = self.located_words(inner, name)
                array = match.group(1)
                self.arrays[array] = (self.arrays.get(array, []) if match.group(2) else []) + words
                continue
            if match:
                if not _first_branch_assigns(match.group(1), branches, first_branch):
                    continue
                value = " ".join(self.words(match.group(3)))
                previous = self.variables.get(match.group(1), "") if match.group(2) else ""
                self.variables[match.group(1)] = previous + value
                continue
            train = _TRAIN.search(line)
            if train and self.command is None:
                tail = line[train.end() :]
                # lines of ${ARRAY[@]} only (and a redirection or pipe), right after: the command's, whose
                # backslash was forgotten
                while i < len(lines) and lines[i].strip() and _only_expansions(lines[i]):
                    tail += " " + lines[i]
                    i += 1
                self.command = _command_words(self.located_words(tail, name))

    def _run_other(self, target: str, depth: int) -> None:
        """A wrapper's ``exec bash other.sh "$@"``: read the other script with this one's variables."""
        path = os.path.join(self.scripts_dir, os.path.basename(self.expand(target).strip("'\"")))
        if os.path.isfile(path):
            with open(path) as f:
                self.read(f.read(), os.path.basename(path), depth + 1)

    def _source(self, target: str) -> None:
        path = self.expand(target).strip("'\"")
        preset = os.path.join(self.scripts_dir, "models", os.path.basename(path))
        if os.path.isfile(preset):
            self.sourced.append(os.path.basename(preset))
            with open(preset) as f:
                self.read(f.read(), os.path.join("models", os.path.basename(preset)))


# ---------------------------------------------------------------- flag uses and the check


@dataclasses.dataclass
class Use:
    flag: str
    values: list[str]
    origin: str  # the file where the use is written


def flag_uses(words: list[tuple[str, str]]) -> list[Use]:
    """The ``--flag [values...]`` uses of (word, file) pairs, in order (``--flag=value`` split)."""
    uses: list[Use] = []
    for token, origin in words:
        if token.startswith("--") and len(token) > 2:
            flag, _, value = token.partition("=")
            uses.append(Use(flag, [value] if value else [], origin))
        elif uses:
            uses[-1].values.append(token)
    return uses


def argv_of(uses: list[Use]) -> list[str]:
    return [word for use in uses for word in (use.flag, *use.values)]


# flags whose value is a model folder: a placeholder with a config.json. (The reference's --ref-load is a
# Megatron torch_dist conversion; vime reads an HF folder there, which a run points it at.)
MODEL_FLAGS = {"--hf-checkpoint", "--ref-load"}
# flags whose values are paths (replaced by placeholders when absolute)
PATH_FLAGS = {
    "--load",
    "--save",
    "--ref-load",
    "--critic-load",
    "--critic-save",
    "--prompt-data",
    "--eval-prompt-data",
    "--data-path",
    "--save-debug-rollout-data",
    "--load-debug-rollout-data",
    "--update-weight-disk-dir",
    "--update-weight-local-checkpoint-dir",
    "--tensorboard-dir",
    "--wandb-dir",
}


# what a path flag's value the reader could not evaluate (``${PROMPT_DATA:?set it}``) stands for
UNREAD_PATHS = {"--prompt-data": "prompts.jsonl", "--eval-prompt-data": "eval.jsonl"}


def with_placeholders(uses: list[Use], folder: str, model_dir: str) -> list[Use]:
    out = []
    for use in uses:
        values = list(use.values)
        if use.flag in MODEL_FLAGS:
            values = [model_dir]
        elif use.flag in PATH_FLAGS or any(v.startswith("/") for v in values):
            values = [
                os.path.join(folder, "placeholder", os.path.basename(v.rstrip("/")) or "p")
                if "/" in v
                else os.path.join(folder, "placeholder", UNREAD_PATHS.get(use.flag, "p"))
                if v == PLACEHOLDER and use.flag in PATH_FLAGS  # a path the reader could not evaluate
                else v
                for v in values
            ]
        out.append(Use(use.flag, values, use.origin))
    return out


def _refused_flag(message: str, flags: list[str]) -> str | None:
    """The flag an error names, among those of the list (argparse: 'argument --x:' / 'unrecognized arguments')."""
    match = re.search(r"argument (--[\w-]+)", message)
    if match and match.group(1) in flags:
        return match.group(1)
    match = re.search(r"unrecognized arguments: (\S+)", message)
    if match:
        return match.group(1).split("=")[0]
    for candidate in _FLAG.findall(message):
        if candidate in flags:
            return candidate
    return None


def check_argv(argv: list[str], *, check_local_cuda: bool = False) -> None:
    """What `vime train` checks before it starts anything: parse, validate, resolve defaults, forwarded vLLM
    flags. Raises ConfigError or SystemExit (argparse) naming the flag."""
    import vime.config as config
    from vime.config.training import megatron_core_installed
    from vime.config.vllm import check_against_vllm

    # As on a GPU node (unless --check-local-cuda): no check of this machine's CUDA, and the default trainer is
    # the one a GPU node gets, Megatron (vime.config.training.default_train_backend).
    patches = (
        []
        if check_local_cuda
        else [
            unittest.mock.patch.object(config, "check_local_cuda", lambda settings: None),
            unittest.mock.patch.object(
                config, "default_train_backend", lambda: "megatron" if megatron_core_installed() else "torch"
            ),
        ]
    )
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        settings = config.parse_train_args(argv)
        check_against_vllm(settings.vllm.vllm_args)


@dataclasses.dataclass
class Result:
    name: str
    uses: list[Use]
    refused: dict[str, str]  # flag -> reason
    failure: str | None = None  # an error no flag of the list could be blamed for

    @property
    def passed(self) -> bool:
        return not self.refused and self.failure is None


def check_uses(name: str, uses: list[Use], *, check_local_cuda: bool = False, extra: list[str] = ()) -> Result:
    """Check ``uses`` (+ ``extra`` words, e.g. a minimal command line for a preset), removing each flag a check
    refuses until the rest passes."""
    refused: dict[str, str] = {}
    remaining = list(uses)
    from vime.config import ConfigError

    for _ in range(len(uses) + 2):
        argv = [*extra, *argv_of(remaining)]
        flags = [use.flag for use in remaining]
        # real files, not StringIO: Megatron-LM's import asks sys.stdout for its fileno()
        with tempfile.TemporaryFile("w+") as stderr, tempfile.TemporaryFile("w+") as stdout:
            try:
                with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
                    check_argv(argv, check_local_cuda=check_local_cuda)
                return Result(name, uses, refused)
            except SystemExit:
                stderr.seek(0)
                said = stderr.read().strip()
                message = said.splitlines()[-1] if said else "argparse error"
            except ConfigError as error:
                message = str(error)
            except Exception as error:  # noqa: BLE001 - any other refusal is reported, not raised
                message = f"{type(error).__name__}: {error}"
        flag = _refused_flag(message, flags)
        if flag is None or flag not in flags:
            return Result(name, uses, refused, failure=message)
        refused[flag] = message.removeprefix(f"{flag}: ").removeprefix("vime train: error: ")
        remaining = [use for use in remaining if use.flag != flag]
    return Result(name, uses, refused, failure="too many refusals")


def sglang_as_vllm(uses: list[Use]) -> list[Use]:
    return [
        Use("--vllm-" + u.flag[len("--sglang-") :], u.values, u.origin) if u.flag.startswith("--sglang-") else u
        for u in uses
    ]


def read_run_script(path: str) -> tuple[list[Use], str | None]:
    """(the train.py command's uses, each with the file it is written in; the preset sourced)."""
    reader = ShellReader(os.path.dirname(os.path.abspath(path)))
    with open(path) as f:
        reader.read(f.read(), os.path.basename(path))
    command = reader.command
    if command is None:  # no train.py line: every *_ARGS array, in order
        command = [pair for array, pairs in reader.arrays.items() if array.endswith("_ARGS") for pair in pairs]
    return flag_uses(command), (reader.sourced[0] if reader.sourced else None)


def read_preset(path: str) -> list[Use]:
    reader = ShellReader(os.path.dirname(os.path.dirname(os.path.abspath(path))))
    with open(path) as f:
        reader.read(f.read(), os.path.join("models", os.path.basename(path)))
    return flag_uses(reader.arrays.get("MODEL_ARGS", []))


def tiny_model_dir(folder: str, vocab_size: int = 12) -> str:
    model = os.path.join(folder, "model")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"vocab_size": vocab_size}, f)
    return model


def measure(root: str, *, sglang_vllm: bool = False, check_local_cuda: bool = False, extra: list[str] = ()) -> dict:
    """Coverage of ``root``/scripts/run-*.sh and ``root``/scripts/models/*.sh (``root`` may be scripts/ itself)."""
    scripts = root if os.path.isdir(os.path.join(root, "models")) else os.path.join(root, "scripts")
    runs = sorted(n for n in os.listdir(scripts) if n.startswith("run-") and n.endswith(".sh"))
    presets = sorted(n for n in os.listdir(os.path.join(scripts, "models")) if n.endswith(".sh"))
    with tempfile.TemporaryDirectory(prefix="vime-reference-flags-") as tmp:
        model_dir = tiny_model_dir(tmp)
        adapt = sglang_as_vllm if sglang_vllm else (lambda uses: uses)
        run_results = []
        for name in runs:
            uses, _ = read_run_script(os.path.join(scripts, name))
            run_results.append(
                check_uses(
                    name, with_placeholders(adapt(uses), tmp, model_dir), check_local_cuda=check_local_cuda, extra=extra
                )
            )
        base = ["--hf-checkpoint", model_dir, "--prompt-data", os.path.join(tmp, "data.jsonl"), "--rm-type", "math"]
        preset_results = []
        for name in presets:
            uses = read_preset(os.path.join(scripts, "models", name))
            preset_results.append(
                check_uses(
                    os.path.join("models", name),
                    with_placeholders(adapt(uses), tmp, model_dir),
                    check_local_cuda=check_local_cuda,
                    extra=[*base, *extra],
                )
            )
    total = accepted = 0
    refused_counts: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for result in run_results + preset_results:
        for use in result.uses:
            if use.origin != result.name:
                continue  # a preset's use, counted in the preset
            total += 1
            if use.flag in result.refused or result.failure is not None:
                refused_counts[use.flag] = refused_counts.get(use.flag, 0) + 1
                reasons.setdefault(use.flag, result.refused.get(use.flag, result.failure or ""))
            else:
                accepted += 1
    return {
        "uses_accepted": accepted,
        "uses_total": total,
        "scripts_passed": sum(r.passed for r in run_results),
        "scripts_total": len(run_results),
        "presets_passed": sum(r.passed for r in preset_results),
        "presets_total": len(preset_results),
        "refused": dict(sorted(refused_counts.items(), key=lambda item: (-item[1], item[0]))),
        "reasons": reasons,
        "scripts": {
            r.name: {"passed": r.passed, "refused": sorted(r.refused), "failure": r.failure}
            for r in run_results + preset_results
        },
    }


def render(report: dict) -> str:
    share = 100.0 * report["uses_accepted"] / max(1, report["uses_total"])
    lines = [
        f"flag uses accepted: {report['uses_accepted']} / {report['uses_total']} ({share:.1f}%)",
        f"run scripts accepted unchanged: {report['scripts_passed']} / {report['scripts_total']}",
        f"model presets accepted: {report['presets_passed']} / {report['presets_total']}",
        "",
        "refused flags (uses, reason):",
    ]
    for flag, count in report["refused"].items():
        lines.append(f"  {count:4d}  {flag}: {report['reasons'].get(flag, '')}")
    lines += ["", "per script:"]
    for name, result in report["scripts"].items():
        state = "ok" if result["passed"] else "refused " + ", ".join(result["refused"])
        if result["failure"]:
            state += f" (failure: {result['failure']})"
        lines.append(f"  {name}: {state}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vime.tools.reference_flags", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="the reference's checkout (or its scripts/ folder)")
    parser.add_argument("--sglang-as-vllm", action="store_true", help="spell --sglang-<x> as --vllm-<x>")
    parser.add_argument("--check-local-cuda", action="store_true", help="also check that this machine has CUDA")
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    parser.add_argument(
        "--extra",
        default="",
        help="words put before every argument list, e.g. '--train-backend megatron' (the reference's only trainer)",
    )
    options = parser.parse_args(argv)
    report = measure(
        options.folder,
        sglang_vllm=options.sglang_as_vllm,
        check_local_cuda=options.check_local_cuda,
        extra=shlex.split(options.extra),
    )
    print(json.dumps(report, indent=2) if options.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
