"""A critic beside a LoRA adapter: a linear value head on the final hidden state.

An adapter created with ``LoraSpec(value_head=True)`` gets ``V(s_t) = w . h_{t-1} + b``, with
``h_{t-1}`` the model's final (normed) hidden state at position ``t - 1``, computed WITH the
adapter on: actor and critic share the trunk, as in the shared-parameter PPO of Schulman et
al. 2017, "Proximal Policy Optimization Algorithms", eq. 9 (one network, loss ``L^CLIP - c1
L^VF``), and as the LLM-RLHF implementations do (a scalar head on the policy's last hidden
state; Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", §2). A
separate critic adapter would double every training forward pass; the shared trunk costs one
``H x 1`` product per value position. The value loss therefore moves the LoRA weights too,
scaled by its coefficient.

The head is zero-initialised: every value starts at 0, so a fresh critic is "no baseline"
(GAE then gives discounted returns) rather than random noise added to the advantages.

Its two parameters live in the adapter's parameter table under :data:`PREFIX` names, so the
adapter's AdamW, gradient clipping, snapshot copy, drop and optimizer checkpoint cover them
with no special case; :meth:`ModelHost.save` writes them to :data:`FILE` beside the PEFT
files (which PEFT does not read: a PEFT loader sees a plain LoRA adapter).
"""

from __future__ import annotations

import torch

PREFIX = "value_head."
"""Prefix of the head's parameter names in the adapter's table (``value_head.weight``, ``.bias``)."""
FILE = "value_head.safetensors"
"""The head's weights in a saved adapter folder."""


def new_value_head(hidden_size: int, device: torch.device) -> dict[str, torch.nn.Parameter]:
    """A zero-initialised ``Linear(hidden_size, 1)`` as ``{name: parameter}``: ``weight``
    ``float32[1, H]`` and ``bias`` ``float32[1]``, not requiring grad (the host turns it on
    while a loss is computed)."""
    head = torch.nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    out = {PREFIX + name: p for name, p in head.named_parameters()}
    for p in out.values():
        p.requires_grad_(False)
    return out


def apply(named: dict[str, torch.nn.Parameter], h_N_H: torch.Tensor) -> torch.Tensor:
    """``float32[N]`` values of the hidden states ``h_N_H`` (``float[N, H]``) with the head in
    ``named`` (an adapter's parameter table)."""
    weight, bias = named[PREFIX + "weight"], named[PREFIX + "bias"]
    return torch.nn.functional.linear(h_N_H.to(weight.dtype), weight, bias)[:, 0]


def split(named: dict[str, torch.nn.Parameter]) -> tuple[dict[str, torch.nn.Parameter], dict[str, torch.nn.Parameter]]:
    """``(LoRA parameters, value-head parameters)`` of an adapter's table."""
    head = {k: p for k, p in named.items() if k.startswith(PREFIX)}
    return {k: p for k, p in named.items() if k not in head}, head
