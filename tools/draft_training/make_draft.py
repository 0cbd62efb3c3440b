"""`switchyard make-draft --model SPEC --layers N [--tail M] --out DIR`: a draft model cut from the target
(self-speculation): the embedding, N of its decoder layers (the first N - M and the last M), the final
norm and the LM head, with the target's tokenizer files. The folder loads like any HF Llama-family model.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

_LAYER_PREFIX = "model.layers."
# Per-layer lists in some configs (Qwen3, Gemma-style); cut the same way as the layers.
_PER_LAYER_FIELDS = ("layer_types",)


def select_layers(num_layers: int, keep: int, tail: int = 0) -> list[int]:
    """The target layers a draft of `keep` layers is made of: the first keep - tail, then the last tail."""
    if not 1 <= keep <= num_layers:
        raise ValueError(f"--layers must be within 1..{num_layers} (the target's layers), not {keep}")
    if not 0 <= tail < keep:
        raise ValueError(f"--tail must be within 0..{keep - 1} (fewer than --layers), not {tail}")
    return [*range(keep - tail), *range(num_layers - tail, num_layers)]


def draft_weights(weights: dict[str, torch.Tensor], layers: list[int]) -> dict[str, torch.Tensor]:
    """The tensors of the draft, HF names with its layers renumbered 0..len(layers)-1; every tensor
    outside the decoder layers (embedding, final norm, LM head) kept."""
    renumber = {source: target for target, source in enumerate(layers)}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.startswith(_LAYER_PREFIX):
            index, rest = name[len(_LAYER_PREFIX):].split(".", 1)
            if int(index) not in renumber:
                continue
            name = f"{_LAYER_PREFIX}{renumber[int(index)]}.{rest}"
        out[name] = tensor.contiguous()   # safetensors refuses views that share storage
    return out


def draft_config(config: dict[str, Any], layers: list[int], source: str) -> dict[str, Any]:
    out = dict(config, num_hidden_layers=len(layers))
    for key in _PER_LAYER_FIELDS:
        if isinstance(config.get(key), list):
            out[key] = [config[key][i] for i in layers]
    out["switchyard_draft"] = {"source": source, "layers": layers}   # provenance; loaders ignore it
    return out


def generation_config(source_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The target's generation_config.json, or one with its config's special token ids."""
    path = source_dir / "generation_config.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if config.get(key) is not None}


def make_draft(source_dir: Path, out_dir: Path, keep: int, tail: int = 0) -> list[int]:
    """Write the draft folder (atomically: a temp folder renamed into place); returns the layers kept."""
    from backends.worker.loader import load_weights  # dense tensors, also from a compressed folder

    config = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
    layers = select_layers(int(config["num_hidden_layers"]), keep, tail)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; choose a new folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        weights = draft_weights(load_weights(source_dir), layers)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # Tokenizer, chat template and anything else the target ships beside its weights and config.
        for path in source_dir.iterdir():
            if path.is_file() and path.name != "config.json" and ".safetensors" not in path.name:
                shutil.copy2(path, tmp / path.name)
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(source_dir, config), indent=2))
        (tmp / "config.json").write_text(json.dumps(draft_config(config, layers, str(source_dir)), indent=2))
        tmp.chmod(0o755)   # mkdtemp's 0700 and save_file's 0600 would keep other users' workers out
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="switchyard make-draft", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="the target: 'smollm2', an HF folder or a .gguf file")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers in the draft")
    parser.add_argument("--tail", type=int, default=0, help="of those, how many are the target's last ones")
    parser.add_argument("--out", type=Path, required=True, help="output folder (must not exist)")
    args = parser.parse_args(argv)
    from backends.worker.loader import resolve_model
    try:
        layers = make_draft(resolve_model(args.model), args.out, args.layers, args.tail)
    except (OSError, ValueError, KeyError) as exc:
        print(f"switchyard make-draft: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: layers {layers} of {args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
