"""A checkpoint's tokenizer, loaded as AutoTokenizer loads it but without AutoTokenizer's imports where that is safe.

``AutoTokenizer.from_pretrained`` picks the tokenizer class from the checkpoint's config and tokenizer config. To
read the config it imports transformers' configuration and generation code, and with it torch: about 3 CPU-seconds
for a process that needs only the tokenizer (measured: 4.4 CPU-s with AutoTokenizer, 1.1 with the class it picks),
which every rollout worker, and the driver where it tokenizes, paid at each start. The class AutoTokenizer picks
does not change while the checkpoint's files and transformers do not. So the first process that loads a checkpoint
records the class and a fingerprint of the tokenizer AutoTokenizer built (its size, special tokens, chat template
and the ids of a probe text) in the user's cache, keyed by the content of those files and transformers' version;
a later process builds that class directly and compares the fingerprint. A different fingerprint, or any error,
falls back to AutoTokenizer (and records again): the cache can make a start cheaper, never the tokenizer different.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os

from vime.runtime.user_cache import user_cache_path, write_cached

logger = logging.getLogger(__name__)

# The files AutoTokenizer reads to choose and build the tokenizer (config.json: its model type can choose the class).
TOKENIZER_INPUTS = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
# Ids of this text, with the tokenizer's size, special tokens and chat template, fingerprint what was built.
PROBE = "Hello, world! 12+34=46\n\t  Grüße, 你好 <|im_start|>user\n</s><s>[INST] ¿qué? 🙂"


def load_tokenizer(path: str):
    """The tokenizer ``AutoTokenizer.from_pretrained(path)`` gives (a class recorded for this checkpoint is built
    directly and checked against the recorded fingerprint)."""
    record_path = _record_path(path)
    record = _read_record(record_path) if record_path else None
    if record is not None:
        tokenizer = _load_recorded(path, record)
        if tokenizer is not None:
            return tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if record_path:
        kind = type(tokenizer)
        record = {"module": kind.__module__, "class": kind.__qualname__, "fingerprint": fingerprint(tokenizer)}
        write_cached(record_path, json.dumps(record))
    return tokenizer


def fingerprint(tokenizer) -> str:
    """A digest of what a tokenizer does: its class, size, special tokens, chat template and the ids of
    :data:`PROBE`."""
    facts = [
        type(tokenizer).__qualname__,
        len(tokenizer),
        sorted(tokenizer.all_special_tokens),
        tokenizer.all_special_ids,
        getattr(tokenizer, "chat_template", None),
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        tokenizer.bos_token_id,
        tokenizer.encode(PROBE),
    ]
    return hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()


def _record_path(path: str) -> str | None:
    """Where the record of ``path``'s tokenizer lives (None: not a local folder, AutoTokenizer every time)."""
    if not os.path.isdir(path):
        return None
    import transformers

    digest = hashlib.sha256(transformers.__version__.encode())
    for name in TOKENIZER_INPUTS:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            digest.update(name.encode())
            with open(file, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
    return user_cache_path(os.path.join("tokenizers", digest.hexdigest() + ".json"))


def _read_record(record_path: str) -> dict | None:
    try:
        with open(record_path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and {"module", "class", "fingerprint"} <= set(record) else None


def _load_recorded(path: str, record: dict):
    """The recorded class's tokenizer of ``path`` if it has the recorded fingerprint, else None (the reason logged)."""
    try:
        if not record["module"].startswith("transformers."):
            return None  # remote code: AutoTokenizer decides whether it may run
        kind = getattr(importlib.import_module(record["module"]), record["class"])
        tokenizer = kind.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - any failure falls back to AutoTokenizer, which reports its own
        logger.info("tokenizer of %s: the recorded class did not load (%s); using AutoTokenizer", path, error)
        return None
    if fingerprint(tokenizer) != record["fingerprint"]:
        logger.info("tokenizer of %s: the recorded class built a different tokenizer; using AutoTokenizer", path)
        return None
    return tokenizer
