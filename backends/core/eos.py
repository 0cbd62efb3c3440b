"""A model's end-of-sequence token ids, read from its folder's config files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def eos_token_ids(hf_config: Any, model_dir: Path | None) -> tuple[int, ...]:
    """EOS ids from config.json and, where present, generation_config.json (SmolLM2: <|im_end|> = 2)."""
    ids: set[int] = set()
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None)]
    gen_path = model_dir / "generation_config.json" if model_dir is not None else None
    if gen_path is not None and gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return tuple(sorted(ids))
