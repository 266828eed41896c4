"""The weight-gradient policy of a layer's GEMM, as TransformerEngine has it:
the gradient returned to autograd; or, with fuse_wgrad_accumulation,
accumulated in fp32 into the weight's `main_grad` by the GEMM itself
(overwritten on the first micro-batch); or, with delay_wgrad_compute,
computed later by the module's backward_dw(). A DistributedWeight's gradient
is reduce-scattered into its shard (module/_weights.py).

WeightGrads is one GEMM's policy and the owner of its delayed work; it reads
only the module's public attributes (its parameters by name,
fuse_wgrad_accumulation, delay_wgrad_compute), on every backward. Wgrad is
one backward's use of it; a plain one (neither fused, delayed nor
distributed) holds nothing of that backward, so each WeightGrads makes it once
per kind (bias or not, local bias, frozen weight or not) and reuses it."""
import torch

from .. import _engine
from ._weights import is_distributed_weight, weight_grad


class WeightGrads:
    """The weight-gradient policy of one GEMM of `module`: its weight
    parameters (`weight_names`, rows of the GEMM's weight in that order), its
    bias parameters, and the queue of weight gradients delay_wgrad_compute
    left for backward_dw() (with the bias gradients that come from another
    step, e.g. LayerNormMLP's fc1 bias from the activation's backward)."""

    __slots__ = ("module", "weight_names", "bias_names", "queue", "bias_queue", "plain_steps")

    def __init__(self, module, weight_names, bias_names):
        self.module, self.weight_names, self.bias_names = module, list(weight_names), list(bias_names)
        self.queue, self.bias_queue = [], []
        # The plain Wgrads (neither fused, delayed nor distributed), which
        # hold nothing of one backward: made once per (with_bias,
        # bias_from_local, need_w) and shared by every backward.
        self.plain_steps = [None] * 8

    @property
    def fuse(self):
        return self.module.fuse_wgrad_accumulation

    @property
    def delay(self):
        return self.module.delay_wgrad_compute

    def params(self):
        return [getattr(self.module, n) for n in self.weight_names]

    def step(self, weight, with_bias, is_first_microbatch, bias_from_local=False, need_w=True):
        """The Wgrad of one backward (see Wgrad)."""
        module = self.module
        if module.fuse_wgrad_accumulation or module.delay_wgrad_compute or is_distributed_weight(weight):
            return Wgrad(self, weight, with_bias, is_first_microbatch, bias_from_local, need_w)
        i = 4 * bool(with_bias) + 2 * bool(bias_from_local) + bool(need_w)
        wg = self.plain_steps[i]
        if wg is None:
            wg = self.plain_steps[i] = Wgrad(self, None, with_bias, is_first_microbatch, bias_from_local, need_w)
        return wg

    def pending(self):
        return bool(self.queue or self.bias_queue)

    def finish_delayed(self):
        """backward_dw(): compute the oldest delayed weight (and bias)
        gradient into main_grad (fuse_wgrad_accumulation) or .grad."""
        db = None
        if self.queue:
            wg, dy_total, x_total, db_local, fp8 = self.queue.pop(0)
            wg.delay = False
            dw, db = wg.compute(dy_total, x_total, fp8)
            if wg.bias_from_local:
                db = db_local
            if dw is not None and not wg.fuse:
                row = 0
                for p in wg.params:
                    add_grad(p, dw[row:row + p.shape[0]])
                    row += p.shape[0]
        if self.bias_queue:
            db = self.bias_queue.pop(0)
        if db is not None and self.module.use_bias:
            row = 0
            for name in self.bias_names:
                b = getattr(self.module, name)
                add_grad(b, db[row:row + b.shape[0]])
                row += b.shape[0]


