"""``posenc extend``'s command line: its arguments, the :class:`~.extend_config.ExtendConfig` they
give (the options given, then a study checkpoint's settings, then the defaults), and the run
(:func:`.extend.extend`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..errors import UsageError
from ..study.longrope_search import SearchSettings
from .checkpoint_kinds import is_transformers
from .extend import extend, study_defaults
from .extend_config import KINDS, ExtendConfig


def add_extend_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a posenc checkpoint (NAME.safetensors with NAME.json), e.g. a study's "
                                      "OUT/checkpoints/rope.safetensors (its study's settings are the defaults), or a "
                                      "transformers model's folder (save_pretrained: config.json and weights), a .gguf "
                                      "file or a folder holding one (its own tokenizer's tokens, else bytes; train "
                                      "length default: its max_position_embeddings)")
    p.add_argument("--out", required=True, help="output directory (created; never a folder of other files)")
    p.add_argument("--scaling", required=True, choices=KINDS,
                   help="linear (PI), ntk, yarn, llama3, longrope (given with --longrope-block, or searched with "
                        "--search), ntk_alpha (Hunyuan's, alpha = the factor), resonance (integer wavelengths), "
                        "resonance_yarn (YaRN with integer wavelengths), drope (drop the positions, then recalibrate)")
    p.add_argument("--length", type=int, help="fine-tuning (target) length (a study's default: its finetune_length)")
    p.add_argument("--steps", type=int, required=True, help="fine-tuning steps (0: the zero-shot scaling only)")
    p.add_argument("--train-length", type=int, help="the length the model was trained at (a study's: read)")
    p.add_argument("--lr", type=float, help="learning rate (default 2e-4; a study's: lr x min_lr_ratio)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: 2048 tokens per step; a study's: "
                                                    "as many tokens as its pre-training)")
    p.add_argument("--warmup", type=int, help="warmup steps (default: a tenth of the steps; DroPE 3%%)")
    p.add_argument("--seed", type=int, help="the data seed (batches: seed + 1000000, the study's fine-tune stream)")
    p.add_argument("--data", help="'default', a text file or folder, or hf:NAME[:CONFIG] (a study's: its data)")
    p.add_argument("--valid-bytes", type=int, help="validation tokens scored at every length")
    p.add_argument("--pack-documents", action="store_true", default=None, help="files as documents (as the study)")
    p.add_argument("--eval-lengths", type=int, nargs="+", metavar="L",
                   help="lengths of the before/after table (default: train length, length, 2x length)")
    p.add_argument("--checkpoint-every", type=int, help="steps between resumable training states (default 100)")
    p.add_argument("--longrope-block", metavar="FILE", help="a JSON file holding a longrope block (short_factor, "
                                                             "long_factor, original_max_position_embeddings, ...)")
    p.add_argument("--search", action="store_true", help="longrope: find the factors with LongRoPE's search first")
    p.add_argument("--search-generations", type=int, default=8, help="the search's generations (default 8)")
    p.add_argument("--search-population", type=int, default=16, help="the search's population (default 16)")
    p.add_argument("--search-sequences", type=int, default=4, help="validation windows per individual (default 4)")
    p.add_argument("--pose", action="store_true", help="PoSE (Zhu et al. 2024): fine-tune on windows of the train length "
                                                       "whose position ids skip over --length (posenc and transformers checkpoints)")
    p.add_argument("--pose-chunks", type=int, help="PoSE's chunks per window, 1 .. window (default 2)")
    p.add_argument("--pose-window", type=int, help="PoSE's training window, 1 .. train length (default: the train length)")
    p.add_argument("--remap", action="append", metavar="NAME[:KEY=VALUE,...]",
                   help="a zero-shot column: the base model under a training-free remap of its own RoPE, "
                        "scored at every length; NAME one of selfextend (group, window), rerope (window), string "
                        "(shift, local), dca (chunk_size, local_size), e.g. --remap selfextend:group=4,window=1024 "
                        "(repeat for more columns)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--resume", action="store_true", help="continue the extension in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")


def config_from_args(args: argparse.Namespace) -> ExtendConfig:
    """The :class:`ExtendConfig` of the command line: given options, then a study's, then defaults."""
    checkpoint = Path(args.checkpoint)
    check_checkpoint_path(checkpoint)
    defaults = study_defaults(checkpoint, args.length, pose=bool(getattr(args, "pose", False)))
    given = {"length": args.length, "steps": args.steps, "train_length": args.train_length, "lr": args.lr,
             "batch_size": args.batch_size, "warmup": args.warmup, "seed": args.seed, "data": args.data,
             "valid_bytes": args.valid_bytes, "pack_documents": args.pack_documents, "eval_lengths": args.eval_lengths,
             "checkpoint_every": args.checkpoint_every}
    values = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    if "train_length" not in values and is_transformers(checkpoint):
        from .extend_hf import train_length_of

        found = train_length_of(checkpoint)
        if found is not None:
            values["train_length"] = found
    if "train_length" not in values:
        raise UsageError("train-length: give the length the model was trained at (only a study's checkpoint records it)")
    if "length" not in values:
        raise UsageError("length: give the fine-tuning length")
    longrope = None
    if args.longrope_block is not None:
        try:
            longrope = json.loads(Path(args.longrope_block).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise UsageError(f"longrope-block: {args.longrope_block} is not a readable JSON file ({err})") from None
        if not isinstance(longrope, dict):
            raise UsageError(f"longrope-block: {args.longrope_block} must hold one JSON object (the block)")
    settings = None
    if args.search:
        settings = SearchSettings(train_length=values["train_length"], target_length=values["length"],
                                  generations=args.search_generations, population=args.search_population,
                                  sequences=args.search_sequences, parents=min(4, args.search_population),
                                  seed=values.get("seed", 0))
    pose = bool(getattr(args, "pose", False))
    chunks = getattr(args, "pose_chunks", None)
    window = getattr(args, "pose_window", None)
    if not pose and (chunks is not None or window is not None):
        raise UsageError("pose-chunks, pose-window: apply to a PoSE fine-tune; add --pose")
    return ExtendConfig(scaling=args.scaling, longrope=longrope, search=settings, pose=pose, pose_window=window,
                        pose_chunks=2 if chunks is None else chunks, remaps=list(getattr(args, "remap", None) or []), **values)


def check_checkpoint_path(checkpoint: Path) -> None:
    """The checkpoint named on the command line exists and is a kind ``posenc extend`` reads, checked
    before any option is derived from it.

    Raises:
        UsageError: ``checkpoint`` does not exist, or is a folder holding neither a ``config.json``
            nor a ``.gguf`` file.
    """
    if not checkpoint.exists():
        raise UsageError(f"checkpoint: {checkpoint} does not exist (a posenc NAME.safetensors, a transformers "
                         "model's folder, or a .gguf file)")
    if checkpoint.is_dir() and not is_transformers(checkpoint):
        raise UsageError(f"checkpoint: the folder {checkpoint} holds neither a config.json with weights "
                         "(save_pretrained) nor a .gguf file; a posenc checkpoint is its NAME.safetensors file")


def check_run_options(device: object, threads: object) -> None:
    """``--device`` and ``--threads`` before anything is loaded.

    Raises:
        UsageError: a device other than cpu and cuda, cuda without a CUDA GPU, or threads < 1.
    """
    if device not in ("cpu", "cuda"):
        raise UsageError(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("device: cuda was asked for, but torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise UsageError(f"threads must be an integer >= 1, got {threads!r}")


def run_extend(args: argparse.Namespace) -> int:
    check_run_options(args.device, args.threads)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = config_from_args(args)
    record = extend(args.checkpoint, args.out, cfg, resume=args.resume, progress=not args.no_progress, device=args.device)
    print(f"posenc extend: wrote {Path(args.out) / record['saved']['weights']} and the table in {args.out}", file=sys.stderr)
    return 0


__all__ = ["add_extend_arguments", "check_checkpoint_path", "check_run_options", "config_from_args", "run_extend"]
