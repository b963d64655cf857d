"""``JobSpec``: one training job's arguments, from a TOML file or Python.

The data owner submits it (``fusionp2p train --config job.toml`` or ``Swarm.train``); the
coordinator receives the part it plans from (``JobSpec.to_wire``: model, batch geometry,
compression, plan method; never the data path). Every field is checked here, and a bad
one is reported as one line naming it: ``job.toml: [train] micro_batch_size: ...``.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from fusionp2p.config import NAME_RE, PEER_ID_RE, OptimizerConfig, parse_bytes
from fusionp2p.errors import ConfigError
from fusionp2p.planning.cost import PLANNED_MAX_RATIO
from fusionp2p.records import (
    AVERAGING_CHOICES,
    COMPRESSIONS,
    MAX_MICRO_BATCHES,
    MAX_REPLICAS,
    MAX_TOPK_RATIO,
    PLAN_METHODS,
    ModelSpec,
)
from fusionp2p.training.batches import TrainingData
from fusionp2p.training.data import DATA_KINDS, load_data
from fusionp2p.training.supervision import StepClock

__all__ = ["EXAMPLE_CONFIG", "JobSpec"]

_MAX_STEPS = 10_000_000
WEIGHT_MODES = ("sharded", "gather")  # [output] weights

EXAMPLE_CONFIG = """\
# A fusionp2p training job: `fusionp2p train --config job.toml --initial-peers <multiaddr>`.
# The data stays on this machine (the data owner); only activations and gradients leave it.

name = "stdlib-gpt"            # job id: 1-64 letters, digits, '-' or '_'

[model]
family = "gpt2"                # gpt2, llama, mistral, qwen2, gpt_neox, or one the peers allow
seed = 0                       # initial weights come from this seed (each stage makes its own)
pretrained = ""                # or start from these: a save_pretrained directory or a .safetensors
                               # file on this machine (each stage receives only its tensors)

[model.config]                 # the family's config keys (checked against its schema)
vocab_size = 256               # the byte-level tokenizer needs >= 256
n_positions = 64
n_embd = 128
n_layer = 4
n_head = 4

[data]
kind = "text"                  # "text" (byte tokens, a causal LM) or "digits" (scikit-learn's
                               # bundled digits, a classifier such as family "resnet")
path = ""                      # a text file or a directory of text; "" = the Python stdlib's source
seq_len = 64                   # tokens per sample
max_bytes = 4000000            # read at most this much text
image_size = 32                # "digits": the 8x8 images scaled to this many pixels a side
channels = 3                   # "digits": the grey image repeated over this many channels

[train]
steps = 50
batch_size = 8                 # samples per optimizer step
micro_batch_size = 2           # samples per pipelined micro-batch (must divide batch_size)
optimizer = "adamw"            # adamw or sgd
lr = 0.001
weight_decay = 0.0
compression = "none"           # "none"; "planned": per link the least Top-K that hides it under the
                               # slowest stage's compute; "adaptive": the paper's, by bandwidth;
                               # "uniform": max_ratio on every link
ratio_warmup_steps = 100       # with compression: the Top-K ratios grow from 1 (dense) to the plan's
max_ratio = 20.0               # "planned"/"uniform": no link is compressed harder than this (Top-K ratio)
plan_method = "op-fence"       # or a baseline, "equal-number" or "equal-computation" (with this
                               # compression), or one with its own: "equal-computation/none", ...
replicas = 1                   # data-parallel pipelines, their gradients averaged each step: a number
                               # that divides batch_size / micro_batch_size, or "auto" (op-fence only)
refresh_s = 30                 # with replicas: how often idle peers are looked for, to refill a
                               # dropped replica or (with "auto") to add one when it pays
averaging = "none"             # with replicas: the averaged gradients on the wire, "none" (fp32),
                               # "fp16", or "auto" (fp16 where fp32 would cost over 10% of a step)
checkpoint_every = 0           # steps between checkpoints; 0: chosen to cost <= 10% of the steps
max_memory = ""                # the most this machine's own stage may need, e.g. "4GiB";
                               # "": 80% of its free memory (its part of the model, not all of it)
