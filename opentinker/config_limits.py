"""A config's bounds: the largest (and smallest) value of every numeric field, each with its
reason, and the annotated types the schema (:mod:`opentinker.config`) builds its fields from.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

# Upper bounds. Each lies far above what a real job uses (the bundled jobs and the README's
# sweeps stay 100-1000x below) and low enough that the work, memory or arithmetic it leads to
# stays finite and startable: they stop typos and hostile configs (``steps = 10**30``, ``lr =
# inf``, ``lora_rank = 10**7``), not experiments. Floats are bounded on both sides, so inf and
# nan are refused everywhere.
MAX_STEPS = 10**6
"""Training steps (and every "each N steps" period): 10^6 steps at 1 s each is 11 days; the
default job runs 50."""
MAX_GROUPS_PER_STEP = 10**5
MAX_GROUP_SIZE = 10**4
MAX_EPISODES_PER_STEP = 2**14
"""``groups_per_step * group_size`` (the default job plays 64): the coordinator hands a step's
episodes to the runners in one message each, and 160,000 episodes made a 17 MB message, past
the bus's 4 MiB limit on a body."""
MAX_HANDS_PER_STRATUM = 1000
"""Evaluation games per (start, seat) (the game's evaluation hook has the starts); in the default
job 34 give 408 games, a 95% interval of about +-0.1 per game, and 1000 give 12,000 (+-0.02)."""
MAX_POLICIES = 256
"""Each policy is a learner actor (a process) and an adapter on the scheduler."""
MAX_COEF = 1e6
"""Loss coefficients, LoRA alpha, truncations, opponent weights, DPO/IPO settings."""
MAX_LR = 10.0
"""AdamW fine-tuning rates are 1e-7 to 1e-2."""
MAX_CLIP_HIGH = 10.0
"""PPO's ``1 + clip_high`` (DAPO uses 0.28); keeps every clip bound far inside the losses'
log-ratio clamp (``learners.losses.LOG_RATIO_CLAMP``)."""
MAX_DUAL_CLIP = 1e3
MIN_TEMPERATURE = 1e-4
"""Below it sampling is greedy in all but name, and a temperature that rounds to 0 in float32
divides the logits by zero."""
MAX_TEMPERATURE = 100.0
MAX_TOKENS = 2**17
"""Tokens per reply: 131,072 is the longest context of current open models (a model whose
``config.json`` is at hand is held to its own ``max_position_embeddings``)."""
MAX_TOP_K = 2**20
"""Larger than any vocabulary."""
MAX_THREADS = 4096
MAX_KV_MB = 2**20
"""1 TiB of KV blocks."""
MAX_BATCH_TOKENS = 2**20
MAX_BLOCK_SIZE = 4096
MAX_ENV_RUNNERS = 1024
"""Each is an actor (a process)."""
MAX_DEVICES = 64
"""Each is a scheduler actor (a process)."""
DEVICE_PATTERN = r"^(cpu|cuda(:\d{1,2})?)$"
"""A scheduler's torch device: ``cpu``, ``cuda`` or ``cuda:N``."""
MAX_TIMEOUT_S = 7 * 86400.0
"""A week: a request that takes longer is a hung job."""
MAX_SEED = 2**32 - 1
"""The runtime seeds its numpy streams with the seed's low 32 bits (``rollout/episodes.py``),
so larger seeds would silently alias smaller ones; ``torch.manual_seed`` stops at 2^64."""
MAX_TEXT = 100_000
"""Characters of ``system_prompt`` (it is in every prompt)."""
MAX_PATH_CHARS = 4096
"""``PATH_MAX`` on Linux: ``out_dir``, ``model.base``, ``offline.data``."""
MAX_ITEMS = 64
"""Entries of ``game_kwargs``, ``target_modules`` and a policy's ``train`` overrides."""
MAX_KWARG_CHARS = 256
"""A string in ``game_kwargs`` (it travels with every episode of a step)."""
MAX_DECISIONS = 10**6
"""Most decisions a step of ``train.all_actions_decisions`` draws."""
MAX_REWARD = 1e12

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
Steps = Annotated[int, Meta(ge=0, le=MAX_STEPS)]
PosSteps = Annotated[int, Meta(ge=1, le=MAX_STEPS)]
Hands = Annotated[int, Meta(ge=0, le=MAX_HANDS_PER_STRATUM)]
PosHands = Annotated[int, Meta(ge=1, le=MAX_HANDS_PER_STRATUM)]
Coef = Annotated[float, Meta(ge=0, le=MAX_COEF)]
PosCoef = Annotated[float, Meta(gt=0, le=MAX_COEF)]
UnitFloat = Annotated[float, Meta(ge=0, le=1)]
Prob = Annotated[float, Meta(gt=0, le=1)]
Timeout = Annotated[float, Meta(gt=0, le=MAX_TIMEOUT_S)]
PathStr = Annotated[str, Meta(max_length=MAX_PATH_CHARS)]
