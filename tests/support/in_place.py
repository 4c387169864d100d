"""Transfers received "in place" on the CPU: every ring call of this process receives its K/V
blocks and dK/dV shares into buffers kept per key and reused by every later call (CPU tensors
filled over gloo), as the copy engines' receive buffers are (``ringflex.parallel.inplace``):
a key's buffer is the largest asked for, a smaller ask gets its leading bytes."""
import math

import torch


def receive_in_place() -> dict:
    """Patches ``RingComm`` as above; returns the buffers by key."""
    from ringflex.parallel.comm import RingComm
    buffers = {}

    def receive_buffer(self, key, shape, dtype, device):
        nbytes = math.prod(shape) * dtype.itemsize
        if key not in buffers or buffers[key].numel() < nbytes:
            buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffers[key][:nbytes].view(dtype).view(shape)

    RingComm.receives_in_place = lambda self, device: True
    RingComm.receive_buffer = receive_buffer
    return buffers
