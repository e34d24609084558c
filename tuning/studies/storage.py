"""Where studies live, what they are called, and what they record about themselves.

Studies are ordinary Optuna RDB studies, so `optuna studies --storage URL`, the dashboard and
any number of workers on any number of machines work on them unchanged. The default storage is
`sqlite:///studies/optuna.db` relative to the current directory (run from the repository root,
that is the git-ignored `studies/`); relative SQLite paths are made absolute once, up front, so
every message names the file actually used. Any SQLAlchemy URL works, PostgreSQL included.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, IntegrityError, NoSuchModuleError, ProgrammingError

from hf_selfspec.tuner_api import EMBEDDED, EMBEDDED_NAME

from .. import TuningError
from .config import PromptConfig, StudyConfig
from .toml_reader import ModelConfig

DEFAULT_STORAGE = "sqlite:///studies/optuna.db"
SCHEMA_RACE_ATTEMPTS = 5

logger = logging.getLogger(__name__)


SQLITE_HEADER = b"SQLite format 3\x00"


def resolve_storage_url(url: str | None, create: bool = True) -> str:
    """The URL with a relative SQLite path made absolute and, with `create`, its directory
    created; every storage a command is given passes here, so that a bad one stops the command
    in one line before a model loads. Without `create` (commands that only read studies), a
    SQLite file must exist: opening a mistyped path would create an empty database there."""
    example = "e.g. sqlite:///studies/optuna.db or postgresql+psycopg2://user:pass@host/db"
    try:
        parsed = make_url(url or DEFAULT_STORAGE)
        parsed.get_dialect()
    except NoSuchModuleError:  # an ArgumentError too: caught first
        raise TuningError(f"storage {url}: no database driver {parsed.drivername!r} is installed; {example}") from None
    except ArgumentError:
        raise TuningError(f"storage {url!r} is not a storage URL; {example}") from None
    if parsed.drivername.startswith("sqlite") and parsed.database not in (None, "", ":memory:"):
        path = Path(parsed.database).expanduser().resolve()
        _check_sqlite_file(path, create)
        parsed = parsed.set(database=str(path))
    return parsed.render_as_string(hide_password=False)


def _check_sqlite_file(path: Path, create: bool) -> None:
    if path.is_dir():
        raise TuningError(f"storage {path}: is a directory; name the database file in it")
    if path.is_file():
        try:
            with path.open("rb") as file:
                header = file.read(len(SQLITE_HEADER))
        except OSError as error:
            raise TuningError(f"storage {path}: cannot read it ({error.strerror or error})") from None
        if header and header != SQLITE_HEADER:
            raise TuningError(f"storage {path}: not a SQLite database; name the studies' database file")
        return
    if not create:
        raise TuningError(f"storage {path}: no such database; name the one `hf-selfspec tune` wrote")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise TuningError(f"storage {path}: cannot create its directory ({error.strerror or error})") from None


def display_url(url: str) -> str:
    """The URL fit for a terminal or a log: its password hidden."""
    return make_url(url).render_as_string(hide_password=True)


def _report_stale_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    logger.warning(
        "Trial %d of study %r was running on a worker that stopped sending heartbeats; it is now FAILED.",
        trial.number,
        study.study_name,
    )


def open_storage(url: str, heartbeat_interval: int | None = None, grace_period: int | None = None) -> RDBStorage:
    """An RDB storage; with a heartbeat interval, each running trial proves its worker alive, and
    `study.optimize` fails the trials of dead workers (after `grace_period` s) before each trial."""
    engine_kwargs: dict[str, Any]
    if make_url(url).drivername.startswith("sqlite"):
        # Several local workers, the heartbeat thread and the dashboard share one file: wait for
        # the lock instead of failing a trial on "database is locked".
        engine_kwargs = {"connect_args": {"timeout": 60}}
    else:
        # A trial can leave its connection idle for minutes; servers and proxies drop such ones.
        engine_kwargs = {"pool_pre_ping": True}
    heartbeat = {}
    if heartbeat_interval is not None:
        heartbeat = {
            "heartbeat_interval": heartbeat_interval,
            "grace_period": grace_period,
            "heartbeat_stale_trial_callback": _report_stale_trial,
        }
    for attempt in itertools.count(1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats are stable enough
                return RDBStorage(url, engine_kwargs=engine_kwargs, **heartbeat)
        except (IntegrityError, ProgrammingError):
            # Workers started together on an empty database race to create Optuna's tables, and
            # the losers' CREATE statements collide with the winner's. Once it has committed,
            # opening the storage finds the tables and creates nothing.
            if attempt == SCHEMA_RACE_ATTEMPTS:
                raise
            time.sleep(random.uniform(0.5, 2.0))
        except ImportError as error:
            raise TuningError(
                f"cannot open {display_url(url)}: {error} (for PostgreSQL: pip install psycopg2-binary)"
            ) from None
        except DatabaseError as error:  # a server that refuses, a file that is not a database
            raise TuningError(f"cannot open {display_url(url)}: {' '.join(str(error.orig).split())}") from None


def model_label(model: ModelConfig) -> str:
    """A short name for the model: the embedded model's name, a directory's name, or a Hub id."""
    if model.name == EMBEDDED:
        label = EMBEDDED_NAME
    elif Path(model.name).expanduser().is_dir():
        label = Path(model.name).expanduser().resolve().name
    else:
        label = model.name
    return f"{label}/{model.gguf_file}" if model.gguf_file else label


def prompt_label(prompts: PromptConfig, n_prompts: int) -> str:
    """`source[-split][@offset][-<per_category>each]-<n_prompts>x<max_new_tokens>[-batch<size>]`,
    with the number of prompts the study selected; a batch's speedup is another measurement."""
    split = f"-{prompts.split}" if prompts.split else ""
    offset = f"@{prompts.offset}" if prompts.offset else ""
    each = f"-{prompts.per_category}each" if prompts.per_category else ""
    batch = f"-batch{prompts.batch_size}" if prompts.batch_size > 1 else ""
    return f"{Path(prompts.source).stem}{split}{offset}{each}-{n_prompts}x{prompts.max_new_tokens}{batch}"


