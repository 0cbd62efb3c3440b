"""Parsing and validation of OpenAI request bodies into `SamplingParams` (no I/O, no engine).

Bad bodies raise `APIError` with the field named in `param`; unknown fields are ignored, as
OpenAI-compatible servers do, but OpenAI fields whose contract this worker cannot keep (`best_of` above `n`,
`echo`, `suffix`, `tool_choice: "auto"`, a JSON schema it cannot follow) are refused. Tools are parsed in
`tools.py`; response bodies are built in `responses.py`.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends.core.sampling_params import SamplingParams
from backends.server.errors import APIError, invalid_param, model_not_found, unsupported_param
from backends.server.fields import default, is_int, opt_bool, opt_float, opt_int
from backends.server.output_format import parse_response_format
from backends.server.resume import Resumed, parse_resume_token_ids
from backends.server.tools import ToolCalling, parse_tool_calls, parse_tools, refuse_with_structured_output

MAX_LOGPROBS = 20             # top alternatives per token, as OpenAI's top_logprobs allows
MAX_CHOICES = 16              # `n`: choices per prompt, each a sequence of its own in the batch
MAX_SEQUENCES = 64            # prompts x n in one request
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1     # what torch.Generator.manual_seed accepts
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# The fields of tool use (`parse_tools`); a body with none of them has none to parse.
_TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"})


class RequestKind(str, enum.Enum):
    COMPLETION = "completion"   # POST /v1/completions
    CHAT = "chat"               # POST /v1/chat/completions


@dataclass(frozen=True, slots=True)
class ParseContext:
    served_model_names: tuple[str, ...]   # names /v1/models lists; the first is the default
    vocab_size: int                       # token ids must be below this


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str        # one of _CHAT_ROLES
    content: str     # text parts joined; the chat template renders it
    tool_calls: tuple[dict[str, Any], ...] = ()   # an assistant's calls, as templates take them (arguments parsed)
    tool_call_id: str | None = None               # a tool message: the call it answers


Prompt = tuple[str | None, tuple[int, ...] | None]   # a completions prompt: its text, or its token ids


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    kind: RequestKind
    model: str                                  # the served name the client asked for
    prompt_text: str | None                     # completions: a text prompt
    prompt_token_ids: tuple[int, ...] | None    # completions: a pre-tokenized prompt
    batch: tuple[Prompt, ...]                   # completions: a batch of 2+ prompts (the first is the above)
    messages: tuple[ChatMessage, ...] | None    # chat: rendered with the tokenizer's template
    params: SamplingParams                      # max_tokens is provisional until resolve_max_tokens
    num_choices: int                            # `n`: sequences sampled from the prompt, choices 0..n-1
    max_tokens: int | None                      # as asked; None fills the context (chat)
    stream: bool
    include_usage: bool                         # stream_options.include_usage: a final usage chunk
    return_token_ids: bool                      # extension: choices carry "token_ids"
    resume_token_ids: tuple[int, ...]           # extension: output tokens the client already has (mid-stream
                                                # failover); the answer goes on after them (resume.py)
    skip_special_tokens: bool                   # special tokens stay out of the text
    continue_final_message: bool = False        # chat: the answer goes on from the last (assistant) message
                                                # in place, as vLLM's extension and Anthropic's prefill do
    add_generation_prompt: bool = True          # chat: the template opens a new assistant turn at the end
    tools: ToolCalling | None = None            # chat: the request's tools (tools.py); its answer may be calls
    resume_choices: tuple[Resumed, ...] = ()    # several sequences: `resume_token_ids` of each choice by index

    @property
    def num_sequences(self) -> int:
        """Sequences this request samples: n for each prompt."""
        return max(1, len(self.batch)) * self.num_choices

    def each_prompt(self) -> list[GenerateRequest]:
        """This request once per prompt of its batch (itself, without one)."""
        if not self.batch:
            return [self]
        return [dataclasses.replace(self, prompt_text=text, prompt_token_ids=ids, batch=()) for text, ids in self.batch]


def parse_request(kind: RequestKind, body: Any, ctx: ParseContext) -> GenerateRequest:
    """Validate a decoded JSON body for `kind`; raise APIError on the first bad field."""
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object.")
    model = parse_model(body, ctx.served_model_names)
    num_choices = opt_int(body, "n", 1, MAX_CHOICES) or 1
    _refuse_unsupported(body, kind, num_choices)
    prompt_text, prompt_ids, messages = None, None, None
    batch: tuple[Prompt, ...] = ()
    continue_final, add_generation_prompt = False, True
    tools = None
    if kind is RequestKind.CHAT:
        tools = parse_tools(body) if not _TOOL_FIELDS.isdisjoint(body) else None
        messages = _parse_messages(body.get("messages"))
        continue_final, add_generation_prompt = _parse_final_message(body, messages)
        max_tokens = opt_int(body, "max_completion_tokens", 1) or opt_int(body, "max_tokens", 1)
        logprobs = _parse_chat_logprobs(body)
    else:
        prompts = _parse_prompts(body.get("prompt"), ctx.vocab_size)
        (prompt_text, prompt_ids), batch = prompts[0], prompts if len(prompts) > 1 else ()
        if len(batch) * num_choices > MAX_SEQUENCES:
            raise invalid_param("prompt", f"{len(batch)} prompts x n={num_choices} is over {MAX_SEQUENCES} sequences.")
        max_tokens = opt_int(body, "max_tokens", 1)
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
        logprobs = opt_int(body, "logprobs", 0, MAX_LOGPROBS)
    stream = opt_bool(body, "stream") or False
    include_usage = _parse_stream_options(body, stream)
    params = _parse_sampling(body, ctx.vocab_size, max_tokens, logprobs, tools)
    resume_ids = body.get("resume_token_ids")   # only a failover's continuation sends it
    resumed, resume_choices = ((), ()) if resume_ids is None else \
        parse_resume_token_ids(resume_ids, ctx.vocab_size, max(1, len(batch)) * num_choices)
    return GenerateRequest(
        kind=kind,
        model=model,
        prompt_text=prompt_text,
        prompt_token_ids=prompt_ids,
        batch=batch,
        messages=messages,
        params=params,
        num_choices=num_choices,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=opt_bool(body, "return_token_ids") or False,
        resume_token_ids=resumed,
        skip_special_tokens=default(opt_bool(body, "skip_special_tokens"), True),
        continue_final_message=continue_final,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        resume_choices=resume_choices,
    )


def kv_transfer_params(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The body's `kv_transfer_params` when they ask for a disaggregated leg (disagg.py serves it)."""
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise invalid_param("kv_transfer_params", "`kv_transfer_params` must be an object.")
    if params.get("do_remote_decode") is True or params.get("do_remote_prefill") is True:
        return params
    return None   # neither leg asked for (vLLM sends such params on plain requests): serve normally


