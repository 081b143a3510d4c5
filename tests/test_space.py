"""The Space (examples/space/app.py): launched on 127.0.0.1 in a subprocess, driven in a real headless
Chromium through Playwright, and through its API with gradio_client; pushes go to the loopback Hub.

Browser tests need Debian's chromium at /usr/bin/chromium (scripts/setup_test_tools.sh installs it;
Playwright cannot download browsers here) and are skipped, with that reason, without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fasttune.run.config import RunConfig

pytest.importorskip("gradio", reason="the Space needs the 'space' extra (gradio)")
pytest.importorskip("gradio_client", reason="the API tests need gradio_client (installed with gradio)")

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "space" / "app.py"
CHROMIUM = Path("/usr/bin/chromium")
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed at "
                                    "/usr/bin/chromium (scripts/setup_test_tools.sh installs it)")
TERMINAL = ("completed", "failed", "stopped")


# --- the app in-process: form <-> config (no server) -------------------------------------------

@pytest.fixture(scope="module")
def app_module(tmp_path_factory):
    runs = tmp_path_factory.mktemp("inproc-runs")
    before = os.environ.get("FASTTUNE_SPACE_RUNS")
    os.environ["FASTTUNE_SPACE_RUNS"] = str(runs)
    try:
        spec = importlib.util.spec_from_file_location("fasttune_space_app", APP)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if before is None:
            os.environ.pop("FASTTUNE_SPACE_RUNS")
        else:
            os.environ["FASTTUNE_SPACE_RUNS"] = before
    yield module
    assert not list(runs.iterdir())  # nothing was launched in-process


@pytest.mark.parametrize("data", [
    {"trainer": "dpo", "method": "qlora", "data": {"dataset": "embedded", "columns": {"prompt": "prompt",
     "chosen": "chosen", "rejected": "rejected"}}, "lora": {"target_modules": ["q_proj", "v_proj"]},
     "training": {"bf16": False, "beta": 0.2, "max_steps": 7}, "fast": {"checkpointing": "offload"}},
    {"run_name": "x", "model": {"base": "org/model", "revision": "v1"}, "data": {"max_samples": 50},
     "fast": {"push_to_hub": True, "hub_model_id": "me/x", "gguf_quantizations": ["q4_0", "q8_0"],
              "export_artifacts": ["merged"], "rms_norm": False, "loss_workspace_mib": 256},
     "training": {"bf16": True, "learning_rate": 1e-5}},  # fast.rms_norm: not on the form, kept
    {"data": {"eval_size": 0.1}, "training": {"eval_steps": 5, "packing": True, "report_to": "tensorboard"}},
    {"data": {"eval_dataset": "embedded", "eval_split": "test"}, "training": {"eval_strategy": "no"}},
])
def test_form_round_trips_the_cli_config(app_module, data):
    cfg = RunConfig.from_dict(data)
    paths = app_module.demo.form_paths
    values = app_module.dict_to_form(paths, cfg)
    assert RunConfig.from_dict(app_module.form_to_dict(paths, values)) == cfg
    assert {p for p in paths if not p.startswith("data.columns.")} >= {
        "model.base", "data.dataset", "trainer", "method", "lora.r", "training.learning_rate", "fast.hub_model_id"}


def test_default_run_is_the_yaml_demo_recipe(app_module):
    """The form's defaults train what examples/configs/sft_embedded.yaml trains (measured there to
    reach >= 80% held-out exact match), and a finished run says what its metric measures."""
    from fasttune.run.config import load_run_config
    from fasttune.run.data import EMBEDDED_ROWS

    space = RunConfig.from_dict(app_module.DEFAULT_RUN)
    demo = load_run_config(ROOT / "examples" / "configs" / "sft_embedded.yaml")
    assert (space.model.base, space.model.dtype, space.data.dataset, space.trainer, space.method) == \
        (demo.model.base, demo.model.dtype, demo.data.dataset, demo.trainer, demo.method) == \
        ("embedded", "float32", "embedded", "sft", "full")
    assert (space.data.max_samples or EMBEDDED_ROWS) == demo.data.max_samples
    for key in ("learning_rate", "max_steps", "per_device_train_batch_size", "lr_scheduler_type", "warmup",
                "weight_decay", "seed", "max_length", "optim", "max_grad_norm", "gradient_accumulation_steps"):
        assert getattr(space.training, key) == getattr(demo.training, key), key
    done = app_module.result_md({"status": "completed", "metrics": {
        "global_step": 200, "first_loss": 4.7, "last_loss": 0.01, "exact_match": 0.985, "exact_match_rows": 200}},
        app_module.DOWNLOADS)
    assert "held-out exact match 98.5%: the share of 200 unseen words whose shifted spelling" in done


def test_form_checks_before_launch(app_module, tmp_path, monkeypatch):
    paths = app_module.demo.form_paths
    values = app_module.dict_to_form(paths, RunConfig())
    set_ = lambda path, v: values.__setitem__(paths.index(path), v)  # noqa: E731
    set_("trainer", "dpo")
    cfg, problems = app_module.build_config(paths, values)
    assert cfg is not None and problems == []  # embedded data has every dpo column
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "a", "good": "b", "bad": "c"}\n')
    set_("data.dataset", str(data))
    _, problems = app_module.build_config(paths, values)
    assert problems and problems[0].startswith("data.columns: the dataset's columns (q, good, bad) hold no dpo")
    for role, column in (("prompt", "q"), ("chosen", "good"), ("rejected", "bad")):
        set_(f"data.columns.{role}", column)
    assert app_module.build_config(paths, values)[1] == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert "HF_HUB_OFFLINE is set" in app_module.model_message("org/model")
    set_("model.base", "org/model")
    assert "HF_HUB_OFFLINE is set" in app_module.start_run(paths, values)
    table, msg, *updates = app_module.preview(str(data), "dpo", "q", "", "", "", "good", "bad")
    assert list(table.columns) == ["q", "good", "bad"] and "3 columns" in msg
    assert [u["visible"] for u in updates] == [True, False, False, False, True, True]
    card = app_module.card_preview("gguf", paths, values)
    assert "base_model_relation" in card and "Q8_0" in card


def test_log_panel_drops_library_warnings(app_module, tmp_path):
    jobs = sys.modules["jobs"]
    log = "\n".join([
        "fasttune: run folder runs/x",
        "[2026-12-02 01:43:38,939] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
        "/venv/lib/python3.11/site-packages/transformers/training_args.py:1541: FutureWarning: `gradient_checkpointing`"
        " is deprecated", "  warnings.warn(f\"`{old}` is deprecated\", FutureWarning)",
        "WARNING transformers.trainer: some library notice", "  its second line",
        "fasttune patch report (llama)", "  cross_entropy      1 patched",
        "fasttune: 3 of 60 rows have an empty 'completion' value (line 4); they teach nothing",
        " 50%|█████     | 3/6 [00:13<00:14,  4.71s/it]"])
    assert jobs.filter_log(log).split("\n") == [
        "fasttune: run folder runs/x", "fasttune patch report (llama)", "  cross_entropy      1 patched",
        "fasttune: 3 of 60 rows have an empty 'completion' value (line 4); they teach nothing",
        " 50%|█████     | 3/6 [00:13<00:14,  4.71s/it]"]
    (tmp_path / "console.log").write_bytes("step 1\r\x1b[A 50%|█| 1/2\r100%|█| 2/2\nWARNING datasets: noise\ndone\n"
                                           .encode())  # redrawn bars, a cursor move, a library line
    assert jobs.Jobs(tmp_path).log_tail(tmp_path) == "100%|█| 2/2\ndone\n"


def test_downloads_offer_each_artifact(app_module, tmp_path):
    import zipfile

    results = sys.modules["results"]
    run = tmp_path / "runs" / "demo-1"
    for kind in ("adapter", "merged"):
        (run / kind / "sub").mkdir(parents=True)
        (run / kind / "config.json").write_text("{}")
        (run / kind / "sub" / "w.bin").write_bytes(b"w" * 1500)
    (run / "gguf").mkdir()
    for quant in ("Q8_0", "F16"):
        (run / "gguf" / f"demo-{quant}.gguf").write_bytes(b"GGUF" + b"0" * 2000)
    state = {"status": "completed", "run_dir": str(run), "artifacts": {k: str(run / k) for k in
                                                                      ("adapter", "merged", "gguf")}}
    downloads = results.Downloads(tmp_path / "runs" / "downloads")
    assert results.Downloads(tmp_path).links_md({**state, "status": "running"}) == ""
    deadline = time.time() + 30
    while "preparing" in (md := downloads.links_md(state)) and time.time() < deadline:
        time.sleep(0.05)
    ready, pending = downloads.files(state)
    assert not pending and [label for label, _ in ready] == ["adapter", "merged", "gguf F16", "gguf Q8_0"]
    for label, path in ready:
        assert results.file_url(path) in md and path.parent == downloads.root / "demo-1"
    with zipfile.ZipFile(downloads.root / "demo-1" / "demo-1-merged.zip") as z:
        assert sorted(z.namelist()) == ["merged/config.json", "merged/sub/w.bin"]
    assert (downloads.root / "demo-1" / "demo-F16.gguf").read_bytes()[:4] == b"GGUF"
    text = results.result_md(state, downloads)
    assert text.startswith("✅ **Completed**") and "**Downloads**" in text and "(2.0 KB)" in text
    bare = results.Downloads(tmp_path / "d2")  # nothing exported: the trained model itself
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text("{}")
    assert [label for label, _ in bare.wanted({**state, "artifacts": {}})] == ["final"]


def test_a_dead_training_process_reads_as_interrupted(app_module, tmp_path):
    jobs = sys.modules["jobs"]
    from fasttune.run.folder import read_state, write_state
    from fasttune.run.liveness import identity

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    run = tmp_path / "runs" / "killed-1"
    run.mkdir(parents=True)
    write_state(run, status="running", step=5, max_steps=50, loss=[[5, 2.0]], **identity(proc.pid))
    space = jobs.Jobs(tmp_path / "runs")
    assert space.state()["status"] == "running" and space.active() == run
    proc.kill()
    proc.wait()
    state = space.state()
    assert state["status"] == "interrupted" and "gone" in state["error"] and space.active() is None
    assert read_state(run)["status"] == "interrupted"  # recorded: a later reader agrees
    assert "**Interrupted** at step 5" in sys.modules["results"].result_md(state, sys.modules["results"].Downloads(
        tmp_path / "d"))


# --- the app as a server ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Space:
    """examples/space/app.py in a subprocess on a free loopback port."""

    def __init__(self, runs: Path, hub_url: str, home: Path) -> None:
        self.runs, self.hub_url, self.home = runs, hub_url, home
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Space":
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}/"
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_TOKEN")}
        env.update(FASTTUNE_SPACE_RUNS=str(self.runs), GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port),
                   GRADIO_ANALYTICS_ENABLED="False", HF_ENDPOINT=self.hub_url, HF_HUB_DISABLE_XET="1",
                   HF_HOME=str(self.home), HF_TOKEN="dummy-space-token", HF_HUB_OFFLINE="0",
                   PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
        self.log_path = self.home / f"app-{port}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, str(APP)], env=env, cwd=self.home, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log_text()
            try:
                urllib.request.urlopen(self.url, timeout=2).read(100)
                return self
            except OSError:
                time.sleep(0.5)
        raise AssertionError("the Space did not answer in 120 s:\n" + self.log_text())

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def client(self):
        from gradio_client import Client

        return Client(self.url, verbose=False)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def kill_training(self) -> None:
        """Ends training processes this app started (their own sessions outlive the app)."""
        for state in self.runs.glob("*/state.json"):
            pid = json.loads(state.read_text()).get("pid")
            try:
                if pid and b"fasttune" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.killpg(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


@pytest.fixture(scope="module")
def hub():
    from helpers.hub_server import HubServer

    with HubServer() as server:
        yield server


@pytest.fixture(scope="module")
def space(hub, tmp_path_factory):
    home = tmp_path_factory.mktemp("space")
    app = Space(home / "runs", hub.url, home).start()
    yield app
    app.kill_training()
    app.stop()


def _wait_state(client, until, timeout=240.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = client.predict(api_name="/state")
        if until(state):
            return state
        time.sleep(0.5)
    raise AssertionError(f"timed out; last state: {state}")


def test_api_validates_configs(space):
    client = space.client()
    assert client.predict("trainer: sft\nmethod: lora\n", api_name="/validate") == {"ok": True, "errors": []}
    result = client.predict("trainer: ppo\ntraining: {lr: 1}\n", api_name="/validate")
    assert result["ok"] is False and "trainer: 'ppo' is not one of sft, dpo" in result["errors"]
    assert any(e.startswith("training: unknown key 'lr'; known keys: learning_rate") for e in result["errors"])
    assert client.predict("data: {dataset: /no/such.jsonl}\n", api_name="/validate")["errors"] == [
        "data.dataset: local file '/no/such.jsonl' does not exist"]
    bad_repo = client.predict("fast: {hub_model_id: me/bad repo!}\n", api_name="/validate")
    assert bad_repo["ok"] is False and bad_repo["errors"][0].startswith("fast.hub_model_id: Repo id must use")
    assert client.predict("trainer: ppo\n", api_name="/start")["status"] == "invalid"
    assert not space.runs.exists() or not list(space.runs.glob("*/state.json"))  # nothing launched


def _browser(tmp_path):
    pytest.importorskip("playwright", reason="browser tests need playwright (the 'dev' extra)")
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    ctx = pw.chromium.launch_persistent_context(
        str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), headless=True,
        viewport={"width": 1400, "height": 2000},
        args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync"])
    return pw, ctx


def _plot_max_step(page) -> float | None:
    label = page.locator("#loss-plot [aria-roledescription='axis']").first
    if not label.count():
        return None
    m = re.search(r"values from ([\d.]+) to ([\d.]+)", label.get_attribute("aria-label") or "")
    return float(m.group(2)) if m else None


@needs_chromium
@pytest.mark.slow
def test_browser_trains_watches_the_loss_and_pushes(space, hub, tmp_path):
    pw, ctx = _browser(tmp_path)
    try:
        page = ctx.new_page()
        page.goto(space.url)
        page.wait_for_selector("#start")
        page.wait_for_function("document.querySelector('#data-msg')?.innerText.includes('prompt, completion')")
        # an uploaded file: previewed, its columns checked against the trainer's formats before launch
        upload = tmp_path / "qa.jsonl"
        rows = [{"question": "shift: ab =", "answer": " bc"}, {"question": "shift: yz =", "answer": " za"}]
        upload.write_text("".join(json.dumps(r) + "\n" for r in rows))
        page.locator("#upload input[type=file]").set_input_files(str(upload))
        page.wait_for_function("document.querySelector('#data-msg')?.innerText.includes('hold no sft format')")
        assert "shift: yz =" in page.locator("#preview").inner_text()
        assert Path(page.locator("#dataset input, #dataset textarea").first.input_value()).parent.name == "uploads"
        page.locator("#validate").click()
        page.wait_for_function("document.querySelector('#action-msg')?.innerText.includes('Fix before starting')")
        page.locator("#dataset input, #dataset textarea").first.fill("embedded")
        page.wait_for_function("document.querySelector('#data-msg')?.innerText.includes('prompt, completion')")
        page.locator("#training-max_steps input").fill("24")
        page.locator("#training-per_device_train_batch_size input").fill("16")
        page.locator("#push input[type=checkbox]").check()
        page.locator("#hub-id input, #hub-id textarea").first.fill("tester/space-run")
        # model card preview and the YAML round trip, before the run
        page.get_by_role("button", name="Preview model card").click()
        page.wait_for_function("document.querySelector('#card-preview')?.innerText.includes('tester/space-run')")
        page.get_by_text("YAML (same format as").click()
        page.locator("#export-yaml").click()
        page.wait_for_function(
            "document.querySelector('#yaml-box')?.innerText.includes('hub_model_id: tester/space-run')")
        assert "max_steps: 24" in page.locator("#yaml-box").inner_text()
        page.locator("#training-max_steps input").fill("5")
        page.locator("#import-yaml").click()
        page.wait_for_function("document.querySelector('#training-max_steps input').value === '24'")
        # the run: live status, progress and loss plot, then the pushed repos
        page.locator("#validate").click()
        page.wait_for_function("document.querySelector('#action-msg')?.innerText.includes('Ready to start')")
        page.locator("#start").click()
        seen, status, deadline = set(), None, time.time() + 240
        while time.time() < deadline:
            status = page.locator("#run-progress").get_attribute("data-status")
            if status == "running" and (x := _plot_max_step(page)) is not None:
                seen.add(x)
            if status in TERMINAL:
                break
            time.sleep(0.25)
        assert status == "completed", page.locator("#run-log textarea").input_value()[-3000:]
        assert len(seen) >= 2, seen  # the plot grew while the run was going
        page.wait_for_function("document.querySelector('#run-result')?.innerText.includes('pushed merged')")
        assert _plot_max_step(page) == 24.0
        assert "step 24/24" in page.locator("#run-status").inner_text()
        links = page.locator("#run-result a").evaluate_all("els => els.map(e => e.href)")
        assert f"{hub.url}/tester/space-run" in links and f"{hub.url}/tester/space-run-GGUF" in links
    finally:
        ctx.close()
        pw.stop()
    assert {"tester/space-run", "tester/space-run-GGUF"} <= set(hub.repos)
    assert "model.safetensors" in hub.repos["tester/space-run"].files
    assert "space-run-Q8_0.gguf" in hub.repos["tester/space-run-GGUF"].files
    assert "dummy-space-token" in hub.tokens_seen


@pytest.mark.slow
def test_api_start_stop_and_state_after_restart(space, tmp_path):
    client = space.client()
    config = RunConfig.from_dict({"run_name": "to-stop", "trainer": "sft", "method": "lora",
                                  "data": {"max_samples": 400}, "training": {"max_steps": 5000, "logging_steps": 1,
                                                                            "per_device_train_batch_size": 4}})
    started = client.predict(config.to_yaml(), api_name="/start")
    assert started["status"] == "starting" and Path(started["run_dir"]).name.startswith("to-stop-")
    assert client.predict(config.to_yaml(), api_name="/start")["status"] == "busy"
    running = _wait_state(client, lambda s: s.get("status") == "running" and s.get("step", 0) >= 1, 180)
    assert running["run_dir"] == started["run_dir"]
    stopped = client.predict(api_name="/stop")
    assert stopped["status"] == "stopped" and 1 <= stopped["step"] < 5000
    run_dir = Path(started["run_dir"])
    assert (run_dir / "final" / "adapter_config.json").is_file()  # stopped cleanly: the model so far is saved
    assert json.loads((run_dir / "metrics.json").read_text())["stopped"] is True
    # a restarted app shows the last run and its result
    space.stop()
    space.start()
    after = space.client().predict(api_name="/state")
    assert after["run_dir"] == started["run_dir"] and after["status"] == "stopped"
    assert after["loss"] == stopped["loss"]
    if CHROMIUM.exists():
        pw, ctx = _browser(tmp_path)
        try:
            page = ctx.new_page()
            page.goto(space.url)
            page.wait_for_function("document.querySelector('#run-result')?.innerText.includes('Stopped')")
            assert "to-stop" in page.locator("#run-status").inner_text()
        finally:
            ctx.close()
            pw.stop()


@needs_chromium
@pytest.mark.slow
def test_browser_screenshot_of_a_finished_run_with_downloads_and_an_answer(space, tmp_path, record_property):
    """A finished run as a user sees it: held-out eval loss, a download link per artifact (each one
    served), and the trained model's answer in the "try it" box. The screenshot is saved (its path
    is printed and recorded as the test's ``screenshot`` property; FASTTUNE_SCREENSHOT_DIR keeps a copy).
    FASTTUNE_SCREENSHOT_STEPS trains longer at the form's default batch size (default: 12 steps of 16
    rows, a quick run whose answer is mostly noise; 200 is the form's default run)."""
    steps = int(os.environ.get("FASTTUNE_SCREENSHOT_STEPS", "12"))
    quick = "FASTTUNE_SCREENSHOT_STEPS" not in os.environ
    pw, ctx = _browser(tmp_path)
    try:
        page = ctx.new_page()
        page.goto(space.url)
        page.wait_for_function("document.querySelector('#data-msg')?.innerText.includes('prompt, completion')")
        page.locator("#run-name input, #run-name textarea").first.fill("screenshot")
        page.locator("#training-max_steps input").fill(str(steps))
        if quick:
            page.locator("#training-per_device_train_batch_size input").fill("16")
        page.locator("#data-eval_size input").fill("32")
        for kind in ("merged", "gguf"):
            page.locator("#export-artifacts label").filter(has_text=kind).locator("input").check()
        page.locator("#start").click()
        page.wait_for_function("document.querySelector('#run-progress')?.dataset.status === 'completed'",
                               timeout=240_000 + 2_000 * steps)
        page.wait_for_function("(() => { const r = document.querySelector('#run-result')?.innerText || '';"
                               " return r.includes('screenshot-Q8_0.gguf') && r.includes('merged.zip')"
                               " && !r.includes('preparing'); })()", timeout=60_000)
        result = page.locator("#run-result").inner_text()
        assert "eval loss" in result and f"✅ Completed {steps} steps" in result.replace("**", "")
        links = page.locator("#run-result a").evaluate_all("els => els.map(e => [e.innerText, e.href])")
        downloads = {text: href for text, href in links if "/gradio_api/file=" in href}
        assert {t.split(":")[0] for t in downloads} == {"merged", "gguf Q8_0"}
        for href in downloads.values():  # each link serves its file
            with urllib.request.urlopen(href, timeout=30) as resp:
                assert resp.status == 200 and len(resp.read()) > 1000
        page.locator("#try-prompt textarea, #try-prompt input").first.fill("cab =")  # the embedded task's prompt
        page.locator("#try-generate").click()
        page.wait_for_function("(document.querySelector('#try-output textarea')?.value || '').length > 0",
                               timeout=120_000)
        answer = page.locator("#try-output textarea").input_value()
        assert not answer.startswith(("❌", "Train a model first", "No run yet"))
        log = page.locator("#run-log textarea").input_value()
        assert "Warning:" not in log and "[WARNING]" not in log  # library warnings stay out of the panel
        shot = tmp_path / "space_finished.png"
        page.locator("#run-result").scroll_into_view_if_needed()
        page.screenshot(path=str(shot), full_page=True)
    finally:
        ctx.close()
        pw.stop()
    assert shot.stat().st_size > 20_000
    keep = os.environ.get("FASTTUNE_SCREENSHOT_DIR")
    if keep:
        import shutil

        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, Path(keep) / shot.name)
    record_property("screenshot", str(shot))
    print(f"screenshot of the finished run: {shot} (answer: {answer!r})")