min_peers = 2                  # wait for this many idle peers before submitting
wait_peers_s = 120             # how long to wait for them
seed = 0                       # batch order

[fault]                        # a lost or slow stage owner is planned around, from the last checkpoint
deadline_s = 30                # a step may take at least this long before its stages are probed
deadline_slack = 4.0           # ... and this many times the plan's measured step time
straggler_factor = 1.5         # steps this much slower than the plan's first ones are slow
straggler_steps = 3            # this many slow steps in a row: re-plan with the measured speeds
straggler_min_s = 1.0          # a slow step is also at least this many seconds over (jitter is not slow)
max_replans = 10               # give up after this many re-plans

[output]
dir = "fusionp2p-runs"         # metrics.jsonl, checkpoints, final weights go to <dir>/<name>
tensorboard = false            # also TensorBoard scalars (pip install 'fusionp2p[tensorboard]')
weights = "sharded"            # the final weights stay with the stages (fusionp2p export writes them);
                               # "gather": also pull them here (weights.safetensors, save_pretrained)

[security]                     # a private swarm: trust only these peers (PeerIDs); [] = any
coordinators = []              # whose coordinator lease this data owner accepts
stage_peers = []               # the only peers the job's stages may run on
"""

# (section, key) of every TOML entry -> the JobSpec field it sets
_TOML_FIELDS: dict[tuple[str, str], str] = {
    ("", "name"): "name",
    ("model", "family"): "family",
    ("model", "seed"): "model_seed",
    ("model", "config"): "model_config",
    ("model", "pretrained"): "pretrained",
    ("data", "kind"): "data_kind",
    ("data", "path"): "data_path",
    ("data", "image_size"): "image_size",
    ("data", "channels"): "image_channels",
    ("data", "seq_len"): "seq_len",
    ("data", "max_bytes"): "max_bytes",
    ("train", "steps"): "steps",
    ("train", "batch_size"): "batch_size",
    ("train", "micro_batch_size"): "micro_batch_size",
    ("train", "optimizer"): "optimizer",
    ("train", "lr"): "lr",
    ("train", "weight_decay"): "weight_decay",
    ("train", "compression"): "compression",
    ("train", "ratio_warmup_steps"): "ratio_warmup_steps",
    ("train", "max_ratio"): "max_ratio",
    ("train", "plan_method"): "plan_method",
    ("train", "replicas"): "replicas",
    ("train", "refresh_s"): "refresh_s",
    ("train", "averaging"): "averaging",
    ("train", "checkpoint_every"): "checkpoint_every",
    ("train", "max_memory"): "max_memory",
    ("train", "min_peers"): "min_peers",
    ("train", "wait_peers_s"): "wait_peers_s",
    ("train", "seed"): "data_seed",
    ("fault", "deadline_s"): "deadline_s",
    ("fault", "deadline_slack"): "deadline_slack",
    ("fault", "straggler_factor"): "straggler_factor",
    ("fault", "straggler_steps"): "straggler_steps",
    ("fault", "straggler_min_s"): "straggler_min_s",
    ("fault", "max_replans"): "max_replans",
    ("output", "dir"): "out_dir",
    ("output", "tensorboard"): "tensorboard",
    ("output", "weights"): "weights",
    ("security", "coordinators"): "coordinators",
    ("security", "stage_peers"): "stage_peers",
}
_WHERE = {f: (f"[{s}] {k}" if s else k) for (s, k), f in _TOML_FIELDS.items()}


def _default_model() -> dict[str, Any]:
    return {"vocab_size": 256, "n_positions": 64, "n_embd": 128, "n_layer": 4, "n_head": 4}


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(
            f"{_WHERE.get(name, name)}: must be an integer in [{low}, {high}], got {value!r:.40}"
        )


def _check_float(name: str, value: Any, low: float, high: float) -> None:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise ConfigError(
            f"{_WHERE.get(name, name)}: must be a number in [{low:g}, {high:g}], got {value!r:.40}"
        )


def _unknown_key(section: str, key: str) -> str:
    """An unknown job-file key's error: the nearest known key, and the keys of its section
    (a section that does not exist: the nearest one, and every section)."""
    where = f"[{section}] {key}" if section else key
    sections = sorted({s for s, _ in _TOML_FIELDS})
    if section not in sections:
        near = difflib.get_close_matches(section, [s for s in sections if s], n=1)
        hint = f"; did you mean [{near[0]}]?" if near else ""
        return f"{where}: unknown key{hint} (sections: {', '.join(f'[{s}]' for s in sections if s)})"
    keys = sorted(k for s, k in _TOML_FIELDS if s == section)
    near = difflib.get_close_matches(key, keys, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return (
        f"{where}: unknown key{hint} ({f'[{section}]' if section else 'top-level'} keys: {', '.join(keys)})"
    )


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What to train, on which data, for how long, and where the results go."""

    name: str = "job"
    family: str = "gpt2"
    model_config: dict[str, Any] = field(default_factory=_default_model)
    model_seed: int = 0
    pretrained: str = ""  # a save_pretrained directory or .safetensors file to start from; "": the seed
    data_kind: str = "text"  # or "digits": images and labels, a classification loss
    data_path: str = ""  # text file or directory on the data owner; "" = the stdlib's source
    image_size: int = 32
    image_channels: int = 3
    seq_len: int = 64
    max_bytes: int = 4_000_000
    steps: int = 50
    batch_size: int = 8
    micro_batch_size: int = 2
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    compression: str = "none"
    ratio_warmup_steps: int = 100  # Top-K ratios grow from dense to the plan's over these (convergence.py)
    max_ratio: float = PLANNED_MAX_RATIO  # "planned": the hardest Top-K ratio on any link
    plan_method: str = "op-fence"
    replicas: int | str = 1  # data-parallel pipelines: a number that divides the micro-batches, or "auto"
    refresh_s: float = 30.0  # a replicated run looks for idle peers (to refill or add replicas) this often
    averaging: str = "none"  # the replicas' averaged gradients on the wire: AVERAGING_CHOICES
    checkpoint_every: int = 0  # 0: automatic, so that checkpoints cost <= 10% of the step time
    max_memory: str = ""  # the data owner's own stage may need at most this ("4GiB"); "": 80% of free
    min_peers: int = 1
    wait_peers_s: float = 120.0
    data_seed: int = 0
    deadline_s: float = 30.0  # the least time a step gets before its stage owners are probed
    deadline_slack: float = 4.0  # a step's deadline: this times the plan's measured step time
    straggler_factor: float = 1.5
    straggler_steps: int = 3
    straggler_min_s: float = 1.0
    max_replans: int = 10
    out_dir: str = "fusionp2p-runs"
    tensorboard: bool = False  # also write TensorBoard scalars (the fusionp2p[tensorboard] extra)
    weights: str = "sharded"  # the final weights: kept by the stages, or also "gather"ed here
    coordinators: tuple[str, ...] = ()  # the only peers whose coordinator lease is accepted; () = any
    stage_peers: tuple[str, ...] = ()  # the only peers the job's stages may run on; () = any

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise ConfigError(f"name: must be 1-64 letters, digits, '-' or '_', got {self.name!r:.40}")
        if not isinstance(self.family, str) or not 0 < len(self.family) <= 128:
            raise ConfigError(f"[model] family: must name a model family, got {self.family!r:.40}")
        if not isinstance(self.model_config, dict):
            raise ConfigError("[model.config]: must be a table of the family's config keys")
        _check_int("model_seed", self.model_seed, 0, (1 << 63) - 1)
        if not isinstance(self.pretrained, str):
            raise ConfigError(f"[model] pretrained: must be a path, got {self.pretrained!r:.40}")
        if self.data_kind not in DATA_KINDS:
            raise ConfigError(f"[data] kind: must be one of {list(DATA_KINDS)}, got {self.data_kind!r:.40}")
        _check_int("image_size", self.image_size, 8, 1024)
        _check_int("image_channels", self.image_channels, 1, 4)
        if not isinstance(self.data_path, str):
            raise ConfigError(f"[data] path: must be a string, got {self.data_path!r:.40}")
        _check_int("seq_len", self.seq_len, 2, 1 << 16)
        _check_int("max_bytes", self.max_bytes, 1 << 10, 1 << 34)
        _check_int("steps", self.steps, 1, _MAX_STEPS)
        _check_int("batch_size", self.batch_size, 1, 1 << 16)
        _check_int("micro_batch_size", self.micro_batch_size, 1, 1 << 16)
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"[train] micro_batch_size: {self.micro_batch_size} must divide batch_size {self.batch_size}"
            )
        if self.n_micro_batches > MAX_MICRO_BATCHES:
            raise ConfigError(
                f"[train] batch_size: more than {MAX_MICRO_BATCHES} micro-batches ({self.n_micro_batches})"
            )
        _check_float("lr", self.lr, 1e-12, 10.0)
        _check_float("weight_decay", self.weight_decay, 0.0, 10.0)
        if self.compression not in COMPRESSIONS:
            raise ConfigError(
                f"[train] compression: must be one of {list(COMPRESSIONS)}, got {self.compression!r:.40}"
            )
        _check_int("ratio_warmup_steps", self.ratio_warmup_steps, 0, _MAX_STEPS)
        _check_float("max_ratio", self.max_ratio, 1.0, MAX_TOPK_RATIO)
        if self.plan_method not in PLAN_METHODS:
            raise ConfigError(
                f"[train] plan_method: must be one of {list(PLAN_METHODS)}, got {self.plan_method!r:.40}"
            )
        self._check_replicas()
        _check_float("refresh_s", self.refresh_s, 0.0, 86400.0)
        _check_int("checkpoint_every", self.checkpoint_every, 0, _MAX_STEPS)
        if not isinstance(self.max_memory, str) or (
            self.max_memory and (self.max_memory_bytes or 0) < 1 << 20
        ):
            raise ConfigError(
                f'[train] max_memory: must be a size of at least 1MiB, or "", got {self.max_memory!r:.40}'
            )
        _check_int("min_peers", self.min_peers, 1, 64)
        _check_float("wait_peers_s", self.wait_peers_s, 0.0, 86400.0)
        _check_int("data_seed", self.data_seed, 0, (1 << 63) - 1)
        _check_float("deadline_s", self.deadline_s, 0.1, 86400.0)
        _check_float("deadline_slack", self.deadline_slack, 1.0, 1000.0)
        _check_float("straggler_factor", self.straggler_factor, 1.0, 1000.0)
        _check_int("straggler_steps", self.straggler_steps, 1, 10_000)
        _check_float("straggler_min_s", self.straggler_min_s, 0.0, 86400.0)
        _check_int("max_replans", self.max_replans, 0, 10_000)
        for name in ("coordinators", "stage_peers"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(p, str) and PEER_ID_RE.match(p) for p in value
            ):
                raise ConfigError(f"{_WHERE[name]}: must be a list of PeerIDs, got {value!r:.60}")
            object.__setattr__(self, name, tuple(value))  # a TOML array arrives as a list
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise ConfigError(f"[output] dir: must be a directory path, got {self.out_dir!r:.40}")
        if self.weights not in WEIGHT_MODES:
            raise ConfigError(
                f"[output] weights: must be one of {list(WEIGHT_MODES)}, got {self.weights!r:.40}"
            )
        if not isinstance(self.tensorboard, bool):
            raise ConfigError(f"[output] tensorboard: must be true or false, got {self.tensorboard!r:.40}")
        try:
            OptimizerConfig(name=self.optimizer, lr=self.lr, weight_decay=self.weight_decay)
        except ConfigError as e:
            raise ConfigError(f"[train] optimizer: {e}") from e

    def _check_replicas(self) -> None:
        if self.replicas != "auto":
            _check_int("replicas", self.replicas, 1, MAX_REPLICAS)
            assert isinstance(self.replicas, int)
            if self.n_micro_batches % self.replicas:
                raise ConfigError(
                    f"[train] replicas: {self.replicas} replicas must divide the {self.n_micro_batches} "
                    "micro-batches (batch_size / micro_batch_size) of a step"
                )
        if self.replicas != 1 and self.plan_method != "op-fence":
            raise ConfigError(
                f'[train] replicas: replicas are planned by "op-fence", not {self.plan_method!r}'
            )
        if self.averaging not in AVERAGING_CHOICES:
            raise ConfigError(
                f"[train] averaging: one of {', '.join(AVERAGING_CHOICES)}, not {self.averaging!r:.40}"
            )

    @property
    def replicas_wire(self) -> int:
        """``replicas`` as a job request carries it: 0 for "auto"."""
        return 0 if self.replicas == "auto" else int(self.replicas)

    @property
    def max_memory_bytes(self) -> int | None:
        """What the data owner's own stage may need (None: 80% of free memory at setup).

        Raises:
            ConfigError: ``max_memory`` is not a size.
        """
        try:
            return parse_bytes(self.max_memory) if self.max_memory else None
        except ConfigError as e:
            raise ConfigError(f"[train] max_memory: {e}") from None

    @property
    def n_micro_batches(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def optimizer_config(self) -> OptimizerConfig:
        return OptimizerConfig(name=self.optimizer, lr=self.lr, weight_decay=self.weight_decay)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    @property
    def loss(self) -> str:
        """The data owner's loss (``runtime.losses.LOSSES``): next-token or classification."""
        return "lm" if self.data_kind == "text" else "classification"

    def model_spec(self) -> ModelSpec:
        """The model every stage builds: one micro-batch of ``seq_len`` token ids as input,
        or of ``image_channels`` x ``image_size``² images."""
        images = self.data_kind == "digits"
        return ModelSpec(
            self.family,
            dict(self.model_config),
            input_shape=(self.micro_batch_size, self.image_channels, self.image_size, self.image_size)
            if images
            else (self.micro_batch_size, self.seq_len),
            input_dtype="float32" if images else "int64",
            seed=self.model_seed,
        )

    def step_clock(self, estimate_s: float) -> StepClock:
        """The ``[fault]`` rules for a plan whose cost model estimates ``estimate_s`` a step."""
        return StepClock(
            deadline_s=self.deadline_s,
            slack=self.deadline_slack,
            factor=self.straggler_factor,
            patience=self.straggler_steps,
            min_excess_s=self.straggler_min_s,
            estimate_s=estimate_s,
        )

    def load_data(self) -> TrainingData:
        """The job's data (``training.data.load_data`` of its ``[data]`` table).

        Raises:
            ConfigError: a missing path, too little text.
        """
        return load_data(
            self.data_kind,
            path=self.data_path,
            seq_len=self.seq_len,
            max_bytes=self.max_bytes,
            image_size=self.image_size,
            channels=self.image_channels,
        )

    def with_(self, **changes: Any) -> JobSpec:
        return replace(self, **changes)

    @classmethod
    def from_toml(cls, text: str, *, source: str = "job.toml") -> JobSpec:
        """Parses a job file (see ``EXAMPLE_CONFIG``).

        Raises:
            ConfigError: not TOML, an unknown section or key, or a bad value; the message
                is one line starting with ``source`` and naming the field.
        """
        import tomllib

        try:
            body = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{source}: not valid TOML: {e}") from e
        values: dict[str, Any] = {}
        try:
            for section, content in body.items():
                if not isinstance(content, dict):
                    cls._take(values, "", section, content)
                    continue
                for key, value in content.items():
                    if section == "model" and key == "config" and not isinstance(value, dict):
                        raise ConfigError("[model] config: must be a table")
                    cls._take(values, section, key, value)
            return cls(**values)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from e
        except TypeError as e:  # a value of a type the dataclass cannot take
            raise ConfigError(f"{source}: {e}") from e

    @staticmethod
    def _take(values: dict[str, Any], section: str, key: str, value: Any) -> None:
        name = _TOML_FIELDS.get((section, key))
        if name is None:
            raise ConfigError(_unknown_key(section, key))
        values[name] = value

    @classmethod
    def load(cls, path: str | Path) -> JobSpec:
        """``from_toml`` of a file.

        Raises:
            ConfigError: the file cannot be read, or ``from_toml`` refuses it.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the job file: {e.strerror or e}") from e
        return cls.from_toml(text, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
