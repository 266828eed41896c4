"""What the Megatron-Core GPT tests share: Megatron's GPTModel from
get_gpt_layer_with_transformer_engine_spec() (its TE wrappers over this
package through the `transformer_engine` alias), a float64 plain-PyTorch
reference of the same model from the gathered weights, the comparisons,
Megatron's DDP and optimizer, and the workarounds a CPU run of Megatron
needs (cpu_workarounds: Megatron's own code, not this package's, asks for
CUDA there)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, SEQ, BATCH, HIDDEN, HEADS, GROUPS, FFN, LAYERS = 64, 8, 2, 32, 4, 2, 64, 2
EPS = 1e-5
TOL = 2e-5  # relative error of a whole tensor, fp32 against float64
SEED = 1234


def seed_like_megatron(seed=SEED):
    """Megatron's training seeding (megatron/training/initialize.py,
    _set_random_seed): the CPU generator, the same on every rank, then
    model_parallel_cuda_manual_seed (the device's default generator, the
    same on every rank, and the tracker's per-TP-rank states). Megatron-Core
    itself never seeds the CPU generator, and PyTorch seeds it differently
    in every process; the replicated position embeddings are initialised
    from it (LanguageModelEmbedding, on the CPU whatever
    use_cpu_initialization says), so without this the ranks' copies differ."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, te_rng_tracker=True)


def cpu_workarounds():
    """Megatron-Core's CUDA calls on the paths a CPU (gloo) run takes, each
    pointed at the CPU (none is in this package):
      * megatron/core/distributed/param_and_grad_buffer.py and
        distributed_data_parallel.py: torch.cuda.current_stream() /
        torch.cuda.Stream / torch.cuda.stream() around the gradient
        reduction and torch.cuda.current_device() for the buffers' device;
        torch.cuda.synchronize() in the reductions' and timers' paths;
      * megatron/core/transformer/moe/token_dispatcher.py: a CUDA event
        recorded on the current stream and synchronised for the
        device-to-host copy of the token counts;
      * megatron/core/tensor_parallel/random.py: torch.cuda.get_rng_state /
        set_rng_state for the default generator (the CPU's here; the TE
        tracker, this package's CudaRNGStatesTracker, follows the CPU
        generator on a CPU-only host by itself). torch.cuda.manual_seed
        seeds nothing: on a GPU it does not seed the CPU generator either,
        so what Megatron leaves unseeded there (the CPU generator the
        position embeddings are drawn from) is unseeded here too, and the
        run seeds it as Megatron's training does (seed_like_megatron);
      * megatron/core/optimizer: torch.cuda.FloatTensor / IntTensor for the
        found-inf and norm buffers (clip_grads, optimizer);
      * tensors made with device="cuda" or moved with .cuda() (the
        optimizer's loss scale and norm buffers: optimizer.py, clip_grads.py):
        a torch function mode makes them on the CPU, and answers
        Tensor.type() with the CUDA type name clip_grads.py asserts;
    and torch.cuda.is_available() answers False, so that on a GPU host too
    nothing (Megatron, or the default device of a tracker) picks the GPU."""
    import contextlib

    from torch.overrides import TorchFunctionMode

    def is_cuda(d):
        return d is not None and not isinstance(d, torch.dtype) and torch.device(d).type == "cuda" \
            if isinstance(d, (str, torch.device, int)) and not isinstance(d, bool) else False

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)  # clip_grads.py asserts grads are 'torch.cuda.FloatTensor'
                return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
            if func is torch.Tensor.to:
                args = tuple("cpu" if i and is_cuda(a) else a for i, a in enumerate(args))
            return func(*args, **kwargs)

    CudaToCpu().__enter__()  # for the rest of the process
    cuda = torch.cuda
    cuda.is_available = lambda: False

    class _Event:
        def __init__(self, *a, **k):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def wait(self, stream=None):
            pass

        def query(self):
            return True

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_event(self, event):
            pass

        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

        def record_event(self, event=None):
            return event or _Event()

    cuda.current_stream = lambda device=None: _Stream()
    cuda.default_stream = lambda device=None: _Stream()
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.stream = lambda s=None: contextlib.nullcontext()
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda device=None: None
    cuda.manual_seed = lambda seed: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.FloatTensor = lambda *a: torch.FloatTensor(*a)
    cuda.IntTensor = lambda *a: torch.IntTensor(*a)


