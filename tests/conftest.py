import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread is faster, and intra-op threads spin badly on a shared machine.
    A module asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def timm_sincos():
    """timm's ``timm.layers.pos_embed_sincos``. timm's package ``__init__`` imports torchvision,
    whose PyPI build does not load beside a CPU build of torch, so the module is loaded from timm's
    installed files under a private package name, executing only the modules it imports itself
    (``_fx``, whose torchvision import is optional, ``grid``, ``trace_utils``)."""
    spec = importlib.util.find_spec("timm")
    if spec is None or spec.origin is None:
        pytest.skip("timm is not installed (bash setup.sh test installs it)")
    root = Path(spec.origin).parent
    for name, path in (("_posenc_timm", root), ("_posenc_timm.layers", root / "layers")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules.setdefault(name, package)
    return importlib.import_module("_posenc_timm.layers.pos_embed_sincos")
