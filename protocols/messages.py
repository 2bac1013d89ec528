"""Every message of the OpenTinker wire protocol, as frozen, tagged ``msgspec.Struct`` s.

A message travels as three parts (see :mod:`protocols.codec`): a small fixed header, the
msgpack body of one of the Structs below, and zero or more raw array buffers. Fields typed
``numpy.ndarray`` never go through msgpack: the codec replaces each with an :class:`ArrayRef`
naming the extra frame that holds its bytes, so token ids and log-probs move without copies.

Shapes follow the project convention: ``_T`` tokens, ``_B`` rows of a batch, ``_K`` turns.
Token ids are ``int32``, log-probs and per-token loss inputs are ``float32``.

This module imports nothing of ours: a third party can implement a peer from it alone.
"""

from __future__ import annotations

import enum
from typing import Annotated, Union

import msgspec
import numpy as np

PROTOCOL_VERSION = 12
"""Bumped on any change to a message's fields. Checked when a peer connects (:class:`Hello`)
and in every frame's header; a peer with another version is refused with ``bad_version``."""


MAX_STATS_BATCHES = 256
"""Sample batches a :class:`SchedulerStats` reports, at most (a longer list is refused before
its items are read: the one field whose items can be empty containers)."""
MAX_TABLE = 4096
"""Entries of a scripted table seat (:attr:`PolicyRef.table`)."""

MAX_LISTED = 65536
"""Adapters or jobs one listing may name, at most."""


class StopReason(enum.StrEnum):
    """Why a sampled reply ended."""

    STOP = "stop"
    """A stop token was drawn; it is the last sampled token."""
    LENGTH = "length"
    """``max_tokens`` were drawn without a stop token."""


class ParseOutcome(enum.StrEnum):
    """What the game made of a reply."""

    OK = "ok"
    """The reply named a legal action."""
    INVALID = "invalid"
    """No legal action could be read; the game applied its defined outcome (e.g. forfeit)."""
    TOOL_CALL = "tool_call"
    """The reply called tools (``games.tool_use``), all validly; their result is the seat's next
    observation."""
    INVALID_TOOL_CALL = "invalid_tool_call"
    """The reply called tools and at least one call was invalid (malformed, unknown tool, bad
    arguments, failed, timed out); the error is the seat's next observation."""


class PolicyKind(enum.StrEnum):
    ADAPTER = "adapter"
    """A LoRA adapter on the scheduler's base model."""
    BASE = "base"
    """The base model with no adapter."""
    SCRIPTED = "scripted"
    """A scripted policy of ``games`` (``random``, ...), played inside the env runner."""


class PolicyRef(msgspec.Struct, frozen=True, kw_only=True):
    """Who plays a seat: an adapter (at a version, once known), the base model, or a script."""

    kind: PolicyKind
    name: str = ""
    """Adapter name or scripted policy name; empty for the base model."""
    version: int = -1
    """Adapter version that produced a sample; -1 where not applicable or not yet known."""
    table: Annotated[tuple[tuple[str, str], ...], msgspec.Meta(max_length=MAX_TABLE)] = ()
    """A scripted ``table`` seat's moves: ``(infostate, move)`` pairs (a computed best
    response); empty otherwise."""

    def label(self) -> str:
        """Short human-readable name, e.g. ``adapter:main@3``, ``base``, ``scripted:random``."""
        if self.kind is PolicyKind.BASE:
            return "base"
        suffix = f"@{self.version}" if self.version >= 0 else ""
        return f"{self.kind.value}:{self.name}{suffix}"


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling distribution, completely: the model's ``generation_config`` is ignored.

    Sampler log-probs are ``log_softmax(logits / temperature)`` of the drawn tokens, before
    top-k / top-p truncation (the distribution the importance ratio is taken against).
    """

    temperature: float = 1.0
    """Softmax temperature, > 0."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    max_tokens: int = 16
    """Most tokens drawn per reply, >= 1."""
    stop_token_ids: tuple[int, ...] = ()
    """Drawing any of these ends the reply (the stop token is kept, mask 1)."""
    seed: int = 0
    """Row ``i`` of a request draws from a generator seeded with ``seed + i``."""


