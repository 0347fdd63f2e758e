"""A BERT-family encoder built from `multihead` layers, loaded from a local folder.

The folder holds what Hugging Face writes for a ``BertModel``: ``config.json`` and
``model.safetensors`` (read with the ``safetensors`` package; ``transformers`` is not used).
Each encoder layer is post-norm, as in BERT::

    x (B, L, E)
    x = LayerNorm(x + MultiHeadAttention(x, mask=key_padding))      # attention_norm
    x = LayerNorm(x + ffn_out(gelu(ffn_in(x))))                      # ffn_norm

The checkpoint's names map onto ours in :data:`_RENAMES`: ``attention.self.query`` is our
``attention.q_proj`` and so on, so the checkpoint's row ``h*D .. (h+1)*D`` of the query weight is
head ``h`` in both (the head split of :class:`multihead.MultiHeadAttention`).
"""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.layers import MultiHeadAttention
from multihead.masks import key_padding
from multihead.models.errors import ModelFolderError

__all__ = ["BertConfig", "BertEncoder", "load_bert"]

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),  # exact erf GELU, BERT's "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face ``config.json`` that the encoder needs (names kept as is)."""

    vocab_size: int
    hidden_size: int  # E
    num_hidden_layers: int
    num_attention_heads: int  # H; head dim D = E // H
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    attention_probs_dropout_prob: float = 0.0
    hidden_dropout_prob: float = 0.0

    @classmethod
    def from_json(cls, path: Path) -> BertConfig:
        """Read and check ``config.json``; every problem is a :class:`ModelFolderError`."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelFolderError(
                f"{path} is missing; expected a Hugging Face BERT folder "
                "(config.json, model.safetensors, tokenizer.json)"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFolderError(
                f"{path} is not valid JSON ({exc}); restore the file from the model's package"
            ) from None
        if not isinstance(raw, dict):
            raise ModelFolderError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type", "bert")
        if model_type != "bert":
            raise ModelFolderError(f"{path}: model_type is {model_type!r}; this loader reads 'bert' checkpoints only")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ModelFolderError(
                f"{path}: position_embedding_type {raw['position_embedding_type']!r} is not "
                "supported; expected 'absolute'"
            )
        known = {f.name: f for f in fields(cls)}
        values = {}
        for name, f in known.items():
            if name not in raw:
                if f.default is MISSING:
                    raise ModelFolderError(f"{path} has no {name!r}; a BERT config needs {name}")
                continue
            values[name] = raw[name]
        config = cls(**values)
        config._check(path)
        return config

    def _check(self, path) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFolderError(f"{path}: {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ModelFolderError(
                f"{path}: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ModelFolderError(
                f"{path}: hidden_act {self.hidden_act!r} is not supported; expected one of {sorted(_ACTIVATIONS)}"
            )


class BertEmbeddings(nn.Module):
    """Token + position + token-type embeddings, then LayerNorm. ``(B, L) -> (B, L, E)``."""

    def __init__(self, config: BertConfig):
        super().__init__()
        E = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, E)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, E)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, E)
        self.norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (L,)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(self.norm(x))  # (B, L, E)


class BertLayer(nn.Module):
    """One post-norm encoder layer: self-attention then a GELU MLP, each with a residual."""

    def __init__(self, config: BertConfig):
        super().__init__()
        E = config.hidden_size
        self.attention = MultiHeadAttention(
            E, config.num_attention_heads, qkv_bias=True, out_bias=True, dropout=config.attention_probs_dropout_prob
        )
        self.attention_norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(E, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, E)
        self.ffn_norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor, mask) -> Tensor:
        x = self.attention_norm(x + self.dropout(self.attention(x, mask=mask)))  # (B, L, E)
        return self.ffn_norm(x + self.dropout(self.ffn_out(self.act(self.ffn_in(x)))))


class BertEncoder(nn.Module):
    """The BERT encoder stack (no pooler): token ids ``(B, L)`` to hidden states ``(B, L, E)``.

    Attention layers are named ``layers.{i}.attention``; :func:`multihead.capture_attention`
    records their weights ``(B, H, L, L)`` under those names.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """``input_ids (B, L)``; ``attention_mask`` bool ``(B, L)``, ``True`` = a real token
        (padding is never attended); ``token_type_ids (B, L)``, default 0. Returns ``(B, L, E)``."""
        B, L = input_ids.shape
        if L > self.config.max_position_embeddings:
            raise ValueError(
                f"input_ids has {L} tokens but the model has max_position_embeddings="
                f"{self.config.max_position_embeddings}; shorten the text"
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        # key_padding keeps padded keys out of every row; padded query rows are computed and ignored.
        mask = None if attention_mask is None else key_padding(attention_mask.to(torch.bool))
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return x


# Checkpoint name -> our name. Applied in order to names with a leading "bert." removed.
_RENAMES = [
    (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.query\.", r"layers.\1.attention.q_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.key\.", r"layers.\1.attention.k_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.value\.", r"layers.\1.attention.v_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attention.out_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attention_norm."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn_in."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn_out."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ffn_norm."),
]
# Tensors a BertModel checkpoint holds that an encoder without a pooler does not use.
_UNUSED = re.compile(r"^(pooler\.|embeddings\.position_ids$|cls\.)")


def load_bert(
    folder: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> BertEncoder:
    """Build a :class:`BertEncoder` from ``folder/config.json`` and ``folder/model.safetensors``.

    Every tensor the encoder needs must be present with the shape the config implies; a
    mismatch raises :class:`ModelFolderError` naming the tensor, both shapes and the config field.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = _check_folder(folder)
    config = BertConfig.from_json(folder / "config.json")
    weights_path = folder / "model.safetensors"
    if not weights_path.is_file():
        raise ModelFolderError(f"{weights_path} is missing; this loader reads safetensors weights only")
    try:
        checkpoint = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelFolderError(
            f"{weights_path} is corrupt or unreadable ({_first_line(exc)}); "
            "reinstall the model package or restore the file"
        ) from None

    model = BertEncoder(config)
    expected = model.state_dict()
    state, origin = {}, {}  # our name -> tensor, our name -> the checkpoint's name
    for name, tensor in checkpoint.items():
        ours = _rename(name[5:] if name.startswith("bert.") else name)
        if ours in expected:
            state[ours], origin[ours] = tensor, name
        elif not _UNUSED.match(ours):
            raise ModelFolderError(
                f"{weights_path} holds {name!r}, which a BERT encoder with this config.json "
                "does not have; is config.json from another model?"
            )
    missing = [n for n in expected if n not in state]
    if missing:
        raise ModelFolderError(
            f"{weights_path} lacks {len(missing)} tensors the config needs (first: {missing[0]!r}); "
            f"config.json says num_hidden_layers={config.num_hidden_layers}: does it match the weights?"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelFolderError(
                f"{weights_path}: tensor {origin[name]!r} has shape {tuple(tensor.shape)} but config.json "
                f"implies {tuple(expected[name].shape)} (hidden_size={config.hidden_size}, "
                f"intermediate_size={config.intermediate_size}, vocab_size={config.vocab_size}); "
                "the config does not match the weights"
            )
        if not tensor.is_floating_point():
            raise ModelFolderError(
                f"{weights_path}: tensor {origin[name]!r} has dtype {tensor.dtype}; expected floating point"
            )
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def _check_folder(folder) -> Path:
    folder = Path(folder)
    if not folder.exists():
        raise ModelFolderError(
            f"model folder {folder} does not exist; pass a folder with config.json, "
            "model.safetensors and tokenizer.json"
        )
    if not folder.is_dir():
        raise ModelFolderError(f"model path {folder} is not a folder; pass the folder that holds config.json")
    return folder


def _rename(name: str) -> str:
    for pattern, replacement in _RENAMES:
        new, n = re.subn(pattern, replacement, name)
        if n:
            return new
    return name


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
