"""`hf-selfspec push` against a fake Hub served on 127.0.0.1: never the network.

huggingface_hub reads HF_HUB_OFFLINE and the token location when it is imported, so every case
runs the CLI in a subprocess with exactly the environment it needs.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from helpers.tuning import cli_env, run_cli

from hf_selfspec.hub.package import package
from hf_selfspec.profiles import PROFILE_KEY

REPO = "hf-selfspec-test/tiny"


class _FakeHub(BaseHTTPRequestHandler):
    """Answers the requests a commit needs (README metadata validation included) and records every
    request it sees."""

    requests: list[dict]

    def do_POST(self):
        url = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.requests.append(
            {"path": url.path, "query": parse_qs(url.query), "body": body, "auth": self.headers.get("Authorization")}
        )
        base = f"http://127.0.0.1:{self.server.server_port}"
        if url.path == f"/api/models/{REPO}/preupload/main":
            files = json.loads(body)["files"]
            self._reply(
                200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
            )
        elif url.path == f"/api/models/{REPO}/commit/main":
            self._reply(
                200,
                {
                    "commitUrl": f"{base}/{REPO}/commit/{'a' * 40}",
                    "commitOid": "a" * 40,
                    "pullRequestUrl": f"{base}/{REPO}/discussions/1",
                },
            )
        elif url.path == "/api/validate-yaml":  # asked before a commit that holds a README.md
            self._reply(200, {})
        else:
            self._reply(404, {"error": f"unexpected {url.path}"})

    do_GET = do_HEAD = do_PUT = do_POST

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub():
    handler = type("Handler", (_FakeHub,), {"requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", handler.requests
    server.shutdown()
    server.server_close()


@pytest.fixture
def config_file(tmp_path):
    profile = {
        "strategy": "self_speculative",
        "params": {"attn_skip_layers": [2], "mlp_skip_layers": [2]},
        "measured": {"speedup": 1.25, "study": "tiny"},
    }
    path = tmp_path / "out" / "generation_config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"eos_token_id": 2, PROFILE_KEY: {"cpu/float32": profile}}, indent=2))
    return path


def _online_env(tmp_path, **overrides):
    """Offline mode off, no stored token, and no proxy between us and 127.0.0.1."""
    online = {
        "HF_HUB_OFFLINE": None,
        "TRANSFORMERS_OFFLINE": None,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_TOKEN": "hf_fake_token",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    return cli_env(**{**online, **overrides})


def _committed_files(commit_body: bytes) -> dict[str, bytes]:
    lines = [json.loads(line) for line in commit_body.decode().splitlines()]
    return {
        line["value"]["path"]: base64.b64decode(line["value"]["content"]) for line in lines if line["key"] == "file"
    }


def test_push_opens_a_pull_request_with_exactly_the_config(fake_hub, config_file, tmp_path):
    endpoint, requests = fake_hub
    before = (config_file.read_bytes(), config_file.stat().st_mtime_ns)
    result = run_cli("push", "--config", config_file, "--repo", REPO, "--endpoint", endpoint, env=_online_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"{endpoint}/{REPO}/discussions/1" in result.stdout
    assert [r["path"] for r in requests] == [f"/api/models/{REPO}/preupload/main", f"/api/models/{REPO}/commit/main"]
    assert all(r["query"].get("create_pr") == ["1"] for r in requests)
    assert all(r["auth"] == "Bearer hf_fake_token" for r in requests)
    assert _committed_files(requests[1]["body"]) == {"generation_config.json": before[0]}
    assert (config_file.read_bytes(), config_file.stat().st_mtime_ns) == before


def test_push_folder_opens_one_pull_request_with_the_whole_package(fake_hub, config_file, tmp_path):
    endpoint, requests = fake_hub
    folder = package(config_file, tmp_path / "package").folder
    result = run_cli("push", "--folder", folder, "--repo", REPO, "--endpoint", endpoint, env=_online_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"Opened pull request: {endpoint}/{REPO}/discussions/1" in result.stdout
    commits = [r for r in requests if r["path"] != "/api/validate-yaml"]
    assert [r["path"] for r in commits] == [f"/api/models/{REPO}/preupload/main", f"/api/models/{REPO}/commit/main"]
    assert all(r["query"].get("create_pr") == ["1"] for r in commits)
    local = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert _committed_files(commits[1]["body"]) == local
    assert {"generation_config.json", "README.md", "custom_generate/generate.py", "custom_generate/mixin.py"} <= set(local)


def test_push_folder_refuses_a_folder_that_is_not_a_package(fake_hub, config_file, tmp_path):
    endpoint, requests = fake_hub
    result = run_cli(
        "push", "--folder", config_file.parent, "--repo", REPO, "--endpoint", endpoint, env=_online_env(tmp_path)
    )
    assert result.returncode == 2
    assert "no custom_generate/generate.py; write the folder with `hf-selfspec package`" in result.stderr
    assert requests == []


@pytest.mark.parametrize("flags", [[], ["--config", "c.json", "--folder", "d"]], ids=["neither", "both"])
def test_push_takes_exactly_one_of_config_and_folder(flags):
    result = run_cli("push", *flags, "--repo", REPO)
    assert result.returncode == 2
    assert "one of the arguments --config --folder is required" in result.stderr or "not allowed with" in result.stderr


def test_no_create_pr_commits_directly(fake_hub, config_file, tmp_path):
    endpoint, requests = fake_hub
    result = run_cli(
        "push",
        "--config",
        config_file,
        "--repo",
        REPO,
        "--endpoint",
        endpoint,
        "--no-create-pr",
        env=_online_env(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert f"Committed: {endpoint}/{REPO}/commit/" in result.stdout
    assert all("create_pr" not in r["query"] for r in requests)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"HF_TOKEN": None}, "no Hugging Face token"),
        ({"HF_HUB_OFFLINE": "1"}, "offline"),
    ],
    ids=["no-token", "offline"],
)
def test_push_refuses_clearly_and_leaves_the_file_alone(fake_hub, config_file, tmp_path, overrides, message):
    endpoint, requests = fake_hub
    before = (config_file.read_bytes(), config_file.stat().st_mtime_ns)
    result = run_cli(
        "push", "--config", config_file, "--repo", REPO, "--endpoint", endpoint, env=_online_env(tmp_path, **overrides)
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert requests == []
    assert (config_file.read_bytes(), config_file.stat().st_mtime_ns) == before


@pytest.fixture
def adapter_config_file(config_file):
    """The config's profile drafting with an adapter kept beside it, as `export` leaves it."""
    from helpers.tiny_models import tiny_model

    from hf_selfspec.adapter import AdapterShape, DraftAdapter, save_adapter

    model = tiny_model("llama")
    save_adapter(DraftAdapter(model, AdapterShape.for_model(model, 1)), config_file.parent / "draft.safetensors")
    data = json.loads(config_file.read_text())
    data[PROFILE_KEY]["cpu/float32"] = {"strategy": "kangaroo", "params": {"draft_adapter": "draft.safetensors"}}
    config_file.write_text(json.dumps(data))
    return config_file