# ---------------------------------------------------------------------------------------------
# Scheduler: sampling and log-probs


class SampleRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Generate one reply per prompt with ``adapter`` (``None``: the base model).

    Rows from many requests (and many adapters) are served in one forward pass.
    """

    adapter: str | None
    prompts: list[np.ndarray]
    """One ``int32[T]`` token array per row."""
    params: SamplingParams
    client: str = ""
    """Name of the requesting component, for batch accounting."""
    stream: bool = False
    """Also send :class:`SampleChunk` partials while the rows are drawn (the final
    :class:`SampleResult` carries the whole result either way)."""
    forced: list[np.ndarray] | None = None
    """One ``int32[F]`` reply per row (``1 <= F <= max_tokens``), given instead of drawn: the
    row takes these tokens in turn, each with its log-prob under ``params``' distribution, and
    ends after them (``STOP`` if the last is a stop token, else ``LENGTH``). A reply scored
    where its prompt is computed: the engine reuses the prompt's cached prefix and caches the
    reply for the next turn (an exploring move; ``LogprobsRequest`` scores whole sequences)."""


class SampleChunk(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A partial result of a running ``SampleRequest(stream=True)``: the tokens some of its
    rows drew since their previous chunk. Sent with the request's id, any number of times,
    all before its final reply; a chunk may be dropped when the client does not keep up,
    which ``seq`` shows as a gap (the final reply still has every token)."""

    rows: list[int]
    """Row indices within the request (its ``prompts``) that drew tokens."""
    tokens: list[np.ndarray]
    """Per listed row, the ``int32[t]`` ids it drew since its previous chunk."""
    logprobs: list[np.ndarray]
    """Per listed row, ``float32[t]`` sampler log-probs of those ids."""
    seq: int
    """Chunk number of this request, from 0: consecutive unless chunks were dropped."""


