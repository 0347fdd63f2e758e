"""The demo's headline claims about all-MiniLM-L6-v2's heads, recomputed: this fails when one
stops holding (a changed checkpoint, tokenizer or attention path), and when the docs quote a
number the demo no longer measures."""

from __future__ import annotations

from pathlib import Path

import pytest

from multihead.apps.findings import FOLLOW_MARGIN, MINIMAL_PAIRS, describe_findings, measure_heads

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def findings(encoder):
    return measure_heads(encoder)


def test_a_previous_token_head(findings):
    p = findings.previous
    assert (p.layer, p.head) == (0, 2)
    assert p.mean >= 0.99 and p.least >= 0.95 and p.top_share == 1.0


def test_a_next_token_head(findings):
    n = findings.next
    assert (n.layer, n.head) == (1, 8)
    assert 0.6 <= n.mean <= 0.75 and n.top_share >= 0.7


def test_no_head_follows_the_referent_of_it(findings):
    # The search covers every layer x head of every pair; none moves its weight with the referent.
    assert findings.margins.shape == (len(MINIMAL_PAIRS), 6, 12)
    assert findings.following == []
    assert float(findings.margins.max()) < FOLLOW_MARGIN
    layer, head, margin = findings.best_margin(0)
    assert (layer, head) == (3, 1) and 0.0 < margin < 0.06


def test_the_lookalike_head_points_at_the_subject_in_the_control_too(findings):
    assert findings.lookalike == (5, 11)
    first, control = findings.lookalike_reads[:2]
    assert first.top_key == "cat" and first.on_referent > 0.65 and first.on_other < 0.15
    assert control.referent == "mat" and control.top_key == "cat"  # 'it' = mat, the head still reads cat
    assert control.on_top > 0.6 and control.on_referent < 0.15
    subjects = [pair.nouns[0] for pair in MINIMAL_PAIRS for _ in range(2)]
    assert [r.top_key for r in findings.lookalike_reads] == subjects


def test_the_docs_quote_the_numbers_the_demo_prints(findings):
    lines = describe_findings(findings)
    p, n = findings.previous, findings.next
    first, control = findings.lookalike_reads[:2]
    quoted = [
        f"layer {p.layer}, head {p.head}",
        f"{p.mean:.2f}",
        f"layer {n.layer}, head {n.head}",
        f"{n.mean:.2f}",
        "layer 5, head 11",
        f"{first.on_referent:.2f}",
        f"{control.on_top:.2f}",
        f"{control.on_referent:.2f}",
        f"{findings.best_margin(0)[2]:+.3f}",
    ]
    printed = "\n".join(lines)
    for doc in (ROOT / "README.md", ROOT / "docs" / "demo.md"):
        text = doc.read_text(encoding="utf-8")
        for q in quoted:
            assert q in printed, q
            assert q in text, f"{doc.name} does not quote {q!r}, which the demo prints"
        assert "img/encoder_heads.png" in text
    assert "no head of 72 follows what 'it' refers to" in printed