class Wgrad:
    """How one backward finishes its weight gradient (the policy of its
    WeightGrads). `with_bias`: the bias gradient is wanted; `need_w`: the
    weight's is (a frozen weight gets no GEMM, no main_grad write and no
    .grad); `bias_from_local`: the bias gradient is summed over this rank's
    tokens only (a row layer under sequence parallelism, whose bias carries
    `sequence_parallel` and is reduced by the framework). `plain`: neither
    fused, delayed nor distributed, so the steps may compute the gradient in
    the same engine call as dgrad (module/_steps.py)."""

    __slots__ = ("owner", "params", "weight", "need_w", "fuse", "accumulate", "delay", "with_bias",
                 "bias_from_local", "plain")

    def __init__(self, owner, weight, with_bias, is_first_microbatch, bias_from_local=False, need_w=True):
        self.owner, self.weight, self.with_bias, self.need_w = owner, weight, with_bias, need_w
        self.fuse = owner.fuse
        self.accumulate = self.fuse and not is_first_microbatch
        self.delay = owner.delay
        self.params = owner.params() if self.fuse or self.delay else None
        self.bias_from_local = bias_from_local
        self.plain = not (self.fuse or self.delay or is_distributed_weight(weight))

    def __call__(self, dy_total, x_total, ub, dy_local=None, fp8=None):
        """(dw for autograd, db for autograd): computed now, or (None, None)
        after queueing the GEMM for backward_dw(). fp8: the GEMM's FP8
        operands (module/_fp8_gemm.wgrad_operands) under an FP8 autocast."""
        from ._steps import outside_buffers

        db_local = None
        if self.bias_from_local and self.with_bias:
            db_local = dy_local.sum(0, dtype=torch.float32).to(dy_local.dtype)
        if self.delay:
            dy_total, x_total = outside_buffers(dy_total, ub), outside_buffers(x_total, ub)
            self.owner.queue.append((self, dy_total, x_total, db_local, fp8))
            return None, None
        dw, db = self.compute(dy_total, x_total, fp8)
        return dw, (db_local if self.bias_from_local else db)

    def compute(self, dy_total, x_total, fp8=None):
        """dW = dY^T X (and the bias gradient, the sum of dY over tokens):
        into main_grad with fuse_wgrad_accumulation, else returned. With
        fp8 (the FP8 operands) the GEMM runs in FP8 and the bias gradient
        comes from dY's FP8 cast, which summed it."""
        with_bias = self.with_bias and not self.bias_from_local
        if not self.need_w:  # only the bias gradient: dY's column sums, no GEMM
            return None, (dy_total.sum(0, dtype=torch.float32).to(dy_total.dtype) if with_bias else None)
        w = self.weight
        if fp8 is not None:
            return self._compute_fp8(dy_total, fp8, with_bias)
        if not self.fuse or is_distributed_weight(w):
            res = _engine.gemm(dy_total, x_total, transa=True, bias_grad=with_bias)
            dw, db = res if with_bias else (res, None)
            if self.fuse and not is_distributed_weight(w):
                return self._into_main_grad(dw), db
            return weight_grad(w, dw), db
        if len(self.params) == 1:
            main = main_grad_of(self.params[0])
            res = _engine.gemm(dy_total, x_total, transa=True, out=main, accumulate=self.accumulate,
                               bias_grad=with_bias)
            db = res[1] if with_bias else None
        else:
            res = _engine.gemm(dy_total, x_total, transa=True, out_dtype=torch.float32, bias_grad=with_bias)
            dw, db = res if with_bias else (res, None)
            return self._into_main_grad(dw), db
        return self._dummy_grads(), db

    def _compute_fp8(self, dy_total, ops, with_bias):
        from ._fp8 import same_tensor
        from ._fp8_gemm import wgrad

        db = None
        if with_bias:  # the sums the dY cast took (one pass), else dY's own
            qdy = ops[0]
            db = qdy.dbias if qdy.dbias is not None and same_tensor(qdy.src, dy_total) else None
            if db is None:
                db = dy_total.sum(0, dtype=torch.float32).to(dy_total.dtype)
        w = self.weight
        if not self.fuse or is_distributed_weight(w):
            dw = wgrad(ops, dy_total.dtype)
            if self.fuse and not is_distributed_weight(w):
                return self._into_main_grad(dw), db
            return weight_grad(w, dw), db
        if len(self.params) == 1:
            wgrad(ops, torch.float32, out=main_grad_of(self.params[0]), accumulate=self.accumulate)
            return self._dummy_grads(), db
        return self._into_main_grad(wgrad(ops, torch.float32)), db

    def _into_main_grad(self, dw):
        """Add (or, on a first micro-batch, copy) dw into the main_grad of
        each weight parameter (rows of dw in parameter order)."""
        row = 0
        for p in self.params:
            part = dw[row:row + p.shape[0]]
            row += p.shape[0]
            main = main_grad_of(p)
            main.add_(part) if self.accumulate else main.copy_(part)
        return self._dummy_grads()

    def _dummy_grads(self):
        """TransformerEngine's protocol with Megatron's DDP: a weight with
        `grad_added_to_main_grad` gets it set and a dummy gradient (zeros if it
        asks by `zero_out_wgrad`) that the framework's hook ignores; without
        the attribute the gradient is None."""
        out = []
        for p in self.params:
            if hasattr(p, "grad_added_to_main_grad"):
                p.grad_added_to_main_grad = True
                make = torch.zeros if getattr(p, "zero_out_wgrad", False) else torch.empty
                out.append(make(p.shape, dtype=p.dtype, device=p.device))
            else:
                out.append(None)
        if len(out) == 1 or any(g is None for g in out):
            return out[0] if len(out) == 1 else None
        return torch.cat(out)


def main_grad_of(p):
    main = getattr(p, "main_grad", None)
    if main is None:
        raise RuntimeError("fuse_wgrad_accumulation=True needs the weight's main_grad (an fp32 tensor of the "
                           "weight's shape that the training framework allocates, as Megatron does); this "
                           f"weight of shape {tuple(p.shape)} has none")
    if main.shape != p.shape or main.dtype != torch.float32 or not main.is_contiguous() or main.device != p.device:
        raise ValueError(f"weight.main_grad must be a contiguous float32 tensor of shape {tuple(p.shape)} on "
                         f"{p.device}; got {main.dtype} {tuple(main.shape)} on {main.device}")
    return main


def add_grad(p, g):
    """Accumulate g into p.grad (backward_dw's gradients)."""
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g.clone() if g._base is not None else g
    else:
        p.grad.add_(g)
