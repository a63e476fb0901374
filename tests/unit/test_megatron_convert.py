"""HF <-> Megatron weight naming (pure tensor code: runs without megatron-core)."""

import pytest
import torch
from transformers import AutoConfig

from tests.megatron_shim import tiny_hf_model
from vime.backends.megatron_args import model_args_from_hf
from vime.backends.megatron_convert import (
    from_te_names,
    fuse_qkv,
    hf_to_mcore,
    mcore_to_hf,
    merge_tp_shards,
    read_hf_state_dict,
    split_qkv,
    to_te_names,
    write_hf_safetensors,
)
from vime.config.base import ConfigError

VARIANTS = {
    "qwen2": dict(family="qwen2"),
    "llama": dict(family="llama", rope_scaling=True),
    "qwen3_tied": dict(family="qwen3", tie=True),
    "glm4": dict(family="glm4"),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    folder = tiny_hf_model(str(tmp_path_factory.mktemp(request.param)), **VARIANTS[request.param])
    return request.param, folder, model_args_from_hf(AutoConfig.from_pretrained(folder))


def test_hf_megatron_hf_round_trip_is_exact(tiny, tmp_path):
    _, folder, args = tiny
    hf = read_hf_state_dict(folder)
    mcore = hf_to_mcore(hf, args)
    back = mcore_to_hf(mcore, args)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    # ... and through safetensors files on disk
    write_hf_safetensors(back, str(tmp_path), max_shard_bytes=20_000)  # forces several shards + index
    assert (tmp_path / "model.safetensors.index.json").exists()
    again = read_hf_state_dict(str(tmp_path))
    assert set(again) == set(hf) and all(torch.equal(again[n], hf[n]) for n in hf)


def test_megatron_names_and_shapes(tiny):
    name, folder, args = tiny
    mcore = hf_to_mcore(read_hf_state_dict(folder), args)
    qkv = mcore["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((args.num_attention_heads + 2 * args.num_query_groups) * args.kv_channels, args.hidden_size)
    assert mcore["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * args.ffn_hidden_size, args.hidden_size)
    assert ("output_layer.weight" in mcore) == (not args.tie_embeddings)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mcore) == (name in ("qwen2", "glm4"))
    # GLM-4's norms after the attention and the MLP; its fused gate/up projection is Megatron's fc1 as it is
    assert ("decoder.layers.1.post_self_attn_layernorm.weight" in mcore) == (name == "glm4")
    assert ("decoder.layers.1.post_mlp_layernorm.weight" in mcore) == (name == "glm4")
    if name == "glm4":
        gate_up = read_hf_state_dict(folder)["model.layers.1.mlp.gate_up_proj.weight"]
        assert torch.equal(mcore["decoder.layers.1.mlp.linear_fc1.weight"], gate_up)
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mcore) == (name == "qwen3_tied")
    assert from_te_names(to_te_names(mcore)).keys() == mcore.keys()
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in to_te_names(mcore)


def test_qkv_is_fused_group_by_group():
    args = model_args_from_hf(
        AutoConfig.for_model(
            "llama",
            hidden_size=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=8,
            num_hidden_layers=1,
            vocab_size=4,
        )
    )
    d = args.kv_channels  # 2
    q = torch.arange(4 * d).float().unsqueeze(1)  # heads 0..3
    k = 100 + torch.arange(2 * d).float().unsqueeze(1)  # kv heads 0..1
    v = 200 + torch.arange(2 * d).float().unsqueeze(1)
    fused = fuse_qkv(q, k, v, args).squeeze(1).tolist()
    # group 0: q heads 0,1 | k head 0 | v head 0; then group 1
    assert fused == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    back = split_qkv(fuse_qkv(q, k, v, args), args)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_tensor_parallel_torch_shards_merge_back(tiny):
    _, folder, args = tiny
    mcore = hf_to_mcore(read_hf_state_dict(folder), args)
    shards = [{}, {}]
    for name, value in mcore.items():
        if name.endswith("linear_fc1.weight"):
            gate, up = value.chunk(2)
            parts = [torch.cat([g, u]) for g, u in zip(gate.chunk(2), up.chunk(2))]
        elif name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
            if "embedding" in name or "output" in name:  # padded vocabulary
                value = torch.cat([value, torch.zeros(128 - value.shape[0], value.shape[1])])
            parts = list(value.chunk(2))
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            parts = list(value.chunk(2, dim=1))
        else:
            parts = [value, value]
        for shard, part in zip(shards, parts):
            shard[name] = part
    merged = merge_tp_shards(shards, args)
    assert merged.keys() == mcore.keys()
    assert all(torch.equal(merged[n], mcore[n]) for n in mcore)


def test_unsupported_architectures_are_refused():
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        model_args_from_hf(AutoConfig.for_model("gpt2"))
    with pytest.raises(ConfigError, match="RoPE scaling"):
        model_args_from_hf(AutoConfig.for_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}))


def test_missing_and_extra_hf_tensors_are_named(tiny):
    _, folder, args = tiny
    hf = read_hf_state_dict(folder)
    with pytest.raises(KeyError, match="model.norm.weight"):
        hf_to_mcore({k: v for k, v in hf.items() if k != "model.norm.weight"}, args)
    with pytest.raises(ValueError, match="no Megatron counterpart"):
        hf_to_mcore({**hf, "model.layers.0.extra.weight": torch.zeros(1)}, args)
