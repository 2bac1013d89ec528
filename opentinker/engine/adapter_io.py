"""Files of a saved adapter: what :meth:`ModelHost.save` writes and :meth:`ModelHost.load` reads.

A saved adapter is a folder (:func:`save` writes it, :func:`load` reads it into a registry)::

    adapter_config.json        PEFT format: ``peft.PeftModel.from_pretrained`` loads these two
    adapter_model.safetensors
    value_head.safetensors     only with ``LoraSpec.value_head``: ``value_head.weight``, ``.bias``
    optimizer.safetensors      AdamW state: ``<param>.exp_avg``, ``<param>.exp_avg_sq``, ``<param>.step``
    opentinker.json            :class:`AdapterMeta`: version, LoRA spec, base model and its fingerprint

Parameter names are PEFT's saved names (the adapter's name removed), so a folder loads under
any name. The folder is written beside its final place and renamed into it, so a reader never
sees half a checkpoint. Nothing is pickled: tensors are safetensors, the rest JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from opentinker.engine import anchored, value_head
from opentinker.engine.anchored import Anchored
from opentinker.engine.spec_checks import check_spec
from protocols.messages import LoraSpec

if TYPE_CHECKING:
    from opentinker.engine.registry import AdapterRegistry

FORMAT = 1
META = "opentinker.json"
WEIGHTS = "adapter_model.safetensors"
FULL_WEIGHTS = "model.safetensors"
"""A full-parameter policy's weights (with ``config.json``: a checkpoint transformers loads)."""
OPTIMIZER = "optimizer.safetensors"
_MOMENTS = ("exp_avg", "exp_avg_sq", "step")


