"""The ``multihead`` command: ``demo --quick`` end to end, ``explain``, ``--help``, and bad input
(one line, non-zero exit, no traceback, nothing half-written)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys

import pytest
import torch

from multihead.apps.cli import main
from multihead.apps.demo import MARKER

DEMO_FILES = {
    "viewer.html",
    "encoder_heads.png",
    "encoder_attention.png",
    "recall_attention.png",
    "recall_lookup_head.png",
    "similarity.txt",
}


def test_quick_demo_end_to_end(quick_demo):
    code, stdout, stderr, out = quick_demo
    assert code == 0, stderr
    assert {p.name for p in out.iterdir()} == DEMO_FILES | {MARKER}
    for name in DEMO_FILES - {"viewer.html", "similarity.txt"}:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r"https?://", (out / "viewer.html").read_text(encoding="utf-8"))
    assert f"Outputs in {out}" in stdout and str(out / "viewer.html") in stdout
    accuracy = float(re.search(r"held-out accuracy ([\d.]+)% after \d+ steps: reached", stdout).group(1))
    assert accuracy >= 99.0
    assert "(all correct)" in stdout
    # Piped output (no bar): a line per evaluation, up to the step where training stopped.
    steps = int(re.search(r"after (\d+) steps: reached", stdout).group(1))
    evals = [int(s) for s in re.findall(r"^      step (\d+): loss [\d.]+, held-out accuracy [\d.]+%$", stdout, re.M)]
    assert evals and evals == list(range(50, steps + 1, 50)) and evals[-1] == steps
    # The headline claims are printed with their numbers.
    assert "previous-token head: layer 0, head 2" in stdout and "no head of 72 follows what 'it' refers to" in stdout
    diff = float(re.search(r"max \|logits - uncached\| = ([\d.e+-]+)", stdout).group(1))
    assert diff < 1e-4
    # The similarity table pairs the sentences on the same topic.
    rows = [line.split()[-6:] for line in (out / "similarity.txt").read_text().splitlines()[1:]]
    sim = [[float(x) for x in row] for row in rows]
    for i in range(0, 6, 2):
        assert sim[i][i + 1] > max(sim[i][j] for j in range(6) if j not in (i, i + 1))
    assert not list(out.parent.glob(f".{out.name}-*")), "staging folder left behind"
    # Both models carry their q and k (the neuron view); the recall decoder's reproduce its cached weights.
    page = (out / "viewer.html").read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script id="attention-data" type="application/json">(.*?)</script>', page, re.S)[1])
    encoder, recall = data["sources"]
    assert "queries" in encoder and "queries" in recall
    L, D = recall["lq"], recall["dim"]
    for layer in range(len(recall["layers"])):
        for head in range(recall["heads"]):
            q, k = (
                torch.frombuffer(bytearray(base64.b64decode(recall[kind][layer][head])), dtype=torch.float32).view(L, D)
                for kind in ("queries", "keys")
            )
            scores = (q @ k.T * recall["scale"]).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
            w = torch.frombuffer(bytearray(base64.b64decode(recall["weights"][layer][head])), dtype=torch.uint8)
            torch.testing.assert_close(scores.softmax(-1), w.view(L, L).float() / 255, rtol=0, atol=0.6 / 255)


def test_move_into_place_replaces_a_previous_run(tmp_path):
    # A folder holding the marker is a previous demo run, which a new run replaces by renames;
    # a folder without it is refused before any work (see the bad-input table).
    from multihead.apps.demo import _move_into_place

    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "new.txt").write_text("new")
    target = tmp_path / "target"
    target.mkdir()
    (target / MARKER).write_text("")
    (target / "old.txt").write_text("old")
    _move_into_place(staging, target)
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_explain_verb_is_an_alias_that_says_so(capsys):
    assert main(["explain", "--d-model", "16", "--heads", "2", "--seq", "3", "--batch", "1"]) == 0
    captured = capsys.readouterr()
    assert "alias of 'multihead walkthrough'" in captured.err and ". softmax over keys" in captured.out


def test_walkthrough_prints_every_step(capsys):
    code = main(
        ["walkthrough", "--d-model", "64", "--heads", "8", "--kv-heads", "2", "--seq", "10", "--causal", "--batch", "2"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("multihead walkthrough: one grouped-query (GQA) attention layer")  # its own name
    titles = [
        "input",
        "project to queries, keys and values",
        "split into heads",
        "group query heads onto key/value heads",
        "scores",
        "scale",
        "mask: causal",
        "softmax over keys",
        "weighted sum of values",
        "merge heads",
        "output projection",
    ]
    positions = [out.index(f". {t}") for t in titles]
    assert positions == sorted(positions)
    assert "(2, 10, 64)" in out and "(2, 8, 10, 8)" in out and "(2, 2, 10, 8)" in out and "(2, 8, 10, 10)" in out
    assert "query head : 0 1 2 3 | 4 5 6 7" in out and "kv head    : 0 0 0 0 | 1 1 1 1" in out
    assert "query  0 1........." in out and "query  9 1111111111" in out  # the causal mask, drawn
    assert out.count("  ok") == 3 and "MISMATCH" not in out
    assert re.search(r"backend: \w+ \(chosen by auto\)", out)


def test_walkthrough_without_mask_and_with_a_window(capsys):
    assert main(["walkthrough", "--d-model", "32", "--heads", "4", "--seq", "6", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "mask: none" in out and "group query heads" not in out  # MHA: no grouping step
    assert main(["walkthrough", "--d-model", "32", "--heads", "4", "--seq", "20", "--window", "3", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "sliding_window" in out and "(first 16 of 20 queries and keys)" in out


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["walkthrough", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "usage: multihead" in text
    if argv[0] == "demo":
        for option in ("--out", "--device", "--seed", "--steps", "--quick", "--model", "--debug"):
            assert option in text
    if argv[0] == "walkthrough":
        for option in ("--d-model", "--heads", "--kv-heads", "--seq", "--causal", "--batch"):
            assert option in text


def test_python_dash_m_runs_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "multihead", "walkthrough", "--d-model", "16", "--heads", "2", "--seq", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "output projection" in done.stdout


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


# Each bad input: how to make it (given tmp_path and a broken-able model copy), argv, and the message.
BAD_INPUT = [
    (
        "missing model folder",
        lambda tmp, model: ["demo", "--model", str(tmp / "no-such-model")],
        r"model folder .*no-such-model does not exist",
    ),
    (
        "corrupt weights",
        lambda tmp, model: (
            (model / "model.safetensors").unlink(),
            (model / "model.safetensors").write_bytes(b"garbage"),
            ["demo", "--model", str(model)],
        )[-1],
        r"model\.safetensors is corrupt or unreadable .*reinstall",
    ),
    (
        "config does not match tensors",
        lambda tmp, model: (_edit_config(model, intermediate_size=1024), ["demo", "--model", str(model)])[-1],
        r"intermediate\.dense\.bias. has shape \(1536,\) but config\.json implies \(1024,\)",
    ),
    (
        "text longer than the positions",
        lambda tmp, model: ["demo", "--text", "word " * 600],
        r"text 0 has \d+ tokens but the model reads at most 256; shorten it",
    ),
    ("empty text", lambda tmp, model: ["demo", "--text", " "], r"--text must hold a sentence, got ' '; leave it out"),
    (
        "output folder under a file",
        lambda tmp, model: ((tmp / "a-file").write_text("x"), ["demo", "--out", str(tmp / "a-file" / "out")])[-1],
        r"cannot write the output folder .*a-file/out .*pass --out to a writable folder",
    ),
    (
        "output folder is a file",
        lambda tmp, model: ((tmp / "f").write_text("x"), ["demo", "--out", str(tmp / "f")])[-1],
        r"--out .*f is a file",
    ),
    (
        "output folder holds other files",
        lambda tmp, model: (
            (tmp / "mine").mkdir(),
            (tmp / "mine" / "thesis.tex").write_text("x"),
            ["demo", "--out", str(tmp / "mine")],
        )[-1],
        r"already holds files not written by multihead demo",
    ),
    # "no cuda" is bad input only where there is none; on a CUDA machine an unknown device type is.
    (
        ("no cuda", lambda tmp, model: ["demo", "--device", "cuda:7"], r"--device cuda:7 .*no CUDA device is available")
        if not torch.cuda.is_available()
        else ("not a device", lambda tmp, model: ["demo", "--device", "tpu"], r"--device 'tpu' is not a device name")
    ),
    (
        "explain: kv heads do not divide",
        lambda tmp, model: ["walkthrough", "--heads", "8", "--kv-heads", "3"],
        r"num_heads=8 is not divisible by num_kv_heads=3",
    ),
    (
        "explain: heads do not divide d_model",
        lambda tmp, model: ["walkthrough", "--d-model", "10", "--heads", "3"],
        r"d_model=10 is not divisible by num_heads=3",
    ),
    ("explain: zero tokens", lambda tmp, model: ["walkthrough", "--seq", "0"], r"seq must be a positive int, got 0"),
]


@pytest.mark.parametrize("make, regex", [(c[1], c[2]) for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_gives_one_line_and_writes_nothing(make, regex, tmp_path, model_copy, capsys):
    work = tmp_path / "work"
    work.mkdir()
    argv = make(work, model_copy)
    if argv[0] == "demo" and "--out" not in argv:
        argv += ["--out", str(work / "demo-out")]
    before = sorted(p.name for p in work.iterdir())
    code = main(argv + (["--no-progress"] if argv[0] == "demo" else []))
    captured = capsys.readouterr()
    assert code == 1
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"multihead {argv[0]}: error: ")
    assert re.search(regex, lines[0]), lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert sorted(p.name for p in work.iterdir()) == before, "a failed run left files behind"


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        main(["demo", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--debug"])


# ------------------------------------------------------------------- issue 15's small defects
@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["walkthrough", "--help"]])
def test_help_shows_percent_signs_once(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    text = capsys.readouterr().out
    assert "%%" not in text
    if argv[0] == "demo":
        assert "99%" in " ".join(text.split())


def test_window_help_says_what_the_mask_is_and_the_mask_agrees(capsys):
    with pytest.raises(SystemExit):
        main(["walkthrough", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "sliding_window(left=N)" in help_text and "N + 1 keys" in help_text
    assert main(["walkthrough", "--d-model", "16", "--heads", "2", "--seq", "8", "--window", "4", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"query  7 ([1.]+)", out).group(1)
    assert row == "...11111"  # query 7: itself and the 4 keys before it, none after


def test_a_reader_that_stops_early_ends_the_command_quietly():
    # `multihead walkthrough | head -3`: the reader is gone before the command writes.
    proc = subprocess.Popen(
        [sys.executable, "-m", "multihead", "walkthrough", "--d-model", "16", "--heads", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    proc.stderr.close()
    assert proc.returncode == 141, err
    assert "BrokenPipe" not in err and "Traceback" not in err and "error" not in err


def test_training_bar_ends_at_the_steps_actually_run(capsys):
    import torch

    from multihead.apps.demo import _Recipe, _train
    from multihead.models import CausalDecoder, DecoderConfig, RecallTask

    task = RecallTask(num_pairs=2, num_queries=2, num_keys=4, num_values=4)
    recipe = _Recipe(task, 16, 1, 2, max_steps=2000, batch=4, eval_every=3, eval_size=8)
    torch.manual_seed(0)
    model = CausalDecoder(DecoderConfig(task.vocab_size, task.seq_len, d_model=16, num_layers=1, num_heads=2))
    held_out = task.sample(8, torch.Generator().manual_seed(1))
    said = []
    accuracy, steps = _train(
        model,
        task,
        recipe,
        2000,
        torch.Generator().manual_seed(0),
        held_out,
        progress=True,
        say=said.append,
        device="cpu",
        target=0.0,
    )
    assert steps == 3 and said == []  # a bar was shown, so no progress lines
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "3/3" in bar and "2000" not in bar.split("steps)")[-1], bar  # no total of max_steps, no ETA to it
    _, steps = _train(
        model,
        task,
        recipe,
        7,
        torch.Generator().manual_seed(0),
        held_out,
        progress=False,
        say=said.append,
        device="cpu",
        target=2.0,
    )
    assert steps == 7 and [line.split(":")[0].strip() for line in said] == ["step 3", "step 6", "step 7"]
