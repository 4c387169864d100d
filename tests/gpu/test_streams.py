"""The ring's own reading of the current stream and switch to another (``parallel.streams``)
agree with torch's: the same stream is current inside and after, on the current device and on
another one, under nesting, and a stream is wrapped once."""
import pytest
import torch

from ringflex.parallel.streams import current_stream, on_stream

pytestmark = pytest.mark.gpu


def test_current_stream_follows_torch():
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    assert current_stream(device) == torch.cuda.current_stream(device.index)
    assert current_stream(device) is current_stream(device)  # wrapped once
    assert current_stream(torch.device("cuda")) == torch.cuda.current_stream(device.index)  # no index: the current device
    with torch.cuda.stream(side):
        assert current_stream(device) == side
    assert current_stream(device) == torch.cuda.current_stream(device.index)


def test_on_stream_switches_and_restores():
    device = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.current_stream(device.index)
    first, second = torch.cuda.Stream(device), torch.cuda.Stream(device)
    with on_stream(first):
        assert torch.cuda.current_stream(device.index) == first
        with on_stream(second):
            assert torch.cuda.current_stream(device.index) == second
        assert torch.cuda.current_stream(device.index) == first
        with on_stream(None):
            assert torch.cuda.current_stream(device.index) == first
    assert torch.cuda.current_stream(device.index) == before
    with pytest.raises(RuntimeError, match="inside"):
        with on_stream(first):
            raise RuntimeError("inside")
    assert torch.cuda.current_stream(device.index) == before


def test_work_inside_runs_on_the_stream():
    """A sleep queued inside holds the stream switched to, not the one current outside."""
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    with on_stream(side):
        torch.cuda._sleep(50_000_000)
    assert not side.query()
    assert torch.cuda.current_stream(device.index).query()
    side.synchronize()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_on_stream_of_another_device():
    """Like ``torch.cuda.stream``: the current device is the stream's inside, and both the
    current device and that device's current stream are as before after."""
    torch.cuda.set_device(0)
    other = torch.cuda.Stream(torch.device("cuda", 1))
    before = torch.cuda.current_stream(1)
    with on_stream(other):
        assert torch.cuda.current_device() == 1
        assert torch.cuda.current_stream(1) == other
    assert torch.cuda.current_device() == 0
    assert torch.cuda.current_stream(1) == before
    assert current_stream(torch.device("cuda", 1)) == before
