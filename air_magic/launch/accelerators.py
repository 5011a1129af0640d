"""Which accelerators this machine has, and which ones a launch will use.

Detection goes through NVML (``nvidia-ml-py``), which reads the driver's
device list without creating a CUDA context, so the notebook process never
holds GPU memory because of air_magic. ``CUDA_VISIBLE_DEVICES`` is honoured.
Without a usable NVIDIA driver the launch runs in CPU mode: N processes on the
CPU with the gloo backend, so the same notebook works on a laptop and in CI.

Accelerator types use the seed's naming, ``GPU_<count>x<MODEL>``
(``GPU_8xH100``, ``GPU_2xH200``); the legacy values ``A10``/``H100``/``B300``
(and ``a10g``, ``h100_80gb``) are still understood, with a ``FutureWarning``
raised by the settings layer.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from air_magic.errors import AcceleratorError, ConfigurationError
from air_magic.protocol import env_names
from air_magic.protocol.words import Word


class AcceleratorType(Word):
    """The seed's named accelerator types. Any ``GPU_<n>x<MODEL>`` string is accepted too."""

    GPU_1xA10 = "GPU_1xA10"
    GPU_1xH100 = "GPU_1xH100"
    GPU_8xH100 = "GPU_8xH100"
    GPU_8xB300 = "GPU_8xB300"


class GPUType(Word):
    """The seed's older ``gpu_type`` values (``serverless_gpu.GPUType``): a GPU model, no count.

    Still accepted as ``accelerator_type`` (or ``gpu_type``) with a FutureWarning naming the
    ``GPU_<n>x<MODEL>`` type that replaces it.
    """

    A10 = "A10"
    H100 = "H100"
    B300 = "B300"


# Legacy ``gpu_type`` values (serverless_gpu) and the type that replaces each.
LEGACY_TYPES: dict[str, str] = {
    "a10": "GPU_1xA10",
    "a10g": "GPU_1xA10",
    "h100": "GPU_8xH100",
    "h100_80gb": "GPU_8xH100",
    "b300": "GPU_8xB300",
}

# Marketing names NVML reports that belong to one model family for matching.
_MODEL_ALIASES = {"A10G": "A10"}

_TYPE_RE = re.compile(r"^GPU_(\d+)x([A-Za-z0-9]+)$", re.IGNORECASE)


@dataclass(frozen=True)
class AcceleratorSpec:
    """A parsed accelerator type: ``count`` GPUs of ``model`` (``None``: any count)."""

    count: int | None
    model: str
    legacy: bool = False

    @property
    def name(self) -> str:
        return f"GPU_{self.count if self.count is not None else 'N'}x{self.model}"


def parse_accelerator_type(value: str | AcceleratorType) -> AcceleratorSpec:
    """Parse ``GPU_<n>x<MODEL>`` or a legacy value; raise ConfigurationError otherwise."""
    text = str(value).strip()
    legacy = LEGACY_TYPES.get(text.lower())
    if legacy is not None:
        spec = parse_accelerator_type(legacy)
        # A legacy value named a GPU model, not a node size: match the model only.
        return AcceleratorSpec(count=None, model=spec.model, legacy=True)
    match = _TYPE_RE.match(text)
    if not match or int(match.group(1)) < 1:
        raise ConfigurationError(
            f"accelerator_type {value!r} is not understood: use 'GPU_<count>x<MODEL>' "
            f"such as 'GPU_8xH100' or 'GPU_2xH200' (or leave it out to auto-detect)"
        )
    return AcceleratorSpec(count=int(match.group(1)), model=normalize_model(match.group(2)))


def normalize_model(name: str) -> str:
    """Reduce a device name to its model token: 'NVIDIA H100 80GB HBM3' -> 'H100'."""
    words = [w for w in name.replace("-", " ").split() if w.upper() not in {"NVIDIA", "TESLA", "GEFORCE"}]
    token = (words[0] if words else name).upper()
    return _MODEL_ALIASES.get(token, token)


@dataclass(frozen=True)
class GPU:
    """One visible NVIDIA GPU: its NVML (PCI bus order) index, which ranks get in ``CUDA_VISIBLE_DEVICES``."""

    index: int
    uuid: str
    name: str

    @property
    def model(self) -> str:
        return normalize_model(self.name)


