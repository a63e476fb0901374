"""Prompt data beyond the basics: Parquet and fsspec URLs, chat messages with step_loss_mask,
metadata forms, the source_name rule carried through the queue's record codec, custom data sources
(--data-source-path), and errors that name the file, the line and the key."""

from __future__ import annotations

import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vime.data.prompt import PromptError, chat_messages, render_prompt, sft_tokens
from vime.data.source import (
    CustomPromptSource,
    DataError,
    DataKeys,
    DatasetCursor,
    PromptDataset,
    PromptRecord,
    open_prompt_source,
)
from vime.runtime.plugins import PluginError
from vime.sample import Sample, Status

KEYS = DataKeys("prompt", "label", "metadata")
CHAT = [{"role": "system", "content": "brief", "step_loss_mask": 0}, {"role": "user", "content": "12="}]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_parquet_with_chat_messages_struct_metadata_and_json_string_metadata(tmp_path):
    rows = [
        {"question": CHAT, "answer": "3", "meta": json.dumps({"source_name": "math"})},
        {"question": [{"role": "user", "content": "7="}], "answer": "8", "meta": None},
    ]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    data = PromptDataset.load(str(path), DataKeys("question", "answer", "meta"))
    assert data[0].prompt[0]["content"] == "brief" and data[0].prompt[0]["step_loss_mask"] == 0
    assert data[0].metadata == {"source_name": "math"} and data[1].metadata == {}
    # Parquet fills the missing step_loss_mask of the other messages with null: accepted (= 1).
    assert data[1].prompt[0]["step_loss_mask"] is None and data[1].label == "8"


def test_parquet_struct_metadata_and_memory_url(tmp_path):
    table = pa.Table.from_pylist(
        [
            {"prompt": "a", "label": "1", "metadata": {"source_name": "s1"}},
            {"prompt": "b", "label": "2", "metadata": {"source_name": None}},
        ]
    )
    with fsspec.open("memory://vime-tests/prompts.parquet", "wb") as f:
        pq.write_table(table, f)
    data = PromptDataset.load("memory://vime-tests/prompts.parquet", KEYS)
    assert [r.prompt for r in data.records] == ["a", "b"]
    samples = [Sample(metadata=r.metadata) for r in data.records]
    assert [s.source_name for s in samples] == ["s1", "unknown"]


def test_jsonl_with_other_keys_and_no_label(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "1=", "info": {"k": 1}}])
    data = PromptDataset.load(path, DataKeys("q", None, "info"))
    assert data[0] == PromptRecord(0, "1=", None, {"k": 1})


@pytest.mark.parametrize(
    "row, match",
    [
        (
            {"prompt": [{"role": "user", "content": "x", "step_loss_mask": 2}], "label": "1"},
            r"line 2: field 'prompt', message 0: step_loss_mask must be 0 or 1, got 2",
        ),
        (
            {"prompt": [{"role": "user", "content": "x", "step_loss_mask": True}], "label": "1"},
            r"line 2: field 'prompt', message 0: step_loss_mask must be 0 or 1, got True",
        ),
        ({"prompt": [{"role": "user"}], "label": "1"}, r"line 2: field 'prompt', message 0: a chat message needs"),
        ({"prompt": [], "label": "1"}, r"line 2: field 'prompt' must be a string or a list of chat messages"),
        (
            {"prompt": "x", "label": "1", "metadata": "{not json"},
            r"line 2: field 'metadata' \(--metadata-key\) is a "
            r"string but not JSON",
        ),
        (
            {"prompt": "x", "label": "1", "metadata": [1]},
            r"line 2: field 'metadata' \(--metadata-key\) must be an object",
        ),
        ({"prompt": "x"}, r"line 2: record has no field 'label' \(--label-key\)"),
        ([1, 2], r"line 2: expected a JSON object, got list"),
    ],
)
def test_bad_records_name_file_line_and_key(tmp_path, row, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "label": "1"}, row])
    with pytest.raises(DataError, match=r"bad\.jsonl, " + match):
        PromptDataset.load(path, KEYS)


