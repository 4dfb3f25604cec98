"""``posenc sample CHECKPOINT --prompt TEXT``: see what a study's model learned.

The study's models are byte-level: the prompt's UTF-8 bytes are the tokens, and the new tokens are
bytes again, written to stdout as they come (after the prompt), decoded as UTF-8 with
``errors="replace"``: a character whose bytes are not all there yet waits for them, and bytes that
are not UTF-8 (or tokens above 255) print as U+FFFD. Decoding is :func:`posenc.model.generate.stream`:
greedy with ``--temperature 0``, otherwise sampled (``--top-k``, ``--top-p``) from a generator
seeded with ``--seed``, so the same command prints the same text. Output piped into a reader that
stops early (``| head``) ends the command quietly.

    posenc sample runs/study/checkpoints/alibi.safetensors --prompt "def main(" --max-new-tokens 200
"""

from __future__ import annotations

import argparse
import codecs
import itertools
import os
import sys
from pathlib import Path
from typing import TextIO

import torch

from ..errors import UsageError
from ..model.checkpoint import load_checkpoint
from ..model.generate import check_sampling, stream

BYTES = 256  # byte-level vocabulary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="a study checkpoint: OUT/checkpoints/METHOD.safetensors (with its .json)")
    parser.add_argument("--prompt", required=True, help="text to continue (its UTF-8 bytes are the tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="bytes to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding (default 0.8)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely bytes only (default: all)")
    parser.add_argument("--top-p", type=float, default=None, help="sample within the nucleus of this probability, in (0, 1] (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


def sample(checkpoint: str | Path, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int | None = None,
           top_p: float | None = None, seed: int = 0, device: str = "cpu", out: TextIO | None = None) -> str:
    """Continue ``prompt`` with the model of ``checkpoint``; write prompt and continuation to ``out``
    as the bytes come, and return the continuation. ``temperature`` 0 is greedy decoding.

    The prompt's bytes are its UTF-8 encoding; a command-line argument that was not valid UTF-8
    reaches Python with its undecodable bytes as surrogates (``surrogateescape``), and those are
    the original bytes again here (printed as U+FFFD)."""
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature == 0:
        do_sample, temperature = False, 1.0  # the command's greedy spelling
    else:
        do_sample = True
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature < 0:
            raise UsageError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed, do_sample)  # before loading anything
    if not prompt:
        raise UsageError("prompt must hold at least one character")
    path = Path(checkpoint)
    if path.suffix == ".json":
        raise UsageError(f"checkpoint: give the weights file {str(path.with_suffix('.safetensors'))!r}, not its "
                         f"json {str(path)!r} (a study writes OUT/checkpoints/METHOD.safetensors beside METHOD.json)")
    for needed in (path, path.with_suffix(".json")):
        if not needed.is_file():
            raise UsageError(f"checkpoint: no file {str(needed)!r} (a study writes OUT/checkpoints/METHOD.safetensors and METHOD.json)")
    if device not in ("cpu", "cuda"):
        raise UsageError(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("device 'cuda' requested but torch.cuda.is_available() is False")
    model = load_checkpoint(path, device=device).eval()
    data = prompt.encode("utf-8", errors="surrogateescape")
    if model.config.vocab_size < BYTES and max(data) >= model.config.vocab_size:
        raise UsageError(f"the checkpoint's vocab_size is {model.config.vocab_size}: byte-level text needs {BYTES}")
    tokens = torch.tensor(list(data), dtype=torch.long)[None]  # (1, T)
    steps = stream(model, tokens, max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                   seed=seed)
    first = next(steps)  # the prompt is checked (and read) before anything is printed
    out = sys.stdout if out is None else out
    out.write(data.decode("utf-8", errors="replace"))
    out.flush()
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = []
    for step in itertools.chain([first], steps):
        token = int(step.tokens[0])
        piece = text.decode(bytes([token]) if token < BYTES else b"\xff")  # "" while a character is incomplete
        if piece:
            pieces.append(piece)
            out.write(piece)
            out.flush()
    tail = text.decode(b"", final=True)
    pieces.append(tail)
    out.write(tail + "\n")
    out.flush()
    return "".join(pieces)


def run(args: argparse.Namespace) -> int:
    try:
        sample(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
               args.device)
    except BrokenPipeError:
        # The reader went away (``posenc sample ... | head``): what it wanted was printed. Point
        # stdout at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0
