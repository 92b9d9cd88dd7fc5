"""Shared factories: a tiny random-init Llama built here, the real SmolLM2 directory, small datasets."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import kernels
from batchgen.config import batchgen_home

REPO = Path(__file__).resolve().parent.parent
TEST_DATA = Path(__file__).resolve().parent / "data"  # in the repo, with its licence (data/README.md)
# Inductor's compile cache: the machine's (one per build of batchgen's kernels), shared by every test as a
# user's runs share it (the engine sets it on its first compile, and would otherwise pick the tmp
# BATCHGEN_HOME of whichever test ran first)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(kernels.compile_cache_dir()))
# the same for the C++ kernels built on this machine (batchgen.kernels)
os.environ.setdefault("BATCHGEN_KERNEL_DIR", str(batchgen_home() / "kernels"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from batchgen.model.prepare import resolve_model

    return resolve_model("smollm2-135m")


def build_tiny_model(dest: Path, real_model_dir: Path, model_type: str = "llama", seed: int = 0) -> Path:
    """A 2-layer random-init checkpoint with SmolLM2's tokenizer, saved by transformers itself."""
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif model_type == "qwen3":  # Qwen3's shape: q/k norm, head_dim not hidden / heads
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))
    elif model_type == "llama3":  # Llama 3.1's RoPE scaling, with a short original context so all of it matters
        model = LlamaForCausalLM(LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}))
    elif model_type == "gemma2":  # GeGLU, (1 + w) and sandwich norms, soft caps, a window on every other layer
        model = Gemma2ForCausalLM(Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                               attn_implementation="eager"))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (real_model_dir / name).is_file():
            shutil.copy(real_model_dir / name, dest / name)
    return dest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, real_model_dir) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), real_model_dir)


def engine_tokens(model_dir, prompts: list[str], sampling, **config) -> tuple[dict, dict]:
    """The native engine's real path over text prompts, run to the end: (request id -> output token
    ids, the engine's conditions). `sampling`: SamplingParams, or a function of the prompt's index."""
    from batchgen.config import EngineConfig
    from batchgen.engine.native import NativeEngine

    e = NativeEngine(model_dir, EngineConfig(**config))
    for i, p in enumerate(prompts):
        e.add(str(i), e.tokenizer.encode(p), sampling(i) if callable(sampling) else sampling)
    out = {}
    while e.has_unfinished():
        for f in e.step().finished:
            out[f.request_id] = f.output_token_ids
    return out, e.conditions()


def pytest_runtest_setup(item):
    """`@pytest.mark.needs(why, flag)`: the part a test needs is missing when `why` is a reason (not
    None); the test then skips on a laptop and fails where `flag` is set (CI), see skip_or_fail."""
    for mark in item.iter_markers("needs"):
        why, flag = mark.args
        if why is not None:
            skip_or_fail(why, flag)


def skip_or_fail(reason: str, flag: str = "BATCHGEN_REQUIRE_KERNELS") -> None:
    """A part a test needs is missing here: on a developer's machine the test skips and says why; CI
    (.ci/run) sets the flag, which turns that skip into a failure, so a broken part cannot hide."""
    if os.environ.get(flag) == "1":
        pytest.fail(f"{flag}=1 but {reason}")
    pytest.skip(reason)


def on_one_thread(fn):
    """fn() with torch on one thread (a kernel's rows must not depend on how many threads split them)."""
    import torch

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn()
    finally:
        torch.set_num_threads(threads)


def kernel_op(name: str, why: str | None, op):
    """`op` once kernel `name` has loaded (`why` is None), else skip (or fail in CI) saying why."""
    if why is not None:
        skip_or_fail(f"the {name} kernel did not load: {why}")
    return op


def read_run_table(run_dir, table: str):
    """One output table of a run, from the files its manifests commit (what every reader must see)."""
    from batchgen.data.run_dir import RunDir

    return RunDir(run_dir).read_table(table)


def cli_args(inp, out, model, run_id, *extra):
    """`batchgen generate` on the tiny model: 4-token answers, shards of 4 rows, batches of 3."""
    return ["generate", "--input", str(inp), "--output", str(out), "--run-id", run_id, "--model", str(model),
            "--max-tokens", "4", "--max-model-len", "64", "--shard-size", "4", "--max-num-seqs", "3",
            "--no-progress", *extra]