class AdapterMeta(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``opentinker.json``: what the PEFT files do not say."""

    format: int
    """Layout version of the folder (:data:`FORMAT`)."""
    version: int
    """The adapter's version (number of optimizer steps) when saved."""
    spec: LoraSpec
    base_model: str
    """The base model as the saving host named it (a path or hub id), for people."""
    base_fingerprint: str
    """:func:`fingerprint` of the base weights: loading onto other weights is refused."""


def fingerprint(model: torch.nn.Module) -> str:
    """A short hash of a model's weights: every tensor's name and shape and ~1k evenly spaced
    values of it. Two different checkpoints of one architecture differ in it with overwhelming
    probability; it costs milliseconds, not a pass over all the weights."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            stride = max(1, flat.numel() // 1024)
            digest.update(f"{name}{tuple(tensor.shape)}".encode())
            digest.update(flat[::stride].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def portable_name(param_name: str, adapter: str) -> str:
    """``...q_proj.lora_A.<adapter>.weight`` -> ``...q_proj.lora_A.weight`` (PEFT's saved key)."""
    return param_name.replace(f".{adapter}.", ".")


def optimizer_tensors(
    optimizer: torch.optim.Optimizer | None, named: Mapping[str, torch.nn.Parameter]
) -> dict[str, torch.Tensor]:
    """AdamW state of each named parameter that has one, as CPU tensors keyed
    ``<name>.exp_avg`` / ``.exp_avg_sq`` / ``.step`` (``step`` as a 1-element tensor)."""
    out: dict[str, torch.Tensor] = {}
    if optimizer is None:
        return out
    for name, param in named.items():
        state = optimizer.state.get(param)
        if not state:
            continue
        for key in _MOMENTS:
            value = torch.as_tensor(state[key]).detach().to("cpu", torch.float32)
            out[f"{name}.{key}"] = value.reshape(1) if key == "step" else value.contiguous()
    return out


def restore_optimizer(
    optimizer: torch.optim.Optimizer, named: Mapping[str, torch.nn.Parameter],
    tensors: Mapping[str, torch.Tensor], where: str,
) -> None:
    """Inverse of :func:`optimizer_tensors`; ``ValueError`` naming ``where`` on a missing or
    misshapen entry. Parameters with no entry start with fresh moments (none were saved)."""
    for name, param in named.items():
        present = [f"{name}.{key}" in tensors for key in _MOMENTS]
        if not any(present):
            continue
        if not all(present):
            raise ValueError(f"{where}: optimizer state of {name} is incomplete")
        moments = {k: tensors[f"{name}.{k}"] for k in ("exp_avg", "exp_avg_sq")}
        for key, value in moments.items():
            if value.shape != param.shape:
                raise ValueError(f"{where}: {name}.{key} has shape {tuple(value.shape)}, the "
                                 f"parameter {tuple(param.shape)}")
        optimizer.state[param] = {
            # AdamW keeps ``step`` as a float32 CPU scalar (not capturable, not fused).
            "step": tensors[f"{name}.step"].reshape(()).to(torch.float32).clone(),
            **{k: v.to(param.device, param.dtype).clone() for k, v in moments.items()},
        }


def write_folder(final: Path, fill: Callable[[Path], None]) -> None:
    """Write a folder with ``fill(tmp)`` beside ``final``, then rename it into place.

    An existing ``final`` is renamed aside first and deleted after, so at every moment
    ``final`` is either the old folder or the complete new one (or, for an instant, absent).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=final.name + ".tmp"))
    old = None
    try:
        fill(tmp)
        if final.exists():
            old = Path(tempfile.mkdtemp(dir=final.parent, prefix=final.name + ".old"))
            os.replace(final, old / "x")
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


class Folder:
    """The files of a saved adapter's folder, read by name: through its path, or (an
    :class:`~opentinker.engine.anchored.Anchored` folder of a scheduler with roots) opened
    from its descriptor without following a link, so a file that is a link is refused."""

    def __init__(self, where: Path, fd: int | None = None) -> None:
        self.where, self.fd = where, fd

    @classmethod
    @contextlib.contextmanager
    def open(cls, where: str | Path | Anchored) -> Iterator[Folder]:
        """The folder ``where``; ``ValueError`` when it is not one (or, anchored, is reached
        through a link)."""
        if not isinstance(where, Anchored):
            if not Path(where).is_dir():
                raise ValueError(f"{where}: no such adapter folder")
            yield cls(Path(where))
            return
        with anchored.open_folder(where) as fd:
            yield cls(Path(str(where)), fd)

    def read_bytes(self, name: str) -> bytes:
        """A file's bytes; ``ValueError`` naming it when it is missing (or, anchored, a link)."""
        if self.fd is not None:
            return anchored.read_file(self.fd, name, str(self.where / name))
        if not (self.where / name).is_file():
            raise ValueError(f"{self.where}: missing {name}")
        return (self.where / name).read_bytes()

    def exists(self, name: str) -> bool:
        if self.fd is None:
            return (self.where / name).is_file()
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """A safetensors file, on CPU; ``ValueError`` naming it when it is missing, unreadable
        or (anchored) a link."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        file = self.where / name
        if self.fd is None and not file.is_file():
            raise ValueError(f"{self.where}: missing {name}")
        fd = None if self.fd is None else anchored.open_file(self.fd, name, str(file))
        try:
            # /proc/self/fd/N names the file the descriptor holds (mapped, not copied).
            return load_file(str(file) if fd is None else str(anchored.folder_path(fd, str(file))), device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{file} is corrupt: {e}") from None
        finally:
            if fd is not None:
                os.close(fd)


def read_meta(folder: Folder) -> AdapterMeta:
    """``opentinker.json`` of a saved adapter; ``ValueError`` naming the path and the fault."""
    file = folder.where / META
    if folder.fd is None and not folder.exists(META):  # (anchored: read_bytes says missing, or a link)
        raise ValueError(f"{folder.where}: missing {META} (not a folder written by ModelHost.save)")
    try:
        meta = msgspec.json.decode(folder.read_bytes(META), type=AdapterMeta)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"{file} is corrupt: {e}") from None
    if meta.format != FORMAT:
        raise ValueError(f"{file}: format {meta.format}, this version reads format {FORMAT}")
    return meta


def write_meta(folder: Path, meta: AdapterMeta) -> None:
    (folder / META).write_bytes(msgspec.json.format(msgspec.json.encode(meta)))


def save_tensors(folder: Path, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(dict(tensors), str(folder / name))


def peft_model_files(model: torch.nn.Module, adapter: str) -> Callable[[Path], None]:
    """A writer of adapter ``adapter``'s PEFT files from a PEFT ``model`` into a folder."""

    def write(tmp: Path) -> None:
        peft_dir = tmp / "peft"
        model.save_pretrained(str(peft_dir), selected_adapters=[adapter])
        # PEFT writes a non-"default" adapter into a subfolder named after it.
        src = peft_dir / adapter if (peft_dir / adapter / "adapter_config.json").is_file() else peft_dir
        for f in src.iterdir():
            f.rename(tmp / f.name)
        shutil.rmtree(peft_dir)

    return write


def write_adapter(
    final: Path | Anchored, write_peft: Callable[[Path], None], named: Mapping[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer | None, meta: AdapterMeta,
) -> None:
    """Write an adapter to the folder ``final`` atomically (:func:`write_folder`, or for an
    anchored folder :func:`~opentinker.engine.anchored.write_folder_at`): its PEFT files
    (``write_peft(folder)``), value head (if ``named`` holds one), AdamW state of the ``named``
    parameters, and ``meta``."""

    def fill(tmp: Path) -> None:
        write_peft(tmp)
        _, head = value_head.split(dict(named))
        if head:
            save_tensors(tmp, value_head.FILE, {k: p.detach().cpu() for k, p in head.items()})
        save_tensors(tmp, OPTIMIZER, optimizer_tensors(optimizer, named))
        write_meta(tmp, meta)

    if isinstance(final, Anchored):
        anchored.write_folder_at(final, fill, META)
    else:
        write_folder(final, fill)


def read_adapter(folder: Folder, spec: LoraSpec, trainable: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(weights, optimizer moments)`` of a saved adapter (moments only when ``trainable``);
    the weights include the value head when ``spec`` has one. ``ValueError`` naming a missing
    or corrupt file."""
    weights = folder.tensors(FULL_WEIGHTS if spec.full else WEIGHTS)
    if spec.value_head:
        weights.update(folder.tensors(value_head.FILE))
    return weights, (folder.tensors(OPTIMIZER) if trainable else {})


@torch.no_grad()
def restore(
    folder: Path, spec: LoraSpec, named: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer | None,
    weights: Mapping[str, torch.Tensor], moments: Mapping[str, torch.Tensor],
) -> None:
    """Copy :func:`read_adapter`'s tensors into a fresh adapter's ``named`` parameters and
    ``optimizer``; ``ValueError`` naming the file and the parameter that does not fit."""
    for key, p in named.items():
        if key not in weights or weights[key].shape != p.shape:
            got = tuple(weights[key].shape) if key in weights else "missing"
            file = value_head.FILE if key.startswith(value_head.PREFIX) else (FULL_WEIGHTS if spec.full else WEIGHTS)
            raise ValueError(f"{folder / file}: {key} is {got}, the spec {spec} needs {tuple(p.shape)}")
        p.copy_(weights[key])
    if optimizer is not None:
        restore_optimizer(optimizer, named, moments, str(folder / OPTIMIZER))


def save(registry: AdapterRegistry, adapter: str, path: str | Anchored) -> int:
    """Write ``adapter`` to the folder ``path`` atomically (temporary folder, then rename):
    PEFT format, its value head if it has one, its AdamW state, its version and the base
    model's name and fingerprint. Returns its version. An anchored ``path`` is written without
    following a link (:mod:`opentinker.engine.anchored`)."""
    state = registry.get(adapter)
    meta = AdapterMeta(
        format=FORMAT, version=state.version, spec=state.spec,
        base_model=registry.model_path, base_fingerprint=registry.base_fingerprint,
    )
    if hasattr(registry, "write_peft_files"):
        def write_peft(tmp: Path) -> None:
            registry.write_peft_files(adapter, tmp)
    else:
        write_peft = peft_model_files(registry.model, adapter)
    write_adapter(path if isinstance(path, Anchored) else Path(path), write_peft, state.named, state.optimizer, meta)
    return state.version


@torch.no_grad()
def load(registry: AdapterRegistry, path: str | Anchored, name: str, trainable: bool = True,
         fresh: bool = False) -> int:
    """Load a folder written by :func:`save` as adapter ``name``: weights (and value head),
    AdamW state (for a trainable adapter) and version (returned); ``fresh``: the weights only,
    with a fresh AdamW state and version 0 (a warm start of a new job).

    Raises:
        ValueError: naming ``path`` and the fault: no such folder, a missing or corrupt
            file, a base model other than the registry's, weights that do not fit the spec; for
            an anchored ``path``, a folder or file reached through a link.
            Nothing is left behind: the registry keeps serving as before.
    """
    with Folder.open(path) as files:
        return _load(registry, files, name, trainable, fresh)


def _load(registry: AdapterRegistry, files: Folder, name: str, trainable: bool, fresh: bool) -> int:
    folder = files.where
    meta = read_meta(files)
    if meta.base_fingerprint != registry.base_fingerprint:
        raise ValueError(
            f"{folder}: saved on base model {meta.base_model!r} (fingerprint "
            f"{meta.base_fingerprint}); this host serves {registry.model_path!r} "
            f"(fingerprint {registry.base_fingerprint})"
        )
    try:
        check_spec(meta.spec, registry.hidden_size)  # before anything is allocated
    except ValueError as e:
        raise ValueError(f"{folder / META}: {e}") from None
    weights, moments = read_adapter(files, meta.spec, trainable and not fresh)
    state = registry.add(name, meta.spec, trainable=trainable)
    try:
        restore(folder, meta.spec, state.named, state.optimizer, weights, moments)
    except Exception:
        registry.drop_adapter(name)
        raise
    state.version = 0 if fresh else meta.version
    return state.version