def derive_study_name(config: StudyConfig, device_key: str, n_prompts: int) -> str:
    """`model:strategy:device/dtype:prompts`, e.g.
    `SmolLM2-135M-Instruct:self_speculative:cpu/float32:humaneval-8x64`, or
    `...:workload-tune-2each-16x64` for two prompts of each workload category.

    Beyond model, device and dtype, the name holds the strategy and the prompt set, because
    speedups measured under different ones are not comparable: a quick run with
    `--n-prompts 2` gets its own study instead of polluting the long one, and re-running the
    same config resumes the same study. A lookup corpus adds its name (`...:lookup=own-code`):
    free proposals from it change every trial's speed. So does an online corpus (`...:online`,
    or `...:online?` where trials choose).
    """
    parts = [model_label(config.model), config.search.strategy, device_key, prompt_label(config.prompts, n_prompts)]
    if config.search.lookup_corpus:
        parts.append(f"lookup={Path(config.search.lookup_corpus).stem}")
    if True in config.search.online_corpus:
        parts.append("online" if False not in config.search.online_corpus else "online?")
    return config.study.name or ":".join(parts)


def estimated_study_name(measured_name: str) -> str:
    """Estimates and measurements are not comparable values, so they live in separate studies;
    the estimated one is named after the measured study its best trials are confirmed in."""
    return f"{measured_name}:estimated"