def detect_gpus() -> list[GPU]:
    """The GPUs this process may use, in ``CUDA_VISIBLE_DEVICES`` order.

    Uses NVML only; returns ``[]`` when there is no driver. Never touches CUDA.
    """
    if cpu_forced():
        return []
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py is a dependency, but be kind to odd installs
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            gpus.append(
                GPU(
                    index=i,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    name=name.decode() if isinstance(name, bytes) else name,
                )
            )
    finally:
        pynvml.nvmlShutdown()
    return apply_visible_devices(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def apply_visible_devices(gpus: list[GPU], visible: str | None) -> list[GPU]:
    """Filter and order ``gpus`` the way CUDA reads ``CUDA_VISIBLE_DEVICES``.

    Entries are indices or (prefixes of) UUIDs; CUDA stops at the first
    entry it cannot resolve, and so do we.
    """
    if visible is None:
        return gpus
    chosen: list[GPU] = []
    for token in (t.strip() for t in visible.split(",")):
        if not token:
            break
        match: GPU | None = None
        if token.isdigit():
            idx = int(token)
            match = gpus[idx] if idx < len(gpus) else None
        else:
            match = next((g for g in gpus if g.uuid.startswith(token) or g.uuid == "GPU-" + token), None)
        if match is None or match in chosen:
            break
        chosen.append(match)
    return chosen


@dataclass(frozen=True)
class AcceleratorPlan:
    """What a launch will run on: ``world_size`` ranks on ``gpus`` or, when empty, the CPU."""

    world_size: int
    gpus: tuple[GPU, ...]
    detected: str

    @property
    def cpu_mode(self) -> bool:
        return not self.gpus

    @property
    def backend(self) -> str:
        return "gloo" if self.cpu_mode else "nccl"


DEFAULT_CPU_RANKS = 2


def describe(gpus: list[GPU]) -> str:
    """'GPU_2xH200' for a homogeneous set, a list otherwise, 'no NVIDIA GPU (CPU mode)' for none."""
    if not gpus:
        return "no NVIDIA GPU (CPU mode)"
    models = {g.model for g in gpus}
    if len(models) == 1:
        return f"GPU_{len(gpus)}x{models.pop()}"
    return ", ".join(f"{g.index}: {g.name}" for g in gpus)


def plan_accelerators(
    num_accelerators: int | None,
    accelerator: AcceleratorSpec | None,
    gpus: list[GPU] | None = None,
) -> AcceleratorPlan:
    """Decide which devices a launch uses; raise AcceleratorError before anything starts."""
    if gpus is None:
        gpus = detect_gpus()
    detected = describe(gpus)
    visible_note = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible_note})" if visible_note is not None else ""

    if not gpus:
        if accelerator is not None:
            raise AcceleratorError(
                f"accelerator_type {accelerator.name} was asked for, but this machine has "
                f"{detected}{where}. Leave accelerator_type out to run on the CPU."
            )
        count = num_accelerators if num_accelerators is not None else default_cpu_ranks()
        return AcceleratorPlan(world_size=count, gpus=(), detected=detected)

    if accelerator is not None:
        models = {g.model for g in gpus}
        if models != {accelerator.model}:
            raise AcceleratorError(
                f"accelerator_type {accelerator.name} was asked for, but this machine has {detected}{where}."
            )
        if accelerator.count is not None and accelerator.count > len(gpus):
            raise AcceleratorError(
                f"accelerator_type {accelerator.name} needs {accelerator.count} GPUs, but "
                f"{len(gpus)} are visible{where}: {detected}."
            )
    if num_accelerators is not None:
        count = num_accelerators
    elif accelerator is not None and accelerator.count is not None:
        count = accelerator.count
    else:
        count = len(gpus)
    if count > len(gpus):
        listing = ", ".join(f"{g.index}: {g.name}" for g in gpus)
        raise AcceleratorError(
            f"num_accelerators={count} but only {len(gpus)} GPU(s) are visible{where}: {listing}."
        )
    return AcceleratorPlan(world_size=count, gpus=tuple(gpus[:count]), detected=detected)


def cpu_forced() -> bool:
    """CPU ranks even where GPUs are visible (``AIR_MAGIC_FORCE_CPU``, set by ``--nproc-per-node cpu``):
    the one place CPU mode is read from the environment, here and by the Ray placement."""
    return os.environ.get(env_names.FORCE_CPU, "") not in ("", "0")


def default_cpu_ranks() -> int:
    """How many CPU ranks a call without GPUs runs when it does not say (``AIR_MAGIC_CPU_RANKS``)."""
    raw = os.environ.get(env_names.CPU_RANKS)
    if raw is None:
        return DEFAULT_CPU_RANKS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigurationError(f"AIR_MAGIC_CPU_RANKS={raw!r} must be a positive integer")
    return value
