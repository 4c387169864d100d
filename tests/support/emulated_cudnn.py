"""A CPU stand-in for the slice of the cuDNN frontend the cuDNN kernel uses (``FakeCudnn``):
it records the graph the kernel's callbacks emit, refuses what cuDNN refuses (logical ops,
graph inputs in the first port of comparisons and selects), and evaluates it in float64.
Every mod of the matrix then runs through the real planning and lowering code, exactly, on
machines without a GPU (``tests/gpu/test_cudnn_kernel.py``, ``tests/test_random_calls.py``)."""
import math

import torch


class FakeTensor:
    uids = iter(range(1, 1 << 30))

    def __init__(self, op=None, args=None, virtual=True, ragged_offset=None):
        self.uid, self.op, self.args, self.virtual, self.dtype = next(self.uids), op, args or {}, virtual, None
        self.ragged_offset = ragged_offset

    def set_output(self, _):
        return self

    set_dim = set_stride = set_output

    def set_ragged_offset(self, offsets):
        self.ragged_offset = offsets
        return self

    def set_data_type(self, dtype):
        self.dtype = dtype
        return self

    def get_uid(self):
        return self.uid


class FakeShim:
    def __init__(self, graph, lower):
        self._target, self._lower = graph, lower

    def __getattr__(self, name):
        return getattr(self._target, name)


class FakeGraph:
    def __init__(self, **_):
        self.attention = None

    def tensor(self, ragged_offset=None, **_):
        return FakeTensor(virtual=False, ragged_offset=ragged_offset)

    def __getattr__(self, name):  # pointwise ops
        if name.startswith("logical"):
            raise RuntimeError(f"{name} does not compile in cuDNN's fused SDPA")

        def op(compute_data_type=None, **ports):
            if name.startswith(("cmp_", "binary_select")) and not next(iter(ports.values())).virtual:
                raise RuntimeError(f"graph input in the first port of {name}")
            return FakeTensor(name, ports)
        return op

    def sdpa(self, **kw):
        self.attention, self.outs = kw, [FakeTensor(virtual=False) for _ in range(2)]
        return self.outs

    def sdpa_backward(self, **kw):
        self.attention, self.outs = kw, [FakeTensor(virtual=False) for _ in range(3)]
        return self.outs

    def build_operation_graph(self):
        kw = self.attention
        self.score, self.ds = FakeTensor("score"), FakeTensor("ds")
        # As the frontend (1.32) does: the graph keeps each callback, wrapped in a closure over
        # a lowering that holds the graph, and hands callbacks a wrapper whose _lower is it.
        graph = self

        def lower(t):
            return graph

        shim = FakeShim(self, lower)
        self.kept = [(kw.get(name), lower) for name in ("score_mod", "score_mod_bprop")]
        self.modified = kw["score_mod"](shim, self.score) if kw.get("score_mod") else self.score
        self.ds_in = kw["score_mod_bprop"](shim, self.ds) if kw.get("score_mod_bprop") else self.ds
        if not (self.modified.virtual and self.ds_in.virtual):
            raise RuntimeError("a score_mod callback returned a graph input, not a tensor computed from the score")

    validate = check_support = build_plans = lambda self, *a: None

    def create_execution_plans(self, modes):
        failure = None  # as the frontend (1.32) does: a declined mode's error stays in this frame
        for mode in modes:
            try:
                if mode == "FALLBACK":  # it declines most attention graphs
                    raise RuntimeError("no fallback engine for this graph")
            except RuntimeError as exc:
                failure = exc  # noqa: F841

    def get_workspace_size(self):
        return 0

    def execute(self, buffers, workspace, handle=None, tensor_uids=None):
        data = dict(zip(tensor_uids, buffers))
        for call in self._sequences(data) if self.attention.get("use_padding_mask") else [data]:
            self._attend(call)

    def _sequences(self, data):
        """Each sequence of a ragged batch as the tensors of a call of its own: views found from
        its offsets as cuDNN does (element offset = batch * stride 0 + row * stride 2)."""
        kw = self.attention
        ports = [(kw[n], "q") for n in ("q", "o", "dO", "stats") if n in kw] + [(kw["k"], "kv"), (kw["v"], "kv")]
        ports += zip(self.outs, ("q", "q") if "dO" not in kw else ("q", "kv", "kv"))
        lengths = {axis: data[kw[f"seq_len_{axis}"].uid].flatten().tolist() for axis in ("q", "kv")}
        for i in range(len(lengths["q"])):
            if not lengths["q"][i]:  # a batch's padding: its offsets may point past the tensors' end
                continue
            views = {}
            for t, axis in ports:
                base, offset = data[t.uid], int(data[t.ragged_offset.uid].flatten()[i])
                b, row = offset // base.stride(0), offset % base.stride(0) // base.stride(2)
                views[t.uid] = base[b:b + 1, :, row:row + lengths[axis][i]]
            yield views

    def _attend(self, data):
        kw = self.attention
        q, k, v = (data[kw[n].uid].double() for n in ("q", "k", "v"))
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        values = {self.score.uid: q @ k.transpose(-1, -2) * kw["attn_scale"]}

        def value(t):
            if t.uid not in values:
                if not t.virtual:
                    values[t.uid] = data[t.uid].double()
                elif t.op == "gen_index":
                    base, axis = value(t.args["input"]), t.args["axis"]
                    shape = [1] * 4
                    shape[axis] = base.shape[axis]
                    values[t.uid] = torch.arange(base.shape[axis], dtype=torch.float64).view(shape)
                else:
                    x = {name: value(a) for name, a in t.args.items()}
                    values[t.uid] = FAKE_OPS[t.op](x) if t.op in FAKE_OPS else getattr(torch, t.op)(x["input"])
            return values[t.uid]

        s = torch.broadcast_to(value(self.modified), values[self.score.uid].shape)
        i, j = torch.arange(s.shape[2]).view(-1, 1), torch.arange(s.shape[3]).view(1, -1)
        if kw.get("use_causal_mask"):
            s = torch.where(j <= i, s, -math.inf)
        if kw.get("diagonal_band_right_bound") is not None:
            s = torch.where(j <= i + kw["diagonal_band_right_bound"], s, -math.inf)
        if kw.get("diagonal_band_left_bound") is not None:
            s = torch.where(j >= i - kw["diagonal_band_left_bound"] + 1, s, -math.inf)
        if "dO" not in kw:
            lse = torch.logsumexp(s, -1, keepdim=True)
            data[self.outs[0].uid].copy_(torch.exp(s - torch.where(lse.isneginf(), 0, lse)) @ v)
            data[self.outs[1].uid].copy_(lse)
            return
        o, do, lse = (data[kw[n].uid].double() for n in ("o", "dO", "stats"))
        p = torch.exp(s - lse)
        values[self.ds.uid] = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
        ds = torch.broadcast_to(value(self.ds_in), p.shape)
        reduce = lambda x: x.unflatten(1, (-1, groups)).sum(2)  # noqa: E731
        data[self.outs[0].uid].copy_(ds @ k * kw["attn_scale"])
        data[self.outs[1].uid].copy_(reduce(ds.transpose(-1, -2) @ q * kw["attn_scale"]))
        data[self.outs[2].uid].copy_(reduce(p.transpose(-1, -2) @ do))


