"""The layers built exactly as Megatron-Core's TE wrappers build them
(megatron/core/extensions/transformer_engine.py: TELinear,
TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear):
the same keyword arguments to the constructors, the attributes the wrappers set
before and after construction, an RNG tracker stand-in with Megatron's
`.fork(name)`, Megatron's forward (is_first_microbatch, return_bias) and its
DDP's main_grad / grad_added_to_main_grad protocol; then forward/backward over
micro-batches against a float64 reference. Single process (tp_size=1; the
device Megatron takes from torch.cuda.current_device() is the CPU here), and
under torchrun (main(), launched by test_megatron_tensor_parallel): TP with
sequence parallelism and Megatron's tp_comm_overlap arguments on
initialize_ub's communicators, finalize_model_grads' reduction of the
sequence-parallel main_grads, bf16 parameters with fp32 main_grad.
  torchrun --nproc_per_node=2 tests/test_megatron_construction.py [--device cuda]"""
import contextlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import transformer_engine_c as te
from helpers import rel_err

IN, FFN, QKV = 32, 64, 48


def make_config(**kw):
    cfg = dict(params_dtype=torch.float32, use_cpu_initialization=False, perform_initialization=True,
               sequence_parallel=False, gradient_accumulation_fusion=True, delay_wgrad_compute=False,
               tp_comm_overlap=False, symmetric_ar_type=None, disable_parameter_transpose_cache=False,
               normalization="LayerNorm", layernorm_epsilon=1e-5, layernorm_zero_centered_gamma=False,
               tensor_model_parallel_size=1, device="cpu")
    cfg.update(kw)
    return types.SimpleNamespace(**cfg)


class RNGTracker:
    """Megatron's CudaRNGStatesTracker, on the CPU generator: named states,
    fork(name) runs its body on that state and keeps what it drew."""

    def __init__(self):
        self.states, self.forks = {}, []

    def add(self, name, seed):
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    def is_initialized(self):
        return bool(self.states)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        self.forks.append(name)
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


TRACKER = RNGTracker()


def get_cuda_rng_tracker():
    return TRACKER


def _extra_te_kwargs(config):
    return {"params_dtype": config.params_dtype, "device": config.device}


def _cond_init(config, init_method):
    return init_method if config.perform_initialization else (lambda w: None)


class TELinear(te.Linear):
    """Megatron's TELinear constructor and forward, for TE >= 2.3."""

    def __init__(self, input_size, output_size, *, parallel_mode, config, init_method, bias, skip_bias_add,
                 skip_weight_param_allocation=False, tp_comm_buffer_name=None, is_expert=False,
                 symmetric_ar_type=None, tp_group=None):
        self.config = config  # set before nn.Module.__init__, as Megatron does
        self.te_return_bias = skip_bias_add and bias
        self.is_first_microbatch = True
        self.disable_parameter_transpose_cache = config.disable_parameter_transpose_cache
        self.symmetric_ar_type = symmetric_ar_type
        extra = _extra_te_kwargs(config)
        if config.delay_wgrad_compute:
            extra["delay_wgrad_compute"] = config.delay_wgrad_compute
        if config.tp_comm_overlap and parallel_mode != "duplicated":
            extra["ub_overlap_ag"] = config.tp_comm_overlap_ag
            extra["ub_overlap_rs"] = config.tp_comm_overlap_rs
            extra["ub_name"] = tp_comm_buffer_name
        if symmetric_ar_type is not None:
            extra["symmetric_ar_type"] = symmetric_ar_type
        tp_size = 1 if parallel_mode == "duplicated" or tp_group is None else tp_group.size()
        extra["rng_tracker_name"] = "data-parallel-rng" if parallel_mode == "duplicated" else None
        super().__init__(
            in_features=input_size, out_features=output_size, sequence_parallel=config.sequence_parallel,
            fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
            tp_group=tp_group if torch.distributed.is_initialized() else None, tp_size=tp_size,
            get_rng_state_tracker=get_cuda_rng_tracker if get_cuda_rng_tracker().is_initialized() else None,
            init_method=_cond_init(config, init_method), bias=bias, return_bias=self.te_return_bias,
            parallel_mode=None if parallel_mode == "duplicated" else parallel_mode, **extra)
        for p in self.parameters():
            p.allreduce = True
            if parallel_mode == "duplicated":
                p.sequence_parallel = config.sequence_parallel
                p.tensor_model_parallel = False
        self._tp_group = tp_group

    def forward(self, x):
        first = None if self.disable_parameter_transpose_cache else self.is_first_microbatch
        out = super().forward(x, is_first_microbatch=first)
        self.is_first_microbatch = False
        return out if self.te_return_bias else (out, None)

    def backward_dw(self):
        if self.config.delay_wgrad_compute:
            super().backward_dw()


