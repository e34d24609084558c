"""Several workers at once on one PostgreSQL storage (the server comes from .ci/postgres.sh)."""

from __future__ import annotations

import os
import subprocess
import threading
import uuid
from collections import Counter

import optuna
import pytest
from optuna.trial import TrialState
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from helpers import REPO_ROOT
from helpers.tuning import cli_command, cli_env, write_study_config

from hf_selfspec.tuning.studies.storage import open_storage

URL_VARIABLE = "HF_SELFSPEC_TEST_POSTGRES_URL"
TRIALS_PER_WORKER = 3


@pytest.fixture
def postgres_url():
    url = os.environ.get(URL_VARIABLE)
    if not url:
        if os.environ.get("CI"):
            pytest.fail(f"{URL_VARIABLE} is unset under CI: .ci/run must `source .ci/postgres.sh`")
        pytest.skip(f"no PostgreSQL server: `source .ci/postgres.sh` sets {URL_VARIABLE}")
    return url


def test_two_workers_share_one_study_without_losing_or_duplicating_trials(postgres_url, tiny_llama_dir, tmp_path):
    name = f"shared-{uuid.uuid4().hex[:8]}"
    config = write_study_config(
        tmp_path / "study.toml",
        tiny_llama_dir,
        postgres_url,
        n_prompts=2,
        max_new_tokens=8,
        study=f'name = "{name}"',
    )
    workers = [
        subprocess.Popen(
            cli_command("tune", config, "--n-trials", str(TRIALS_PER_WORKER), "--no-progress"),
            env=cli_env(),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=300)
            assert worker.returncode == 0, err
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    try:
        trials = optuna.load_study(study_name=name, storage=postgres_url).get_trials()
        finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)]
        assert len(finished) == 2 * TRIALS_PER_WORKER
        assert not [t for t in trials if t.state == TrialState.RUNNING]
        per_worker = Counter(t.user_attrs["worker"].rsplit(":", 1)[1] for t in finished)
        assert per_worker == {str(worker.pid): TRIALS_PER_WORKER for worker in workers}
        numbers = [t.number for t in trials]
        assert sorted(numbers) == list(range(len(trials)))  # every trial once, none duplicated
        assert len({t._trial_id for t in trials}) == len(trials)
        # Warm starts are enqueued once, by whichever worker created the study, so no two trials
        # (sampled thresholds are continuous) share parameters.
        assert len({tuple(sorted(t.params.items())) for t in finished}) == len(finished)
    finally:
        optuna.delete_study(study_name=name, storage=postgres_url)


@pytest.fixture
def empty_database(postgres_url):
    """A database of its own, so Optuna's tables do not exist yet."""
    name = f"fresh_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"CREATE DATABASE {name}"))
    yield make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as connection:
        connection.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
    admin.dispose()


def test_workers_opening_an_empty_database_together_all_get_the_storage(empty_database):
    """Their CREATE TABLE statements race; the losers must retry, not crash."""
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def open_together() -> None:
        start.wait()
        try:
            open_storage(empty_database, heartbeat_interval=5, grace_period=10).engine.dispose()
        except BaseException as error:  # reported below, with the others
            errors.append(error)

    threads = [threading.Thread(target=open_together) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert optuna.get_all_study_names(empty_database) == []