def run_cli_subprocess(args, kill_at=None, env=None, timeout=300):
    """The CLI in its own process (for crashes, signals and fault injection set through the environment)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "BATCHGEN_KILL_AT": kill_at or "", **(env or {})}
    return subprocess.run([sys.executable, "-m", "batchgen.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=timeout)


def write_prompts(path: Path, prompts: list, ids: list | None = None, **extra_columns) -> Path:
    cols = {}
    if ids is not None:
        cols["id"] = ids
    cols["prompt"] = prompts
    cols.update(extra_columns)
    pq.write_table(pa.table(cols), path)
    return path


def make_run(root, model, run_id, max_num_seqs, max_tokens="6", n=9):
    """A small run of the CLI: n prompts of growing length, one of them capped at a single token."""
    prompts = [("word " * (3 + 5 * i)).strip() for i in range(n)]
    inp = write_prompts(root / f"{run_id}.parquet", prompts, ids=[f"q{i}" for i in range(n)],
                        max_tokens=[1 if i == 4 else None for i in range(n)])
    from batchgen.cli import main

    assert main(["generate", "--input", str(inp), "--output", str(root), "--run-id", run_id, "--model", str(model),
                 "--max-tokens", max_tokens, "--max-model-len", "128", "--max-num-seqs", str(max_num_seqs),
                 "--shard-size", "5", "--no-progress", "--ignore-eos"]) == 0
    return root / run_id


@pytest.fixture
def seed_prompts() -> Path:
    return TEST_DATA / "alpaca_seed_prompts.parquet"


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """One temporary Prefect API for every flow test in the session (about 10 s to start)."""
    import os

    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (moto in server mode, from PyPI) on 127.0.0.1, started for the session; the
    standard AWS variables point every client at it (this process and its children)."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(endpoint + "/", timeout=1)
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {proc.returncode}; see {log.name}")
            time.sleep(0.1)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield endpoint
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def bucket(s3_server, request) -> str:
    """A fresh bucket on the session's S3 server: its s3:// URI."""
    import re
    import uuid

    from batchgen.data.fs import filesystem

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:6]
    fs, _ = filesystem(f"s3://{name}")
    fs.mkdir(name)
    return f"s3://{name}"


def upload(local: Path, uri: str) -> str:
    from batchgen.data.fs import filesystem

    fs, path = filesystem(uri)
    fs.put_file(str(local), path)
    return uri


# ---- a real browser -----------------------------------------------------------------------------
# Debian's `chromium`, driven by Playwright's Python client (no browser download: executable_path).
# On a developer's machine without it the browser tests skip with the reason; CI sets
# BATCHGEN_REQUIRE_BROWSER=1, which turns that skip into a failure.
def find_chromium() -> str | None:
    import os

    for name in (os.environ.get("BATCHGEN_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")  # not longer: Playwright's sync API holds an event loop open on this thread
def chromium():
    import os

    reason = None
    exe = find_chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "the playwright package is not installed (pip install -e '.[dev]')"
    if exe is None:
        reason = reason or "no chromium on PATH (Debian: apt-get install chromium; or set BATCHGEN_CHROMIUM)"
    if reason:
        if os.environ.get("BATCHGEN_REQUIRE_BROWSER") == "1":
            pytest.fail(f"BATCHGEN_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            browser.close()


class PageWatch:
    """A page that records its console errors, uncaught exceptions and failed requests."""

    def __init__(self, page):
        self.page, self.errors, self.failed = page, [], []
        page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.on("requestfailed", lambda r: self.failed.append(f"{r.url}: {r.failure}"))


def screenshot_dir() -> Path | None:
    """BATCHGEN_SCREENSHOTS=docs makes the browser tests save the README's pictures there."""
    import os

    d = os.environ.get("BATCHGEN_SCREENSHOTS")
    return Path(d) if d else None


# ---- a real Prefect server ------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check, timeout_s, what):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1)
    raise TimeoutError(f"{what} not ready after {timeout_s}s")


@contextlib.contextmanager
def prefect_server_env(home: Path, ui: bool):
    """`prefect server start` on a free loopback port (with its UI if asked); yields the env that points at it."""
    import os
    import subprocess
    import sys
    import urllib.request

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "true" if ui else "false"}
    log = open(home / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_until(lambda: urllib.request.urlopen(f"{api}/health", timeout=2).status == 200, 180, "prefect server")
        yield env
    finally:
        server.terminate()
        server.wait(30)
        log.close()