FAKE_OPS = {
    "add": lambda x: x["a"] + x["b"], "sub": lambda x: x["a"] - x["b"], "mul": lambda x: x["a"] * x["b"],
    # as cuDNN divides: by multiplying with the float32 reciprocal (one too low at some exact
    # multiples: 41 / 41 is 0.99999994 on an H100)
    "div": lambda x: (x["a"].float() * (1 / x["b"].float())).to(x["a"].dtype), "min": lambda x: torch.minimum(x["input0"], x["input1"]),
    "max": lambda x: torch.maximum(x["input0"], x["input1"]), "pow": lambda x: x["input0"] ** x["input1"],
    "binary_select": lambda x: torch.where(x["mask"].bool(), x["input0"], x["input1"]),
    "tanh_backward": lambda x: x["loss"] * (1 - torch.tanh(x["input"]) ** 2),
    "sigmoid_backward": lambda x: x["loss"] * torch.sigmoid(x["input"]) * (1 - torch.sigmoid(x["input"])),
    **{f"cmp_{n}": (lambda f: lambda x: f(x["input"], x["comparison"]))(getattr(torch, t))
       for n, t in (("eq", "eq"), ("neq", "ne"), ("lt", "lt"), ("le", "le"), ("gt", "gt"), ("ge", "ge"))},
}


class FakeCudnn:
    pygraph = FakeGraph
    data_type = type("data_type", (), {n: n for n in ("FLOAT", "INT32", "BOOLEAN", "BFLOAT16", "HALF")})
    heur_mode = type("heur_mode", (), {"A": "A", "FALLBACK": "FALLBACK"})
    diagonal_alignment = type("diagonal_alignment", (), {"TOP_LEFT": "TOP_LEFT"})


def emulate(monkeypatch):
    """ringflex's cuDNN kernel package, its frontend replaced by ``FakeCudnn`` for one test."""
    from ringflex.kernels import cudnn as module

    monkeypatch.setattr(module.frontend, "cudnn", lambda: FakeCudnn)
    monkeypatch.setattr(module.frontend, "handle", lambda device: None)
    module.clear_cache()
    return module


def on_every_ring_call():
    """Makes every ring call of this process (a rank of its own, a probe's) run the cuDNN
    kernel, its frontend replaced by ``FakeCudnn``; returns the kernel's package."""
    from ringflex import api
    from ringflex.kernels import cudnn as module

    module.frontend.cudnn, module.frontend.handle = (lambda: FakeCudnn), (lambda device: None)
    kernel = module.CudnnKernel()
    api.select_kernel = lambda *args, **kwargs: kernel
    return module