def apex_wgrad_stand_in():
    """Megatron's own ColumnParallelLinear (the GPT output layer) accumulates
    its weight gradient into main_grad with APEX's CUDA extension
    fused_weight_gradient_mlp_cuda when gradient_accumulation_fusion is on,
    and refuses to build without it. Not installed here: a plain-PyTorch
    stand-in of its two functions (main_grad += grad_output^T input) is put
    where megatron/core/tensor_parallel/layers.py looks it up. The TE layers
    (this package) accumulate into main_grad themselves."""
    import types
    from megatron.core.tensor_parallel import layers

    def accum(total_input, grad_output, main_grad):
        x = total_input.reshape(-1, total_input.shape[-1]).to(main_grad.dtype)
        dy = grad_output.reshape(-1, grad_output.shape[-1]).to(main_grad.dtype)
        main_grad.add_(dy.t() @ x)

    layers.fused_weight_gradient_mlp_cuda = types.SimpleNamespace(wgrad_gemm_accum_fp32=accum,
                                                                  wgrad_gemm_accum_fp16=accum)
    layers._grad_accum_fusion_available = True


def transformer_config(tp, dev, sequence_parallel, grad_acc_fusion, cpu_init=None):
    """cpu_init: Megatron's use_cpu_initialization (the full weight made on
    the CPU from the CPU generator, this rank's shard kept), default on a CPU
    run; otherwise each layer initialises its shard on the run's device
    under the tracker's per-TP-rank fork (a GPU run's default)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    if cpu_init is None:
        cpu_init = dev.type == "cpu"
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
        use_cpu_initialization=cpu_init, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, gradient_accumulation_fusion=grad_acc_fusion, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        use_te_rng_tracker=True, init_method_std=0.05, layernorm_epsilon=EPS)


def build_model(tp, dev, sequence_parallel, grad_acc_fusion, cpu_init=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    config = transformer_config(tp, dev, sequence_parallel, grad_acc_fusion, cpu_init)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=False)
    return model.to(dev)


def perturb_norms(model, seed):
    """Norm weights and biases away from 1 / 0 (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_((torch.randn(p.shape, generator=g) * 0.2).to(p.device))


def batch(dev):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens.to(dev), labels.to(dev)


def megatron_loss(model, tokens, labels):
    pos = torch.arange(SEQ, device=tokens.device).unsqueeze(0).expand(BATCH, SEQ)
    per_token = model(input_ids=tokens, position_ids=pos, attention_mask=None, labels=labels)
    return per_token.float().mean()


def _tp_params(model):
    return [(n, p) for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)]


def gather_params(model, group):
    """name -> the full float64 CPU parameter: tensor-parallel ones gathered
    along partition_dim over `group`, the others this rank's."""
    size = dist.get_world_size(group)
    full = {}
    for n, p in model.named_parameters():
        t = p.detach()
        if getattr(p, "tensor_model_parallel", False) and size > 1:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        full[n] = t.double().cpu()
    return full


def _shard(full, p, group):
    if not getattr(p, "tensor_model_parallel", False) or dist.get_world_size(group) == 1:
        return full
    return full.chunk(dist.get_world_size(group), dim=p.partition_dim)[dist.get_rank(group)]


def reduce_sequence_parallel_grads(model, group):
    """Sum over the group the gradients of parameters marked
    `sequence_parallel` (what Megatron's finalize_model_grads does)."""
    for _, p in model.named_parameters():
        if getattr(p, "sequence_parallel", False) and dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)


def reference_forward(w, tokens, labels):
    """Megatron's GPT (pre-norm, learned absolute positions, GQA with
    Megatron's per-group [q.., k, v] fused QKV layout, causal attention,
    GeLU MLP, untied output layer), float64, from full weights `w`."""
    hn = HIDDEN // HEADS
    per_group = HEADS // GROUPS
    x = w["embedding.word_embeddings.weight"][tokens] + w["embedding.position_embeddings.weight"][:SEQ]
    x = x.transpose(0, 1)  # [s, b, h]
    s, b = x.shape[:2]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(LAYERS):
        pre = f"decoder.layers.{i}."
        a = pre + "self_attention.linear_qkv."
        ln = F.layer_norm(x, (HIDDEN,), w[a + "layer_norm_weight"], w[a + "layer_norm_bias"], EPS)
        qkv = F.linear(ln, w[a + "weight"], w[a + "bias"]).view(s, b, GROUPS, per_group + 2, hn)
        q = qkv[:, :, :, :per_group].reshape(s, b, HEADS, hn)
        k = qkv[:, :, :, per_group].repeat_interleave(per_group, dim=2)
        v = qkv[:, :, :, per_group + 1].repeat_interleave(per_group, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, hn]
        scores = (q @ k.transpose(-1, -2)) / hn ** 0.5
        ctx = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, HEADS * hn)
        p = pre + "self_attention.linear_proj."
        x = x + F.linear(ctx, w[p + "weight"], w[p + "bias"])
        f1, f2 = pre + "mlp.linear_fc1.", pre + "mlp.linear_fc2."
        ln = F.layer_norm(x, (HIDDEN,), w[f1 + "layer_norm_weight"], w[f1 + "layer_norm_bias"], EPS)
        h = F.gelu(F.linear(ln, w[f1 + "weight"], w[f1 + "bias"]))
        x = x + F.linear(h, w[f2 + "weight"], w[f2 + "bias"])
    x = F.layer_norm(x, (HIDDEN,), w["decoder.final_layernorm.weight"], w["decoder.final_layernorm.bias"], EPS)
    logits = F.linear(x, w["output_layer.weight"], w.get("output_layer.bias"))  # [s, b, vocab]
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), labels.t().reshape(-1), reduction="none")
    return per_token.mean()


