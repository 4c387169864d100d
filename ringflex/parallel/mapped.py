"""Memory that the other ranks of a group copy into: the copy-engine transport's mailboxes
(``peer``) and its receive buffers (``inplace``). torch's symmetric memory maps it between
the GPUs of a host; it refuses ranks that share a GPU, whose processes map each other's
memory by CUDA IPC instead (torch's own sharing of CUDA tensors between processes)."""
from __future__ import annotations

from typing import Dict, Iterable, Tuple

import torch
from torch import Tensor

from .groups import gather_objects, made_together

_IPC_DEVICE = 6  # where the GPU lies in what torch's ``reduce_tensor`` gives to rebuild a CUDA tensor


def mapped(group, device: torch.device, nbytes: int, peers: Iterable[int], shared_gpu: bool,
           what: str) -> Tuple[Tensor, Dict[int, Tensor], object]:
    """``nbytes`` of this rank's memory on ``device``, made by every rank of ``group`` together
    (``what`` names it in the error where a rank cannot), each of ``peers``' counterpart mapped
    into this process, and what keeps them mapped (hold it as long as the tensors)."""
    peers = sorted(set(peers))
    if shared_gpu:
        mine = made_together(group, lambda: torch.empty(nbytes, dtype=torch.uint8, device=device), what)
        theirs = _ipc_opened(group, mine, peers)
        return mine, theirs, theirs
    import torch.distributed._symmetric_memory as symm_mem
    mine = made_together(group, lambda: symm_mem.empty(nbytes, dtype=torch.uint8, device=device), what)
    handle = symm_mem.rendezvous(mine, group.group_name)
    return mine, {r: handle.get_buffer(r, (nbytes,), torch.uint8) for r in peers}, handle


def _ipc_opened(group, mine: Tensor, peers) -> Dict[int, Tensor]:
    """The tensors of ``peers`` that match ``mine``, mapped into this process by CUDA IPC. Each
    is opened in this rank's GPU's context, whichever GPU it lies on (so its tensor names this
    rank's GPU): a stream memory operation reaches only memory mapped in its stream's context,
    and torch would map it in its own GPU's."""
    from torch.multiprocessing.reductions import reduce_tensor
    rebuild, shared = reduce_tensor(mine)
    everyone = gather_objects(group, shared)
    device = mine.device.index
    return {r: rebuild(*everyone[r][:_IPC_DEVICE], device, *everyone[r][_IPC_DEVICE + 1:]) for r in peers}