def _cpu_init(layer, config, init_method, out_size, in_size, bias, row):
    """Megatron's use_cpu_initialization: the master weight made on the CPU and
    copied in, the bias replaced by a new zero Parameter."""
    master = torch.empty(out_size, in_size, dtype=config.params_dtype)
    init_method(master)
    with torch.no_grad():
        layer.weight.copy_(master)
    if bias:
        layer.bias = torch.nn.Parameter(torch.zeros(out_size, dtype=config.params_dtype))
        layer.bias.allreduce = True
        if row:
            layer.bias.sequence_parallel = config.sequence_parallel


class TEColumnParallelLinear(TELinear):
    def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                 is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None, stride=1):
        assert not gather_output
        super().__init__(input_size=input_size, output_size=output_size, parallel_mode="column", config=config,
                         init_method=(_cond_init(config, init_method) if not config.use_cpu_initialization
                                      else lambda w: None),
                         bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         skip_weight_param_allocation=skip_weight_param_allocation,
                         tp_comm_buffer_name=tp_comm_buffer_name, symmetric_ar_type=config.symmetric_ar_type,
                         tp_group=tp_group)
        setattr(self.weight, "partition_stride", stride)
        if config.use_cpu_initialization:
            _cpu_init(self, config, init_method, output_size, input_size, bias, row=False)


class TERowParallelLinear(TELinear):
    def __init__(self, input_size, output_size, *, config, init_method, bias, input_is_parallel, skip_bias_add,
                 is_expert, tp_comm_buffer_name=None, tp_group=None):
        assert input_is_parallel
        super().__init__(input_size=input_size, output_size=output_size, parallel_mode="row", config=config,
                         init_method=(_cond_init(config, init_method) if not config.use_cpu_initialization
                                      else lambda w: None),
                         bias=bias, skip_bias_add=skip_bias_add, skip_weight_param_allocation=False,
                         is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name,
                         symmetric_ar_type=config.symmetric_ar_type, tp_group=tp_group)
        if config.use_cpu_initialization:
            _cpu_init(self, config, init_method, output_size, input_size, bias, row=True)


class TELayerNormColumnParallelLinear(te.LayerNormLinear):
    def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                 is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None, stride=1):
        self.config = config
        self._tp_group = tp_group
        self.te_return_bias = skip_bias_add and bias
        self.is_first_microbatch = True
        self.disable_parameter_transpose_cache = config.disable_parameter_transpose_cache
        extra = _extra_te_kwargs(config)
        self.tp_size = 1 if tp_group is None else tp_group.size()  # before super().__init__, as Megatron
        self.tp_rank = 0 if tp_group is None else tp_group.rank()
        if config.delay_wgrad_compute:
            extra["delay_wgrad_compute"] = config.delay_wgrad_compute
        extra["normalization"] = config.normalization
        if config.tp_comm_overlap:
            extra["ub_bulk_wgrad"] = config.tp_comm_bulk_wgrad
            extra["ub_bulk_dgrad"] = config.tp_comm_bulk_dgrad
            extra["ub_overlap_ag"] = config.tp_comm_overlap_ag
            extra["ub_overlap_rs_dgrad"] = config.tp_comm_overlap_rs_dgrad
            extra["ub_name"] = tp_comm_buffer_name
        if config.symmetric_ar_type is not None:
            extra["symmetric_ar_type"] = config.symmetric_ar_type
        super().__init__(
            in_features=input_size, out_features=output_size, eps=config.layernorm_epsilon,
            sequence_parallel=config.sequence_parallel, fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
            tp_group=tp_group if torch.distributed.is_initialized() else None,
            tp_size=config.tensor_model_parallel_size,
            get_rng_state_tracker=get_cuda_rng_tracker if get_cuda_rng_tracker().is_initialized() else None,
            init_method=(_cond_init(config, init_method) if not config.use_cpu_initialization else lambda w: None),
            bias=bias, return_bias=self.te_return_bias, parallel_mode="column", return_layernorm_output=False,
            zero_centered_gamma=config.layernorm_zero_centered_gamma, **extra)
        setattr(self.weight, "partition_stride", stride)
        if config.use_cpu_initialization:
            _cpu_init(self, config, init_method, output_size, input_size, bias, row=False)

    def forward(self, x):
        first = None if self.disable_parameter_transpose_cache else self.is_first_microbatch
        if x.dtype != self.layer_norm_weight.dtype:
            x = x.to(self.layer_norm_weight.dtype)
        out = super().forward(x, is_first_microbatch=first)
        self.is_first_microbatch = False
        return out if self.te_return_bias else (out, None)

    def backward_dw(self):
        if self.config.delay_wgrad_compute:
            super().backward_dw()


