"""The model adapter (``nodetrain.model.hf``) against transformers itself, in one process, in fp32.

Every supported architecture (its tiny config from family_configs.py, with the fields that
exercise its family's hooks), run block by block with transformers' own weights bound (the
rotary embedding, the causal and sliding-window masks and packed position ids built by
``HFModel.context``), gives the logits of the transformers model built from the same config. These
are the cheapest tests of the transformers calls the model makes, so CI's oldest-transformers leg
runs them (``.ci/run``); the last test keeps those calls in the form every supported version takes.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from family_configs import FIELDS, WINDOW, tiny_config

from nodetrain.config.constants import SUPPORTED_ARCHS
from nodetrain.model import HFModel, hf

SEQ_LEN = 10  # > WINDOW, so the sliding-window mask differs from the causal one
WINDOWED = ("MistralForCausalLM", "Qwen2ForCausalLM")  # a sliding window and nothing else
NO_PACKING = ("GptOssForCausalLM",)
"""transformers builds these masks without position ids (no packed-document detection), so its
model attends across documents; nodetrain's packed rows never do (checked per document)."""


def _config(arch: str, windowed: bool = True) -> transformers.PretrainedConfig:
    if windowed:
        return tiny_config(arch)
    return tiny_config(arch, **{k: None for k in FIELDS[arch] if k == "sliding_window"})


def _reference(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return getattr(transformers, config.architectures[0])(config).float().eval()


def _blocks_logits(config, ref, ids: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
    """[B, T, V] logits of ``ids`` [B, T] through nodetrain's blocks with ``ref``'s weights bound."""
    model, weights = HFModel(config), ref.state_dict()
    h = ids
    for i in range(len(model.units)):
        bound = {}
        for b in model.bindings[i]:
            owner = model.units[b.unit]
            bound[b.local_name] = weights[next(p.hf_name for p in owner.params if p.offset == b.offset)]
        ctx = model.context(h, pos) if 0 < i < len(model.units) - 1 else None
        h = model.forward_block(i, bound, h, ctx)
    return h


def _packed_positions(batch: int) -> torch.Tensor:
    """[batch, SEQ_LEN] int64: two documents per row (6 + 4 tokens), positions restart at 0."""
    return torch.cat([torch.arange(6), torch.arange(SEQ_LEN - 6)]).repeat(batch, 1)


@pytest.mark.parametrize("arch", sorted(SUPPORTED_ARCHS))
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_blocks_give_transformers_logits(arch: str, packed: bool) -> None:
    if packed and arch == "DeepseekV3ForCausalLM":
        pytest.skip("transformers' own DeepSeek-V3 fails on packed position ids (sdpa, MLA head sizes)")
    config = _config(arch)
    ref = _reference(config)
    ids = torch.randint(0, config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    pos = _packed_positions(2) if packed else None
    with torch.no_grad():
        got = _blocks_logits(config, ref, ids, pos)
        if not (packed and arch in NO_PACKING):
            want = ref(input_ids=ids, position_ids=pos).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if packed:  # no token attends across the boundary: each document gives its logits alone
            for doc in (slice(0, 6), slice(6, SEQ_LEN)):
                alone = ref(input_ids=ids[:, doc]).logits
                torch.testing.assert_close(got[:, doc], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", WINDOWED)
def test_sliding_window_is_applied(arch: str) -> None:
    """The window shapes the logits: without it transformers gives other logits, and so do we."""
    config = _config(arch)
    full = _config(arch, windowed=False)  # the same model without the window
    ref, ref_full = _reference(config), _reference(full)
    ref_full.load_state_dict(ref.state_dict())
    ids = torch.randint(0, config.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        windowed = _blocks_logits(config, ref, ids, None)
        causal = _blocks_logits(full, ref_full, ids, None)
        torch.testing.assert_close(causal, ref_full(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert (windowed[:, WINDOW:] - causal[:, WINDOW:]).abs().max() > 1e-3
    torch.testing.assert_close(windowed[:, :WINDOW], causal[:, :WINDOW], rtol=1e-5, atol=1e-5)


def test_mask_helpers_get_the_kv_cache_positionally(monkeypatch) -> None:
    """transformers renamed the mask helpers' ``past_key_values`` keyword to ``cache`` in 5.24; the
    oldest supported version (5.17) knows only the first, 5.24 prefers the second. Positionally
    both take it, so a keyword for it fails this test on any version (not only on the oldest)."""
    calls = []

    def spy(real):
        def call(*args, **kwargs):
            calls.append(sorted(kwargs))
            assert not {"cache", "past_key_values"} & set(kwargs), kwargs
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(hf, "create_causal_mask", spy(hf.create_causal_mask))
    monkeypatch.setattr(hf, "create_sliding_window_causal_mask", spy(hf.create_sliding_window_causal_mask))
    config = _config("MistralForCausalLM")
    HFModel(config).context(torch.zeros(1, SEQ_LEN, config.hidden_size), _packed_positions(1))
    assert calls == [["position_ids"], ["position_ids"]]
