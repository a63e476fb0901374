"""PPO's critic on the torch backend: :class:`ValueModel` (the policy's transformer body and a one-output linear
head), its files, and where a critic's ``load`` (``--roles-config``) points."""

from __future__ import annotations

import os

import torch

from vime.config.base import ConfigError
from vime.config.roles import FLAG as ROLES_FLAG

VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_OPTIMIZER_FILE = "optimizer.pt"
LATEST_FILE = "latest_checkpointed_iteration.txt"  # the layout of --save, for a critic's own save folder


def _load_body(path: str) -> torch.nn.Module:
    """The transformer body (no LM head) of the HF model at ``path``."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a causal-LM folder has an lm_head the body does not use: expected
    try:
        return AutoModel.from_pretrained(path, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)


class ValueModel(torch.nn.Module):
    """PPO's critic: a transformer body and a linear head with one output per position.

    **Decision** (as the reference framework, which swaps the policy's output layer for a one-output
    linear layer): the body starts from the policy's checkpoint (or the critic's ``load``), the head is
    ``torch.nn.Linear(hidden_size, 1)`` with PyTorch's default initialisation, seeded by --seed. Values
    are not scaled by the sampling temperature.
    """

    def __init__(self, body: torch.nn.Module):
        super().__init__()
        self.body = body
        self.value_head = torch.nn.Linear(body.config.hidden_size, 1)

    @classmethod
    def from_pretrained(cls, path: str) -> ValueModel:
        return cls(_load_body(path))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # No KV cache: it would hold every layer's keys and values, and transformers looks for packed
        # sequences in the position ids only without one.
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # The head in its own dtype (bf16 with --bf16), the values in float32: [B, T], the value of the prefix up to t.
        return self.value_head(hidden.to(self.value_head.weight.dtype)).float().squeeze(-1)

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        self.body.save_pretrained(os.path.join(path, "model"), safe_serialization=True)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()},
            os.path.join(path, VALUE_HEAD_FILE),
        )

    def load_head(self, path: str) -> None:
        from safetensors.torch import load_file

        self.value_head.load_state_dict(load_file(os.path.join(path, VALUE_HEAD_FILE)))

    def load_weights(self, path: str) -> None:
        """Body and head from a folder written by :meth:`save`."""
        self.body.load_state_dict(_load_body(os.path.join(path, "model")).state_dict())
        self.load_head(path)


def is_critic_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, VALUE_HEAD_FILE))


def resolve_critic_load(path: str, field: str, source: str | None) -> tuple[str, bool]:
    """(folder, is a critic checkpoint) for the critic's ``load``: a save folder (its latest iteration),
    one critic checkpoint, or an HF model folder (the body; the head starts fresh)."""
    if os.path.isfile(os.path.join(path, LATEST_FILE)):
        with open(os.path.join(path, LATEST_FILE)) as f:
            path = os.path.join(path, f"iter_{int(f.read().strip()):07d}")
    if is_critic_checkpoint(path):
        return path, True
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, False
    raise ConfigError(
        ROLES_FLAG,
        f"{source or '<yaml>'}: {field}: {path!r} is neither a critic checkpoint "
        f"(model/ and {VALUE_HEAD_FILE}) nor an HF model folder (config.json)",
    )