def init_normal(w):
    return torch.nn.init.normal_(w, 0.0, 0.05)


class MLP(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = TELayerNormColumnParallelLinear(IN, FFN, config=config, init_method=init_normal,
                                                   gather_output=False, bias=True, skip_bias_add=False,
                                                   is_expert=False, tp_comm_buffer_name="fc1")
        self.fc2 = TERowParallelLinear(FFN, IN, config=config, init_method=init_normal, bias=True,
                                       input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                       tp_comm_buffer_name="fc2")

    def forward(self, x):
        h, _ = self.fc1(x)
        out, bias = self.fc2(F.gelu(h))
        return out + bias


class DDPStandIn:
    """Megatron DDP's grad buffer: main_grad views of one fp32 buffer,
    grad_added_to_main_grad reset at zero_grad, and the post-accumulate hook
    that adds .grad into main_grad unless the layer already did. With
    overlap_grad_reduce Megatron asserts the hook sees a grad (why TE hands back a
    dummy wgrad when it accumulated into main_grad itself)."""

    def __init__(self, module, overlap_grad_reduce):
        self.overlap_grad_reduce = overlap_grad_reduce
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params))
        self.fired = set()
        off = 0
        for p in self.params:
            p.main_grad = self.buffer[off:off + p.numel()].view(p.shape)
            off += p.numel()
            p.register_post_accumulate_grad_hook(self._hook)
        self.zero_grad()

    def _hook(self, p):
        if self.overlap_grad_reduce:
            assert p.grad is not None, f"{tuple(p.shape)}: the hook saw no grad"
        self.fired.add(id(p))
        if p.grad is not None and (not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False)):
            p.main_grad.add_(p.grad.data)
        p.grad = None

    def zero_grad(self):
        self.buffer.zero_()
        for p in self.params:
            p.grad_added_to_main_grad = False


def run_backward_dw(model, ddp):
    """Megatron calls backward_dw() per layer; grads it sets directly (not
    through autograd, so no hook fired) are taken into main_grad as DDP would."""
    model.fc1.backward_dw()
    model.fc2.backward_dw()
    for p in ddp.params:
        if p.grad is not None:
            ddp._hook(p)


def reference_mlp(model, xs, dys):
    """float64: outputs per micro-batch and the summed parameter grads."""
    p = {n: t.detach().double().requires_grad_() for n, t in model.named_parameters()}
    outs = []
    for x, dy in zip(xs, dys):
        xr = x.double()
        n = F.layer_norm(xr, (IN,), p["fc1.layer_norm_weight"], p["fc1.layer_norm_bias"], 1e-5)
        h = F.linear(n, p["fc1.weight"], p["fc1.bias"])
        y = F.linear(F.gelu(h), p["fc2.weight"]) + p["fc2.bias"]
        y.backward(dy.double())
        outs.append(y.detach())
    return outs, {n: t.grad for n, t in p.items()}


