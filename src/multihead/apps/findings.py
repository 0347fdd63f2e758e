"""What a head of the pretrained encoder does, measured: the claims the demo and the docs make.

Every sentence in the README or ``docs/demo.md`` about what a head of all-MiniLM-L6-v2 does is a
number computed here (``tests/demo/test_findings.py`` recomputes them and fails when one stops
holding). Layers and heads count from 0. Three measurements:

* **Positional heads.** For every head, the mean weight each word piece (the tokens between
  ``[CLS]`` and ``[SEP]``) puts on the token just before it, and on the one just after it, over
  :data:`PROBE_SENTENCES`. The best head for each is reported with its least weight and the share
  of tokens whose top key it is.
* **Pronouns, searched over heads with a control.** A *minimal pair* is two sentences that differ
  in one word which changes what "it" refers to::

      The cat sat on the mat because it was tired.   it = cat
      The cat sat on the mat because it was soft.    it = mat

  A head *follows the referent* in a pair when, in both sentences, the weight from "it" to the
  referent exceeds the weight to the other noun by at least :data:`FOLLOW_MARGIN`. Every layer x
  head is searched over :data:`MINIMAL_PAIRS`.
* **The head that looked as if it resolved "it"** (the one sending "it" most to "cat" in the
  first sentence) is read in the control sentence of every pair: where does "it" go there?

On all-MiniLM-L6-v2 (measured, see ``docs/demo.md``): layer 0 head 2 reads the previous token;
no head follows the referent in any pair; the head that sends "it" to "cat" (layer 5 head 11)
does so in the control sentence too: it points at the subject noun.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "MinimalPair",
    "MINIMAL_PAIRS",
    "PROBE_SENTENCES",
    "FOLLOW_MARGIN",
    "HeadFindings",
    "measure_heads",
    "describe_findings",
    "plot_findings",
]


@dataclass(frozen=True)
class MinimalPair:
    """Two sentences with one "it": in ``first`` it means ``nouns[0]``, in ``second`` ``nouns[1]``."""

    first: str
    second: str
    nouns: tuple[str, str]

    def sentences(self) -> list[tuple[str, str, str]]:
        """``(sentence, referent, other noun)`` for both sentences."""
        a, b = self.nouns
        return [(self.first, a, b), (self.second, b, a)]


MINIMAL_PAIRS = [
    MinimalPair(
        "The cat sat on the mat because it was tired.", "The cat sat on the mat because it was soft.", ("cat", "mat")
    ),
    MinimalPair(
        "The trophy did not fit in the suitcase because it was too big.",
        "The trophy did not fit in the suitcase because it was too small.",
        ("trophy", "suitcase"),
    ),
    MinimalPair(
        "The dog chased the ball because it was excited.",
        "The dog chased the ball because it was bouncing.",
        ("dog", "ball"),
    ),
]

#: The demo's six similarity sentences and the six sentences of the minimal pairs.
PROBE_SENTENCES = [
    "A cat sits on the warm windowsill.",
    "A kitten is sleeping in the sun by the window.",
    "The stock market fell sharply this morning.",
    "Shares dropped as investors sold their holdings.",
    "How do I bake sourdough bread at home?",
    "A recipe for homemade bread with a crunchy crust.",
] + [s for pair in MINIMAL_PAIRS for s in (pair.first, pair.second)]

#: Weight on the referent minus weight on the other noun, in both sentences, to count as following it.
FOLLOW_MARGIN = 0.1


@dataclass(frozen=True)
class PositionalHead:
    """A head scored on how much each word piece attends to its neighbour at ``offset`` (-1: before)."""

    layer: int
    head: int
    offset: int
    mean: float  # mean weight on the neighbour, over every word piece of every probe sentence
    least: float  # the smallest such weight
    top_share: float  # share of word pieces whose top key is that neighbour


@dataclass(frozen=True)
class PronounRead:
    """Where one head sends "it" in one sentence."""

    sentence: str
    referent: str
    other: str
    top_key: str  # the key "it" attends to most
    on_referent: float
    on_other: float
    on_top: float


@dataclass
class HeadFindings:
    previous: PositionalHead
    next: PositionalHead
    margins: Tensor  # (pairs, layers, H): min over the pair's two sentences of w(it -> referent) - w(it -> other)
    lookalike: tuple[int, int]  # the head sending "it" most to the referent in MINIMAL_PAIRS[0].first
    lookalike_reads: list[PronounRead]  # that head on every sentence of every pair

    @property
    def following(self) -> list[tuple[int, int, int]]:
        """``(pair, layer, head)`` for every head that follows the referent in a pair."""
        return [(int(p), int(layer), int(h)) for p, layer, h in (self.margins >= FOLLOW_MARGIN).nonzero().tolist()]

    def best_margin(self, pair: int) -> tuple[int, int, float]:
        """``(layer, head, margin)`` of the head that comes closest to following pair ``pair``."""
        m = self.margins[pair]
        layer, head = divmod(int(m.argmax()), m.shape[1])
        return layer, head, float(m[layer, head])


@torch.no_grad()
def measure_heads(encoder) -> HeadFindings:
    """Measure the findings on a :class:`~multihead.models.SentenceEncoder` (see the module docstring)."""
    maps = _attention_maps(encoder, PROBE_SENTENCES)  # the pairs' sentences are among them
    previous, following = [], []
    for text in PROBE_SENTENCES:
        w = maps[text][1]  # (layers, H, L, L)
        inner = torch.arange(1, w.shape[-1] - 1)  # the word pieces between [CLS] and [SEP]
        previous.append(_neighbour(w, inner, -1))
        following.append(_neighbour(w, inner, +1))

    margins, reads_by_sentence = [], {}
    for pair in MINIMAL_PAIRS:
        diffs = []
        for sentence, referent, other in pair.sentences():
            tokens, w = maps[sentence]
            it = _index(tokens, "it", sentence)
            row = w[:, :, it, :]  # (layers, H, L): where "it" attends
            diffs.append(row[..., _index(tokens, referent, sentence)] - row[..., _index(tokens, other, sentence)])
            reads_by_sentence[sentence] = (tokens, row, referent, other)
        margins.append(torch.minimum(*diffs))  # (layers, H): both sentences must agree

    tokens, row, referent, _ = reads_by_sentence[MINIMAL_PAIRS[0].first]
    on_ref = row[..., tokens.index(referent)]
    layer, head = divmod(int(on_ref.argmax()), on_ref.shape[1])
    reads = []
    for pair in MINIMAL_PAIRS:
        for sentence, _, _ in pair.sentences():
            tokens, row, ref, other = reads_by_sentence[sentence]
            r = row[layer, head]  # (L,)
            top = int(r.argmax())
            reads.append(
                PronounRead(
                    sentence,
                    ref,
                    other,
                    tokens[top],
                    float(r[tokens.index(ref)]),
                    float(r[tokens.index(other)]),
                    float(r[top]),
                )
            )
    return HeadFindings(_best(previous, -1), _best(following, +1), torch.stack(margins), (layer, head), reads)


def describe_findings(f: HeadFindings) -> list[str]:
    """The findings as the lines the demo prints (and the docs quote)."""
    p, n = f.previous, f.next
    layer, head = f.lookalike
    first, control = f.lookalike_reads[0], f.lookalike_reads[1]
    lines = [
        f"what the heads do, measured on {len(PROBE_SENTENCES)} sentences (layers and heads count from 0):",
        f"  previous-token head: layer {p.layer}, head {p.head}: each word piece puts {p.mean:.2f} of its attention "
        f"(least {p.least:.2f}) on the token before it, its top key for {p.top_share:.0%} of them",
        f"  next-token head: layer {n.layer}, head {n.head}: {n.mean:.2f} on the token after it (least {n.least:.2f}), "
        f"its top key for {n.top_share:.0%} of them",
    ]
    followers = f.following
    pairs = ", ".join("/".join(pair.nouns) for pair in MINIMAL_PAIRS)
    if followers:
        found = "; ".join(f"layer {l}, head {h} in {'/'.join(MINIMAL_PAIRS[i].nouns)}" for i, l, h in followers)
        lines.append(
            f"  pronoun: heads that follow what 'it' refers to (margin >= {FOLLOW_MARGIN}) in {pairs}: {found}"
        )
    else:
        best = [f.best_margin(i) for i in range(len(MINIMAL_PAIRS))]
        closest = ", ".join(
            f"{'/'.join(pair.nouns)} {m:+.3f} (layer {l}, head {h})" for pair, (l, h, m) in zip(MINIMAL_PAIRS, best)
        )
        lines.append(
            f"  pronoun: no head of {f.margins[0].numel()} follows what 'it' refers to in any of the "
            f"{len(MINIMAL_PAIRS)} minimal pairs (weight on the referent minus the other noun, in both "
            f"sentences, >= {FOLLOW_MARGIN}); closest: {closest}"
        )
    subjects = [pair.nouns[0] for pair in MINIMAL_PAIRS for _ in range(2)]
    on_subject = sum(r.top_key == s for r, s in zip(f.lookalike_reads, subjects))
    too = " too" if control.top_key == first.referent else ""
    lines.append(
        f"  the head sending 'it' most to '{first.referent}' in {first.sentence!r} (layer {layer}, "
        f"head {head}, {first.on_referent:.2f}) sends it to '{control.top_key}' in the control "
        f"{control.sentence!r}{too} ({control.on_top:.2f}; '{control.referent}' {control.on_referent:.2f}); "
        f"its top key from 'it' is the subject noun ({'/'.join(subjects[::2])}) in {on_subject} of the "
        f"{len(f.lookalike_reads)} sentences of the pairs"
    )
    return lines


def plot_findings(encoder, f: HeadFindings, path: str | Path) -> Path:
    """Four heads side by side: the previous- and next-token heads on the first pair's first
    sentence, and the look-alike head on both sentences of that pair (the control)."""
    from multihead.viz.heatmap import plot_attention_panels

    pair = MINIMAL_PAIRS[0]
    maps = _attention_maps(encoder, [pair.first, pair.second])
    first, control = f.lookalike_reads[0], f.lookalike_reads[1]
    layer, head = f.lookalike
    p, n = f.previous, f.next

    def panel(sentence, l, h, title, mark_row=None):
        tokens, w = maps[sentence]
        return dict(weights=w[l, h], tokens=tokens, title=title, row=tokens.index("it") if mark_row else None)

    panels = [
        panel(
            pair.first,
            p.layer,
            p.head,
            f"layer {p.layer}, head {p.head}: the token before\n"
            f"mean {p.mean:.2f} over {len(PROBE_SENTENCES)} sentences",
        ),
        panel(
            pair.first,
            n.layer,
            n.head,
            f"layer {n.layer}, head {n.head}: the token after\nmean {n.mean:.2f} over {len(PROBE_SENTENCES)} sentences",
        ),
        panel(
            pair.first,
            layer,
            head,
            f"layer {layer}, head {head}, 'it' = {first.referent}\n"
            f"it -> {first.referent} {first.on_referent:.2f}, "
            f"{first.other} {first.on_other:.2f}",
            mark_row=True,
        ),
        panel(
            pair.second,
            layer,
            head,
            f"same head, control: 'it' = {control.referent}\n"
            f"it -> {control.top_key} {control.on_top:.2f}, "
            f"{control.referent} {control.on_referent:.2f}",
            mark_row=True,
        ),
    ]
    title = (
        "all-MiniLM-L6-v2 (on multihead layers): what four heads do, measured by `multihead demo`\n"
        "no head follows what 'it' refers to; the one that looks as if it did points at the subject noun"
    )
    return plot_attention_panels(panels, path, title=title)


# ----------------------------------------------------------------------------------------- helpers
@torch.no_grad()
def _attention_maps(encoder, texts: list[str]) -> dict[str, tuple[list[str], Tensor]]:
    """``text -> (tokens, weights (layers, H, L, L))`` from one padded batch: padded keys get
    weight 0 and the real tokens' rows equal one text at a time (to ~1e-6), and one batch is many
    times faster than one call per text (docs/performance.md#the-demos-findings)."""
    from multihead.capture import capture_attention

    input_ids, mask, tokens = encoder.tokenize(list(texts))
    with capture_attention(encoder.model) as cap:
        encoder.model(input_ids, mask)
    w = torch.stack([layer.float().cpu() for layer in cap.weights], dim=1)  # (B, layers, H, L, L)
    return {text: (tok, w[i, :, :, : len(tok), : len(tok)]) for i, (text, tok) in enumerate(zip(texts, tokens))}


def _neighbour(w: Tensor, inner: Tensor, offset: int) -> tuple[Tensor, Tensor]:
    """Per head, the weights ``(layers, H, n)`` on the neighbour at ``offset`` and whether it is the top key."""
    on = w[:, :, inner, inner + offset]  # (layers, H, n)
    top = w[:, :, inner, :].argmax(-1) == inner + offset  # (layers, H, n)
    return on, top


def _best(per_sentence: list[tuple[Tensor, Tensor]], offset: int) -> PositionalHead:
    on = torch.cat([o for o, _ in per_sentence], dim=-1)  # (layers, H, all word pieces)
    top = torch.cat([t for _, t in per_sentence], dim=-1)
    mean = on.mean(-1)
    layer, head = divmod(int(mean.argmax()), mean.shape[1])
    return PositionalHead(
        layer,
        head,
        offset,
        float(mean[layer, head]),
        float(on[layer, head].min()),
        float(top[layer, head].float().mean()),
    )


def _index(tokens: list[str], word: str, sentence: str) -> int:
    if tokens.count(word) != 1:
        raise ValueError(
            f"{sentence!r}: expected the word piece {word!r} once, found it {tokens.count(word)} times in {tokens}"
        )
    return tokens.index(word)
