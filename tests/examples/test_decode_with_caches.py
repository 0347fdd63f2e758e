"""``examples/decode_with_caches.py`` runs at its quick settings and every cache decodes what the
model without a cache computes (issue 32, item 3: decode with each cache)."""

from __future__ import annotations

from test_look_train_export import example


def test_every_cache_decodes_what_the_uncached_model_computes():
    results = example("decode_with_caches").main(["--quick"])
    assert list(results) == ["dynamic", "static", "sliding", "paged", "quantized"]
    for name in ("dynamic", "static", "sliding", "paged"):  # lossless: fp32 rounding only
        r = results[name]
        assert r["max_diff"] <= 1e-5 * r["scale"], (name, r["max_diff"])
        assert r["agree"] == 1.0 and r["tokens"].shape == (2, 24)
        assert r["nbytes"] > 0
    for name in ("static", "sliding", "paged"):
        assert results[name]["tokens"].equal(results["dynamic"]["tokens"]), name
    q = results["quantized"]
    # 8-bit keys and values move the logits (so the tokens beyond the full-precision sinks and
    # residual window really were quantized), by far less than the logits' own size
    assert 1e-5 * q["scale"] < q["max_diff"] < 1e-2 * q["scale"], q["max_diff"]
    # the ring holds window + 1 tokens: less than the static cache's every slot
    assert results["sliding"]["nbytes"] < results["static"]["nbytes"]
