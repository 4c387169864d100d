"""Degenerate masks on a ring of 4: outputs and gradients match the float64 oracle, rows that
see no key give exactly 0 (output, dq; LSE -inf), keys no row sees get exactly 0 (dk, dv),
and nothing is ever NaN, in fp32 and bf16, for every layout."""
import torch

import ringflex
from support.harness import run_world
from support.oracle import attention
from ringflex import mods
from ringflex.plan.layout import positions

WORLD, LOCAL = 4, 8
S = WORLD * LOCAL  # zigzag chunks of 4 tokens, striped stride 4
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _blind(ranks, layout):
    """Causal, except that the queries held by ``ranks`` see nothing."""
    blind = torch.zeros(S, dtype=torch.bool)
    for r in ranks:
        blind[positions(layout, S, WORLD, r)] = True

    def blind_ranks_mask(b, h, q_idx, kv_idx):
        return ~blind[q_idx] & (kv_idx <= q_idx)
    return blind_ranks_mask


def _nothing(b, h, q_idx, kv_idx):
    return q_idx < 0


def _last_key_only(b, h, q_idx, kv_idx):
    return kv_idx == S - 1


def problems(layout):
    """name -> (score_mod, mask_mod)."""
    return {
        "rank 0's queries all masked": (None, _blind([0], layout)),
        "ranks 1 and 2 all masked": (None, _blind([1, 2], layout)),
        "documents end on rank boundaries": (None, mods.document(mods.document_ids([LOCAL, LOCAL, 2 * LOCAL]))),
        "documents end on zigzag chunk boundaries": (None, mods.document(mods.document_ids([4, 12, 4, 12]))),
        "one-token documents": (None, mods.document(mods.document_ids([1] * S))),
        "one-token documents among others": (None, mods.document(mods.document_ids([1, 3, 1, 1, 10, 1, 15]))),
        "window of 1": (None, mods.sliding_window(1)),
        "window of 3 (inside a chunk)": (None, mods.sliding_window(3)),
        "window longer than the sequence": (None, mods.sliding_window(4 * S)),
        "every hop empty": (None, _nothing),
        "every hop empty, with softcap": (mods.softcap(3.0), _nothing),
        "only the last key": (mods.softcap(3.0), _last_key_only),
    }


def _check(rank, world_size):
    failures = []
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(2, 2, S, 8, generator=g) for _ in range(4)]
    b, h = torch.arange(2).view(-1, 1, 1, 1), torch.arange(2).view(1, -1, 1, 1)
    qi, ki = torch.arange(S).view(1, 1, -1, 1), torch.arange(S).view(1, 1, 1, -1)
    for layout in ringflex.LAYOUTS:
        for name, (score_mod, mask_mod) in problems(layout).items():
            visible = torch.broadcast_to(mask_mod(b, h, qi, ki), (2, 2, S, S))
            blind_rows = ringflex.shard(~visible.any(-1), 2, layout=layout)  # [B, H, S_local]
            unseen_keys = ringflex.shard(~visible.any(-2), 2, layout=layout)
            for dtype, tol in TOLERANCE.items():
                q, k, v, dout = (t.to(dtype) for t in full)
                ref = [t.double().requires_grad_() for t in (q, k, v)]
                want = attention(*ref, score_mod, mask_mod)
                want.backward(dout.double())
                local = [ringflex.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
                out, lse = ringflex.ring_flex_attention(*local, score_mod=score_mod, mask_mod=mask_mod, layout=layout,
                                                        return_lse=True)
                out.backward(ringflex.shard(dout, 2, layout=layout))
                got = {"out": out, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
                where = f"{layout} {name} {dtype}"
                for (what, t), w in zip(got.items(), [want] + [r.grad for r in ref]):
                    err = (t.double() - ringflex.shard(w, 2, layout=layout)).abs().max().item()
                    if not torch.isfinite(t).all():
                        failures.append(f"{where}: {what} is not finite")
                    elif err > tol * max(1.0, w.abs().max().item()):
                        failures.append(f"{where}: {what} error {err:.3g}")
                for what, t, zero in (("out", out, blind_rows), ("dq", got["dq"], blind_rows),
                                      ("dk", got["dk"], unseen_keys), ("dv", got["dv"], unseen_keys)):
                    if (t[zero] != 0).any():
                        failures.append(f"{where}: {what} is not exactly 0 where no key / no query is visible")
                if not (lse[blind_rows] == float("-inf")).all() or not torch.isfinite(lse[~blind_rows]).all():
                    failures.append(f"{where}: the LSE is not -inf exactly for the rows that see nothing")
    return failures


def test_degenerate_masks_match_the_oracle_without_nan():
    failures = [f for per_rank in run_world(WORLD, _check, timeout=240) for f in per_rank]
    assert not failures, "\n".join(failures[:40])