def reference_loss_and_grads(full, tokens, labels):
    w = {n: t.clone().requires_grad_() for n, t in full.items()}
    loss = reference_forward(w, tokens, labels)
    loss.backward()
    return loss.detach(), {n: t.grad for n, t in w.items()}


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _largest_difference(a, b):
    """Where a and b differ most, and their values there."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    d = (a - b).abs().nan_to_num(float("inf"))
    i = int(torch.argmax(d))
    at = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), a.shape)) if a.dim() else ()
    return f"at {list(at)}: {a.flatten()[i].item():.6g} vs {b.flatten()[i].item():.6g}"


def compare(model, loss, ref_loss, ref_grads, group, grad_of, what):
    """(errors, summary). errors: the loss and each parameter gradient
    further than TOL from the reference's shard of it, the furthest first.
    summary: the loss against the reference and the gradient furthest from
    its reference, by how much and where (on a pass too)."""
    errors, off = [], []
    loss_line = f"loss {loss.item():.8f} vs reference {ref_loss.item():.8f}"
    if abs(loss.item() - ref_loss.item()) > TOL * abs(ref_loss.item()):
        errors.append(f"{what}: {loss_line}")
    seen = set()
    worst = (-1.0, "no gradient compared", "")
    for n, p in model.named_parameters():
        n = n.removeprefix("module.")
        seen.add(n)
        g = grad_of(p)
        if g is None:
            errors.append(f"{what}: {n} got no gradient")
            continue
        want = _shard(ref_grads[n], p, group)
        if g.shape != want.shape:
            errors.append(f"{what}: {n} gradient {tuple(g.shape)} vs reference shard {tuple(want.shape)}")
            continue
        err = _rel(g, want)
        err = float("inf") if err != err else err
        if err > worst[0]:
            worst = (err, n, _largest_difference(g, want))
        if not err <= TOL:
            off.append((err, f"{what}: {n} gradient relative error {err:.3g} > {TOL} ({_largest_difference(g, want)})"))
    errors += [line for _, line in sorted(off, key=lambda e: -e[0])]
    missing = set(ref_grads) - seen
    if missing:
        errors.append(f"{what}: the reference has parameters the model lacks: {sorted(missing)}")
    summary = f"{what}: {loss_line}; largest gradient error {worst[1]} {worst[0]:.3g} {worst[2]}"
    return errors, summary


def same_on_every_rank(named, group, what):
    """Errors (strings) for each (name, tensor) of `named` that is not the
    same on every rank of `group`, with the largest difference between this
    rank's and another's. Tensors must be on the group's device."""
    errors = []
    size = dist.get_world_size(group)
    if size == 1:
        return errors
    me = dist.get_rank(group)
    for n, t in named:
        t = t.detach().contiguous()
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t, group=group)
        differ = [r for r, q in enumerate(parts) if not torch.equal(t, q)]
        if differ:
            d = max((t.double() - parts[r].double()).abs().max().item() for r in differ)
            errors.append(f"{what}: {n} differs across the tensor-parallel ranks (rank {me} against ranks "
                          f"{differ}: largest difference {d:.3g})")
    return errors


def replicated_equal(model, group, when):
    """Parameters that are not tensor-parallel must be equal on every rank."""
    named = [(n, p) for n, p in model.named_parameters() if not getattr(p, "tensor_model_parallel", False)]
    return same_on_every_rank(named, group, f"replicated parameter {when}")


def ddp_and_optimizer(model, lr=3e-3):
    """Megatron's DistributedDataParallel (fp32 main_grad buffers) and its
    optimizer (Adam, gradient clipping at 1.0) over the model."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                           overlap_grad_reduce=False,
                                                                           use_distributed_optimizer=False))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1.0,
                                                 bf16=False, fp16=False, params_dtype=torch.float32,
                                                 use_distributed_optimizer=False), [ddp])
    return ddp, opt
