"""The reference framework's quick-start script, scripts/run-qwen3-4B.sh (issue 19): its argument list, as
`vime train` would receive it, through vime's parser and start-up validation (nothing is started).

The list below is copied from the script (its ``train.py`` line with MODEL_ARGS from scripts/models/qwen3-4B.sh,
CKPT_ARGS, ROLLOUT_ARGS, OPTIMIZER_ARGS, GRPO_ARGS, PERF_ARGS, EVAL_ARGS, SGLANG_ARGS and MISC_ARGS expanded,
``${NUM_GPUS}`` = 8), as data: the reference's scripts are not part of this repository. Model and data paths
point at a tiny model and temporary files. ``python -m vime.tools.reference_flags <checkout>`` measures every
script of the reference the same way.

The flags vime still refuses are listed with the reason (STILL_REFUSED): the test fails if any other flag is
refused, so the list can only shrink; each listed flag is an expected failure (xfail) of its own.
"""

from __future__ import annotations

import pytest

from vime.tools.reference_flags import Use, check_uses, flag_uses

MODEL = "<tiny model>"
DATA = "<prompt file>"
EVAL_DATA = "<eval file>"
CHECKPOINTS = "<checkpoint folder>"

# scripts/run-qwen3-4B.sh of the reference (THUDM/slime 624b824a8), expanded
QWEN3_4B_ARGS = [
    *("--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate"),
    # MODEL_ARGS (scripts/models/qwen3-4B.sh)
    "--swiglu",
    *("--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728", "--num-attention-heads", "32"),
    *("--group-query-attention", "--num-query-groups", "8", "--use-rotary-position-embeddings"),
    *("--disable-bias-linear", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base", "1000000"),
    *("--vocab-size", "151936", "--kv-channels", "128", "--qk-layernorm"),
    # CKPT_ARGS
    *("--hf-checkpoint", MODEL, "--ref-load", MODEL, "--load", CHECKPOINTS, "--save", CHECKPOINTS),
    *("--save-interval", "20"),
    # ROLLOUT_ARGS
    *("--prompt-data", DATA, "--input-key", "prompt", "--label-key", "label", "--apply-chat-template"),
    *("--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "3000", "--rollout-batch-size", "32"),
    *("--n-samples-per-prompt", "8", "--rollout-max-response-len", "8192", "--rollout-temperature", "1"),
    *("--global-batch-size", "256", "--balance-data"),
    # OPTIMIZER_ARGS
    *("--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1"),
    *("--adam-beta1", "0.9", "--adam-beta2", "0.98"),
    # GRPO_ARGS
    *("--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl"),
    *("--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28"),
    # PERF_ARGS
    *("--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1"),
    *("--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1"),
    *("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
    *("--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216"),
    # EVAL_ARGS
    *("--eval-interval", "20", "--eval-prompt-data", "aime", EVAL_DATA, "--n-samples-per-eval-prompt", "16"),
    *("--eval-max-response-len", "16384", "--eval-top-p", "1"),
    # SGLANG_ARGS
    *("--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7"),
    # MISC_ARGS
    *("--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32"),
    *("--attention-softmax-in-fp32", "--attention-backend", "flash"),
]

# What vime still refuses, and why. As given, on a GPU node (vime's default trainer there is Megatron, as the
# reference's; tools/reference_flags.py reads the scripts as a GPU node runs them):
STILL_REFUSED = {
    "--sglang-mem-fraction-static": "vime's engines are vLLM's: --vllm-gpu-memory-utilization is the equivalent",
}
# With --train-backend torch added (vime's trainer for machines without GPUs, the default there):
STILL_REFUSED_TORCH = {
    **STILL_REFUSED,
    "--tensor-model-parallel-size": "2 needs --train-backend megatron (the torch trainer's ranks are data-parallel "
    "replicas)",
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("quickstart")
    model = make_tiny_model(str(root / "model"))
    (root / "data.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    (root / "aime.jsonl").write_text('{"prompt": "2+2=", "label": "4"}\n')
    return {MODEL: model, DATA: str(root / "data.jsonl"), EVAL_DATA: str(root / "aime.jsonl")} | {
        CHECKPOINTS: str(root / "ckpt")
    }


def quickstart_uses(paths) -> list[Use]:
    return flag_uses([(paths.get(word, word), "run-qwen3-4B.sh") for word in QWEN3_4B_ARGS])


def test_the_list_is_the_scripts():
    uses = flag_uses([(word, "run-qwen3-4B.sh") for word in QWEN3_4B_ARGS])
    assert len(uses) == 72  # flag uses of the script and its preset
    assert len({use.flag for use in uses}) == 72


@pytest.mark.parametrize(
    ("extra", "expected"), [([], STILL_REFUSED), (["--train-backend", "torch"], STILL_REFUSED_TORCH)]
)
def test_only_the_known_flags_are_refused(paths, extra, expected):
    result = check_uses("run-qwen3-4B.sh", quickstart_uses(paths), extra=extra)
    assert result.failure is None
    new = set(result.refused) - set(expected)
    assert not new, f"newly refused: { {flag: result.refused[flag] for flag in new} }"
    accepted = set(expected) - set(result.refused)
    assert not accepted, f"now accepted, remove from the list: {sorted(accepted)}"


@pytest.mark.parametrize("flag", sorted(STILL_REFUSED))
@pytest.mark.xfail(reason="still refused: see STILL_REFUSED", strict=False)
def test_flag_is_accepted(paths, flag):
    result = check_uses("run-qwen3-4B.sh", quickstart_uses(paths))
    assert flag not in result.refused, result.refused.get(flag)


def test_the_rest_passes_unchanged(paths):
    """Without the refused flags the script's list passes parsing and start-up validation as is."""
    uses = [use for use in quickstart_uses(paths) if use.flag not in STILL_REFUSED]
    result = check_uses("run-qwen3-4B.sh", uses)
    assert result.passed, (result.refused, result.failure)


# ---------------------------------------------------------------- the counting tool, on scripts written here

PRESET = """
N_DENSE=1
N_MOE=3
MODEL_ARGS=(
   --num-layers $((N_DENSE + N_MOE))
   --rotary-base "${MODEL_ARGS_ROTARY_BASE:-10000}"
   --swiglu  # a comment
)
"""

RUN = """
pkill -9 python  # never executed: the tool reads text
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
MODEL_ARGS_ROTARY_BASE=500 source "${SCRIPT_DIR}/models/tiny.sh"
NUM_GPUS=${NUM_GPUS:-$(nvidia-smi -L | wc -l)}
NUM_GPUS=1
CKPT_ARGS=(
   --hf-checkpoint /root/model
   #--hf-checkpoint /root/other
)
ROLLOUT_ARGS=(--prompt-data /root/data.jsonl --rm-type math)
ROLLOUT_ARGS+=(--rollout-batch-size 4 --n-samples-per-prompt 1 --global-batch-size 4)
ray job submit -- python3 train.py \\
   --actor-num-gpus-per-node ${NUM_GPUS} \\
   --update-weight-buffer-size $(( 4 * 512 * 1024 * 1024))
   ${MODEL_ARGS[@]} ${CKPT_ARGS[@]}
   ${ROLLOUT_ARGS[@]}
"""


def test_reader_follows_the_scripts(tmp_path):
    from vime.tools.reference_flags import read_run_script

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.sh").write_text(PRESET)
    (tmp_path / "run-tiny.sh").write_text(RUN)
    uses, preset = read_run_script(str(tmp_path / "run-tiny.sh"))
    assert preset == "tiny.sh"
    assert [(u.flag, u.values, u.origin) for u in uses] == [
        ("--actor-num-gpus-per-node", ["1"], "run-tiny.sh"),
        ("--update-weight-buffer-size", ["2147483648"], "run-tiny.sh"),
        ("--num-layers", ["4"], "models/tiny.sh"),
        ("--rotary-base", ["500"], "models/tiny.sh"),
        ("--swiglu", [], "models/tiny.sh"),
        ("--hf-checkpoint", ["/root/model"], "run-tiny.sh"),
        ("--prompt-data", ["/root/data.jsonl"], "run-tiny.sh"),
        ("--rm-type", ["math"], "run-tiny.sh"),
        ("--rollout-batch-size", ["4"], "run-tiny.sh"),
        ("--n-samples-per-prompt", ["1"], "run-tiny.sh"),
        ("--global-batch-size", ["4"], "run-tiny.sh"),
    ]


def test_measure_counts_uses_scripts_and_presets(tmp_path, capsys):
    from vime.tools.reference_flags import main, measure

    (tmp_path / "scripts" / "models").mkdir(parents=True)
    (tmp_path / "scripts" / "models" / "tiny.sh").write_text(PRESET)
    (tmp_path / "scripts" / "run-tiny.sh").write_text(RUN)
    (tmp_path / "scripts" / "run-bad.sh").write_text(
        "python3 train.py --hf-checkpoint /m --prompt-data /d.jsonl --rm-type math --not-a-flag 3 --sglang-x 1\n"
    )
    report = measure(str(tmp_path))
    # run-tiny.sh: its 8 uses pass; the preset: 3; run-bad.sh: 3 of 5
    assert (report["uses_accepted"], report["uses_total"]) == (14, 16)
    assert (report["scripts_passed"], report["scripts_total"]) == (1, 2)
    assert (report["presets_passed"], report["presets_total"]) == (1, 1)
    assert report["refused"] == {"--not-a-flag": 1, "--sglang-x": 1}
    assert main([str(tmp_path / "scripts")]) == 0
    out = capsys.readouterr().out
    assert "flag uses accepted: 14 / 16 (87.5%)" in out and "run scripts accepted unchanged: 1 / 2" in out


# The shapes of vllm-project/vime's own scripts that the reader once misread (each made a whole script fail).
BRANCHES = """
if command -v nvidia-smi >/dev/null 2>&1; then
    DETECTED_GPUS=$(nvidia-smi -L | wc -l)
else
    DETECTED_GPUS=0
fi
NUM_GPUS=${NUM_GPUS:-${DETECTED_GPUS}}
[ -z "$NUM_GPUS" ] || [ "$NUM_GPUS" -le 0 ] && NUM_GPUS=4
if [ "$MODE" = big ]; then
   EVAL_ARGS=(--eval-interval 20)
else
   EVAL_ARGS=(
      --eval-interval 5
   )
   OTHER=(--only-in-else 1)
fi
if [ -n "$X" ]; then Y=1; fi
RUNTIME_ENV_JSON="{
  \\"env_vars\\": {
    \\"A\\": \\"1\\"
  }
}"
BODY=$(cat << 'EOF'
{
  --not-a-flag-of-the-command 1
}
EOF
)
PROMPT_DATA_PATH="${PROMPT_DATA_PATH:?set PROMPT_DATA_PATH}"
python "${VIME_ROOT}/train.py" \\
   --actor-num-gpus-per-node ${NUM_GPUS} \\
   --prompt-data "${PROMPT_DATA_PATH}" \\
   ${EVAL_ARGS[@]+"${EVAL_ARGS[@]}"} \\
   ${OTHER[@]} \\
   --rollout-batch-size 4 "$@" \\
   2>&1 | tee "${LOG_FILE}"
"""


def test_reader_takes_the_first_branch_and_stops_at_pipes(tmp_path):
    from vime.tools.reference_flags import PLACEHOLDER, read_run_script

    (tmp_path / "run-branches.sh").write_text(BRANCHES)
    (tmp_path / "run-wrapper.sh").write_text('export MODE=big\nexec bash "${SCRIPT_DIR}/run-branches.sh" "$@"\n')
    uses, _ = read_run_script(str(tmp_path / "run-branches.sh"))
    assert [(u.flag, u.values) for u in uses] == [
        ("--actor-num-gpus-per-node", ["4"]),  # the `&& NUM_GPUS=4` fallback; the else branch's 0 is not read
        ("--prompt-data", [PLACEHOLDER]),  # ${NAME:?message}: not evaluated
        ("--eval-interval", ["20"]),  # the first branch's array; the else branch's is skipped whole
        ("--only-in-else", ["1"]),  # an else branch still sets what the first branch left alone
        ("--rollout-batch-size", ["4"]),  # "$@" is empty; 2>&1 | tee ... is not the command's
    ]
    wrapped, _ = read_run_script(str(tmp_path / "run-wrapper.sh"))
    assert [u.flag for u in wrapped] == [u.flag for u in uses]
    assert {u.origin for u in wrapped} == {"run-branches.sh"}  # counted in the script that writes them


def test_unevaluated_paths_become_placeholders_of_their_kind(tmp_path):
    from vime.tools.reference_flags import PLACEHOLDER, Use, with_placeholders

    [use] = with_placeholders([Use("--prompt-data", [PLACEHOLDER], "run.sh")], str(tmp_path), str(tmp_path))
    assert use.values[0].endswith(".jsonl")