@dataclass(frozen=True)
class StudyContext:
    """What a study measured, stored as study user attributes so that `export`, the dashboard
    and every later worker can read it without the config file."""

    model: str
    gguf_file: str | None
    dtype: str
    device_key: str
    strategy: str
    num_layers: int
    prompt_source: str
    n_prompts: int
    prompt_offset: int
    max_new_tokens: int
    baseline_tokens_per_second: float
    versions: dict[str, str]
    # The adapters a study chooses among, by name, with their weights file where the worker that
    # saved the context keeps them: `export` copies the chosen one from there.
    draft_adapters: dict[str, str] = field(default_factory=dict)
    # Each adapter's `adapter_digest`: retraining keeps the name, so only this tells trials of
    # the old weights from those of the new.
    draft_adapter_digests: dict[str, str] = field(default_factory=dict)
    # The lookup corpus every trial looked up in (where this worker keeps it) and its digest.
    lookup_corpus: str = ""
    lookup_corpus_digest: str = ""
    # The switch's choices (`SearchConfig.online_corpus`), and what a trial's online corpus
    # holds once it has decoded every prompt (where this worker keeps it, and its digest), for
    # `export` to ship beside a profile whose trial learned with it.
    online_corpus_choices: list[bool] = field(default_factory=lambda: [False])
    online_corpus_file: str = ""
    online_corpus_digest: str = ""
    # The split the prompts came from ("" for all) and how many of each category were taken (0: a slice).
    prompt_split: str = ""
    prompts_per_category: int = 0
    # The floor every category's speedup had to reach for a trial to be feasible (0: none).
    category_floor: float = 0.0
    # How many prompts a trial decoded at once (1: one at a time, as before batches were tuned).
    batch_size: int = 1

    # Fields that define the measurement; a resumed study must agree on every one of them. The
    # model's path is left out (workers on other machines keep it elsewhere); its depth is in.
    # So are the adapters' paths; their names are in.
    IDENTITY = (
        "dtype",
        "device_key",
        "strategy",
        "num_layers",
        "prompt_source",
        "n_prompts",
        "prompt_offset",
        "prompt_split",
        "prompts_per_category",
        "batch_size",
        "max_new_tokens",
        "draft_adapter_names",
        "draft_adapter_digests",
        "lookup_corpus_name",
        "lookup_corpus_digest",
        "online_corpus_choices",
    )

    @property
    def draft_adapter_names(self) -> list[str]:
        return list(self.draft_adapters)

    @property
    def lookup_corpus_name(self) -> str:
        return Path(self.lookup_corpus).name if self.lookup_corpus else ""

    def save(self, study: optuna.Study) -> None:
        for key, value in dataclasses.asdict(self).items():
            study.set_user_attr(key, value)

    @classmethod
    def load(cls, study: optuna.Study) -> StudyContext:
        attrs = study.user_attrs
        # A field with a default was added later; studies tuned before it lack it and mean it.
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in attrs]
        if missing and not study.get_trials(deepcopy=False):
            raise TuningError(
                f"study {study.study_name!r} has no trials: its tune stopped before the first; run "
                "`hf-selfspec tune` with its config again to resume it"
            )
        if missing:
            raise TuningError(
                f"study {study.study_name!r} was not made by `hf-selfspec tune` (it lacks {', '.join(missing)})"
            )
        return cls(**{f.name: attrs[f.name] for f in dataclasses.fields(cls) if f.name in attrs})

    def check_matches(self, study: optuna.Study) -> None:
        """Refuse to resume a study that measured something else under the same name."""
        if not study.user_attrs:
            return
        try:
            stored = StudyContext.load(study)
        except TuningError:
            if study.get_trials(deepcopy=False):
                raise
            return  # its creator stopped while saving the context; this run saves it whole
        for key in self.IDENTITY:
            if getattr(stored, key) != getattr(self, key):
                if key == "lookup_corpus_digest":
                    raise TuningError(
                        f"study {study.study_name!r} looked up in other text under the corpus name "
                        f"{self.lookup_corpus_name} (rewritten since?); pick another [study] name or storage"
                    )
                if key == "draft_adapter_digests":
                    raise TuningError(
                        f"study {study.study_name!r} was tuned with other weights under the adapter names "
                        f"{', '.join(self.draft_adapter_names)} (retrained since?); pick another [study] name or storage"
                    )
                raise TuningError(
                    f"study {study.study_name!r} was tuned with {key}={getattr(stored, key)!r}, not "
                    f"{getattr(self, key)!r}; pick another [study] name or storage"
                )


def create_or_load_study(
    storage: RDBStorage, name: str, sampler: optuna.samplers.BaseSampler, pruner: optuna.pruners.BasePruner
) -> tuple[optuna.Study, bool]:
    """The study, and whether this call created it. Creation is decided by the storage's unique
    study name, so among workers starting together exactly one sees `True`."""
    try:
        study = optuna.create_study(
            storage=storage, study_name=name, direction="maximize", sampler=sampler, pruner=pruner
        )
        return study, True
    except optuna.exceptions.DuplicatedStudyError:
        return optuna.load_study(storage=storage, study_name=name, sampler=sampler, pruner=pruner), False


def load_existing_study(storage_url: str, name: str) -> optuna.Study:
    storage = open_storage(storage_url)
    names = optuna.get_all_study_names(storage)
    if name not in names:
        listing = "\n  ".join(sorted(names)) or "(none)"
        raise TuningError(f"no study {name!r} in {display_url(storage_url)}; it holds:\n  {listing}")
    return optuna.load_study(storage=storage, study_name=name)