def resolve_max_tokens(req: GenerateRequest, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """Fix max_tokens against the context: refuse prompt + max_tokens over it (400), fill it if unset."""
    if num_prompt_tokens == 0:
        raise APIError("The prompt is empty.", param=_prompt_param(req.kind), code="invalid_value")
    room = max_model_len - num_prompt_tokens
    asked = req.max_tokens if req.max_tokens is not None else max(room, 1)
    if num_prompt_tokens + asked > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + asked} tokens ({num_prompt_tokens} in the prompt, {asked} in the "
            f"completion). Please reduce the prompt or max_tokens.",
            param=_prompt_param(req.kind) if room <= 0 else "max_tokens",
            code="context_length_exceeded",
        )
    if req.params.min_tokens > asked:
        raise invalid_param("min_tokens", f"min_tokens ({req.params.min_tokens}) exceeds max_tokens ({asked}).")
    return dataclasses.replace(req.params, max_tokens=asked)


def _prompt_param(kind: RequestKind) -> str:
    return "messages" if kind is RequestKind.CHAT else "prompt"


def parse_model(body: dict[str, Any], served_model_names: tuple[str, ...]) -> str:
    """The served name asked for (the first when absent); 404 model_not_found for another (every route)."""
    model = body.get("model")
    if model is None:
        return served_model_names[0]
    if not isinstance(model, str):
        raise invalid_param("model", "`model` must be a string.")
    if model not in served_model_names:
        raise model_not_found(model)
    return model


