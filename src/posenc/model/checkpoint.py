"""Model checkpoints: weights as safetensors, the :class:`~posenc.model.lm.LMConfig` as json beside them.

    alibi.safetensors   the weights; its header also holds the LMConfig they were trained with
    alibi.json          {"format", "lm_config", "posenc", "weights": {"bytes", "sha256", "tensors", "shared"}}

Neither file can execute code when read (no pickle), so a checkpoint from anywhere is safe to load.
The two files are bound to each other: the json records the weights file's size and sha256, and
the weights' header records the config, so an edited json (another encoding, causal flag or size),
weights from another run, or a truncated file are refused with a sentence saying which, instead of
loading a model that is silently not the one that was trained.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import UsageError
from ..files import write_bytes, write_json
from ..version import __version__
from .lm import LM, LMConfig

FORMAT = "posenc-checkpoint/1"


def unique_tensors(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a state dict stored once: (kept name -> tensor, alias -> kept name).

    Tied weights (the output head and the token embedding) and T5's one table for every layer are
    the same tensor under several names; safetensors stores each storage once.
    """
    kept: dict[str, torch.Tensor] = {}
    alias: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and key in seen:
            alias[name] = seen[key]
        else:
            seen[key] = name
            kept[name] = t
    return kept, alias


def save_checkpoint(model: LM, path: str | Path) -> None:
    """Write ``path`` (safetensors) and ``path.with_suffix('.json')``; each atomically.

    Raises:
        UsageError: ``path`` does not end in ``.safetensors`` (the json would take the weights'
            name, or another file's), or its json exists and is not a posenc checkpoint's (a
            user's file is never replaced).
    """
    from safetensors.torch import save

    path = Path(path)
    if path.suffix != ".safetensors":
        raise UsageError(f"path: give the weights file NAME.safetensors (its json NAME.json is written beside it), "
                         f"got {str(path)!r}")
    _check_replaceable(path.with_suffix(".json"))
    config = model.config.to_dict()
    kept, alias = unique_tensors(model.state_dict())
    # One metadata entry: safetensors keeps metadata in a hash map whose order changes from one
    # save to the next, and the same weights must give the same bytes (and sha256).
    header = json.dumps({"format": FORMAT, "lm_config": config}, sort_keys=True, allow_nan=False)
    data = save({k: v.detach().contiguous().cpu() for k, v in kept.items()}, metadata={"posenc": header})
    write_bytes(path, data)
    write_json(path.with_suffix(".json"), {
        "format": FORMAT, "lm_config": config, "posenc": __version__,
        "weights": {
            "file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "tensors": {k: list(v.shape) for k, v in kept.items()}, "shared": alias,
        },
    })


def _check_replaceable(meta_path: Path) -> None:
    """A UsageError when ``meta_path`` exists and is not a posenc checkpoint's json."""
    if not meta_path.exists():
        return
    try:
        ours = json.loads(meta_path.read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise UsageError(f"path: {meta_path} exists and is not a posenc checkpoint's json; refusing to replace it "
                         "(choose another NAME.safetensors, or move the file)")


def safetensors_header(data: bytes) -> dict:
    """The json header of a safetensors file: 8 bytes of little-endian length, then the json."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n])


def _config_diff(a: dict, b: dict) -> list[str]:
    return [f"{k}: json {a.get(k, '(absent)')!r}, weights {b.get(k, '(absent)')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, "(absent)") != b.get(k, "(absent)")]


def read_meta(path: str | Path) -> dict:
    """The json of the checkpoint ``path`` (its LMConfig and fingerprint), checked for form only."""
    path = Path(path)
    meta_path = path.with_suffix(".json")
    if not meta_path.is_file():
        raise UsageError(f"path: {meta_path} is missing; a checkpoint is NAME.safetensors plus NAME.json")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"path: {meta_path} is not valid JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("lm_config"), dict) \
            or not isinstance(meta.get("weights"), dict):
        raise UsageError(f"path: {meta_path} is not a posenc checkpoint (format {FORMAT!r} with lm_config and "
                         "weights fingerprint); it was edited, or written by an older posenc")
    return meta


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> LM:
    """An :class:`LM` from a checkpoint written by :func:`save_checkpoint` (e.g. a study's
    ``checkpoints/METHOD.safetensors``); UsageError naming the problem when the files do not match."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    if path.suffix == ".json":
        raise UsageError(f"path: give the weights file {path.with_suffix('.safetensors')}, not its json {path}")
    meta = read_meta(path)
    if not path.is_file():
        raise UsageError(f"path: {path} is missing (its json is there)")
    data = path.read_bytes()
    want = meta["weights"]
    if len(data) != want.get("bytes"):
        raise UsageError(f"path: {path} is damaged: {len(data):,} bytes where its json recorded "
                         f"{want.get('bytes')!r} (truncated or replaced)")
    if hashlib.sha256(data).hexdigest() != want.get("sha256"):
        raise UsageError(f"path: {path} does not match the sha256 in {path.with_suffix('.json').name}: "
                         "the weights were changed or replaced")
    try:
        header = safetensors_header(data)
        trained = json.loads(header.get("__metadata__", {}).get("posenc", "{}")).get("lm_config")
        tensors = load(data)
    except (SafetensorError, ValueError, UnicodeDecodeError, AttributeError) as err:
        raise UsageError(f"path: {path} is not a readable safetensors file ({err})") from None
    if not isinstance(trained, dict):
        raise UsageError(f"path: {path} does not record the config it was trained with (not a posenc checkpoint)")
    diff = _config_diff(meta["lm_config"], trained)
    if diff:
        raise UsageError(f"path: the json of {path.name} does not describe its weights ({'; '.join(diff)}); "
                         "it was edited or belongs to other weights, refusing to load")
    try:
        model = LM(LMConfig(**trained))
    except (TypeError, ValueError) as err:
        raise UsageError(f"path: {path} holds a config this posenc cannot build ({err})") from None
    kept, alias = unique_tensors(model.state_dict())
    expected = {k: list(v.shape) for k, v in kept.items()}
    found = {k: list(v.shape) for k, v in tensors.items()}
    if expected != found:
        diff = [f"{k}: model {expected.get(k)}, file {found.get(k)}" for k in sorted(set(expected) | set(found))
                if expected.get(k) != found.get(k)]
        raise UsageError(f"path: {path}'s tensors do not fit its config ({'; '.join(diff[:4])}"
                         f"{'; ...' if len(diff) > 4 else ''})")
    dtypes = [f"{k}: model {str(v.dtype).removeprefix('torch.')}, file {str(tensors[k].dtype).removeprefix('torch.')}"
              for k, v in kept.items() if tensors[k].dtype != v.dtype]
    if dtypes:  # load_state_dict would convert silently (an int32 file loading as float32)
        raise UsageError(f"path: {path}'s tensors have other dtypes than its config's model ({'; '.join(dtypes[:4])}"
                         f"{'; ...' if len(dtypes) > 4 else ''})")
    model.load_state_dict({**tensors, **{a: tensors[k] for a, k in alias.items()}})
    return model.to(device)
