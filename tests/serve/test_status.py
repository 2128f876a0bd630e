"""serve/_status.py: GET / (the status page) and GET /status.json, over the scripted engine; then the page in a real
headless Chromium (Debian's `chromium`): it renders, its figures are /metrics', it changes while requests run, and
it shows the manifest's strings as text. The browser test skips, saying why, where `chromium` is not installed
(`make test` installs it where it can)."""

from __future__ import annotations

import html.parser
import os
import shutil
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardtool.serve import Access
from shardtool.serve._status import PAGE, manifest_card, per_token

from _fake_engine import FakeEngine  # noqa: E402  (tests/serve is on sys.path: pytest's prepend mode)
from test_app import MODEL, post, replying, serving, tok  # noqa: F401  (tok: a fixture)

# Signed model IDs cannot hold `<` (manifest/_records.py), but the page must not rely on that: this one is fake.
HOSTILE_ID = 'acme/<b id="injected">tiny</b>&amp;'
PAGE_FIGURES = ("queue_depth", "running", "kv_cache_bytes_in_use", "kv_cache_bytes_capacity",
                "generation_tokens_total", "verification_failures_total")


def fake_manifest(model_id: str = HOSTILE_ID) -> SimpleNamespace:
    head = SimpleNamespace(model_id=model_id, version=7, merkle_root=bytes(range(32)), created=1_700_000_000,
                           expires=1_900_000_000, entry_count=12,
                           contract={"expert_bytes_per_token_cold": 3 * 2**20, "experts_per_token": 2})
    return SimpleNamespace(head=head, signers=(SimpleNamespace(keyid="ab" * 16), SimpleNamespace(keyid="cd" * 16)))


@pytest.fixture
def engine(tok):
    return FakeEngine(tok, reply=replying(tok), manifest=fake_manifest())


def metrics_of(base: str) -> dict[str, float]:
    """GET /metrics as {engine figure: value} (a counter's sample keeps its _total)."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for sample in family.samples:
            if not sample.labels and sample.name.startswith("shardtool_"):
                out[sample.name[len("shardtool_"):]] = sample.value
    return out


# ---------------------------------------------------------------------------------------------------------
# HTTP


def test_the_page_is_one_self_contained_document(engine):
    with serving(engine) as base:
        r = httpx.get(base + "/")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    text = r.text
    # no external asset: the only URL is the SVG namespace's name, which nothing fetches
    assert text.count("http") == 1 and "http://www.w3.org/2000/svg" in text
    assert " src=" not in text and " href=" not in text and "innerHTML" not in text
    assert r.content == PAGE


def test_status_json_is_the_metrics_read_and_the_manifest(engine, tok):
    with serving(engine) as base:
        post(base, "/v1/completions", {"model": MODEL, "prompt": "x"})
        doc = httpx.get(base + "/status.json").json()
        scraped = metrics_of(base)
    m = doc["manifest"]
    assert m["model_id"] == HOSTILE_ID and m["version"] == 7 and m["signers"] == ["ab" * 16, "cd" * 16]
    assert m["merkle_root"] == bytes(range(32)).hex() and m["expires_utc"] == "2030-03-17T17:46:40Z"
    generated = len(replying(tok)([], None))  # the fake counts every token it emits, the EOS too
    assert doc["figures"]["generation_tokens_total"] == generated
    for key, value in doc["figures"].items():
        assert scraped[key] == value, key
    assert doc["bytes_per_token"] == {"expert_bytes_per_generated_token": 0.0, "contract_cold": 3 * 2**20}
    layers = doc["expert_cache"]["layers"]
    assert [x["layer"] for x in layers] == [1, 3] and layers[0]["cached"] == [generated % 4]


def test_an_engine_without_manifest_or_cache_map(tok):
    engine = FakeEngine(tok, reply=replying(tok))
    engine.expert_cache = None  # an engine that cannot say which experts it caches
    with serving(engine) as base:
        doc = httpx.get(base + "/status.json").json()
    assert doc["manifest"] is None and doc["expert_cache"] is None
    assert doc["bytes_per_token"] == {"expert_bytes_per_generated_token": None, "contract_cold": None}


@pytest.mark.parametrize("figures, expected", [
    pytest.param({}, None, id="nothing-generated"),
    pytest.param({"generation_tokens_total": 0, "expert_bytes_read_total": 5}, None, id="bytes-but-no-token"),
    pytest.param({"generation_tokens_total": 4, "expert_bytes_read_total": 10}, 2.5, id="ten-bytes-four-tokens"),
])
def test_bytes_per_token(figures, expected):
    assert per_token(figures) == expected


def test_manifest_card_without_contract():
    manifest = fake_manifest("acme/tiny")
    manifest.head.contract = None
    assert manifest_card(manifest)["contract"] is None and manifest_card(None) is None


@pytest.mark.parametrize("path, headers, status", [
    pytest.param("/", {}, 200, id="page-without-key"),
    pytest.param("/status.json", {}, 401, id="figures-without-key"),
    pytest.param("/status.json", {"authorization": "Bearer nope"}, 401, id="figures-with-a-wrong-key"),
    pytest.param("/status.json", {"authorization": "Bearer s3cret"}, 200, id="figures-with-the-key"),
    pytest.param("/", {"host": "evil.example"}, 400, id="page-for-another-host"),
])
def test_the_page_is_open_and_its_figures_need_the_key(engine, path, headers, status):
    with serving(engine, access=Access(api_key="s3cret")) as base:
        assert httpx.get(base + path, headers=headers).status_code == status


# ---------------------------------------------------------------------------------------------------------
# A real browser


class _Dom(html.parser.HTMLParser):
    """The dumped DOM: text by element id, `data-v` of each figure by its `data-k`, and every element's tag."""

    def __init__(self, text: str):
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.values: dict[str, str] = {}
        self.tags: list[tuple[str, dict]] = []
        self.heat_cells = 0
        self._open: list[str | None] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if "data-k" in a:
            self.values[a["data-k"]] = a.get("data-v", "")
        if tag == "rect" and a.get("class") in ("hc", "hn"):
            self.heat_cells += 1
        if tag not in ("meta", "input", "br"):
            self._open.append(a.get("id"))

    def handle_endtag(self, tag):
        if tag not in ("meta", "input", "br") and self._open:
            self._open.pop()

    def handle_data(self, data):
        for ident in self._open:
            if ident is not None:
                self.by_id[ident] = self.by_id.get(ident, "") + data


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no `chromium` on PATH: `make test` installs Debian's package (apt-get install -y chromium, "
                    "as root); this machine has no apt or no root")
    return path