def test_bad_files_are_named(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"broken\.parquet: not a readable Parquet file"):
        PromptDataset.load(str(tmp_path / "broken.parquet"), KEYS)
    with pytest.raises(DataError, match=r"prompts\.csv: unsupported format"):
        PromptDataset.load(write_jsonl(tmp_path / "prompts.csv", [{"prompt": "a"}]), KEYS)
    with pytest.raises(DataError, match=r"empty\.jsonl: no records"):
        PromptDataset.load(write_jsonl(tmp_path / "empty.jsonl", []), KEYS)
    with pytest.raises(DataError, match=r"memory://vime-tests/absent\.jsonl: no such file"):
        PromptDataset.load("memory://vime-tests/absent.jsonl", KEYS)


def test_source_name_rule():
    assert Sample(source="dyn", metadata={"source_name": "meta"}).source_name == "dyn"
    assert Sample(metadata={"source_name": "meta"}).source_name == "meta"
    assert Sample().source_name == "unknown"


def test_source_and_session_survive_the_queue_record_codec():
    from vime.queue.records import decode_group, encode_group

    samples = [
        Sample(
            group_index=3,
            index=i,
            prompt_index=7,
            tokens=[1, 2, 3],
            response_length=1,
            reward=1.0,
            status=Status.COMPLETED,
            weight_versions=[0],
            loss_mask=[0],
            session_id=f"g3-{i}",
            **kw,
        )
        for i, kw in enumerate([{"source": "dyn"}, {"metadata": {"source_name": "meta"}}, {}])
    ]
    decoded = decode_group(encode_group(samples, "g3", {}))
    assert [s.source_name for s in decoded] == ["dyn", "meta", "unknown"]
    assert [s.session_id for s in decoded] == ["g3-0", "g3-1", "g3-2"]
    assert decoded[0].loss_mask == [0]


def test_reward_by_source():
    from vime.rollout.rewards import reward_by_source

    samples = [
        Sample(reward=1.0, source="a"),
        Sample(reward=0.0, source="a"),
        Sample(reward=0.5, metadata={"source_name": "b"}),
        Sample(reward=0.25),
    ]
    assert reward_by_source(samples) == {"reward_mean/a": 0.5, "reward_mean/b": 0.5, "reward_mean/unknown": 0.25}


# ---------------------------------------------------------------- chat templates and step_loss_mask
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer():
    from vime.tools.make_tiny_model import build_tokenizer

    tokenizer = build_tokenizer("0123456789=<>/abcdefghijklmnopqrstuvwxyz")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_chat_template_rendering_ignores_step_loss_mask(chat_tokenizer):
    ids = render_prompt(chat_tokenizer, CHAT, apply_chat_template=True)
    assert chat_tokenizer.decode(ids) == "<system>brief</s><user>12=</s><assistant>"
    assert chat_messages(CHAT)[0] == {"role": "system", "content": "brief"}
    assert CHAT[0]["step_loss_mask"] == 0  # the record itself is not modified
    with pytest.raises(PromptError, match="needs --apply-chat-template"):
        render_prompt(chat_tokenizer, CHAT, apply_chat_template=False)