def test_push_config_carries_the_adapter_its_profile_names(fake_hub, adapter_config_file, tmp_path):
    endpoint, requests = fake_hub
    directory = adapter_config_file.parent
    result = run_cli(
        "push", "--config", adapter_config_file, "--repo", REPO, "--endpoint", endpoint, env=_online_env(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    assert _committed_files(requests[-1]["body"]) == {
        name: (directory / name).read_bytes() for name in ("generation_config.json", "draft.safetensors", "draft.json")
    }


def test_push_folder_carries_the_packaged_adapter(fake_hub, adapter_config_file, tmp_path):
    endpoint, requests = fake_hub
    folder = package(adapter_config_file, tmp_path / "package").folder
    result = run_cli("push", "--folder", folder, "--repo", REPO, "--endpoint", endpoint, env=_online_env(tmp_path))
    assert result.returncode == 0, result.stderr
    committed = _committed_files([r for r in requests if r["path"].endswith("/commit/main")][0]["body"])
    assert committed["draft.safetensors"] == (adapter_config_file.parent / "draft.safetensors").read_bytes()
    assert committed["draft.json"] == (adapter_config_file.parent / "draft.json").read_bytes()


def test_a_pushed_package_lends_its_adapter_to_a_model_whose_folder_lacks_it(fake_hub, tmp_path):
    """The package named by Hub id as `custom_generate=` for a model saved elsewhere, decoded
    offline through transformers alone from a Hub cache holding exactly what was committed: the
    uploaded bundled profiles fetch the adapter from the package's repository."""
    from helpers.adapters import random_adapter
    from helpers.tiny_models import tiny_transformers_model
    from helpers.zero_install import run_isolated

    endpoint, requests = fake_hub
    model = tiny_transformers_model("llama", initializer_range=0.3)
    model.generation_config.eos_token_id = None  # every prompt decodes in full
    model.save_pretrained(tmp_path / "model")
    exported = tmp_path / "exported"
    random_adapter(model, 1, exported)
    profile = {"strategy": "kangaroo", "measured": {"speedup": 1.1, "study": "tiny"},
               "params": {"draft_adapter": "adapter-1-1.safetensors", "max_draft_tokens": 4,
                          "draft_exit_threshold": 0.0, "backoff_probe_interval": 0}}
    (exported / "generation_config.json").write_text(json.dumps({PROFILE_KEY: {"cpu/float32": profile}}))
    folder = package(exported / "generation_config.json", tmp_path / "package").folder
    local_bundled = (folder / "custom_generate" / "bundled_profiles.py").read_bytes()

    result = run_cli("push", "--folder", folder, "--repo", REPO, "--endpoint", endpoint, env=_online_env(tmp_path))
    assert result.returncode == 0, result.stderr
    committed = _committed_files([r for r in requests if r["path"].endswith("/commit/main")][0]["body"])
    bundled = committed["custom_generate/bundled_profiles.py"].decode()
    assert f"'hf://{REPO}@main/adapter-1-1.safetensors'" in bundled
    assert (folder / "custom_generate" / "bundled_profiles.py").read_bytes() == local_bundled  # left as it was

    commit = "b" * 40
    repo_cache = tmp_path / "hf-home" / "hub" / f"models--{REPO.replace('/', '--')}"
    for path, content in committed.items():
        (repo_cache / "snapshots" / commit / path).parent.mkdir(parents=True, exist_ok=True)
        (repo_cache / "snapshots" / commit / path).write_bytes(content)
    (repo_cache / "refs").mkdir()
    (repo_cache / "refs" / "main").write_text(commit)
    facts = run_isolated(tmp_path, package=REPO, model=str(tmp_path / "model"), model_repo=None,
                         prompts=[[5, 17, 42, 8, 9], [60, 1, 33]], max_new_tokens=24, check_other_dtype=False)
    assert facts["hf_selfspec_importable"] is False
    assert facts["custom_generate"]["identical"] == [True, True]
    assert all(drafted and drafted > 0 for drafted in facts["custom_generate"]["drafted"]), facts


@pytest.mark.parametrize("how", ["--config", "--folder"])
def test_push_refuses_a_profile_whose_adapter_is_missing(fake_hub, adapter_config_file, tmp_path, how):
    endpoint, requests = fake_hub
    folder = package(adapter_config_file, tmp_path / "package").folder
    target = folder / "generation_config.json" if how == "--config" else folder
    (folder / "draft.safetensors").unlink()
    result = run_cli("push", how, target, "--repo", REPO, "--endpoint", endpoint, env=_online_env(tmp_path))
    assert result.returncode == 2
    assert f"draft adapter file {folder / 'draft.safetensors'} is missing" in result.stderr
    assert "Traceback" not in result.stderr and requests == []
