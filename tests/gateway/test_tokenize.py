"""Prompt counting matches transformers' own tokenizer and chat template on the same folder."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cache.block_hash import block_hashes
from gateway.routing.token_count import TokenCounter

TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
          "user assistant system messages and prompts", "<|im_start|> <|im_end|>"] * 20


@pytest.fixture(scope="module", params=["tokenizer_config", "jinja_file"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"tok_{request.param}")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    if request.param == "tokenizer_config":
        config["chat_template"] = TEMPLATE
    else:
        (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


MESSAGES = [{"role": "system", "content": "you are a helpful assistant"},
            {"role": "user", "content": "hello world, how are you today? the quick brown fox"}]


def test_chat_counts_match_transformers(folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=TEMPLATE)
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    counted = TokenCounter({"m": folder}).count_chat("m", MESSAGES)
    assert list(counted.token_ids) == list(expected) and counted.num_tokens == len(expected)
    assert block_hashes(counted.token_ids, 4) == block_hashes(list(expected), 4)


def test_text_and_token_id_prompts(folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    counter = TokenCounter({"m": folder, "n": None})
    text = "the lazy dog says hello"
    assert list(counter.count_prompt("m", text).token_ids) == reference(text)["input_ids"]
    assert counter.count_prompt("m", [5, 6, 7]).num_tokens == 3
    assert counter.count_prompt("m", [text, text]).num_tokens == 2 * len(reference(text)["input_ids"])
    estimate = counter.count_prompt("n", "x" * 400)  # no tokenizer: chars / 4, no ids
    assert estimate.num_tokens == 100 and estimate.token_ids is None


# A template in the manner of Qwen's and Llama 3's: tools as JSON (`tojson` with its options), the date,
# tool calls and results, and `{% break %}`.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntoday {{ strftime_now('%Y') }}; tools:\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{{ tool.function.parameters | tojson(indent=2, sort_keys=true) }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}{% if loop.index > 8 %}{% break %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather, é", "parameters": CITY}}]
TOOL_MESSAGES = [{"role": "user", "content": "weather in the world?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "x"}'}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_tool_definitions_and_calls_count_as_transformers_renders_them(tmp_path: Path, folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TOOLS_TEMPLATE}))
    reference = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=TOOLS_TEMPLATE)
    expected = reference.apply_chat_template(TOOL_MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    counter = TokenCounter({"m": tmp_path, "n": None})
    counted = counter.count_chat("m", TOOL_MESSAGES, tools=TOOLS)
    assert list(counted.token_ids) == list(expected)
    assert counted.num_tokens > counter.count_chat("m", TOOL_MESSAGES).num_tokens
    # without a tokenizer the estimate counts the tools' and calls' JSON too
    assert counter.count_chat("n", TOOL_MESSAGES, tools=TOOLS).num_tokens > \
        counter.count_chat("n", TOOL_MESSAGES).num_tokens > counter.count_chat("n", TOOL_MESSAGES[:1] * 3).num_tokens
