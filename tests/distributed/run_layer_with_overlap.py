"""Linear / LayerNormLinear with userbuffers overlap against the same layer
without overlap (same parameters and inputs): output, input grad and every
parameter grad, plus stats() proving the overlapped paths ran. Run:
  torchrun --nproc_per_node=2 tests/distributed/run_layer_with_overlap.py --dtypes float32,bfloat16
Prints "PASS run_layer_with_overlap" and exits 0 when every check passed."""
import argparse
import sys
import warnings

import torch
import torch.distributed as dist

import transformer_engine_c as tec
import common
from common import close

SEQ, BATCH, HID, FFN = 4, 2, 32, 64  # SEQ: tokens per rank along the sequence


def comms(tp, dtype, names):
    return {n: common.comm((SEQ * BATCH * tp, HID), dtype, name=n) for n in names}


def run_pair(make, inp_shape, dtype, what, seed, tensorwise=False, scale=0.1):
    """Build the overlapped layer and its plain twin, run fwd+bwd, compare."""
    torch.manual_seed(seed)  # parameters: every rank builds the same full tensors' shards by seed
    ub_layer = make(True)
    ref_layer = make(False)
    ref_layer.load_state_dict(ub_layer.state_dict())
    g = torch.Generator(common.DEV).manual_seed(1000 + dist.get_rank() + seed)
    with torch.no_grad():  # make biases and norm params non-trivial
        for p1, p2 in zip(ub_layer.parameters(), ref_layer.parameters()):
            p1.add_(torch.randn(p1.shape, generator=g).to(dtype) * 0.1)
            p2.copy_(p1)
    # Small values: the non-overlapped reference reduce-scatters in bf16 (gloo),
    # whose rounding at magnitude ~1 alone exceeds TE's atol.
    # (A norm's input keeps scale 1: its dx scales with 1/sigma.)
    x = (torch.randn(inp_shape, generator=g) * scale).to(dtype)
    outs = []
    for layer in (ub_layer, ref_layer):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        dy = (torch.randn(y.shape, generator=torch.Generator(common.DEV).manual_seed(7 + dist.get_rank())) * 0.1).to(dtype)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (y1, dx1, g1), (y2, dx2, g2) = outs
    close(y1, y2, f"{what} output", tensorwise)
    close(dx1, dx2, f"{what} input grad", tensorwise)
    for n in g2:
        # Parameter grads sum over every token after a reduce-scatter that the
        # reference rounds in bf16 and the engine sums in fp32: per element
        # they differ by the reference's rounding; compare the whole tensor.
        close(g1[n], g2[n], f"{what} grad of {n}", tensorwise or dtype != torch.float32)
    with torch.no_grad():  # grad mode never switches the overlap off
        close(ub_layer(x), y2, f"{what} output under no_grad", tensorwise)


def expect(stats_before, comms_, want, what):
    for name, keys in want.items():
        st = comms_[name].stats()
        for k, n in keys.items():
            got = st[k] - stats_before[name][k]
            assert got == n, f"{what}: {name}.stats()[{k!r}] grew by {got}, expected {n}: {st}"


def snapshot(cs):
    return {n: c.stats() for n, c in cs.items()}