@pytest.mark.parametrize("fusion", [True, False], ids=["grad-acc-fusion", "no-fusion"])
@pytest.mark.parametrize("delay", [False, True], ids=["", "delay-wgrad"])
@pytest.mark.parametrize("cpu_init", [False, True], ids=["", "cpu-init"])
@pytest.mark.parametrize("zero_out", [False, True], ids=["", "zero-out-wgrad"])
def test_megatron_mlp_microbatches(fusion, delay, cpu_init, zero_out):
    TRACKER.__init__()
    TRACKER.add("model-parallel-rng", 1234)
    TRACKER.add("data-parallel-rng", 99)
    config = make_config(gradient_accumulation_fusion=fusion, delay_wgrad_compute=delay,
                         use_cpu_initialization=cpu_init)
    rng_before = torch.get_rng_state()
    model = MLP(config)
    if not cpu_init:  # weights initialised inside the tracker's fork, not from the default generator
        assert TRACKER.forks.count("model-parallel-rng") >= 2, TRACKER.forks
        assert torch.equal(torch.get_rng_state(), rng_before), "construction drew from the default generator"
    # Megatron reads these attributes
    assert model.fc1.in_features == IN and model.fc1.out_features == FFN and model.fc1.tp_size == 1
    assert model.fc1.use_bias and model.fc1.eps == 1e-5 and model.fc2.use_bias
    assert model.fc1.weight.partition_stride == 1
    with torch.no_grad():  # non-trivial norm parameters and biases
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    for p in (model.fc1.weight, model.fc2.weight):
        p.zero_out_wgrad = zero_out
    ddp = DDPStandIn(model, overlap_grad_reduce=not delay)  # delayed wgrads arrive in backward_dw()
    xs = [torch.randn(6, 2, IN) for _ in range(3)]
    dys = [torch.randn(6, 2, IN) for _ in range(3)]
    ref_outs, ref_grads = reference_mlp(model, xs, dys)
    for i, (x, dy) in enumerate(zip(xs, dys)):
        y = model(x)
        assert rel_err(y, ref_outs[i]) < 1e-5, f"micro-batch {i}: output"
        y.backward(dy)
        if delay:
            if fusion and i == 0:  # the weight grads wait for backward_dw()
                assert model.fc2.weight.main_grad.count_nonzero() == 0
            run_backward_dw(model, ddp)
    for name, p in model.named_parameters():
        assert p.grad is None, f"{name}.grad left set (the DDP hook takes every grad)"
        assert rel_err(p.main_grad, ref_grads[name]) < 1e-5, f"{name}.main_grad"
        assert id(p) in ddp.fired, f"{name}: autograd delivered no grad (Megatron's hook asserts one)"
    if fusion:
        assert model.fc1.weight.grad_added_to_main_grad and model.fc2.weight.grad_added_to_main_grad
    # the next step: DDP zeroes the buffer; Megatron's wrapper keeps is_first_microbatch False
    ddp.zero_grad()
    model(xs[0]).backward(dys[0])
    if delay:
        run_backward_dw(model, ddp)
    _, g0 = reference_mlp(model, xs[:1], dys[:1])
    for name, p in model.named_parameters():
        assert rel_err(p.main_grad, g0[name]) < 1e-5, f"second step: {name}.main_grad"


def test_megatron_column_and_duplicated_linear():
    TRACKER.__init__()
    TRACKER.add("model-parallel-rng", 5)
    TRACKER.add("data-parallel-rng", 6)
    config = make_config(gradient_accumulation_fusion=False)
    qkv = TEColumnParallelLinear(IN, QKV, config=config, init_method=init_normal, gather_output=False, bias=True,
                                 skip_bias_add=False, is_expert=False, tp_comm_buffer_name="qkv")
    assert TRACKER.forks and set(TRACKER.forks) == {"model-parallel-rng"}, TRACKER.forks
    # the weight is what init_method draws from the tracker's state
    torch.manual_seed(5)
    want = init_normal(torch.empty(QKV, IN))
    assert torch.equal(qkv.weight.detach(), want)
    dup = TELinear(IN, IN, parallel_mode="duplicated", config=config, init_method=init_normal, bias=False,
                   skip_bias_add=False, skip_weight_param_allocation=False)
    assert TRACKER.forks[-1] == "data-parallel-rng" and dup.parallel_mode is None
    assert getattr(dup, "bias", None) is None or dup.bias.numel() == 0
    assert dup.weight.sequence_parallel is False and dup.weight.tensor_model_parallel is False
    x = torch.randn(5, IN, requires_grad=True)
    y, b = qkv(x)
    assert b is None and y.shape == (5, QKV)
    z, _ = dup(x)
    (y.sum() + z.sum()).backward()
    ref = F.linear(x.detach().double(), qkv.weight.double(), qkv.bias.double())
    assert rel_err(y, ref) < 1e-5
    assert qkv.weight.grad is not None and dup.weight.grad is not None


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_megatron_layernorm_column_rmsnorm_and_zero_centered(normalization):
    config = make_config(normalization=normalization, layernorm_zero_centered_gamma=True,
                         gradient_accumulation_fusion=False)
    TRACKER.__init__()
    layer = TELayerNormColumnParallelLinear(IN, FFN, config=config, init_method=init_normal, gather_output=False,
                                            bias=False, skip_bias_add=True, is_expert=False,
                                            tp_comm_buffer_name="qkv")
    assert layer.normalization == normalization and layer.te_return_bias is False
    assert (getattr(layer, "layer_norm_bias", None) is None) == (normalization == "RMSNorm")
    x = torch.randn(4, IN, dtype=torch.float64)  # Megatron's forward casts to the norm's dtype
    y, b = layer(x)
    assert b is None and y.dtype == torch.float32
    g = layer.layer_norm_weight.detach().double() + 1  # zero-centred gamma
    xd = x
    if normalization == "LayerNorm":
        n = F.layer_norm(xd, (IN,), g, layer.layer_norm_bias.detach().double(), 1e-5)
    else:
        n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g
    assert rel_err(y, F.linear(n, layer.weight.detach().double())) < 1e-5