def _browse(chromium: str, tmp_path, url: str, *args: str) -> str:
    """Run a headless Chromium on `url` (its own profile under tmp_path) and return its stdout. Started in its own
    session, so the whole browser (its zygote and renderers) is ended by its process group, and nothing else."""
    profile = tmp_path / f"profile-{time.monotonic_ns()}"
    cmd = [chromium, "--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
           "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
           "--virtual-time-budget=4000", *args, url]
    if os.geteuid() == 0:
        cmd.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        with _suppress_gone():
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of this browser is left; the group is ours alone
        proc.wait()
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


class _suppress_gone:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is ProcessLookupError


def test_the_page_in_headless_chromium(tok, tmp_path):
    chromium = _chromium()
    ids = tok.encode("one two three four five six seven eight nine ten " * 40).ids
    engine = FakeEngine(tok, reply=lambda prompt, params: ids, manifest=fake_manifest(), step_seconds=0.05,
                        max_context=1024)
    with serving(engine) as base:
        post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5})
        idle = _Dom(_browse(chromium, tmp_path, base + "/", "--dump-dom"))
        scraped = metrics_of(base)

        # It renders: the manifest, as text (the hostile model ID is not markup), and the heat map's 2 x 4 cells.
        assert idle.by_id["m-model_id"] == HOSTILE_ID
        assert not any(a.get("id") == "injected" for _, a in idle.tags)
        assert idle.by_id["m-version"] == "7" and idle.by_id["m-signers"] == f"{'ab' * 16}, {'cd' * 16}"
        assert idle.by_id["m-merkle_root"] == bytes(range(32)).hex()
        assert idle.heat_cells == 8 and idle.by_id["state"].startswith("live")
        # Its figures are /metrics' (nothing runs between the two reads).
        for key in PAGE_FIGURES:
            assert float(idle.values[key]) == scraped[key], key
        assert idle.values["generation_tokens_total"] == "5"

        # It changes while requests run: two long requests, the page read twice while they generate.
        threads = [threading.Thread(target=post, args=(base, "/v1/completions",
                                                       {"model": MODEL, "prompt": "x", "max_tokens": 300}))
                   for _ in range(2)]
        for t in threads:
            t.start()
        while engine.metrics()["generation_tokens_total"] < 8:
            time.sleep(0.02)
        first = _Dom(_browse(chromium, tmp_path, base + "/", "--dump-dom"))
        shot = tmp_path / "status-page.png"
        _browse(chromium, tmp_path, base + "/", f"--screenshot={shot}", "--window-size=1100,900",
                "--hide-scrollbars")
        second = _Dom(_browse(chromium, tmp_path, base + "/", "--dump-dom"))
        for t in threads:
            t.join()
    assert first.values["running"] == "2"
    assert 5 < int(first.values["generation_tokens_total"]) < int(second.values["generation_tokens_total"])
    assert first.by_id["tps"] != "-"  # two polls at least: a rate
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    print(f"status page screenshot: {shot}")