def test_sft_tokens_mask_assistant_turns_and_honour_step_loss_mask(chat_tokenizer):
    conversation = [
        {"role": "user", "content": "1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "3="},
        {"role": "assistant", "content": "99", "step_loss_mask": 0},
        {"role": "user", "content": "5="},
        {"role": "assistant", "content": "6"},
    ]
    tokens, response_length, mask = sft_tokens(chat_tokenizer, conversation)
    text = chat_tokenizer.decode(tokens)
    assert text.startswith("<user>1=</s><assistant>")
    response = tokens[len(tokens) - response_length :]
    assert len(mask) == response_length
    trained = chat_tokenizer.decode([t for t, m in zip(response, mask) if m])
    assert trained == "2</s>6</s>"  # the turn with step_loss_mask 0 is not trained, user turns never
    with pytest.raises(PromptError, match="at least one assistant message"):
        sft_tokens(chat_tokenizer, [{"role": "user", "content": "1="}])


# ---------------------------------------------------------------- --data-source-path
class RowsSource:
    """A map-style custom source (the interface vime's --data-source-path needs)."""

    def __init__(self, args):
        self.rows = args.rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


class StreamingSource:
    """The reference framework's streaming interface: refused with an explanation."""

    def __init__(self, args):
        pass

    def get_samples(self, n):
        return []


class Args:
    def __init__(self, rows):
        self.rows = rows


def test_custom_source_rows_as_dicts_samples_and_records():
    rows = [
        {"prompt": "1=", "label": "2", "metadata": {"source_name": "m"}},
        Sample(prompt=[{"role": "user", "content": "3="}], label="4", source="dyn", metadata={"k": 1}),
        PromptRecord(99, "5=", "6", {}),
    ]
    source = open_prompt_source(None, KEYS, data_source_path=f"{__name__}.RowsSource", args=Args(rows))
    assert isinstance(source, CustomPromptSource) and len(source) == 3
    assert source[0] == PromptRecord(0, "1=", "2", {"source_name": "m"})
    assert source[1] == PromptRecord(1, [{"role": "user", "content": "3="}], "4", {"k": 1}, "dyn")
    assert source[2].index == 2 and source[2].prompt == "5="
    # epochs, shuffling and the cursor work as for files
    taken = DatasetCursor().take(source, 4, seed=1, shuffle=True)
    assert sorted(r for e, r in taken if e == 0) == [0, 1, 2] and taken[3][0] == 1


def test_custom_source_errors_name_the_flag_and_row(tmp_path):
    path = f"{__name__}.RowsSource"
    with pytest.raises(DataError, match=r"--data-source-path .*RowsSource: the source is empty"):
        open_prompt_source(None, KEYS, data_source_path=path, args=Args([]))
    with pytest.raises(DataError, match=r"--data-source-path .*RowsSource, row 0: expected a dict record, a Sample"):
        open_prompt_source(None, KEYS, data_source_path=path, args=Args([42]))
    source = open_prompt_source(
        None, KEYS, data_source_path=path, args=Args([{"prompt": "a", "label": "b"}, {"text": "c"}])
    )
    with pytest.raises(DataError, match=r"RowsSource, row 1: record has no field 'prompt' \(--input-key\)"):
        source[1]
    with pytest.raises(DataError, match=r"RowsSource, row 5: IndexError"):
        source[5]
    with pytest.raises(DataError, match=r"StreamingSource has no __len__\(\) \(vime's data sources are map-style"):
        open_prompt_source(None, KEYS, data_source_path=f"{__name__}.StreamingSource", args=None)
    with pytest.raises(
        PluginError,
        match=r"--data-source-path .*RowsSource: constructing it with args failed: "
        r"AttributeError",
    ):
        open_prompt_source(None, KEYS, data_source_path=path, args=object())
    with pytest.raises(DataError, match=r"^--prompt-data: no prompt file given"):
        open_prompt_source(None, KEYS)


def test_config_accepts_a_data_source_instead_of_prompt_data(tmp_path):
    from vime.config import ConfigError, parse_train_args

    (tmp_path / "config.json").write_text("{}")
    base = ["--hf-checkpoint", str(tmp_path), "--rm-type", "f1", "--run-dir", str(tmp_path / "run")]
    settings = parse_train_args(base + ["--data-source-path", f"{__name__}.RowsSource"])
    assert settings.data.prompt_data is None and settings.data.data_source_path.endswith("RowsSource")
    with pytest.raises(ConfigError, match="^--prompt-data: is required"):
        parse_train_args(base)
