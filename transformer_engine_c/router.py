"""TransformerEngine's mixture-of-experts router functions
(`transformer_engine.pytorch.router`), in PyTorch operations: the same
results and gradients as TE's fused kernels, computed in fp32.

Score functions "softmax" and "sigmoid" (TE 2.9's); routing maps are bool
[tokens, experts] (TE's "bytemap")."""
import torch

__all__ = ["fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"]

_SCORE_FUNCTIONS = ("softmax", "sigmoid")


def _check_logits(logits, what):
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"{what}: logits must be a 2-D tensor [tokens, experts], got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{what}: logits must be float32, bfloat16 or float16, got {logits.dtype}")


def _check_score_function(score_function, what):
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(f"{what}: score_function must be one of {_SCORE_FUNCTIONS}, got {score_function!r}")


def _topk(scores, topk, num_groups, group_topk):
    """(values, indices) of the top-k experts per token; with group_topk, only
    among the group_topk groups (of num_groups equal groups of experts)
    whose top-(topk / group_topk) scores sum highest."""
    if not group_topk:
        return torch.topk(scores, topk, dim=1)
    tokens, experts = scores.shape
    if not num_groups or experts % num_groups or topk % group_topk or group_topk > num_groups:
        raise ValueError(f"group top-k: num_groups={num_groups} must divide the {experts} experts, "
                         f"group_topk={group_topk} divide topk={topk} and be <= num_groups")
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_score = grouped.topk(topk // group_topk, dim=-1).values.sum(-1)
    chosen = group_score.topk(group_topk, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, chosen, True)
    masked = scores.masked_fill(~keep.repeat_interleave(experts // num_groups, dim=1), float("-inf"))
    return torch.topk(masked, topk, dim=1)


def fused_topk_with_score_function(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
                                   score_function, expert_bias):
    """Route each token to `topk` experts. Returns (probs, routing_map):
    probs [tokens, experts] in logits' dtype, zero off the chosen experts;
    routing_map bool, True on them.
      * softmax: the top-k of softmax(logits) (use_pre_softmax) or the
        softmax over the top-k logits;
      * sigmoid: the top-k of sigmoid(logits) (+ expert_bias for the choice
        only), normalised to sum 1 when topk > 1;
    then scaled by scaling_factor (if given). num_groups / group_topk
    restrict the choice to the best groups of experts."""
    what = "fused_topk_with_score_function"
    _check_logits(logits, what)
    _check_score_function(score_function, what)
    topk = int(topk)
    if not 0 < topk <= logits.shape[1]:
        raise ValueError(f"{what}: topk must be in [1, {logits.shape[1]}], got {topk}")
    if expert_bias is not None and score_function != "sigmoid":
        raise ValueError(f"{what}: expert_bias goes with score_function='sigmoid'")
    x = logits.float()
    if score_function == "softmax":
        if use_pre_softmax:
            probs, idx = _topk(torch.softmax(x, dim=-1), topk, num_groups, group_topk)
        else:
            top, idx = _topk(x, topk, num_groups, group_topk)
            probs = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(x)
        if expert_bias is not None:
            _, idx = _topk(scores + expert_bias.float(), topk, num_groups, group_topk)
            probs = scores.gather(1, idx)
        else:
            probs, idx = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * float(scaling_factor)
    probs = probs.to(logits.dtype)
    routing_probs = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter(1, idx, True)
    return routing_probs, routing_map


def fused_compute_score_for_moe_aux_loss(logits, topk, score_function):
    """The scores the auxiliary load-balancing loss uses: (routing_map,
    scores), scores fp32 [tokens, experts] (softmax, or sigmoid normalised
    to sum 1 per token) and routing_map its top-k, bool."""
    what = "fused_compute_score_for_moe_aux_loss"
    _check_logits(logits, what)
    _check_score_function(score_function, what)
    x = logits.float()
    if score_function == "softmax":
        scores = torch.softmax(x, dim=-1)
    else:
        s = torch.sigmoid(x)
        scores = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    idx = torch.topk(scores, int(topk), dim=1).indices
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter(1, idx, True)
    return routing_map, scores


def fused_moe_aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    """The auxiliary load-balancing loss, a scalar in probs' dtype:
    sum_e(sum_t probs[t, e] * tokens_per_expert[e]) * num_experts * coeff /
    (topk * total_num_tokens^2). Differentiable in probs."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        raise ValueError("fused_moe_aux_loss: probs must be a 2-D tensor [tokens, experts]")
    if tokens_per_expert.shape != (probs.shape[1],):
        raise ValueError(f"fused_moe_aux_loss: tokens_per_expert must be [{probs.shape[1]}], got "
                         f"{tuple(tokens_per_expert.shape)}")
    total = total_num_tokens.item() if isinstance(total_num_tokens, torch.Tensor) else total_num_tokens
    if total <= 0 or int(topk) <= 0:
        raise ValueError(f"fused_moe_aux_loss: total_num_tokens ({total}) and topk ({topk}) must be positive")
    per_expert = probs.float().sum(dim=0)
    loss = (per_expert * tokens_per_expert.float()).sum() * (int(num_experts) * float(coeff)
                                                             / (int(topk) * float(total) * float(total)))
    return loss.to(probs.dtype)