class SampleResult(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    tokens: list[np.ndarray]
    """Per row, the sampled ``int32[T_i]`` ids exactly as drawn (stop token included)."""
    logprobs: list[np.ndarray]
    """Per row, ``float32[T_i]`` sampler log-probs of those ids."""
    stop_reasons: list[StopReason]
    adapter_version: int
    """Version of the adapter that sampled (-1 for the base model)."""
    batch_id: int
    """Id of the forward batch that served these rows (rows of one batch share it)."""


class LogprobsRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Teacher-forced log-probs of every token after the first, with ``adapter`` (or base)."""

    adapter: str | None
    sequences: list[np.ndarray]
    """``int32[T_i]`` token arrays."""
    temperature: float = 1.0
    """Score ``softmax(logits / temperature)``: the policy as it samples at that temperature."""
    tail: int = 0
    """Score only the last ``tail`` tokens of each sequence (all but its first when shorter);
    the other entries are 0. 0: every token. The vocabulary projection then runs only where
    asked: scoring a reply after a long prompt costs the prompt's forward pass alone."""


class LogprobsResult(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    logprobs: list[np.ndarray]
    """Per sequence, ``float32[T_i]``; entry 0 is 0 (nothing predicts the first token)."""
    adapter_version: int


class ValuesRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The critic's values along each sequence, from ``adapter``'s value head (an adapter
    created with ``LoraSpec.value_head``; anything else is an ``invalid`` error).

    Aligned as log-probs are: entry ``t`` is the value of the state before token ``t``, i.e.
    the value head on the final hidden state at position ``t - 1``, which has read tokens
    ``< t`` (with the adapter on). A turn's value is the entry at its first sampled token.
    """

    adapter: str
    sequences: list[np.ndarray]
    """``int32[T_i]`` token arrays."""


class ValuesResult(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    values: list[np.ndarray]
    """Per sequence, ``float32[T_i]``; entry 0 is 0 (no state precedes the first token)."""
    adapter_version: int


# ---------------------------------------------------------------------------------------------
# Scheduler: training and adapters


MOVE_INPUTS = ("move_tokens", "move_weights")
"""The :class:`Datum` loss inputs of shape ``[T, M]`` (the ``move_values`` term's); every other
is ``[T]``."""


class Datum(msgspec.Struct, frozen=True, kw_only=True):
    """One training sequence: tokens and named per-token loss inputs.

    Every array in ``loss_inputs`` has the length of ``tokens`` (``[T]``, or ``[T, M]`` for
    ``move_tokens`` and ``move_weights``, the same ``M`` in every datum of a call); entry ``t``
    refers to token ``t`` as predicted from tokens ``< t``. ``mask`` (1 on sampled tokens, 0 on
    observation tokens; entry 0 is always 0) is required; the loss names the others it needs
    (e.g. ``advantages``, ``sampler_logprobs``). The value loss reads ``value_mask`` (1 where
    the critic is trained, e.g. each turn's first sampled token), ``value_targets`` and
    ``old_values`` at those positions, aligned as :class:`ValuesResult`'s values. The
    ``move_values`` term reads ``move_tokens`` (token ids, -1 for none) and ``move_weights``:
    at a decision position each legal move's first token and its weight (summing to 0), after
    it the rest of the sampled move's canonical reply, one token a position, weight 1.
    """

    tokens: np.ndarray
    loss_inputs: dict[str, np.ndarray]


def token_order(tokens: np.ndarray) -> bytes:
    """A sort key that orders token sequences lexicographically, token by token (a prefix
    before its continuations): in that order each sequence shares with its predecessor the
    longest prefix it shares with any sequence before it."""
    return np.asarray(tokens, np.int64).astype(">u8").tobytes()


def datum_order(datums: list[Datum] | tuple[Datum, ...]) -> list[Datum]:
    """The order a scheduler computes a ``ForwardBackward``'s datums in: token order
    (:func:`token_order`), so that the parts it cuts hold the most shared prefixes; the loss is
    a sum over datums, so the order changes nothing else. Datums with preference pairs
    (``pair_id``) keep the order they came in. A sender that splits a request sorts it so
    first: each slice then holds the datums the whole request's parts would (bit-identical
    results for slices of whole engine batches)."""
    if any("pair_id" in d.loss_inputs for d in datums):
        return list(datums)
    return sorted(datums, key=lambda d: token_order(d.tokens))


class LoraSpec(msgspec.Struct, frozen=True, kw_only=True):
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    seed: int = 0
    """Seed of the adapter's initialisation."""
    value_head: bool = False
    """Give the adapter a critic: a linear value head on the final hidden state (a shared
    actor-critic trunk), trained, saved, snapshotted and dropped with the adapter; read with
    :class:`ValuesRequest`, trained with the ``value`` loss."""
    full: bool = False
    """A full-parameter policy instead of a LoRA adapter: a private copy of every base weight
    on the same scheduler, trained with AdamW on all of them and saved as safetensors (rank,
    alpha, dropout and target_modules are ignored). Needs the engine's own forward."""


class AdamParams(msgspec.Struct, frozen=True, kw_only=True):
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 0.0
    """Clip the global gradient norm to this; 0 disables."""


class CreateAdapter(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    name: str
    spec: LoraSpec


class AdapterInfo(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    name: str
    version: int


class ForwardBackward(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Accumulate gradients of ``sum(loss) / normalizer`` on ``adapter``.

    The loss is a plain sum over datums and tokens; ``normalizer`` is passed in (e.g. the
    global count of loss tokens of the whole step), never inferred from this micro-batch, so
    splitting a batch into several requests gives the same gradient.
    """

    adapter: str
    datums: list[Datum]
    loss: str
    """Name in ``learners.LOSSES``."""
    loss_config: dict[str, float] = {}
    """The loss's settings (e.g. ``clip_low``, ``value_clip``); a key naming a penalty loss
    (``kl_k1``, ``kl_k2``, ``kl_k3``, ``entropy``) or ``value`` (the critic's loss, for an
    adapter with a value head) adds that term with this coefficient; ``temperature`` (default
    1) scores tokens under ``softmax(logits / temperature)``, the sampler's distribution."""
    normalizer: float = 1.0
    value_normalizer: float = 0.0
    """Divides the value term (0: ``normalizer``); e.g. the step's number of value positions,
    so the value loss is a mean over turns whatever the length of the replies."""


class ForwardBackwardResult(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    loss: float
    metrics: dict[str, float]


class OptimStep(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Apply AdamW to the accumulated gradients, zero them, and bump the adapter version."""

    adapter: str
    params: AdamParams


class OptimStepResult(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    version: int
    grad_norm: float


class DiscardGradients(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Zero the gradients ``adapter`` accumulated since its last :class:`OptimStep` (what a
    learner that died between its ``ForwardBackward`` and its ``OptimStep`` left), so the step
    can be made again from the same weights; replied with :class:`AdapterInfo` (the adapter's
    version, unchanged). Learners send it before every update."""

    adapter: str


class DropAdapter(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Free an adapter (weights and optimizer state); replied with :class:`AdapterInfo`
    (``version`` -1). Unknown names are a ``not_found`` error."""

    name: str


class SnapshotAdapter(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Freeze a copy of ``adapter`` at its current version under ``name`` (for leagues and
    evaluation); the copy samples and scores but never trains. Replied with :class:`AdapterInfo`."""

    adapter: str
    name: str


class SaveAdapter(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Write the adapter in PEFT format (``adapter_config.json`` + safetensors), with its
    optimizer state and version, to ``path`` (atomically). Replied with :class:`Saved`."""

    adapter: str
    path: str


class LoadAdapter(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Load an adapter written by :class:`SaveAdapter` from ``path`` as ``name`` (its
    optimizer state and version too); replied with :class:`AdapterInfo`."""

    path: str
    name: str
    trainable: bool = True
    fresh: bool = False
    """Weights only (a warm start): a fresh optimizer state and version 0."""


class Saved(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    path: str
    version: int


class SchedulerStats(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Ask for (empty) or report the scheduler's counters. The counters include the scheduler
    process's resident memory, ``mem/rss_bytes``, and its peak, ``mem/peak_rss_bytes``, since
    it started or since the last request with ``reset_peak`` (where the OS reports them)."""

    counters: dict[str, int] = {}
    batches: Annotated[list[list[str]], msgspec.Meta(max_length=MAX_STATS_BATCHES)] = []
    """For the most recent sample batches (at most 256), the client names of their rows."""
    reset_peak: bool = False
    """In a request: after reading the counters, start the peak-memory mark again (a job's
    training step measures its own peak); honoured for the scheduler's own user only (on a
    shared scheduler one job must not move another's mark)."""


class ListAdapters(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Ask which adapters the asking peer can use by name: its job's own on a shared
    scheduler (named without the job's prefix), every adapter for the scheduler's own user.
    Replied with :class:`AdapterList`."""


class AdapterList(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    adapters: Annotated[list[AdapterInfo], msgspec.Meta(max_length=MAX_LISTED)] = []
    """Sorted by name; ``version`` is each adapter's current version."""


# ---------------------------------------------------------------------------------------------
# Jobs on a shared scheduler (``opentinker serve``); from the scheduler's own user only


class OpenJob(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Register a job with a shared scheduler. The reply's credentials make the job a tenant:
    its components' adapter names are its own (another job's adapter is reachable only by its
    full name ``<job>/<adapter>``, for sampling and scoring, never for training or dropping),
    and its adapter paths must lie in ``roots`` (``read_roots``: read only). Replied with
    :class:`JobOpened`."""

    name: str
    """The job's name (letters, digits, ``_ . + -``); the job id is made from it."""
    roots: Annotated[list[str], msgspec.Meta(max_length=16)] = []
    read_roots: Annotated[list[str], msgspec.Meta(max_length=16)] = []
    priority: float = 1.0
    """The job's weight in the scheduler's sharing of compute time between jobs, > 0."""
    probe: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    """A file the job wrote in one of its ``roots``, holding ``probe_text``: the scheduler reads
    it to be sure it sees the job's folders as the job does (a job on another machine needs its
    ``out_dir`` on a file system both share at the same path); ``""``: not checked."""
    probe_text: Annotated[str, msgspec.Meta(max_length=64)] = ""


class JobOpened(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    job: str
    """The job id: the bus user name of its components and the prefix of its adapters."""
    secret: str
    """The bus secret its components present (PLAIN, with ``job`` as the user name)."""
    curve_public: str = ""
    curve_secret: str = ""
    """On a scheduler on CURVE (reachable from other machines): the key pair its components
    present instead (Z85 text), which the scheduler takes as ``job``; ``""`` on PLAIN."""


class CloseJob(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """End a job on a shared scheduler: its adapters are dropped, its credentials refused from
    now on, its requests in flight cancelled. Replied with :class:`JobInfo`."""

    job: str


class ListJobs(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Ask for the jobs a shared scheduler serves; replied with :class:`JobList`."""


class JobInfo(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    job: str
    name: str
    priority: float
    state: str
    """``running`` or ``closed``."""
    adapters: Annotated[list[str], msgspec.Meta(max_length=MAX_LISTED)] = []
    compute_ms: int = 0
    """Compute time the scheduler spent on the job's requests so far."""
    contended_ms: int = 0
    """Of it, the time spent while another job also had work waiting or running: where the
    jobs' priorities set their shares when both ask for more than they get (a job that asks
    for less than its share gets all it asks for)."""
    opened_at: float = 0.0
    """Unix time the job was opened."""


class JobList(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    jobs: Annotated[list[JobInfo], msgspec.Meta(max_length=MAX_LISTED)] = []


class EvalJob(msgspec.Struct, frozen=True, kw_only=True):
    """An evaluation to queue (``opentinker jobs submit --eval PATH``): ``opentinker eval`` of
    saved adapters on the service's scheduler, its report written as JSON."""

    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    """A run folder or a saved adapter folder, on the service's machine (absolute)."""
    vs: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    """Opponents, comma-separated (``opentinker eval --vs``); ``""``: random and the scripted seats."""
    games_per_stratum: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    """0: ``opentinker eval``'s default."""
    game: Annotated[str, msgspec.Meta(max_length=256)] = ""
    """Required for an adapter folder; ``""``: the run's."""


class InferJob(msgspec.Struct, frozen=True, kw_only=True):
    """Batch inference to queue (``opentinker jobs submit --infer PROMPTS``): ``opentinker
    infer`` on the service's scheduler and its model, the replies written as JSON Lines."""

    prompts: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    """A JSON Lines file of prompts, on the service's machine (absolute)."""
    adapter: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    """A saved adapter folder or a run folder of one policy (absolute); ``""``: the base model."""
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 128
    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] = 1.0
    """0: greedy."""
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    seed: Annotated[int, msgspec.Meta(ge=0, lt=2**31)] = 0
    batch: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 32
    """Prompts per request (the rows the job holds KV blocks for at once)."""


class SubmitJob(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Queue a job on a service (``opentinker jobs submit``): it runs when the service's memory
    budget has room, as a tenant of its scheduler. Exactly one of ``config`` (a run: RL, SFT,
    DPO), ``eval`` (an evaluation) and ``infer`` (batch inference). Replied with
    :class:`QueueEntry`."""

    config: Annotated[str, msgspec.Meta(max_length=1 << 20)] = ""
    """The resolved job config as TOML (paths absolute; a relative ``out_dir`` lies in the
    service's runs folder)."""
    eval: EvalJob | None = None
    infer: InferJob | None = None
    priority: float = 1.0
    memory_mb: float = 0.0
    """What the job holds, MB: 0 or 1 to 2**24; the service charges at least its own estimate
    (the job's processes and its share of the scheduler), so this may raise it, never lower it."""


class ListQueue(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Ask for a service's queued, running and ended jobs; replied with :class:`QueueList`."""


class CancelQueued(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Cancel a submitted job: a queued one never starts, a running one is stopped and closed
    (its adapters freed). Replied with :class:`QueueEntry`."""

    id: str


class QueueEntry(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    id: str
    name: str
    state: str
    """``queued``, ``running``, ``cancelling``, ``done``, ``failed`` or ``cancelled``."""
    priority: float
    memory_mb: float
    """What the queue holds room for (estimated or submitted)."""
    job: str = ""
    """Its tenant id on the scheduler once it runs."""
    submitted_at: float = 0.0
    started_at: float = 0.0
    ended_at: float = 0.0
    returncode: int = -1
    """Its process's exit status once ended (-1: none)."""
    log: str = ""
    """Its process's output (on the service's machine)."""
    kind: str = "run"
    """``run``, ``eval`` or ``infer``."""
    output: str = ""
    """What it writes (on the service's machine): a run's folder, an evaluation's JSON report,
    an inference's replies (JSON Lines)."""


class QueueList(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    entries: Annotated[list[QueueEntry], msgspec.Meta(max_length=MAX_LISTED)] = []
    budget_mb: float = 0.0
    """The service's memory budget for jobs (0: none)."""
    used_mb: float = 0.0


# ---------------------------------------------------------------------------------------------
# Episodes and trajectories


class EpisodeSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One episode to play: set by the coordinator from the root seed."""

    episode_id: int
    group_id: int
    """Episodes of one group share a start (e.g. the same deal and seat assignment)."""
    game: str
    game_kwargs: dict[str, int | float | str | bool] = {}
    seed: int
    """Seeds the game's ``reset`` and, with the turn index, every sample of the episode."""
    seats: dict[str, PolicyRef]
    """Agent name -> who plays it."""
    seat_groups: dict[str, int] = {}
    """Agent name -> group id of that seat's trajectory (advantages are relative within it);
    e.g. in self-play each seat of a deal forms its own group. Defaults to ``group_id``."""
    train: bool = True
    """Whether trajectories go to the learners (False: evaluation)."""


class RunEpisodes(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Play these episodes and reply with :class:`EpisodesDone` when all have ended."""

    episodes: list[EpisodeSpec]
    sampling: SamplingParams
    """Sampling settings of every LLM seat; each sample's seed is derived from the episode's."""
    system_prompt: str
    """The system message of every LLM seat's conversation."""
    step: int = 0
    learners: dict[str, str] = {}
    """Trainable policy name -> endpoint of its learner's PULL socket."""
    progress: str = ""
    """Endpoint of a PULL socket (the driver's) to which the runner pushes :class:`Metrics`
    (``episodes_done``, ``episodes``, ``train``) as its episodes end; empty: none. Best
    effort: a full queue drops them rather than hold up an episode."""
    explore: float = 0.0
    """Probability that a training decision of a learner's seat replies with one of the
    observation's legal moves, drawn uniformly, instead of a sample (scored by the policy:
    its ``sampler_logprobs`` are the policy's teacher-forced log-probs of that reply)."""
    group_draws: bool = False
    """Scripted seats of the episodes of one group draw from one random stream (seeded by the
    group, not the episode): given the same moves they answer the same (common random
    numbers). False: each episode its own stream."""
    batch: int = 0
    """The batch these episodes belong to (a coordinator's id for one training step's or
    evaluation's episodes), which may reach a runner as several requests (slices, waves): its
    progress counts the whole batch. 0: this request alone."""
    batch_episodes: int = 0
    """This runner's episodes in the whole ``batch`` (the ``episodes`` progress reports);
    0: this request's own."""


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One decision of one seat, token-in/token-out.

    ``obs_tokens`` extend the seat's running sequence up to the reply (mask 0: the rendered
    observation, the chat template's tokens, and whatever the template adds after the previous
    reply); ``sampled_tokens`` are the reply exactly as drawn (mask 1).
    """

    obs_tokens: np.ndarray
    """``int32[O]``."""
    sampled_tokens: np.ndarray
    """``int32[S]``."""
    sampler_logprobs: np.ndarray
    """``float32[S]``."""
    policy: PolicyRef
    """With the adapter version that sampled."""
    stop_reason: StopReason
    parse: ParseOutcome
    reward: float = 0.0
    """Reward the seat received from this decision until its next one (including rewards
    paid on other seats' moves, e.g. at a showdown); the turns' rewards sum to
    ``Trajectory.total_reward``."""
    game_value: float | None = None
    """The game's exact value of this decision's state to the seat, against the episode's
    scripted opponent played well from there on (``GameEval.state_values``); None where the
    game does not value it. The critic of the ``exact_gae`` advantage."""
    move_tokens: np.ndarray | None = None
    """``int32[M, L]``: each legal move's canonical reply at this decision as the policy would
    sample it (its tokens and the stop token, -1 after), where the game values every legal
    move here as it does the state (``StateValues.moves``) and no two replies start with the
    same token; None otherwise."""
    move_values: np.ndarray | None = None
    """``float32[M]``: the game's exact value of each of those moves to the seat (the targets
    of ``train.move_values``); None with ``move_tokens``."""
    move_values_by: dict[str, np.ndarray] = {}
    """``{opponent: float32[M]}``: the same moves' values against each scripted opponent the
    game values moves against (the episode's own among them; the targets of
    ``train.move_values_against``); empty with ``move_tokens`` None."""


class Trajectory(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Everything one LLM seat did in one episode; sent to the learner of its policy."""

    episode_id: int
    group_id: int
    seat: str
    seed: int
    policy: str
    """Trainable policy name (the learner this trajectory goes to)."""
    turns: list[Turn]
    total_reward: float
    """Sum of the seat's rewards over the episode."""
    step: int = 0
    """Training step the episode was played for."""
    seq: int = 0
    """Sender's sequence number, for acknowledgement and de-duplication."""


class EpisodeSummary(msgspec.Struct, frozen=True, kw_only=True):
    episode_id: int
    group_id: int
    seed: int
    rewards: dict[str, float]
    """Agent -> total reward."""
    invalid: dict[str, int]
    """Agent -> count of invalid replies."""
    turns: dict[str, int]
    """Agent -> number of decisions."""
    transcript: list[str] = []
    """Readable lines of the episode: what each LLM seat saw (its observation, indented), each
    reply (``"agent [policy]: 'text'"``, marked when invalid), and the outcome."""
    tool_calls: dict[str, int] = {}
    """Agent -> tool calls made (a game with tools, ``games.tool_use``; invalid ones included)."""
    invalid_tool_calls: dict[str, int] = {}
    """Agent -> invalid tool calls."""


class EpisodesDone(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    summaries: list[EpisodeSummary]
    trajectories_sent: int


class LearnerStep(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Train on the trajectories of ``step`` once ``expected`` of them have arrived."""

    step: int
    expected: int
    timeout_s: float = 600.0
    datums: list[Datum] = []
    """Datums the coordinator made (the exact all-actions term), trained on beside the
    trajectories' datums."""
    datums_only: bool = False
    """Train on ``datums`` alone (the trajectories still arrive and are recorded)."""


class LearnerStepResult(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    step: int
    version: int
    metrics: dict[str, float]


class TrajectoryAck(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Ask a learner which of ``step``'s trajectories it holds: it answers
    :class:`TrajectoriesHeld` once ``expected`` have arrived or ``wait_s`` has passed."""

    step: int
    expected: int
    wait_s: float = 10.0


class TrajectoriesHeld(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    step: int
    held: list[tuple[int, str]]
    """``(episode_id, seat)`` of every trajectory of the step the learner holds."""
    duplicates: int = 0
    """Copies that arrived again (re-sent) and were dropped, over the learner's life so far."""


class ResendTrajectories(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Ask an env runner to push these trajectories of ``step`` again (a runner keeps a
    training step's trajectories until a later training step starts)."""

    step: int
    keys: list[tuple[int, str]]
    """``(episode_id, seat)`` of each trajectory to push again."""


class Resent(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    step: int
    count: int
    missing: list[tuple[int, str]] = []
    """Keys the runner no longer (or never) held."""


class Metrics(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A component's metrics at a step, streamed one way (PUSH) to whoever draws progress."""

    source: str
    """Component name, e.g. ``learner-main``."""
    step: int
    values: dict[str, float]
    time: float = 0.0
    """Sender's wall-clock time (``time.time()``), for plots; not used for ordering."""


# ---------------------------------------------------------------------------------------------
# Session: handshake, liveness, cancellation, shutdown


class Hello(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A client's first request on a connection; the server answers :class:`Welcome`, or an
    ``Error`` with code ``bad_version``. Until then every other request gets ``no_handshake``."""

    version: int
    """The client's ``PROTOCOL_VERSION`` (also in the frame header)."""
    peer: str = ""
    """Client name, for logs and counters."""


class Welcome(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    version: int
    peer: str = ""
    """Server name."""
    heartbeat_s: float = 0.0
    """The server's heartbeat interval: a client silent for 3 of them is dropped."""


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Liveness, either way: the server answers each one with a ``Heartbeat``. A peer from which
    nothing arrived for 3 heartbeat intervals is lost (``peer_lost``)."""

    seq: int = 0


class Cancel(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Cancel this client's request ``request_id``: replied with :class:`Ack` when it was
    cancelled, ``not_found`` when it was not in flight. A state-changing request that has
    already started runs to completion (and its reply is kept for retries)."""

    request_id: int


class Shutdown(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Ask the server to stop after replying :class:`Ack`."""

    reason: str = ""


# ---------------------------------------------------------------------------------------------
# Generic replies


class Ack(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    pass


class ErrorCode(enum.StrEnum):
    BAD_FRAME = "bad_frame"
    BAD_VERSION = "bad_version"
    BAD_MESSAGE = "bad_message"
    UNKNOWN_TYPE = "unknown_type"
    TOO_LARGE = "too_large"
    NOT_FOUND = "not_found"
    INVALID = "invalid"
    INTERNAL = "internal"
    TIMEOUT = "timeout"
    NO_HANDSHAKE = "no_handshake"
    """A request from a peer that has not said :class:`Hello` (or was dropped as lost)."""
    BUSY = "busy"
    """The server's bounded queue of requests is full; retry later."""
    CANCELLED = "cancelled"
    PEER_LOST = "peer_lost"


class Error(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Reply to a request that could not be served; the server keeps serving."""

    code: ErrorCode
    message: str


Message = Union[
    SampleRequest,
    SampleChunk,
    SampleResult,
    LogprobsRequest,
    LogprobsResult,
    ValuesRequest,
    ValuesResult,
    CreateAdapter,
    AdapterInfo,
    ForwardBackward,
    ForwardBackwardResult,
    OptimStep,
    OptimStepResult,
    DiscardGradients,
    DropAdapter,
    SnapshotAdapter,
    SaveAdapter,
    LoadAdapter,
    Saved,
    SchedulerStats,
    ListAdapters,
    AdapterList,
    OpenJob,
    JobOpened,
    CloseJob,
    ListJobs,
    JobInfo,
    JobList,
    SubmitJob,
    ListQueue,
    CancelQueued,
    QueueEntry,
    QueueList,
    Metrics,
    Hello,
    Welcome,
    Heartbeat,
    Cancel,
    Shutdown,
    RunEpisodes,
    EpisodesDone,
    Trajectory,
    LearnerStep,
    LearnerStepResult,
    TrajectoryAck,
    TrajectoriesHeld,
    ResendTrajectories,
    Resent,
    Ack,
    Error,
]
"""Every message that may stand as a body on the bus."""

STATE_CHANGING: tuple[type, ...] = (
    CreateAdapter, DropAdapter, SnapshotAdapter, LoadAdapter, ForwardBackward, OptimStep, DiscardGradients,
)
"""Requests whose replies are remembered by request id, so a retry is never applied twice."""

PARTIALS: tuple[type, ...] = (SampleChunk,)
"""Partial results: a message of these types carries the request id of a request still
running and is never its final reply; any other message with that id is the final one."""
