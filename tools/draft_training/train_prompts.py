"""The built-in prompts `switchyard train-draft` generates its distillation text from, and the held-out ones
its acceptance is measured on: structured output (JSON edits, tool calls, code refactors, quoting a
passage) and prose. Pure data and string templates; deterministic for a seed.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

STRUCTURED, PROSE = "structured", "prose"


@dataclass(frozen=True, slots=True)
class Prompt:
    kind: str     # STRUCTURED | PROSE
    text: str     # the user message (the chat template wraps it)


_NAMES = ["Ada", "Bruno", "Chen", "Dalia", "Emeka", "Fiona", "Goran", "Hana", "Ivan", "Jules", "Kofi", "Lena",
          "Mateo", "Nadia", "Oskar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara"]
_CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Austin", "Hanoi", "Porto", "Quito", "Perth",
           "Kyiv", "Dakar", "Seoul", "Bern", "Accra"]
_TOPICS = ["a lighthouse keeper who finds a message in a bottle", "the history of the printing press",
           "how bees communicate", "a city without cars", "why the sky is blue", "learning to play the cello",
           "the first day at a new job", "a robot that learns to paint", "how vaccines work",
           "the life cycle of a star", "a rainy afternoon in a small village", "the invention of the bicycle",
           "what makes a good friend", "a journey across a desert", "how compilers turn code into programs",
           "the smell of bread in the morning", "an old map found in an attic", "how tides work",
           "a chess match between two rivals", "the migration of whales", "building a treehouse",
           "the importance of sleep", "a market at dawn", "how a bill becomes a law", "the northern lights",
           "a letter to your future self", "the ocean floor", "why people keep diaries",
           "a storm at sea", "the taste of an unfamiliar fruit", "how glass is made", "a forgotten garden"]
_PROSE_FORMS = ["Write a short story about {}.", "Explain {} to a curious twelve-year-old.",
                "Write a descriptive paragraph about {}.", "Write a short essay on {}.",
                "Describe {} in three paragraphs.", "Tell me about {}."]
_TOOLS = [
    ("get_weather", {"city": "string", "unit": "celsius|fahrenheit"}, "What is the weather in {city} in {unit}?",
     lambda r: {"city": r.choice(_CITIES), "unit": r.choice(["celsius", "fahrenheit"])}),
    ("book_flight", {"origin": "string", "destination": "string", "date": "YYYY-MM-DD"},
     "Book me a flight from {origin} to {destination} on {date}.",
     lambda r: {"origin": r.choice(_CITIES), "destination": r.choice(_CITIES),
                "date": f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"}),
    ("send_email", {"to": "string", "subject": "string", "body": "string"},
     "Email {to} with the subject '{subject}' saying {body}.",
     lambda r: {"to": f"{r.choice(_NAMES).lower()}@example.com", "subject": r.choice(["Meeting", "Invoice", "Hello"]),
                "body": r.choice(["the report is ready", "see you on Monday", "thanks for your help"])}),
    ("search_products", {"query": "string", "max_price": "number"}, "Find me {query} under {max_price} dollars.",
     lambda r: {"query": r.choice(["running shoes", "a desk lamp", "headphones", "a tent"]),
                "max_price": r.choice([20, 50, 100, 250])}),
    ("create_event", {"title": "string", "start": "ISO time", "attendees": "list of names"},
     "Schedule '{title}' at {start} with {attendees}.",
     lambda r: {"title": r.choice(["Design review", "Lunch", "Standup"]),
                "start": f"2025-06-{r.randint(1, 28):02d}T10:00", "attendees": ", ".join(r.sample(_NAMES, 2))}),
]
_FUNCTIONS = [
    "def total(xs):\n    t = 0\n    for x in xs:\n        t = t + x\n    return t\n",
    "def evens(nums):\n    out = []\n    for n in nums:\n        if n % 2 == 0:\n"
    "            out.append(n)\n    return out\n",
    "def find_user(users, name):\n    for u in users:\n        if u['name'] == name:\n"
    "            return u\n    return None\n",
    "def read_lines(path):\n    f = open(path)\n    data = f.read()\n    f.close()\n"
    "    return data.split('\\n')\n",
    "def count_words(text):\n    counts = {}\n    for w in text.split():\n        if w in counts:\n"
    "            counts[w] += 1\n        else:\n            counts[w] = 1\n    return counts\n",
    "def mean(values):\n    if len(values) == 0:\n        return 0\n    s = 0\n    for v in values:\n"
    "        s += v\n    return s / len(values)\n",
    "function max(arr) {\n  var m = arr[0];\n  for (var i = 1; i < arr.length; i++) {\n"
    "    if (arr[i] > m) m = arr[i];\n  }\n  return m;\n}\n",
    "def squares(n):\n    result = []\n    i = 0\n    while i < n:\n        result.append(i * i)\n"
    "        i += 1\n    return result\n",
]
_REFACTORS = ["Refactor this code to be more idiomatic. Output only the code.",
              "Add type hints and a docstring to this function. Output only the code.",
              "Rename the variables in this code to be more descriptive. Output only the code.",
              "Rewrite this code using a comprehension or built-in where possible. Output only the code."]
_PASSAGES = [
    "The river rose slowly through the night. By morning the lower fields were under water, and the farmers "
    "moved their animals to the hill behind the church. No one was hurt, but the bridge was closed for a week.",
    "Photosynthesis takes place in the chloroplasts of plant cells. Light energy splits water molecules, "
    "releasing oxygen. The energy is stored in sugars that the plant uses to grow.",
    "The museum opens at nine and closes at five. Tickets cost twelve dollars for adults and are free for "
    "children under ten. Photography is allowed in every gallery except the east wing.",
    "Marta learned to code at the age of forty. She started with small scripts to sort her photos, then built "
    "a website for her bakery. Two years later she was teaching evening classes at the library.",
    "The committee met on Tuesday to discuss the budget. It approved funds for new streetlights but postponed "
    "the decision on the park renovation until the spring meeting.",
    "Copper conducts electricity well and resists corrosion. For these reasons it is used in most household "
    "wiring, although aluminium is sometimes chosen for long power lines because it is lighter.",
]
_QUESTIONS = ["Answer by quoting the exact sentence from the passage that answers: {}",
              "Quote the passage word for word, then answer in one sentence: {}"]
_PASSAGE_QUESTIONS = ["what happened first?", "what is the main point?", "what was decided or done?",
                      "which detail is about cost or time?"]


def _record(rng: random.Random) -> dict[str, object]:
    name = rng.choice(_NAMES)
    return rng.choice([
        {"id": rng.randint(100, 999), "name": name, "email": f"{name.lower()}@example.com",
         "city": rng.choice(_CITIES), "active": rng.choice([True, False])},
        {"order_id": f"A-{rng.randint(1000, 9999)}", "customer": name, "items": [
            {"sku": f"SKU-{rng.randint(10, 99)}", "qty": rng.randint(1, 5)} for _ in range(rng.randint(1, 3))],
         "status": rng.choice(["pending", "shipped", "delivered"])},
        {"service": rng.choice(["api", "worker", "cache"]), "replicas": rng.randint(1, 8),
         "port": rng.choice([8000, 8080, 9000]), "debug": rng.choice([True, False]),
         "region": rng.choice(["eu-west", "us-east", "ap-south"])},
    ])


def _json_edit(rng: random.Random) -> str:
    record = _record(rng)
    field = rng.choice(list(record))
    value = rng.choice(['"updated"', "42", "false", f'"{rng.choice(_CITIES)}"'])
    return (f"Rewrite this JSON with the field \"{field}\" changed to {value}. Output only the JSON.\n"
            f"{json.dumps(record, indent=2)}")


def _tool_call(rng: random.Random, tools: list) -> str:
    name, params, question, fill = rng.choice(tools)
    return (f"You can call this tool: {name}({json.dumps(params)}). Reply with only a JSON object "
            f"{{\"name\": ..., \"arguments\": {{...}}}} that calls it for this request: "
            f"{question.format(**fill(rng))}")


def _code(rng: random.Random, functions: list[str]) -> str:
    return f"{rng.choice(_REFACTORS)}\n```\n{rng.choice(functions)}```"


def _quote(rng: random.Random, passages: list[str]) -> str:
    return f"{rng.choice(_QUESTIONS).format(rng.choice(_PASSAGE_QUESTIONS))}\nPassage: {rng.choice(passages)}"


def _prose(rng: random.Random, topics: list[str]) -> str:
    return rng.choice(_PROSE_FORMS).format(rng.choice(topics))


def _split(items: list, held_out: int) -> tuple[list, list]:
    return items[:-held_out], items[-held_out:]


def prompt_sets(seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts): the held-out ones use topics, tools, functions and
    passages the training prompts never show."""
    topics, eval_topics = _split(_TOPICS, 4)
    tools, eval_tools = _split(_TOOLS, 1)
    functions, eval_functions = _split(_FUNCTIONS, 1)
    passages, eval_passages = _split(_PASSAGES, 1)
    rng = random.Random(seed)
    train: list[Prompt] = []
    for i in range(4000):   # more than any budget on a CPU gets through; order mixes the kinds
        pick = i % 6
        if pick == 0:
            train.append(Prompt(STRUCTURED, _json_edit(rng)))
        elif pick == 1:
            train.append(Prompt(STRUCTURED, _tool_call(rng, tools)))
        elif pick == 2:
            train.append(Prompt(STRUCTURED, _code(rng, functions)))
        elif pick == 3:
            train.append(Prompt(STRUCTURED, _quote(rng, passages)))
        else:
            train.append(Prompt(PROSE, _prose(rng, topics)))
    held = random.Random(seed + 1)
    # interleaved, so that the first few (--eval-prompts) cover both kinds
    structured = [Prompt(STRUCTURED, _json_edit(held)), Prompt(STRUCTURED, _tool_call(held, eval_tools)),
                  Prompt(STRUCTURED, _code(held, eval_functions)), Prompt(STRUCTURED, _quote(held, eval_passages))]
    prose = [Prompt(PROSE, form.format(topic)) for form, topic in zip(_PROSE_FORMS, eval_topics, strict=False)]
    return train, [p for pair in zip(structured, prose, strict=True) for p in pair]
