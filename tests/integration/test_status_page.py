"""The live status page (`/` on `--metrics-port`) in a real headless chromium, driven by selenium, against a real
syncer and two real learners: it loads, shows both learners, its numbers advance as rounds commit, its JSON agrees
with the tape, it says so when the syncer is gone, and a screenshot of it is saved in the run's directory."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Procs, commits, read_tape, start_syncer, syncer_exit_code, wait_until

from syncer.core.records import wire_bits
from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings

pytestmark = pytest.mark.integration
PAGE_LINE = re.compile(r"^yeto syncer status page on (http://\S+/)$", re.MULTILINE)
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"  # Debian's, installed by scripts/setup.sh
STEP_S = 0.05  # the learners' pace: rounds keep committing while the browser starts and polls


class Islands:
    """Two in-process learners stepping on a thread at a steady pace, until paused or stopped."""

    def __init__(self, address: str, key_file: Path) -> None:
        self.tensors = {lid: torch.zeros(8) for lid in (0, 1)}
        self.sessions = {
            lid: LearnerSession(load_settings(LearnerSettings, syncer=address, key_file=key_file, learner_id=lid,
                                              sync_interval=2, consensus_every=0, reconnect_max_s=1),
                                [("w", self.tensors[lid][:4]), ("v", self.tensors[lid][4:])])
            for lid in (0, 1)}
        self.running = threading.Event()
        self.stopped = threading.Event()
        self.idle = threading.Event()  # set while paused, between steps
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._train, name="islands", daemon=True)

    def start(self) -> None:
        starting = [threading.Thread(target=s.start) for s in self.sessions.values()]
        for thread in starting:
            thread.start()
        for thread in starting:
            thread.join(60)
        self.running.set()
        self.thread.start()

    def _train(self) -> None:
        try:
            while not self.stopped.is_set():
                if not self.running.is_set():
                    self.idle.set()
                    self.running.wait(0.1)
                    continue
                self.idle.clear()
                for lid, session in self.sessions.items():
                    self.tensors[lid].add_(0.01 * (lid + 1))
                    session.step(tokens=64 * (lid + 1))
                time.sleep(STEP_S)
        except BaseException as exc:  # reported by the test, not lost on this thread
            self.error = exc

    def pause(self) -> None:
        self.running.clear()
        assert self.idle.wait(30), "the learners did not pause"

    def finish(self) -> None:
        self.stopped.set()
        self.running.set()
        self.thread.join(30)
        assert self.error is None, repr(self.error)
        finishing = [threading.Thread(target=s.finish) for s in self.sessions.values()]
        for thread in finishing:
            thread.start()
        for thread in finishing:
            thread.join(60)

    def close(self) -> None:
        self.stopped.set()
        self.running.set()
        for session in self.sessions.values():
            session.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail(f"{CHROMIUM} and {CHROMEDRIVER} are needed: scripts/setup.sh installs Debian's chromium and "
                    "chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # No sandbox (root in CI), and none of chromium's own traffic: only the syncer's page on loopback.
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic",
                "--disable-extensions", f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "status.json", timeout=10) as response:
        return json.loads(response.read())


def agrees_with_tape(snapshot: dict[str, Any], tape: list[dict[str, Any]]) -> bool:
    """The JSON's counts, tokens, versions and last rounds are the tape's."""
    done = commits(tape)
    tokens = {lid: sum(c["tokens"][c["learners"].index(lid)] for c in done if lid in c["learners"]) for lid in (0, 1)}
    versions = {}
    for c in done:
        versions[c["fragment"]] = max(versions.get(c["fragment"], 0), c["version"])
    shown = [r for r in snapshot["rounds"] if r["decision"] == "commit"]
    shown_rounds = [r["round"] for r in shown]
    bits = {c["round"]: wire_bits(c) for c in done}
    return (snapshot["counts"]["committed"] == len(done) > 0
            and {lr["learner"]: lr["tokens"] for lr in snapshot["learners"]} == tokens
            and {f["fragment"]: f["version"] for f in snapshot["fragments"] if f["version"]} == versions
            and shown_rounds == [c["round"] for c in reversed(done)][: len(shown_rounds)]
            and all((r["bits_up"], r["bits_down"]) == bits[r["round"]] == (32.0, 32.0) for r in shown))


def committed_shown(driver: Any) -> int:
    from selenium.webdriver.common.by import By

    return int(driver.find_element(By.ID, "rounds-committed").text.split("/")[0].strip() or 0)


@pytest.mark.timeout(180)
def test_the_status_page_shows_a_live_run_in_a_real_browser(procs: Procs, key_file: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=2, total_rounds=0,
                          extra=["--metrics-port", "0", "--sync-interval-steps", "2"])
    found = PAGE_LINE.search(syncer.proc.stdout())
    assert found, syncer.proc.stdout()
    url = found.group(1)
    islands = Islands(syncer.address, key_file)
    try:
        islands.start()
        browser.get(url)
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#learners tbody tr")) == 2)
        rows = {row.get_attribute("data-learner"): row.text for row in
                browser.find_elements(By.CSS_SELECTOR, "#learners tbody tr")}
        assert set(rows) == {"0", "1"} and all("connected" in text for text in rows.values()), rows
        assert "2 learners" in browser.find_element(By.ID, "shape").text
        first = committed_shown(browser)
        wait.until(lambda d: committed_shown(d) >= first + 3)  # the page follows the rounds as they commit
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#spark-rate polyline"))
        assert browser.find_elements(By.CSS_SELECTOR, "#rounds tbody tr td.decision-commit")
        heads = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#rounds thead th")]
        cells = [td.text for td in browser.find_elements(By.CSS_SELECTOR, "#rounds tbody tr:first-child td")]
        shown = dict(zip(heads, cells, strict=True))
        assert (shown["bits up"], shown["bits down"]) == ("32.0", "32.0"), shown  # f32 both ways
        assert browser.find_element(By.ID, "phase").text.startswith("running")
        shot = procs.workdir / "status-page.png"
        assert browser.save_screenshot(str(shot))
        header = shot.read_bytes()[:24]
        assert header[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        assert int.from_bytes(header[16:20], "big") >= 1000, "the screenshot is not the whole window"

        islands.pause()  # no new pushes: the JSON and the tape settle on the same figures
        wait_until(lambda: agrees_with_tape(status(url), read_tape(syncer.tape)), 30,
                   "/status.json agreeing with the tape")
        islands.running.set()
        islands.finish()
    finally:
        islands.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    # The syncer is gone: the page keeps its last state and says the syncer does not answer.
    WebDriverWait(browser, 15).until(lambda d: d.find_element(By.ID, "banner").is_displayed())
    assert "does not answer" in browser.find_element(By.ID, "banner").text
    assert first < committed_shown(browser) <= len(commits(read_tape(syncer.tape)))
