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
