"""Anthropic Messages API <-> OpenAI chat translation, both ways, as pure functions and stream translators
(no I/O, no aiohttp): `inbound` serves Anthropic clients at POST /v1/messages over the OpenAI-style
dispatch; `outbound` lets a model's chain fall back to an Anthropic-compatible upstream (the `anthropic`
provider kind). `gateway/translate/sse.py` frames the event streams both share.
"""
from __future__ import annotations

API_VERSION = "2023-06-01"   # the version this gateway sends upstream
# `anthropic-version` from clients: a date from the Messages API's first version on. Later versions
# (SDKs send newer dates) keep the request and response fields translated here, so any such date is
# accepted; a value that is no date at all is refused.
FIRST_VERSION = "2023-01-01"