def _refuse_unsupported(body: dict[str, Any], kind: RequestKind, num_choices: int) -> None:
    best_of = opt_int(body, "best_of", 1)
    if best_of is not None and best_of != num_choices:
        raise unsupported_param("best_of", f"best_of must equal n ({num_choices}): choosing among more is not "
                                "supported.")
    if kind is RequestKind.COMPLETION and opt_bool(body, "echo"):
        raise unsupported_param("echo", "echo=true is not supported.")
    if kind is RequestKind.COMPLETION and body.get("suffix") is not None:
        raise unsupported_param("suffix", "suffix is not supported.")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid_param("user", "`user` must be a string.")


def _parse_prompts(prompt: Any, vocab_size: int) -> tuple[Prompt, ...]:
    """One prompt (a string, or token ids), or a batch of them."""
    if prompt is None:
        raise APIError("`prompt` is required.", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_SEQUENCES:
            raise invalid_param("prompt", f"A batch holds at most {MAX_SEQUENCES} prompts.")
        if len(prompt) == 1:
            return (_parse_prompt(prompt[0], vocab_size, "prompt"),)   # a batch of one prompt
        return tuple(_parse_prompt(p, vocab_size, f"prompt[{i}]") for i, p in enumerate(prompt))
    return (_parse_prompt(prompt, vocab_size, "prompt"),)


def _parse_prompt(prompt: Any, vocab_size: int, param: str) -> Prompt:
    if isinstance(prompt, str):
        if not prompt:
            raise invalid_param(param, "The prompt is empty.")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise invalid_param(param, f"Token ids in the prompt must be in [0, {vocab_size}).")
        return None, tuple(prompt)
    raise invalid_param(param, f"`{param}` must be a non-empty string or a non-empty list of token ids.")


def _parse_messages(messages: Any) -> tuple[ChatMessage, ...]:
    if messages is None:
        raise APIError("`messages` is required.", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise invalid_param("messages", "`messages` must be a non-empty array.")
    return tuple(_parse_message(i, m) for i, m in enumerate(messages))


def _parse_final_message(body: dict[str, Any], messages: tuple[ChatMessage, ...]) -> tuple[bool, bool]:
    """(continue_final_message, add_generation_prompt): continuing the last message opens no new turn, and it
    must be the assistant's (a prefilled answer)."""
    continue_final = opt_bool(body, "continue_final_message") or False
    add_generation_prompt = default(opt_bool(body, "add_generation_prompt"), not continue_final)
    if continue_final and add_generation_prompt:
        raise invalid_param("continue_final_message", "continue_final_message and add_generation_prompt cannot "
                            "both be true: the answer either continues the last message or opens a new turn.")
    if continue_final and messages[-1].role != "assistant":
        raise invalid_param("continue_final_message", "continue_final_message continues an assistant message: "
                            f"the last message is the {messages[-1].role}'s.")
    return continue_final, add_generation_prompt


def _parse_message(index: int, message: Any) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid_param(param, f"{param} must be an object.")
    role = message.get("role")
    if not isinstance(role, str) or role not in _CHAT_ROLES:    # an object is no role (and no set member)
        raise invalid_param(f"{param}.role", f"{param}.role must be one of {sorted(_CHAT_ROLES)}.")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        content = _join_text_parts(f"{param}.content", content)
    if not isinstance(content, str):
        raise invalid_param(f"{param}.content", f"{param}.content must be a string or an array of text parts.")
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise invalid_param(f"{param}.tool_calls", "Only an assistant message has tool_calls.")
    call_id = message.get("tool_call_id")
    if call_id is not None and (role != "tool" or not isinstance(call_id, str)):
        raise invalid_param(f"{param}.tool_call_id", "tool_call_id is a tool message's string.")
    return ChatMessage(role=role, content=content, tool_call_id=call_id,
                       tool_calls=() if calls is None else parse_tool_calls(f"{param}.tool_calls", calls))


def _join_text_parts(param: str, parts: list[Any]) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid_param(param, f"{param}: only parts of type 'text' are supported.")
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted = opt_bool(body, "logprobs") or False
    top = opt_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise invalid_param("top_logprobs", "top_logprobs requires logprobs=true.")
    return (top or 0) if wanted else None


def _parse_stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid_param("stream_options", "`stream_options` must be an object.")
    if not stream:
        raise invalid_param("stream_options", "stream_options is only allowed when stream=true.")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise invalid_param("stream_options.include_usage", "include_usage must be a boolean.")
    return include


def _parse_sampling(body: dict[str, Any], vocab_size: int, max_tokens: int | None,
                    logprobs: int | None, tools: ToolCalling | None) -> SamplingParams:
    seed = opt_int(body, "seed", SEED_MIN, SEED_MAX)
    output_format = parse_response_format(body) if body.get("response_format") is not None else None
    structured_format = output_format is not None and output_format.structured
    if tools is not None:
        refuse_with_structured_output(tools, structured_format)
    json_schema = tools.schema if tools is not None and tools.calls else \
        output_format.json_schema if output_format is not None else None
    structured = structured_format or json_schema is not None
    ignore_eos, min_tokens = opt_bool(body, "ignore_eos") or False, default(opt_int(body, "min_tokens", 0), 0)
    if structured and (ignore_eos or min_tokens):
        raise invalid_param("response_format" if structured_format else "tool_choice",
                            "A JSON response ends when its JSON value closes: it cannot be combined with "
                            "ignore_eos or min_tokens.")
    return SamplingParams(
        max_tokens=max_tokens or 1,
        temperature=default(opt_float(body, "temperature", 0.0, 2.0), 1.0),
        top_p=default(opt_float(body, "top_p", 0.0, 1.0, low_open=True), 1.0),
        top_k=default(opt_int(body, "top_k", -1, vocab_size), 0),
        min_p=default(opt_float(body, "min_p", 0.0, 1.0), 0.0),
        seed=seed,
        stop_token_ids=_parse_stop_token_ids(body.get("stop_token_ids"), vocab_size),
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        presence_penalty=default(opt_float(body, "presence_penalty", -2.0, 2.0), 0.0),
        frequency_penalty=default(opt_float(body, "frequency_penalty", -2.0, 2.0), 0.0),
        repetition_penalty=default(opt_float(body, "repetition_penalty", 0.0, 10.0, low_open=True), 1.0),
        logprobs=logprobs,
        logit_bias=_parse_logit_bias(body.get("logit_bias"), vocab_size),
        stop=_parse_stop(body.get("stop")),
        speculative=default(opt_bool(body, "speculative"), True) and not structured,
        json_object=output_format is not None and output_format.json_object,
        json_schema=json_schema,
    )


def _parse_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid_param("stop", "`stop` must be a string or an array of strings.")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid_param("stop", f"At most {MAX_STOP_STRINGS} stop strings are allowed.")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise invalid_param("stop", f"Stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters.")
    return tuple(dict.fromkeys(stops))


def _parse_stop_token_ids(ids: Any, vocab_size: int) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab_size for t in ids):
        raise invalid_param("stop_token_ids", f"`stop_token_ids` must be an array of token ids in [0, {vocab_size}).")
    return tuple(ids)


def _parse_logit_bias(bias: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: token ids (as JSON object keys, so strings) to a bias in [-100, 100]."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise invalid_param("logit_bias", "`logit_bias` must be an object of token ids to numbers.")
    out = []
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1   # int() of 4,301 digits raises
        if not 0 <= token < vocab_size:
            raise invalid_param("logit_bias", f"`logit_bias` keys must be token ids in [0, {vocab_size}), got {key!r}.")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not -100 <= value <= 100:
            raise invalid_param("logit_bias", f"`logit_bias[{key!r}]` must be a number in [-100, 100].")
        if value:
            out.append((token, float(value)))
    return tuple(out)
