"""The extension table of a real model: SmolLM2-135M-Instruct (GGUF, trained at 8,192 tokens) under
every zero-shot scaling and remap of posenc, plus LongRoPE's searched factors and a PoSE + YaRN
fine-tune, at 8,192, 16,384 and (for the rows that still hold at 16,384) 32,768 tokens.

Not a test: a benchmark, resumable. Every (row, length) cell is one float32 forward, written to
``results.json`` atomically as soon as it is done; a rerun skips the cells it holds with the same
settings (a new LongRoPE block or PoSE checkpoint is measured again).

The text: the distinct long license texts Debian ships in ``/usr/share/common-licenses`` (GPL-3,
GPL-2, LGPL-2.1, MPL-1.1, MPL-2.0, GFDL-1.3, Apache-2.0, CC0-1.0, Artistic), concatenated in that
order: long English prose that no posenc test or parameter was tuned to. One pass at length L
reads the L - P tokens of prose that end at token 32,512 of the text, then a copy of the P = 256
tokens that begin L / 2 tokens earlier, and gives two measures:

- ``tail``: perplexity of the 4,096 tokens of prose just before the repeated passage: the same
  tokens at every length, with L - P - 4,096 tokens of context before them;
- ``copy``: perplexity of the last P tokens, the second copy of a passage L / 2 tokens back (4,096 at
  8,192, 8,192 at 16,384, 16,384 at 32,768): a long-range measure the model passes in its own length
  (it retrieves a passage 4,096 tokens back; at 7,900 tokens back it mostly does not).

Rows (each configured for the 16,384-token target, s = 2, and measured at 8,192 too; the 32,768
column uses s = 4): none, PI (linear), NTK, dynamic NTK, YaRN, Llama 3, LongRoPE with factors from
posenc's own search on this model (``--longrope-block``), SelfExtend, ReRoPE, STRING, DCA, and
PoSE + YaRN (``--pose-checkpoint``, a folder written by ``posenc extend --pose``).

    .venv/bin/python benchmarks/extension_table.py --out benchmarks/results/extension-smollm2 \
        --lengths 8192 16384
    .venv/bin/python benchmarks/extension_table.py --out benchmarks/results/extension-smollm2 \
        --lengths 32768 --rows ntk dynamic yarn llama3 selfextend rerope string dca
    .venv/bin/python benchmarks/extension_table.py --out benchmarks/results/extension-smollm2 \
        --rows longrope --longrope-block runs/smollm2-longrope-search-g2/extend.json
    .venv/bin/python benchmarks/extension_table.py --out benchmarks/results/extension-smollm2 \
        --rows pose+yarn --pose-checkpoint runs/smollm2-pose-yarn-224

The LongRoPE block and the PoSE checkpoint come from ``posenc extend`` (docs/results.md has their
commands). One process at a time: each writes the whole ``results.json``.

Writes ``results.json`` (every cell: the measures, seconds, the row's settings), ``table.md`` and
``table.csv`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from posenc.bench.machine import cpu_model
from posenc.files import write_json, write_text

LICENSES = ["GPL-3", "GPL-2", "LGPL-2.1", "MPL-1.1", "MPL-2.0", "GFDL-1.3", "Apache-2.0", "CC0-1.0", "Artistic"]
TRAINED = 8192
PASSAGE = 256
TAIL = 4096
BASE = 1e5


def scaling(kind: str, s: float) -> dict[str, Any]:
    """A Hugging Face scaling block for factor s over the trained length (rope_theta kept)."""
    block: dict[str, Any] = {"rope_type": kind, "factor": s, "rope_theta": BASE}
    if kind not in ("linear", "ntk"):
        block["original_max_position_embeddings"] = TRAINED
    if kind == "llama3":
        block.update(low_freq_factor=1.0, high_freq_factor=4.0)
    return block


def row_settings(row: str, s: int, longrope: dict | None) -> tuple[str, dict[str, Any]] | None:
    """(encoding name, options) for posenc.hf.use, or None for the untouched model."""
    if row == "none":
        return None
    if row in ("linear", "ntk", "dynamic", "yarn", "llama3"):
        return "rope", {"base": BASE, "scaling": scaling(row, float(s))}
    if row == "longrope":
        if longrope is None:
            raise SystemExit("--longrope-block FILE is needed for the longrope row")
        return "rope", {"base": BASE, "scaling": longrope}
    if row == "selfextend":  # the grouped distance (L-1)/G + W - W/G stays well inside 8,192
        return "selfextend", {"group": 2 * s, "window": 1024}
    if row == "rerope":  # distances clamped at a quarter of the trained length
        return "rerope", {"window": 2048}
    if row == "string":  # the largest distance L-1 maps to 8,191 + 0: shift = L - N + local
        return "string", {"shift": s * TRAINED - TRAINED + 128, "local": 128}
    if row == "dca":  # chunk_size c <= N: intra/successive/inter distances all below c
        return "dca", {"chunk_size": 6144, "local_size": 1024}
    raise SystemExit(f"unknown row {row!r}")


ROWS = ["none", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope", "selfextend", "rerope", "string", "dca", "pose+yarn"]


def corpus(tokenizer) -> torch.Tensor:
    root = Path("/usr/share/common-licenses")
    text = "\n\n".join((root / name).read_text(encoding="utf-8", errors="replace") for name in LICENSES)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


END = 32768 - PASSAGE  # every window's prose ends here: the tail measure reads the same tokens at every length


def window(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """(1, L): the L - P tokens of prose that end at END, then a copy of the P tokens that begin L / 2
    tokens before the copy."""
    if tokens.numel() < END or length - PASSAGE > END:
        raise SystemExit(f"the text holds {tokens.numel()} tokens; a window of {length} needs {END} and at most {END + PASSAGE}")
    prose = tokens[END - (length - PASSAGE):END]
    start = length - PASSAGE - length // 2
    return torch.cat([prose, prose[start:start + PASSAGE]])[None]


def measure(model, ids: torch.Tensor) -> dict[str, float]:
    """One forward: the two perplexities, the logits made only for the scored tokens."""
    length = ids.shape[1]
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # (1, L, 576)
        head = model.lm_head

        def ppl(a: int, b: int) -> float:  # tokens a..b-1 predicted from a-1..b-2
            logits = head(hidden[0, a - 1:b - 1]).float()
            return math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, a:b])))

        copy_start = length - PASSAGE
        return {"tail": ppl(copy_start - TAIL, copy_start), "copy": ppl(copy_start, length)}


def same(held: Any, settings: Any) -> bool:
    """True when a held cell's settings (read back from JSON) are ``settings``."""
    return json.dumps(held, sort_keys=True) == json.dumps(settings, sort_keys=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/extension-smollm2")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--rows", nargs="+", default=[r for r in ROWS if r not in ("longrope", "pose+yarn")], choices=ROWS)
    p.add_argument("--longrope-block", help="a JSON file with the searched longrope block (posenc extend --search's extend.json)")
    p.add_argument("--pose-checkpoint", help="posenc extend --pose's output folder (its model/ folder is loaded)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--table-only", action="store_true", help="write the table from results.json, run nothing")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"cells": {}}
    results["machine"] = {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__}
    results["text"] = {"source": "/usr/share/common-licenses: " + ", ".join(LICENSES), "passage": PASSAGE, "tail": TAIL}
    if not args.table_only:
        import posenc.hf
        from posenc.hf.checkpoints import load_pretrained, smollm2_gguf

        base, tokenizer = load_pretrained(smollm2_gguf())
        tokens = corpus(tokenizer)
        results["text"]["tokens"] = tokens.numel()
        longrope = None
        if args.longrope_block:
            saved = json.loads(Path(args.longrope_block).read_text())
            longrope = saved["search"]["block"] if "search" in saved else saved.get("scaling", saved)  # extend.json, or a block
        for length in args.lengths:
            s = max(2, length // TRAINED) if length > TRAINED else 2
            ids = window(tokens, length)
            for row in args.rows:
                key = f"{row}@{length}"
                if row == "pose+yarn":
                    if not args.pose_checkpoint:
                        raise SystemExit("--pose-checkpoint is needed for the pose+yarn row")
                    settings: Any = {"checkpoint": args.pose_checkpoint}
                else:
                    settings = row_settings(row, s, longrope)
                held = results["cells"].get(key)
                if held is not None and same(held["settings"], settings):  # a new search or fine-tune is measured again
                    continue
                if row == "pose+yarn":
                    model, _ = load_pretrained(Path(args.pose_checkpoint) / "model")
                else:
                    model = base if settings is None else posenc.hf.use(copy.deepcopy(base), settings[0], **settings[1])
                start = time.perf_counter()
                cell = measure(model, ids)
                cell.update(seconds=round(time.perf_counter() - start, 1), settings=settings)
                results["cells"][key] = cell
                write_json(path, results)
                print(f"{key}: tail {cell['tail']:.3f}  copy {cell['copy']:.3f}  ({cell['seconds']} s)", file=sys.stderr, flush=True)
                del model
    write_json(path, results)
    write_table(out, results)
    return 0


def write_table(out: Path, results: dict[str, Any]) -> None:
    cells = results["cells"]
    lengths = sorted({int(k.split("@")[1]) for k in cells})
    rows = [r for r in ROWS if any(k.split("@")[0] == r for k in cells)]
    head = "| row | " + " | ".join(f"tail ppl {n // 1024}k | copy ppl {n // 1024}k" for n in lengths) + " |"
    lines = [f"SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to float32), trained at {TRAINED}; "
             f"{results['machine']['cpu']}, {results['machine']['threads']} threads, torch {results['machine']['torch']}.",
             f"Text: {results['text']['source']}. tail: perplexity of the {TAIL} tokens before the repeated passage; "
             f"copy: perplexity of the last {PASSAGE} tokens, a copy of the {PASSAGE} tokens L/2 back.", "",
             head, "|---|" + "---|---|" * len(lengths)]
    csv = ["row,length,tail_ppl,copy_ppl,seconds"]
    for r in rows:
        parts = []
        for n in lengths:
            c = cells.get(f"{r}@{n}")
            parts += ["-", "-"] if c is None else [f"{c['tail']:.2f}", f"{c['copy']:.2f}"]
            if c is not None:
                csv.append(f"{r},{n},{c['tail']:.4f},{c['copy']:.4f},{c['seconds']}")
        lines.append(f"| {r} | " + " | ".join(parts) + " |")
    write_text(out / "table.md", "\n".join(lines) + "\n")
    write_text(out / "table.csv", "\n".join(csv) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
