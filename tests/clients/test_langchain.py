"""LangChain's ChatOpenAI, unchanged, against the running gateway (invoke and stream), with
`x-session-affinity` as a default header."""
from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

from tests.clients.conftest import MODEL, SESSION_HEADER, System, same_worker

pytestmark = pytest.mark.slow


def test_chat_openai_invoke_and_stream(system: System) -> None:
    chat = ChatOpenAI(model=MODEL, base_url=system.openai_base_url, api_key=system.api_key, max_tokens=8,
                      temperature=0, max_retries=0, default_headers={SESSION_HEADER: "langchain"},
                      stream_usage=True)
    messages = [SystemMessage("You answer in one word."), HumanMessage("Name a fruit.")]
    with same_worker(system, 2):
        reply = chat.invoke(messages)
        pieces = list(chat.stream(messages))
    assert isinstance(reply.content, str) and reply.content
    assert reply.usage_metadata is not None and 0 < reply.usage_metadata["output_tokens"] <= 8
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(p.content for p in pieces if isinstance(p.content, str))
    assert streamed
    usage = [p.usage_metadata for p in pieces if p.usage_metadata]
    assert usage and 0 < usage[-1]["output_tokens"] <= 8
