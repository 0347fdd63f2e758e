"""``SentenceEncoder``: a sentence-transformers folder run on `multihead` layers.

The folder is what ``sentence-transformers`` saves: a BERT checkpoint (:mod:`multihead.models.bert`),
``tokenizer.json`` (read with the ``tokenizers`` package), ``modules.json`` listing the pipeline
(Transformer -> Pooling -> optional Normalize), ``1_Pooling/config.json`` and
``sentence_bert_config.json`` (``max_seq_length``). ``encode`` follows that pipeline::

    texts -> token ids (B, L) -> BertEncoder -> (B, L, E) -> pooling over real tokens -> (B, E)
          -> L2-normalize if modules.json lists Normalize

    enc = SentenceEncoder.from_pretrained(find_minilm())
    emb = enc.encode(["a cat", "a dog"])            # (2, 384), unit norm
    maps = enc.attention("the cat sat")             # tokens + per-layer (1, H, L, L) weights
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from multihead.capture import capture_attention
from multihead.models.bert import BertEncoder, _check_folder, load_bert
from multihead.models.errors import ModelFolderError

__all__ = ["SentenceEncoder", "AttentionMaps"]

_POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")


@dataclass(frozen=True)
class AttentionMaps:
    """The attention of every layer for one text.

    ``tokens``: the ``L`` word pieces (with ``[CLS]``/``[SEP]``); ``names``: one name per layer;
    ``weights``: per layer ``(1, H, L, L)`` (bertviz's format); ``stacked()`` gives ``(layers, H, L, L)``.
    """

    tokens: list[str]
    names: list[str]
    weights: list[Tensor]

    def stacked(self) -> Tensor:
        """The first sentence's weights of every layer, ``(layers, H, L, L)``."""
        return torch.stack([w[0] for w in self.weights])


class SentenceEncoder:
    """A pretrained sentence encoder: tokenizer + :class:`BertEncoder` + pooling + normalization."""

    def __init__(
        self,
        model: BertEncoder,
        tokenizer,
        *,
        pooling: str = "mean_tokens",
        normalize: bool = False,
        max_seq_length: int | None = None,
    ):
        if pooling not in _POOLING_MODES:
            raise ValueError(f"pooling must be one of {_POOLING_MODES}, got {pooling!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.normalize = normalize
        limit = model.config.max_position_embeddings
        self.max_seq_length = min(limit, max_seq_length) if max_seq_length else limit

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> SentenceEncoder:
        """Load a sentence-transformers folder (e.g. :func:`multihead.models.find_minilm`)."""
        from tokenizers import Tokenizer

        folder = _check_folder(path)
        model = load_bert(folder, device=device, dtype=dtype)
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelFolderError(f"{tok_path} is missing; the encoder needs the folder's tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise ModelFolderError(
                f"{tok_path} is corrupt ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
                "restore it from the model's package"
            ) from None
        # tokenizer.json may carry fixed padding/truncation for another use (MiniLM's pads to 128):
        # we pad per batch and check lengths ourselves.
        tokenizer.no_padding()
        tokenizer.no_truncation()
        pooling, normalize = _read_pipeline(folder)
        max_seq_length = _read_json(folder / "sentence_bert_config.json", {}).get("max_seq_length")
        return cls(model, tokenizer, pooling=pooling, normalize=normalize, max_seq_length=max_seq_length)

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters."""
        return next(self.model.parameters()).device

    @property
    def dim(self) -> int:
        """``E``, the size of a sentence embedding."""
        return self.model.config.hidden_size

    def tokenize(self, texts: list[str], *, truncate: bool = False) -> tuple[Tensor, Tensor, list[list[str]]]:
        """``(input_ids (B, L), attention_mask bool (B, L), tokens)``, padded to the longest text.

        A text longer than ``max_seq_length`` tokens raises ``ValueError`` unless ``truncate``
        (then it is cut to ``max_seq_length``, keeping the final ``[SEP]``, as sentence-transformers does).
        """
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError(
                f"texts must be a list of str, got {type(texts).__name__}"
                + (" (wrap a single text in a list)" if isinstance(texts, str) else "")
            )
        if not texts:
            raise ValueError("texts is empty; expected at least one text")
        encodings = self.tokenizer.encode_batch(list(texts))
        ids, tokens = [], []
        for i, enc in enumerate(encodings):
            seq_ids, seq_tokens = list(enc.ids), list(enc.tokens)
            if len(seq_ids) > self.max_seq_length:
                if not truncate:
                    raise ValueError(
                        f"text {i} has {len(seq_ids)} tokens but the model reads at most "
                        f"{self.max_seq_length}; shorten it (or pass truncate=True)"
                    )
                seq_ids = seq_ids[: self.max_seq_length - 1] + seq_ids[-1:]
                seq_tokens = seq_tokens[: self.max_seq_length - 1] + seq_tokens[-1:]
            ids.append(seq_ids)
            tokens.append(seq_tokens)
        L = max(len(s) for s in ids)
        pad = self.model.config.pad_token_id
        input_ids = torch.full((len(ids), L), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), L), dtype=torch.bool)
        for i, seq in enumerate(ids):
            input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[i, : len(seq)] = True
        return input_ids.to(self.device), mask.to(self.device), tokens

    @torch.no_grad()
    def encode(self, texts: list[str], *, batch_size: int = 32, truncate: bool = False) -> Tensor:
        """Sentence embeddings ``(N, E)`` (float32, on the model's device), pooled and normalized
        as the folder's ``modules.json`` and ``1_Pooling/config.json`` say."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.tokenize(texts, truncate=truncate)  # validate every text before any work
        out = []
        for start in range(0, len(texts), batch_size):
            input_ids, mask, _ = self.tokenize(texts[start : start + batch_size], truncate=truncate)
            hidden = self.model(input_ids, mask)  # (B, L, E)
            out.append(self._pool(hidden, mask))
        emb = torch.cat(out).float()
        return torch.nn.functional.normalize(emb, p=2, dim=1) if self.normalize else emb

    @torch.no_grad()
    def attention(self, text: str, *, truncate: bool = False) -> AttentionMaps:
        """The attention weights of every layer for ``text``, recorded by :func:`capture_attention`."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        input_ids, mask, tokens = self.tokenize([text], truncate=truncate)
        with capture_attention(self.model) as cap:
            self.model(input_ids, mask)
        return AttentionMaps(tokens[0], list(cap.names), [w.float().cpu() for w in cap.weights])

    def _pool(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """``(B, L, E)`` -> ``(B, E)`` over the real tokens of each row."""
        if self.pooling == "cls_token":
            return hidden[:, 0]
        m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
        if self.pooling == "max_tokens":
            return hidden.masked_fill(~mask.unsqueeze(-1), float("-inf")).max(dim=1).values
        counts = m.sum(dim=1).clamp(min=1e-9)  # (B, 1)
        summed = (hidden * m).sum(dim=1)
        return summed / (counts if self.pooling == "mean_tokens" else counts.sqrt())


def _read_json(path: Path, default):
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFolderError(f"{path} is not valid JSON ({exc}); restore it from the model's package") from None


def _read_pipeline(folder: Path) -> tuple[str, bool]:
    """Pooling mode and whether to L2-normalize, from ``modules.json`` (sentence-transformers'
    defaults, mean pooling without normalization, when the folder has none)."""
    modules = _read_json(folder / "modules.json", [])
    pooling_dir, normalize = None, False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            pooling_dir = folder / module.get("path", "")
        elif kind.endswith(".Normalize"):
            normalize = True
    if pooling_dir is None:
        return "mean_tokens", normalize
    config = _read_json(pooling_dir / "config.json", {})
    chosen = [mode for mode in _POOLING_MODES if config.get(f"pooling_mode_{mode}")]
    if len(chosen) != 1:
        raise ModelFolderError(
            f"{pooling_dir / 'config.json'} enables pooling modes {chosen}; "
            f"this encoder supports exactly one of {list(_POOLING_MODES)}"
        )
    return chosen[0], normalize
