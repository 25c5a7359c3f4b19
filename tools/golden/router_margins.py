# Router margins wide enough for bf16: per decoder layer, the gap between each token's k-th and
# (k+1)-th router logit, measured on the router's own input, and a layer-by-layer nudge of the
# router weights (mlp.gate.weight) until every token's gap reaches a target.
# Why: the GPU computes the router from bf16 activations that differ from the fp32 reference by
# ~1e-2 relative; a token whose k-th and (k+1)-th logits are closer than that may pick another
# expert there, and one flipped token moves every gradient upstream of it.
import torch

import tiny_models as tm

kMarginSteps = 3000      # Adam steps per layer at most
kMarginLearningRate = 1e-2
kMarginSlack = 1.5       # optimise towards slack x the required gap, so the check has room
kStayCloseWeight = 1e-3  # keeps the nudged router near its random draw


def router_gates(model):
    """The routers (modules named ...mlp.gate) in layer order."""
    gates = [(name, module) for name, module in model.named_modules() if name.endswith("mlp.gate")]
    if not gates:
        raise tm.GoldenError("no mlp.gate modules found (did the module names change?)")
    for name, module in gates:
        if getattr(module, "weight", None) is None or module.weight.dim() != 2:
            raise tm.GoldenError(f"{name} has no 2-D weight")
    return gates


def capture_router_inputs(model, forward):
    """Runs forward() once and returns each router's input as [T, C] float64, in layer order."""
    gates = router_gates(model)
    captured = [None] * len(gates)
    handles = []
    for index, (_, module) in enumerate(gates):
        def hook(_module, args, kwargs=None, index=index):
            value = args[0] if args else next(iter((kwargs or {}).values()), None)
            if value is None:
                raise tm.GoldenError(f"{gates[index][0]} was called without its input")
            captured[index] = value.detach().reshape(-1, value.shape[-1]).double().clone()
        try:  # torch >= 2.0 also hands keyword arguments to the hook
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        except TypeError:
            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            outputs = forward()
    finally:
        for handle in handles:
            handle.remove()
    missing = [gates[i][0] for i, value in enumerate(captured) if value is None]
    if missing:
        raise tm.GoldenError(f"routers not called in the forward: {missing}")
    return captured, outputs


def gaps_of(logits, top_k):
    """Per token: k-th minus (k+1)-th largest logit, and the same for the softmax probabilities."""
    ordered = logits.sort(dim=-1, descending=True).values
    probs = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values
    return ordered[:, top_k - 1] - ordered[:, top_k], probs[:, top_k - 1] - probs[:, top_k]


def check_router_is_linear(name, inputs, weight, recorded):
    """transformers' recorded router_logits must be inputs @ weight^T (or their softmax, as some
    releases record); else the margins measured here would not be the ones that route."""
    logits = inputs @ weight.double().t()
    recorded = recorded.detach().double().reshape(logits.shape)
    scale = logits.abs().max().item() + 1e-30
    if (recorded - logits).abs().max().item() <= 1e-4 * scale:
        return
    if (recorded - torch.softmax(logits, dim=-1)).abs().max().item() <= 1e-5:
        return
    raise tm.GoldenError(f"{name}: the recorded router output is neither input @ weight^T nor its softmax "
                         "(the router is not a plain linear map; the margin code needs updating)")


def layer_margins(model, forward, top_k):
    """[(logit_gap, prob_gap)] per layer: the smallest gaps over all tokens, from the routers' inputs."""
    captured, outputs = capture_router_inputs(model, forward)
    gates = router_gates(model)
    if outputs.router_logits is None or len(outputs.router_logits) != len(gates):
        raise tm.GoldenError(f"expected {len(gates)} router outputs, got "
                             f"{None if outputs.router_logits is None else len(outputs.router_logits)}")
    margins = []
    for (name, module), inputs, recorded in zip(gates, captured, outputs.router_logits):
        check_router_is_linear(name, inputs, module.weight, recorded)
        logit_gaps, prob_gaps = gaps_of(inputs @ module.weight.detach().double().t(), top_k)
        margins.append((logit_gaps.min().item(), prob_gaps.min().item()))
    return margins


def widen_router_margins(model, forward, top_k, min_logit_gap, log):
    """Layer by layer (a router changes only what comes after it): nudges mlp.gate.weight until
    every token's k-th vs (k+1)-th logit gap is at least kMarginSlack x min_logit_gap, keeping the
    weights near their draw. The caller re-measures with layer_margins and refuses a short case."""
    gates = router_gates(model)
    target = kMarginSlack * min_logit_gap
    for index, (name, module) in enumerate(gates):
        captured, _ = capture_router_inputs(model, forward)
        inputs = captured[index].float()
        original = module.weight.detach().clone()
        weight = original.clone().requires_grad_(True)
        optimiser = torch.optim.Adam([weight], lr=kMarginLearningRate)
        before = gaps_of(inputs @ original.t(), top_k)[0].min().item()
        for step in range(kMarginSteps):
            logit_gaps, _ = gaps_of(inputs @ weight.t(), top_k)
            if logit_gaps.min().item() >= target:
                break
            loss = torch.relu(target - logit_gaps).sum() + kStayCloseWeight * (weight - original).pow(2).sum()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
        with torch.no_grad():
            module.weight.copy_(weight.detach())
            after = gaps_of(inputs @ module.weight.t(), top_k)[0].min().item()
            moved = ((module.weight - original).norm() / original.norm()).item()
        log(f"  {name}: smallest logit gap {before:.3e} -> {after:.3e} after {step + 1} steps "
            f"(weight moved {moved:.2%})")