def test_is_first_microbatch_overwrites_main_grad():
    """TE's rule: with fuse_wgrad_accumulation, is_first_microbatch=True writes
    the wgrad into main_grad; False or None accumulates into it."""
    m = te.Linear(IN, QKV, fuse_wgrad_accumulation=True, device="cpu")
    m.weight.main_grad = torch.full((QKV, IN), 123.0)
    x, dy = torch.randn(5, IN), torch.randn(5, QKV)
    wgrad = (dy.double().t() @ x.double())
    m(x, is_first_microbatch=True).backward(dy)
    assert rel_err(m.weight.main_grad, wgrad) < 1e-5
    assert m.weight.grad is None  # no grad_added_to_main_grad attribute: TE leaves .grad None
    m(x, is_first_microbatch=False).backward(dy)
    assert rel_err(m.weight.main_grad, 2 * wgrad) < 1e-5
    m(x).backward(dy)
    assert rel_err(m.weight.main_grad, 3 * wgrad) < 1e-5
    m.weight.grad_added_to_main_grad = False
    m.weight.zero_out_wgrad = True
    m(x).backward(dy)
    assert m.weight.grad_added_to_main_grad is True
    assert m.weight.grad is not None and m.weight.grad.shape == m.weight.shape
    assert m.weight.grad.count_nonzero() == 0  # the dummy wgrad is zeros under zero_out_wgrad
    assert rel_err(m.weight.main_grad, 4 * wgrad) < 1e-5


def test_megatron_tensor_parallel():
    from distributed.launch import run_torchrun
    out = run_torchrun("../test_megatron_construction.py", 2, timeout=300, pass_line="PASS megatron tp=2")
    assert "stats ok" in out


def test_megatron_tensor_parallel_cuda(monkeypatch):
    from distributed.launch import gpu_count, run_torchrun
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {gpu_count()}")
    monkeypatch.setenv("TEC_UB_MIN_CHUNK_FLOPS", "0")
    run_torchrun("../test_megatron_construction.py", 2, ["--device", "cuda"], timeout=300,
                 pass_line="PASS megatron tp=2")