def check_layers(tp, dtype):
    kw = dict(params_dtype=dtype, device=common.DEV, sequence_parallel=True, tp_group=dist.group.WORLD, tp_size=tp)
    c = comms(tp, dtype, ["fprop", "dgrad", "wgrad"])
    # Linear row: GEMM+RS in fprop, AG+GEMM in dgrad (one communicator for both)
    s0 = snapshot(c)
    run_pair(lambda ub: tec.Linear(FFN, HID, parallel_mode="row", ub_overlap_rs=ub, ub_overlap_ag=ub,
                                   ub_comm=c["fprop"] if ub else None, **kw),
             (SEQ * tp, BATCH, FFN // tp), dtype, f"Linear row {dtype}", 1)
    expect(s0, c, {"fprop": {"rs_overlap": 2, "ag_overlap": 1}}, "Linear row")
    # Linear column: dgrad reduce-scatter overlapped with dgrad
    s0 = snapshot(c)
    run_pair(lambda ub: tec.Linear(HID, FFN, parallel_mode="column", ub_overlap_ag=ub, ub_overlap_rs_dgrad=ub,
                                   ub_comm=c if ub else None, **kw),
             (SEQ, BATCH, HID), dtype, f"Linear column rs_dgrad {dtype}", 2)
    # (the wgrad input is gathered on the idle fprop communicator: bulk_ag)
    expect(s0, c, {"fprop": {"ag_overlap": 2, "bulk_ag": 1}, "dgrad": {"rs_overlap": 1}}, "Linear column rs_dgrad")
    # Linear column: bulk all-gather with dgrad, bulk reduce-scatter with wgrad
    s0 = snapshot(c)
    run_pair(lambda ub: tec.Linear(HID, FFN, parallel_mode="column", ub_bulk_dgrad=ub, ub_bulk_wgrad=ub,
                                   ub_comm=c if ub else None, **kw),
             (SEQ, BATCH, HID), dtype, f"Linear column bulk {dtype}", 3)
    expect(s0, c, {"dgrad": {"bulk_ag": 1}, "wgrad": {"bulk_rs": 1}}, "Linear column bulk")
    for norm in ("LayerNorm", "RMSNorm"):
        # LayerNormLinear: norm straight into the buffer + AG+GEMM, bulk dgrad + wgrad
        s0 = snapshot(c)
        run_pair(lambda ub: tec.LayerNormLinear(HID, FFN, normalization=norm, parallel_mode="column",
                                                ub_overlap_ag=ub, ub_bulk_dgrad=ub, ub_bulk_wgrad=ub,
                                                ub_comm=c if ub else None, **kw),
                 (SEQ, BATCH, HID), dtype, f"LayerNormLinear {norm} ag+bulk {dtype}", 4, scale=1.0)
        expect(s0, c, {"fprop": {"ag_overlap": 2}, "dgrad": {"bulk_ag": 1}, "wgrad": {"bulk_rs": 1}},
               f"LayerNormLinear {norm} ag+bulk")
        # LayerNormLinear: AG+GEMM fprop, GEMM+RS dgrad
        s0 = snapshot(c)
        run_pair(lambda ub: tec.LayerNormLinear(HID, FFN, normalization=norm, parallel_mode="column",
                                                ub_overlap_ag=ub, ub_overlap_rs_dgrad=ub,
                                                ub_comm=c if ub else None, **kw),
                 (SEQ, BATCH, HID), dtype, f"LayerNormLinear {norm} ag+rs_dgrad {dtype}", 5, scale=1.0)
        expect(s0, c, {"fprop": {"ag_overlap": 2, "bulk_ag": 1}, "dgrad": {"rs_overlap": 1}},
               f"LayerNormLinear {norm} ag+rs_dgrad")
    for x in c.values():
        x.close()


def check_fallback(tp, dtype):
    """Below a communicator's min_chunk_flops the layers run their
    non-overlapped path (same results), counted as ag_fallback/rs_fallback;
    at exactly the threshold they overlap."""
    kw = dict(params_dtype=dtype, device=common.DEV, sequence_parallel=True, tp_group=dist.group.WORLD, tp_size=tp)
    c = {n: common.comm((SEQ * BATCH * tp, HID), dtype, name=f"fb_{n}", min_chunk_flops=float("inf"))
         for n in ("fprop", "dgrad")}
    s0 = snapshot(c)
    run_pair(lambda ub: tec.Linear(FFN, HID, parallel_mode="row", ub_overlap_rs=ub, ub_overlap_ag=ub,
                                   ub_comm=c if ub else None, **kw),
             (SEQ * tp, BATCH, FFN // tp), dtype, f"Linear row, fallback {dtype}", 11)
    expect(s0, c, {"fprop": {"rs_fallback": 2, "rs_overlap": 0}, "dgrad": {"ag_fallback": 1, "ag_overlap": 0}},
           "Linear row fallback")
    s0 = snapshot(c)
    run_pair(lambda ub: tec.LayerNormLinear(HID, FFN, parallel_mode="column", ub_overlap_ag=ub,
                                            ub_overlap_rs_dgrad=ub, ub_comm=c if ub else None, **kw),
             (SEQ, BATCH, HID), dtype, f"LayerNormLinear fallback {dtype}", 12, scale=1.0)
    # where the forward fell back, NCCL (not the fprop communicator) gathers the wgrad input
    expect(s0, c, {"fprop": {"ag_fallback": 2, "ag_overlap": 0, "bulk_ag": 0},
                   "dgrad": {"rs_fallback": 1, "rs_overlap": 0}}, "LayerNormLinear fallback")
    # The boundary: the fprop chunk GEMM is [SEQ*BATCH, HID] @ [HID, FFN/tp].
    flops = 2.0 * SEQ * BATCH * HID * (FFN // tp)
    layer = tec.Linear(HID, FFN, parallel_mode="column", ub_overlap_ag=True, ub_comm=c["fprop"], **kw)
    x = torch.randn(SEQ, BATCH, HID).to(dtype)
    for threshold, counter in ((flops, "ag_overlap"), (flops + 1, "ag_fallback")):
        c["fprop"].min_chunk_flops = {"ag": threshold, "rs": 0.0}
        s0 = snapshot(c)
        with torch.no_grad():
            layer(x)
        expect(s0, c, {"fprop": {counter: 1}}, f"threshold {threshold} for a {flops}-FLOP chunk")
    for x in c.values():
        x.close()


class Block(torch.nn.Module):
    def __init__(self, ub, **kw):
        super().__init__()
        self.fc1 = tec.LayerNormLinear(HID, FFN, parallel_mode="column", ub_overlap_ag=ub, ub_bulk_dgrad=ub,
                                       ub_bulk_wgrad=ub, ub_name="fc1" if ub else None, **kw)
        self.fc2 = tec.Linear(FFN, HID, parallel_mode="row", ub_overlap_rs=ub, ub_overlap_ag=ub,
                              ub_name="fc2" if ub else None, **kw)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))) + x


def check_model(tp, dtype):
    """Two blocks sharing the registry's communicators, fwd + bwd."""
    kw = dict(params_dtype=dtype, device=common.DEV, sequence_parallel=True, tp_group=dist.group.WORLD, tp_size=tp)
    common.init_ub((SEQ * BATCH * tp, HID), tp, dtype=dtype)
    try:
        names = ["fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad"]
        s0 = {n: tec.get_ub(n).stats() for n in names}
        run_pair(lambda ub: torch.nn.Sequential(Block(ub, **kw), Block(ub, **kw)), (SEQ, BATCH, HID), dtype,
                 f"two-block model {dtype}", 6, tensorwise=True, scale=1.0)
        expect(s0, {n: tec.get_ub(n) for n in names},
               {"fc1_fprop": {"ag_overlap": 4}, "fc1_dgrad": {"bulk_ag": 2}, "fc1_wgrad": {"bulk_rs": 2},
                "fc2_fprop": {"rs_overlap": 4}, "fc2_dgrad": {"ag_overlap": 2}}, "model")
    finally:
        tec.destroy_ub()


class MLPBlock(torch.nn.Module):
    """The same block as one LayerNormMLP (gelu, TE's tanh form)."""

    def __init__(self, ub, **kw):
        super().__init__()
        self.mlp = tec.LayerNormMLP(HID, FFN, set_parallel_mode=True, ub_overlap_ag=ub, ub_overlap_rs=ub,
                                    ub_bulk_dgrad=ub, ub_bulk_wgrad=ub, **kw)

    def forward(self, x):
        return self.mlp(x) + x


def check_mlp_model(tp, dtype):
    """Two LayerNormMLP blocks sharing the registry's fc1_* / fc2_*
    communicators, fwd + bwd, against the same model without userbuffers;
    and the LayerNormMLP model against the two-layer block with the same
    weights (LayerNormLinear -> gelu (tanh) -> Linear)."""
    kw = dict(params_dtype=dtype, device=common.DEV, sequence_parallel=True, tp_group=dist.group.WORLD, tp_size=tp)
    common.init_ub((SEQ * BATCH * tp, HID), tp, dtype=dtype)
    try:
        names = ["fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad"]
        s0 = {n: tec.get_ub(n).stats() for n in names}
        run_pair(lambda ub: torch.nn.Sequential(MLPBlock(ub, **kw), MLPBlock(ub, **kw)), (SEQ, BATCH, HID), dtype,
                 f"two-block LayerNormMLP model {dtype}", 8, tensorwise=True, scale=1.0)
        expect(s0, {n: tec.get_ub(n) for n in names},
               {"fc1_fprop": {"ag_overlap": 4}, "fc1_dgrad": {"bulk_ag": 2}, "fc1_wgrad": {"bulk_rs": 2},
                "fc2_fprop": {"rs_overlap": 4}, "fc2_dgrad": {"ag_overlap": 2}}, "LayerNormMLP model")
    finally:
        tec.destroy_ub()
    # One module against two layers: the same parameters give the same model.
    torch.manual_seed(9)
    mlp = MLPBlock(False, **kw)
    fc1 = tec.LayerNormLinear(HID, FFN, parallel_mode="column", **kw)
    fc2 = tec.Linear(FFN, HID, parallel_mode="row", **kw)
    with torch.no_grad():
        for dst, src in ((fc1.layer_norm_weight, mlp.mlp.layer_norm_weight), (fc1.layer_norm_bias, mlp.mlp.layer_norm_bias),
                         (fc1.weight, mlp.mlp.fc1_weight), (fc1.bias, mlp.mlp.fc1_bias), (fc2.weight, mlp.mlp.fc2_weight),
                         (fc2.bias, mlp.mlp.fc2_bias)):
            src.add_(torch.randn_like(src) * 0.1)
            dst.copy_(src)
    x = torch.randn(SEQ, BATCH, HID, generator=torch.Generator().manual_seed(3 + dist.get_rank()), device="cpu").to(dtype)
    x1, x2 = x.clone().to(common.DEV).requires_grad_(), x.clone().to(common.DEV).requires_grad_()
    y1 = mlp(x1)
    y2 = fc2(torch.nn.functional.gelu(fc1(x2), approximate="tanh")) + x2
    dy = torch.randn(y1.shape, generator=torch.Generator().manual_seed(5), device="cpu").to(dtype).to(common.DEV)
    y1.backward(dy)
    y2.backward(dy)
    close(y1, y2, f"LayerNormMLP against LayerNormLinear + gelu + Linear {dtype}", True)
    close(x1.grad, x2.grad, f"LayerNormMLP input grad against the two layers {dtype}", True)
    close(mlp.mlp.fc1_weight.grad, fc1.weight.grad, f"LayerNormMLP fc1 weight grad {dtype}", True)
    close(mlp.mlp.fc2_weight.grad, fc2.weight.grad, f"LayerNormMLP fc2 weight grad {dtype}", True)


def check_construction(tp):
    """Flags that do not apply are ignored with one warning per layer, as TE
    ignores them (and the layer then runs without that overlap); the
    combinations that cannot work are errors."""
    kw = dict(device=common.DEV, sequence_parallel=True, tp_group=dist.group.WORLD, tp_size=tp)
    c = common.comm((SEQ * BATCH * tp, HID), torch.float32, name="ctor")
    ignored = [
        (lambda: tec.Linear(HID, FFN, parallel_mode="column", ub_overlap_rs=True, ub_comm=c, **kw), "ub_overlap_rs"),
        (lambda: tec.Linear(HID, FFN, parallel_mode="row", ub_bulk_dgrad=True, ub_comm=c, **kw), "ub_bulk_dgrad"),
        (lambda: tec.Linear(HID, FFN, parallel_mode="column", ub_overlap_rs_dgrad=True, ub_bulk_wgrad=True,
                            ub_comm=c, **kw), "ub_bulk_wgrad"),
        (lambda: tec.Linear(HID, FFN, parallel_mode="column", ub_overlap_ag=True, ub_comm=c,
                            device=common.DEV, tp_group=dist.group.WORLD, tp_size=tp), "ub_overlap_ag"),
    ]
    for fn, flag in ignored:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer = fn()
        msgs = [str(w.message) for w in caught]
        assert len(msgs) == 1 and flag in msgs[0] and "ignored" in msgs[0], msgs
        assert not layer.ub[flag], (flag, layer.ub.flags)
    bad = [
        (lambda: tec.Linear(HID, FFN, parallel_mode="column", ub_bulk_dgrad=True, ub_bulk_wgrad=True,
                            ub_comm=c, **kw), "two communicators"),
        (lambda: tec.Linear(HID, FFN, parallel_mode="column", ub_overlap_ag=True, **kw), "ub_name"),
    ]
    for fn, word in bad:
        try:
            fn()
            raise AssertionError(f"a layer that cannot work was built (expected '{word}')")
        except ValueError as e:
            assert word in str(e), e
    c.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--checks", default="construction,layers,fallback,model,mlp_model")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()
    common.setup(args.device)
    tp = dist.get_world_size()
    # Every tensor saved for backward in every configuration is checked
    # against every live communicator's ranges (own and peers'): raises on aliasing.
    with tec.debug.check_saved_tensors() as chk:
        for check in args.checks.split(","):
            if check == "construction":
                check_construction(tp)
            else:
                for name in args.dtypes.split(","):
                    globals()[f"check_{check}"](tp, getattr(torch, name))
            dist.barrier()
            if dist.get_rank() == 0:
                print(f"ok {check} tp={tp}", flush=True)
    assert chk.checked > 0 and not chk.violations, (chk.checked, chk.violations)
    if dist.get_rank() == 0:
        print(f"ok saved-tensor check: {chk.checked} saved tensors, no alias of a buffer", flush=True)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 0:
        print("PASS run_layer_with_overlap", flush=True)


if __name__ == "__main__":
    sys.exit(main())
