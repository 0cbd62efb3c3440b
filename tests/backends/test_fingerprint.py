"""The model fingerprint that KV tiers on disk or in a shared store file blocks under
(backends/worker/fingerprint.py): it changes with any weight's bytes and with the config fields that shape
the forward pass, and with nothing else."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from backends.worker.fingerprint import model_fingerprint


def config(**changes: object) -> SimpleNamespace:
    fields: dict[str, object] = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1,
                                 "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "transformers_version": "4.57.0",
                                 "torch_dtype": "bfloat16"}
    return SimpleNamespace(**(fields | changes))


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(16, 8, generator=g),
            "model.layers.0.self_attn.k_proj.weight": torch.randn(8, 8, generator=g),
            "model.norm.weight": torch.ones(8)}


def test_same_weights_and_config_give_the_same_digest_in_any_order() -> None:
    w = weights()
    reordered = dict(reversed(list(w.items())))
    assert model_fingerprint(config(), w) == model_fingerprint(config(), reordered)
    assert model_fingerprint(config(), w) == model_fingerprint(config(), {k: v.clone() for k, v in w.items()})


def test_one_ulp_in_one_weight_changes_the_digest() -> None:
    w = weights()
    changed = dict(w)
    k = w["model.layers.0.self_attn.k_proj.weight"].clone()
    k[3, 5] = torch.nextafter(k[3, 5], torch.tensor(float("inf")))
    changed["model.layers.0.self_attn.k_proj.weight"] = k
    assert model_fingerprint(config(), changed) != model_fingerprint(config(), w)


def test_a_renamed_or_recast_weight_changes_the_digest() -> None:
    w = weights()
    renamed = {("lm_head.weight" if k == "model.norm.weight" else k): v for k, v in w.items()}
    recast = w | {"model.norm.weight": w["model.norm.weight"].to(torch.bfloat16)}   # same values, other bytes
    digests = {model_fingerprint(config(), x) for x in (w, renamed, recast)}
    assert len(digests) == 3


def test_config_fields_that_shape_the_forward_change_it_and_provenance_does_not() -> None:
    w = weights()
    base = model_fingerprint(config(), w)
    assert model_fingerprint(config(rope_theta=500000.0), w) != base
    assert model_fingerprint(config(rope_scaling={"rope_type": "linear", "factor": 2.0}), w) != base
    assert model_fingerprint(config(rms_norm_eps=1e-6), w) != base
    assert model_fingerprint(config(transformers_version="4.99.0", torch_dtype="float32",
                                    _name_or_path="/models/elsewhere"), w) == base


def test_a_strided_view_is_read_by_value() -> None:
    w = weights()
    name = "model.layers.0.self_attn.k_proj.weight"
    strided = w | {name: w[name].t().contiguous().t()}
    assert not strided[name].is_contiguous() and torch.equal(strided[name], w[name])
    assert model_fingerprint(config(), strided) == model_fingerprint(config(), w)
