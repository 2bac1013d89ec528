"""One LoRA adapter's matrices as the engine holds them (:class:`LoraWeights`: PEFT-named
tensors organised per layer and projection, or a fresh adapter drawn as PEFT draws it), and the
cache of stacked adapter matrices kept between no-grad forwards (:class:`LoraStackCache`). The
batched forward over many adapters is :mod:`.lora`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from protocols.messages import LoraSpec

from .config import DecoderSpec, module_dims

if TYPE_CHECKING:  # a type only: the store imports LoraWeights' type back
    from .lora_slots import LoraSlots

__all__ = ["MODULES", "LoraStackCache", "LoraWeights", "peft_name"]

MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""LoRA-able projections, in the order PEFT meets them in a decoder layer."""
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_NAME = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def peft_name(layer: int, module: str, ab: str) -> str:
    """PEFT's saved key of one LoRA matrix (``ab`` is ``"A"`` or ``"B"``)."""
    return f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}.lora_{ab}.weight"


@dataclasses.dataclass(eq=False)
class LoraWeights:
    """One adapter: ``(A_r_in, B_out_r)`` per ``(layer, module)``, the caller's own tensors."""

    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    scale: float
    """alpha / r."""
    version: int | None = None
    """An explicit version (e.g. the adapter's optim-step count) for the stack cache; None: use
    the tensors' ``_version`` counters."""
    store: LoraSlots | None = None
    """The :class:`~.lora_slots.LoraSlots` whose slot holds these tensors (None: they live on
    their own)."""
    slot: int | None = None

    @classmethod
    def from_named(cls, named: Mapping[str, torch.Tensor], spec: LoraSpec, decoder_spec: DecoderSpec) -> LoraWeights:
        """Organise PEFT-named tensors (``...layers.{i}.self_attn.q_proj.lora_A.weight``) without
        copying, so gradients reach the very tensors an optimizer holds. Keys without ``lora_``
        (a value head) are ignored."""
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, t in named.items():
            if ".lora_" not in name:
                continue
            m = _NAME.search(name)
            if m is None or m.group(3) not in MODULES or _PARENT[m.group(3)] != m.group(2):
                raise ValueError(f"not a LoRA weight of a supported projection: {name!r}")
            halves.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = t
        pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, module), ab in sorted(halves.items()):
            if set(ab) != {"A", "B"}:
                raise ValueError(f"layer {layer} {module}: lora_A and lora_B must both be present")
            d_in, d_out = module_dims(decoder_spec, module)
            A, B = ab["A"], ab["B"]
            if layer >= decoder_spec.num_layers or A.shape != (spec.rank, d_in) or B.shape != (d_out, spec.rank):
                raise ValueError(f"layer {layer} {module}: A {tuple(A.shape)}, B {tuple(B.shape)} do not fit "
                                 f"rank {spec.rank}, d_in {d_in}, d_out {d_out}")
            pairs[(layer, module)] = (A, B)
        if not pairs:
            raise ValueError("no LoRA weights in the named tensors")
        return cls(pairs=pairs, scale=spec.alpha / spec.rank)

    @staticmethod
    def new(spec: LoraSpec, decoder_spec: DecoderSpec, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu") -> dict[str, torch.nn.Parameter]:
        """A fresh adapter as PEFT initialises it (A kaiming-uniform(a=sqrt(5)), B zeros), bit
        for bit for the same ``torch.manual_seed(spec.seed)``: PEFT draws each target's A and B
        as ``nn.Linear`` defaults and then A again, in module order, on CPU in fp32, so we do the
        same draws. Returns PEFT-named Parameters with ``requires_grad=False``."""
        unknown = set(spec.target_modules) - set(MODULES)
        if unknown:
            raise ValueError(f"LoraSpec.target_modules {sorted(unknown)} are not supported (only {MODULES})")
        gen = torch.Generator().manual_seed(spec.seed)
        out: dict[str, torch.nn.Parameter] = {}
        for layer in range(decoder_spec.num_layers):
            for module in MODULES:
                if module not in spec.target_modules:
                    continue
                d_in, d_out = module_dims(decoder_spec, module)
                for shape in ((spec.rank, d_in), (d_out, spec.rank)):  # the nn.Linear default inits
                    _kaiming_uniform(torch.empty(shape), gen)
                A = _kaiming_uniform(torch.empty(spec.rank, d_in), gen)
                B = torch.zeros(d_out, spec.rank)
                out[peft_name(layer, module, "A")] = torch.nn.Parameter(A.to(device, dtype), requires_grad=False)
                out[peft_name(layer, module, "B")] = torch.nn.Parameter(B.to(device, dtype), requires_grad=False)
        return out

    def version_key(self) -> tuple[int, ...]:
        """What the stack cache compares to know the weights are unchanged."""
        if self.version is not None:
            return (self.version,)
        return tuple(t._version for A, B in self.pairs.values() for t in (A, B))

    @property
    def rank(self) -> int:
        """r, the adapter's rank (one for all its projections)."""
        return next(iter(self.pairs.values()))[0].shape[0]


def _kaiming_uniform(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    # nn.init.kaiming_uniform_(t, a=sqrt(5)) on fan_in = t.shape[1], drawing from ``gen`` (the
    # global generator after manual_seed(seed) draws the same stream).
    gain = math.sqrt(2.0 / (1 + 5))
    bound = math.sqrt(3.0) * gain / math.sqrt(t.shape[1])
    return t.uniform_(-bound, bound, generator=gen)


class LoraStackCache:
    """Stacked (and dtype-cast) adapter matrices kept between no-grad forwards, for the few most
    recent adapter sets. Entries hold the adapters themselves (compared with ``is``) and their
    version keys, so a dropped or updated adapter never hits a stale entry."""

    def __init__(self, max_sets: int = 2) -> None:
        self.max_sets = max_sets
        self._sets: collections.OrderedDict[tuple, tuple[tuple, dict]] = collections.OrderedDict()
        self.hits = self.misses = 0

    def lookup(self, adapters: Sequence[LoraWeights], dtype: torch.dtype) -> dict:
        """The dict of stacked matrices for this adapter set (empty when new or stale)."""
        key = (tuple(id(a) for a in adapters), dtype)
        check = (tuple(adapters), tuple(a.version_key() for a in adapters))
        entry = self._sets.get(key)
        if entry is not None and all(x is y for x, y in zip(entry[0][0], check[0])) and entry[0][1] == check[1]:
            self._sets.move_to_end(key)
            self.hits += 1
            return entry[1]
        self.misses += 1
        stacks: dict = {}
        self._sets[key] = (check, stacks)
        self._sets.move_to_end(key)
        while len(self._sets) > self.max_sets:
            self._sets.popitem(last=False)
        return stacks