def main():
    """tp = world, sequence parallel, tp_comm_overlap on: fc1 (LayerNorm +
    column, bulk dgrad/wgrad) and fc2 (row, RS/AG overlap) over two
    micro-batches, against float64 on the full tensors."""
    import argparse

    import torch.distributed as dist

    import common
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    rank, tp, dev = common.setup(args.device)
    group = dist.new_group(list(range(tp)))
    S, B = 8 * tp, 2
    TRACKER.__init__()
    TRACKER.add("model-parallel-rng", 2718 + rank)  # Megatron: a different seed per TP rank
    if args.device == "cuda":
        TRACKER.states.clear()  # the stand-in forks the CPU generator only
    config = make_config(params_dtype=torch.bfloat16, sequence_parallel=True, tensor_model_parallel_size=tp,
                         tp_comm_overlap=True, tp_comm_overlap_ag=True, tp_comm_overlap_rs=True,
                         tp_comm_bulk_wgrad=True, tp_comm_bulk_dgrad=True, tp_comm_overlap_rs_dgrad=False,
                         device=dev)
    # Megatron's _initialize_tp_communicators (TE >= 2.7): no dtype, no tp_group
    te.module.base.initialize_ub(shape=[S * B, IN], tp_size=tp,
                                 quantization_modes=[te.module.base.UserBufferQuantizationMode.NONE],
                                 ub_cfgs=None, bootstrap_backend="nccl" if args.device == "cuda" else "gloo")
    fc1 = TELayerNormColumnParallelLinear(IN, FFN, config=config, init_method=init_normal, gather_output=False,
                                          bias=True, skip_bias_add=False, is_expert=False,
                                          tp_comm_buffer_name="fc1", tp_group=group)
    fc2 = TERowParallelLinear(FFN, IN, config=config, init_method=init_normal, bias=True, input_is_parallel=True,
                              skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2", tp_group=group)
    problems = []
    # TE's in_features / out_features are this rank's sizes: Megatron's
    # split_te_layernorm_column_parallel_linear multiplies out_features by tp_size
    for what, got, want in (("fc1.out_features", fc1.out_features, FFN // tp), ("fc1.in_features", fc1.in_features, IN),
                            ("fc2.in_features", fc2.in_features, FFN // tp), ("fc2.out_features", fc2.out_features, IN),
                            ("fc1.tp_size", fc1.tp_size, tp), ("fc2.tp_size", fc2.tp_size, tp)):
        if got != want:
            problems.append(f"{what} is {got}, TE's is {want}")
    g = torch.Generator().manual_seed(5)
    full = {"fc1.layer_norm_weight": 1 + 0.2 * torch.randn(IN, generator=g, device="cpu"),
            "fc1.layer_norm_bias": 0.2 * torch.randn(IN, generator=g, device="cpu"),
            "fc1.weight": 0.1 * torch.randn(FFN, IN, generator=g, device="cpu"), "fc1.bias": 0.2 * torch.randn(FFN, generator=g, device="cpu"),
            "fc2.weight": 0.1 * torch.randn(IN, FFN, generator=g, device="cpu"), "fc2.bias": 0.2 * torch.randn(IN, generator=g, device="cpu")}
    split = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
    model = torch.nn.ModuleDict({"fc1": fc1, "fc2": fc2})
    with torch.no_grad():
        for n, p in model.named_parameters():
            v = full[n] if n not in split else full[n].chunk(tp, split[n])[rank]
            p.copy_(v.bfloat16())
    sp = sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False))
    assert sp == ["fc1.layer_norm_bias", "fc1.layer_norm_weight", "fc2.bias"], sp
    ddp = DDPStandIn(model, overlap_grad_reduce=True)
    names = ["fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad"]
    before = {n: dict(te.module.base.get_ub(n).stats()) for n in names}
    ref = {n: v.bfloat16().double().requires_grad_() for n, v in full.items()}
    for mb in range(2):
        x = torch.randn(S, B, IN, generator=g, device="cpu")
        dy = torch.randn(S, B, IN, generator=g, device="cpu")
        xl, dyl = x.chunk(tp)[rank].to(dev, torch.bfloat16), dy.chunk(tp)[rank].to(dev, torch.bfloat16)
        h, _ = fc1(xl)
        out, bias = fc2(F.gelu(h))
        y = out + bias
        y.backward(dyl)
        xr = x.bfloat16().double()
        n_ = F.layer_norm(xr, (IN,), ref["fc1.layer_norm_weight"], ref["fc1.layer_norm_bias"], 1e-5)
        yr = F.linear(F.gelu(F.linear(n_, ref["fc1.weight"], ref["fc1.bias"])), ref["fc2.weight"]) + ref["fc2.bias"]
        yr.backward(dy.bfloat16().double())
        err = rel_err(y, yr.detach().chunk(tp)[rank])
        assert err < 1.5e-2, f"micro-batch {mb}: output off by {err}"
    for p in ddp.params:  # finalize_model_grads: all-reduce the sequence-parallel main_grads over TP
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.main_grad, group=group)
    for n, p in model.named_parameters():
        want = ref[n].grad if n not in split else ref[n].grad.chunk(tp, split[n])[rank]
        err = rel_err(p.main_grad, want)
        assert p.main_grad.dtype == torch.float32 and err < 1.5e-2, f"{n}.main_grad off by {err}"
        assert p.grad is None
    grew = {n: {k: te.module.base.get_ub(n).stats()[k] - before[n][k] for k in before[n]} for n in names}
    for n, k in (("fc1_fprop", "ag_overlap"), ("fc1_dgrad", "bulk_ag"), ("fc1_wgrad", "bulk_rs"),
                 ("fc2_fprop", "rs_overlap"), ("fc2_dgrad", "ag_overlap")):
        assert grew[n][k] == 2, f"{n}.stats()[{k!r}] grew by {grew[n][k]} over 2 micro-batches: {grew}"
    te.module.base.destroy_ub()
    dist.barrier()
    if rank == 0:
        print("stats ok", flush=True)
        print("\n".join(f"FAILED: {p}" for p in problems) or f"PASS megatron tp={tp}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
