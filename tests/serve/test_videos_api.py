# SPDX-License-Identifier: Apache-2.0
"""The jobs API in one process: uvicorn + the Starlette app on loopback, the SQLite store in
tmp_path, and the rank-0 loop's own video code (``VideoDrive.run``) with the synthetic runner
on a single rank, driven by the test. No model, no torchrun."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("av")

from dist_attn.distributed import DistEnv  # noqa: E402
from dist_attn.models.h3.serve.config import apply_overrides, load_config  # noqa: E402
from dist_attn.models.h3.serve.http import HttpServer  # noqa: E402
from dist_attn.models.h3.serve.http.state import VideoJobs  # noqa: E402
from dist_attn.models.h3.serve.jobs.mp4 import probe_mp4  # noqa: E402
from dist_attn.models.h3.serve.jobs.store import JobStatus, JobStore  # noqa: E402
from dist_attn.models.h3.serve.jobs.synthetic import SyntheticRunner  # noqa: E402
from dist_attn.models.h3.serve.jobs.videos import VideoRules  # noqa: E402
from dist_attn.models.h3.serve.launch.process import bind_listener  # noqa: E402
from dist_attn.models.h3.serve.ranks.loop import Rank0  # noqa: E402

from tests.serve._server import metric_samples  # noqa: E402

RULES = VideoRules(default_height=64, default_width=64, default_steps=3, max_steps=50)
GOOD = {"prompt": "a red fox in snow", "frames": 124, "height": 32, "width": 64, "steps": 3,
        "seed": 7}


class _Api:
    def __init__(self, tmp_path, *, max_queued: int = 3, step_s: float = 0.01,
                 rules: VideoRules = RULES, **overrides: object) -> None:
        cfg = apply_overrides(load_config(None), {"serve.queue_size": 2, **overrides})
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                      backend=None)
        self.dir = str(tmp_path / "out")
        self.store = JobStore(self.dir)
        self.runner = SyntheticRunner(env, step_s=step_s, rules=rules)
        self.videos = VideoJobs(store=self.store, rules=rules, max_queued=max_queued,
                                output_dir=self.dir)
        self.rank0 = Rank0(cfg, env, None, {"model": "synthetic"}, None, self.runner,
                            self.videos)
        self.sock = bind_listener("127.0.0.1", 0, 128)
        self.server = HttpServer(self.rank0.front.state, self.sock)
        self.server.start()
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def call(self, method: str, path: str, body: dict | bytes | None = None, *,
             headers: dict[str, str] | None = None) -> tuple[int, dict | bytes, dict]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                raw, status, headers = r.read(), r.status, dict(r.headers)
        except urllib.error.HTTPError as e:
            raw, status, headers = e.read(), e.code, dict(e.headers)
        is_json = headers.get("content-type", "").startswith("application/json")
        return status, json.loads(raw) if is_json else raw, headers

    def run_next(self) -> None:
        """Plays the rank-0 loop once: the oldest queued job runs to its end."""
        record = self.store.start_next()
        assert record is not None
        self.rank0.video.run(record)

    def close(self) -> None:
        self.server.stop()
        self.sock.close()


@pytest.fixture
def api(tmp_path):
    a = _Api(tmp_path)
    yield a
    a.close()


def test_submit_poll_download(api):
    status, job, headers = api.call("POST", "/v1/videos", GOOD)
    assert status == 202 and job["status"] == "queued" and job["id"].startswith("vid_")
    assert headers["location"] == f"/v1/videos/{job['id']}"
    # in the store (another connection sees it committed) by the time the 202 arrived
    db = sqlite3.connect(os.path.join(api.dir, "jobs.sqlite3"))
    assert db.execute("SELECT status FROM jobs WHERE id = ?", (job["id"],)).fetchone() == ("queued",)
    assert job["queue_position"] == 0 and job["progress"]["remaining_s"] > 0
    assert job["request"]["rows"] == 5 + 414 + 37 * 2  # 5 words + 2 x 207 audio + 37 frames x 2
    assert api.call("GET", f"/v1/videos/{job['id']}/content")[0] == 409  # not yet
    api.run_next()
    status, done, _ = api.call("GET", f"/v1/videos/{job['id']}")
    assert status == 200 and done["status"] == "succeeded", done
    assert done["progress"]["step"] == 3 and done["progress"]["fraction"] == 1.0
    assert len(done["timings"]["step_s"]) == 3 and done["timings"]["total"] > 0
    status, mp4, headers = api.call("GET", done["content_url"])
    assert status == 200 and headers["content-type"] == "video/mp4"
    path = os.path.join(api.dir, "dl.mp4")
    with open(path, "wb") as f:
        f.write(mp4)
    back = probe_mp4(path)
    assert (back.frames, back.width, back.height, back.fps) == (124, 64, 32, 24.0)
    assert back.sample_rate == 32_000 and back.audio_channels == 2
    status, png, headers = api.call("GET", done["thumbnail_url"])
    assert status == 200 and headers["content-type"] == "image/png" and png[:4] == b"\x89PNG"
    status, listing, _ = api.call("GET", "/v1/videos?limit=5")
    assert status == 200 and [j["id"] for j in listing["data"]] == [job["id"]]
    samples = metric_samples(api.rank0.front.metrics.render().decode())
    assert samples['dist_attn_video_jobs{status="succeeded"}'] == 1
    assert samples["dist_attn_video_queue_depth"] == 0
    assert samples['dist_attn_denoise_step_seconds_count{kind="video"}'] == 3
    assert samples['dist_attn_video_jobs_finished_total{status="succeeded"}'] == 1


@pytest.mark.parametrize("body,status,needle", [
    ({"frames": 124}, 400, "prompt=None must be a non-empty string"),
    ({**GOOD, "frames": 130}, 400, "frames=130 must be 17 * n + 5"),
    ({**GOOD, "frames": 107}, 400, "frames=107 gives 4.46 s"),
    ({**GOOD, "height": 48}, 400, "height=48 must be a positive multiple of 32"),
    ({"prompt": "x", "height": 64}, 400, "height and width must be given together"),
    ({**GOOD, "guidance": 7.5}, 400, "guidance=7.5 is not supported: MiniMax-H3 is "
                                     "guidance-distilled"),
    ({**GOOD, "negative_prompt": "blurry"}, 400, "negative_prompt='blurry' is not supported"),
    ({**GOOD, "steps": 51}, 413, "steps=51 exceeds serve.max_steps=50"),
    ({**GOOD, "height": 1024, "width": 1344}, 413, "height*width=1376256 exceeds"),
    ({**GOOD, "width": 320}, 400, "width/height=320/32 must be within [0.25, 4]"),
    ({**GOOD, "fps": 30}, 400, "unknown field(s) ['fps']"),
    ({**GOOD, "seed": -1}, 400, "seed=-1 must be in [0, 2**63)"),
])
def test_bad_requests_name_the_field_value_and_rule(api, body, status, needle):
    got, answer, _ = api.call("POST", "/v1/videos", body)
    assert got == status and needle in answer["error"]["message"], answer
    assert api.store.counts()[JobStatus.QUEUED] == 0


def test_defaults_and_accepted_no_ops(api):
    status, job, _ = api.call("POST", "/v1/videos", {"prompt": "sea", "guidance": 1,
                                                     "negative_prompt": ""})
    assert status == 202
    req = job["request"]
    assert (req["height"], req["width"], req["frames"], req["steps"]) == (64, 64, 124, 3)
    assert 0 <= req["seed"] < 2**63  # chosen, and reported


def test_queue_cap_answers_429_with_retry_after_from_measured_steps(api):
    """Retry-After is when a slot opens: when the running job ends (it was the whole backlog,
    here 3 queued x 3 steps x 2.0 s more)."""
    from dist_attn.models.h3.serve.http.state import VideoProgress

    api.rank0.front.state.step_times.observe_step(493, 2.0)  # the rows of GOOD
    for _ in range(3):
        assert api.call("POST", "/v1/videos", GOOD)[0] == 202
    api.videos.running = VideoProgress(job_id="vid_x", rows=493, steps=3, step=1,
                                       started=time.time() - 100.0)
    status, answer, headers = api.call("POST", "/v1/videos", GOOD)
    assert status == 429 and "jobs.max_queued" in answer["error"]["message"]
    assert headers["retry-after"] == "4"  # 2 steps left x 2.0 s (whole: 6 s, 100 s run)
    api.videos.running = None


def test_cancel_queued_and_running_and_finished(api):
    a = api.call("POST", "/v1/videos", GOOD)[1]
    b = api.call("POST", "/v1/videos", {**GOOD, "steps": 40})[1]
    status, cancelled, _ = api.call("DELETE", f"/v1/videos/{a['id']}")
    assert status == 200 and cancelled["status"] == "cancelled"
    assert api.call("DELETE", f"/v1/videos/{a['id']}")[0] == 409  # already final
    assert api.call("DELETE", "/v1/videos/vid_nope")[0] == 404
    api.runner.step_s = 0.05
    t = threading.Thread(target=api.run_next)
    t.start()
    _wait_for_step(api, b["id"], 2)
    status, marked, _ = api.call("DELETE", f"/v1/videos/{b['id']}")
    assert status == 200 and marked["status"] == "running" and marked["cancel_requested"]
    t.join(10)
    gone = api.call("GET", f"/v1/videos/{b['id']}")[1]
    assert gone["status"] == "cancelled" and "after" in gone["error"], gone
    assert gone["progress"]["step"] < 40
    assert not os.path.exists(os.path.join(api.dir, "videos", f"{b['id']}.mp4"))
    assert api.call("GET", f"/v1/videos/{b['id']}/content")[0] == 409


def test_listing_filters_and_pages(api):
    ids = [api.call("POST", "/v1/videos", GOOD)[1]["id"] for _ in range(3)]
    api.run_next()
    page = api.call("GET", "/v1/videos?limit=2")[1]
    assert [j["id"] for j in page["data"]] == ids[::-1][:2] and page["has_more"]
    rest = api.call("GET", f"/v1/videos?limit=2&before={ids[1]}")[1]
    assert [j["id"] for j in rest["data"]] == [ids[0]] and not rest["has_more"]
    done = api.call("GET", "/v1/videos?status=succeeded")[1]
    assert [j["id"] for j in done["data"]] == [ids[0]]
    for query, needle in (("limit=0", "limit='0'"), ("status=done", "status='done'"),
                          ("before=vid_x", "before='vid_x'")):
        status, answer, _ = api.call("GET", f"/v1/videos?{query}")
        assert status == 400 and needle in answer["error"]["message"]


def test_a_file_removed_from_disk_is_410_not_500(api):
    job = api.call("POST", "/v1/videos", GOOD)[1]
    api.run_next()
    os.remove(os.path.join(api.dir, "videos", f"{job['id']}.mp4"))
    status, answer, _ = api.call("GET", f"/v1/videos/{job['id']}/content")
    assert status == 410 and "no longer in the output directory" in answer["error"]["message"]


def test_disk_errors_fail_the_job_alone(api, monkeypatch):
    """Rank-0-only failures (the directory, the MP4 write) fail that job; the next one runs."""
    import dist_attn.models.h3.serve.jobs.synthetic as runner_module

    first = api.call("POST", "/v1/videos", GOOD)[1]
    with open(os.path.join(api.dir, "videos"), "w") as f:  # a file where the directory goes
        f.write("in the way")
    api.run_next()
    failed = api.call("GET", f"/v1/videos/{first['id']}")[1]
    assert failed["status"] == "failed" and "not writable" in failed["error"], failed
    os.remove(os.path.join(api.dir, "videos"))

    def full_disk(*_a, **_k):
        raise OSError(28, "No space left on device")

    second = api.call("POST", "/v1/videos", GOOD)[1]
    monkeypatch.setattr(runner_module, "write_mp4", full_disk)
    api.run_next()
    failed = api.call("GET", f"/v1/videos/{second['id']}")[1]
    assert failed["status"] == "failed" and "No space left" in failed["error"], failed
    assert api.dir not in failed["error"]  # no server paths in answers
    monkeypatch.undo()
    third = api.call("POST", "/v1/videos", GOOD)[1]
    api.run_next()
    assert api.call("GET", f"/v1/videos/{third['id']}")[1]["status"] == "succeeded"


def test_a_failed_job_leaves_no_thumbnail(api, monkeypatch):
    """The first frame's PNG is published before the MP4; when the MP4 then failed (a full
    disk), the PNG stayed in videos/, never served and never removed."""
    from dist_attn.models.h3.serve.jobs import mp4

    publish = mp4._publish

    def no_space_for_mp4(tmp: str, path: str) -> None:
        if path.endswith(".mp4"):
            raise OSError(28, "No space left on device")
        publish(tmp, path)

    job = api.call("POST", "/v1/videos", GOOD)[1]
    monkeypatch.setattr(mp4, "_publish", no_space_for_mp4)
    api.run_next()
    failed = api.call("GET", f"/v1/videos/{job['id']}")[1]
    assert failed["status"] == "failed" and "No space left" in failed["error"], failed
    assert os.listdir(os.path.join(api.dir, "videos")) == []
    monkeypatch.undo()
    job = api.call("POST", "/v1/videos", GOOD)[1]
    api.run_next()  # a job that succeeds keeps both
    assert sorted(os.listdir(os.path.join(api.dir, "videos"))) == [f"{job['id']}.mp4",
                                                                   f"{job['id']}.png"]


def test_a_job_the_disk_cannot_hold_is_refused_507(api, monkeypatch):
    """Submissions with 110 KB and with 0 bytes free got 202 (and failed later). The free space
    must hold the new job's files and those of the jobs before it, each at its bound: the raw
    yuv420p frames (H.264 of noise at CRF 18 writes 0.41-0.59 of them), the AAC track at its bit
    rate, the PNG as raw RGB."""
    import shutil
    from collections import namedtuple

    # GOOD: 124 frames of 32 x 64 -> 380,928 + 124,000 (AAC, 5.17 s) + 65,536 (container)
    # + 6,144 + 4,096 (PNG) bytes
    one = 124 * 32 * 64 * 3 // 2 + 124_000 + 65_536 + 32 * 64 * 3 + 4_096
    usage = namedtuple("usage", "total used free")
    free = [0]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, free[0]))
    for free[0] in (0, 110_000, one - 1):
        status, answer, _ = api.call("POST", "/v1/videos", GOOD)
        assert status == 507, answer
        assert answer["error"]["message"] == (
            f"the output directory has {free[0]} bytes free; this job needs up to {one} bytes "
            f"(its MP4 and thumbnail) and the 0 job(s) queued or running before it 0: free "
            "space, or submit again once jobs ahead have finished")
    assert api.store.counts()[JobStatus.QUEUED] == 0  # nothing stored
    free[0] = one
    assert api.call("POST", "/v1/videos", GOOD)[0] == 202
    status, answer, _ = api.call("POST", "/v1/videos", GOOD)  # one queued ahead
    assert status == 507 and f"needs up to {one} bytes" in answer["error"]["message"]
    assert f"the 1 job(s) queued or running before it {one}:" in answer["error"]["message"]
    free[0] = 2 * one
    assert api.call("POST", "/v1/videos", GOOD)[0] == 202
    samples = metric_samples(api.rank0.front.metrics.render().decode())
    assert samples['dist_attn_request_errors_total{code="507"}'] == 4


def test_old_videos_are_deleted_by_count_and_by_age(tmp_path):
    """Every job's MP4 (and PNG) stayed for ever. After each job only the newest
    jobs.videos_kept succeeded jobs keep their files, and none older than jobs.videos_max_age_s;
    the jobs stay listed, their content answers 410 naming the rule."""
    api = _Api(tmp_path, **{"jobs.videos_kept": 2, "jobs.videos_max_age_s": 3600.0})
    try:
        ids = []
        for _ in range(3):
            ids.append(api.call("POST", "/v1/videos", GOOD)[1]["id"])
            api.run_next()
        videos = os.path.join(api.dir, "videos")
        assert sorted(os.listdir(videos)) == sorted(f"{i}.{x}" for i in ids[1:]
                                                    for x in ("mp4", "png"))
        old = api.call("GET", f"/v1/videos/{ids[0]}")[1]
        assert old["status"] == "succeeded" and "content_url" not in old, old
        for variant in ("", "?variant=thumbnail"):
            status, answer, _ = api.call("GET", f"/v1/videos/{ids[0]}/content{variant}")
            assert status == 410, answer
            assert answer["error"]["message"] == (
                f"the files of video job {ids[0]} were deleted by the server's retention "
                "(jobs.videos_kept=2 newest, jobs.videos_max_age_s=3600.0)")
        assert api.call("GET", f"/v1/videos/{ids[1]}/content")[0] == 200
        assert api.rank0.video.prune(now=time.time() + 1800) == []  # none an hour old yet
        assert api.rank0.video.prune(now=time.time() + 3601) == ids[1:]
        assert os.listdir(videos) == []
        # a store re-opened later reads the same (the deletion is recorded)
        reopened = JobStore(api.dir)
        assert [j.output for j in reopened] == [None, None, None]
        reopened.close()
    finally:
        api.close()


def test_a_lone_surrogate_in_the_prompt_is_400_naming_prompt(tmp_path):
    """JSON may spell a lone surrogate ("\\ud800"); the pipeline's tokenizer raised on it and
    the client got a 500. The tiny pipeline's own tokenizer counts the text rows here."""
    import dataclasses

    pytest.importorskip("transformers")
    from dist_attn.models.h3.serve.h3.tiny import _tokenizer

    tok = _tokenizer()
    rules = dataclasses.replace(
        RULES, text_rows=lambda p: len(tok(p, add_special_tokens=False)["input_ids"]))
    api = _Api(tmp_path, rules=rules)
    try:
        status, answer, _ = api.call("POST", "/v1/videos", b'{"prompt": "\\ud800 x"}')
        assert status == 400, answer
        message = answer["error"]["message"]
        assert message.startswith("prompt='\\ud800 x' holds a lone surrogate (U+D800 at index 0)")
        assert api.store.counts()[JobStatus.QUEUED] == 0
        paired = json.dumps({"prompt": "\U0001F98A a fox"}).encode()  # a pair: one character
        assert api.call("POST", "/v1/videos", paired)[0] == 202
    finally:
        api.close()


def test_a_limit_of_non_ascii_digits_is_400(api):
    """'\u00b2'.isdigit() is True and int('\u00b2') raises: ?limit=%C2%B2 was a 500. int()
    takes other scripts' digits ('\u0663' is 3): both are refused, by one rule."""
    for query, shown in (("%C2%B2", "'\u00b2'"), ("%D9%A3", "'\u0663'")):
        status, answer, _ = api.call("GET", f"/v1/videos?limit={query}")
        assert status == 400, answer
        assert answer["error"]["message"] == (f"limit={shown} must be an integer in [1, 100] "
                                              "(ASCII digits)")
    assert api.call("GET", "/v1/videos?limit=3")[0] == 200


def test_a_limit_of_4301_digits_is_400_naming_limit(api):
    """Python's int() refuses more than 4300 digits: ?limit=<4301 digits> answered 500 and
    logged a traceback per request. Leading zeros do not make a small limit long."""
    for raw in ("1" * 4301, "9" * 50):
        status, answer, _ = api.call("GET", f"/v1/videos?limit={raw}")
        assert status == 400, answer
        assert answer["error"]["message"] == (f"limit='{raw}' must be an integer in [1, 100] "
                                              "(ASCII digits)")
    assert api.call("GET", "/v1/videos?limit=" + "0" * 5000 + "7")[0] == 200


def test_duplicate_json_keys_are_400_naming_the_key(api):
    """json.loads kept the last of a repeated key: {"steps": 1000, "steps": 2} was a 202."""
    body = b'{"prompt": "a fox", "steps": 1000, "steps": 2}'
    status, answer, _ = api.call("POST", "/v1/videos", body)
    assert status == 400, answer
    assert answer["error"]["message"] == ("duplicate key 'steps' in a JSON object ('steps': "
                                          "1000, then 2): each key may appear once")
    assert api.store.counts()[JobStatus.QUEUED] == 0


def test_a_store_that_cannot_commit_answers_507_naming_the_job_store(tmp_path):
    """A full disk answered a generic 500. SQLite's real SQLITE_FULL is made here by capping the
    file's pages: SQLite also rolled the transaction back itself, and the store's ROLLBACK then
    raised 'no transaction is active', hiding the error."""
    from dist_attn.models.h3.serve.jobs.videos import parse_video_request

    api = _Api(tmp_path, max_queued=10_000)
    try:
        db = api.store._db
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        same = parse_video_request(GOOD, RULES)  # rows as large as the request below
        for _ in range(1000):
            try:
                api.store.submit(same, max_queued=10_000)
            except Exception:  # noqa: BLE001 - full: what the store raises is the HTTP test's
                break
        else:
            pytest.fail("the capped store never filled")
        status, answer, _ = api.call("POST", "/v1/videos", GOOD)
        assert status == 507, answer
        message = answer["error"]["message"]
        assert message.startswith("the job store (jobs.sqlite3) cannot commit: its disk is full")
        assert api.dir not in message  # no server paths in answers
        samples = metric_samples(api.rank0.front.metrics.render().decode())
        assert samples['dist_attn_request_errors_total{code="507"}'] == 1
        db.execute("PRAGMA max_page_count = 1073741823")  # space again: the store carries on
        assert api.call("POST", "/v1/videos", GOOD)[0] == 202
    finally:
        api.close()


def _wait_for_step(api, job_id: str, step: int, timeout_s: float = 10.0) -> None:
    """Polls the job until its progress reaches ``step`` (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while api.call("GET", f"/v1/videos/{job_id}")[1]["progress"]["step"] < step:
        assert time.monotonic() < deadline, f"{job_id} never reached step {step}"
        time.sleep(0.02)


def _fill_the_store(api) -> None:
    """Caps the store's file at its current pages and fills them: every commit that needs a
    page more then fails with SQLite's real SQLITE_FULL."""
    from dist_attn.models.h3.serve.jobs.store import StoreError
    from dist_attn.models.h3.serve.jobs.videos import parse_video_request

    db = api.store._db
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    filler = parse_video_request(GOOD, RULES)
    for _ in range(1000):
        try:
            api.store.submit(filler, max_queued=10_000)
        except StoreError:
            return
    pytest.fail("the capped store never filled")


def test_a_job_whose_end_cannot_be_stored_still_ends(tmp_path):
    """With the disk full at a job's end, the job stayed 'running' forever (remaining_s frozen,
    the metric counting it running) and its DELETE never completed, even once space returned.
    The end is held in memory, shown to clients, and committed when the store can."""
    api = _Api(tmp_path, max_queued=10_000)
    try:
        done = api.call("POST", "/v1/videos", GOOD)[1]["id"]
        stopped = api.call("POST", "/v1/videos", {**GOOD, "steps": 40})[1]["id"]
        first = api.store.start_next()  # run by hand: the store is full at its end
        _fill_the_store(api)
        api.rank0.video.run(first)
        job = api.call("GET", f"/v1/videos/{done}")[1]
        assert job["status"] == "succeeded" and job["progress"]["remaining_s"] == 0.0, job
        assert api.call("GET", f"/v1/videos/{done}/content")[0] == 200
        status, answer, _ = api.call("DELETE", f"/v1/videos/{done}")
        assert status == 409 and "already succeeded" in answer["error"]["message"], answer
        listed = api.call("GET", "/v1/videos?status=succeeded")[1]["data"]
        assert [j["id"] for j in listed] == [done]
        assert api.call("GET", "/v1/videos?status=running")[1]["data"] == []
        samples = metric_samples(api.call("GET", "/metrics")[1].decode())
        assert samples['dist_attn_video_jobs{status="running"}'] == 0
        assert samples['dist_attn_video_jobs{status="succeeded"}'] == 1
        api.store._db.execute("PRAGMA max_page_count = 1073741823")
        api.store.flush()  # space again: the held end is committed
        row = sqlite3.connect(api.store.path).execute(
            "SELECT status FROM jobs WHERE id = ?", (done,)).fetchone()
        assert row == ("succeeded",)
        running = api.store.start_next()  # cancelled while it runs, the store full again
        assert running.id == stopped
        _fill_the_store(api)
        api.runner.step_s = 0.05
        t = threading.Thread(target=api.rank0.video.run, args=(running,))
        t.start()
        _wait_for_step(api, stopped, 1)
        status, answer, _ = api.call("DELETE", f"/v1/videos/{stopped}")
        assert status == 200 and answer["cancel_requested"], answer
        t.join(10)
        job = api.call("GET", f"/v1/videos/{stopped}")[1]
        assert job["status"] == "cancelled" and "after" in job["error"], job
    finally:
        api.close()


def test_range_errors_of_the_content_are_json(api):
    """Starlette answered an unsatisfiable Range with a 416 and an empty body, a malformed one
    with text/plain: every error is JSON, and counted."""
    job = api.call("POST", "/v1/videos", GOOD)[1]
    api.run_next()
    url = f"/v1/videos/{job['id']}/content"
    size = os.path.getsize(os.path.join(api.dir, "videos", f"{job['id']}.mp4"))
    status, answer, headers = api.call("GET", url, headers={"Range": "bytes=99999999-"})
    assert status == 416 and headers["content-type"] == "application/json", answer
    assert answer["error"] == {"code": 416, "message": "Range='bytes=99999999-' starts past the "
                                                       f"end of the video ({size} bytes)"}
    assert headers["content-range"] == f"bytes */{size}"
    status, answer, _ = api.call("GET", url, headers={"Range": "items=0-1"})
    assert status == 400 and answer["error"]["message"].startswith("Range='items=0-1': "), answer
    status, part, headers = api.call("GET", url, headers={"Range": "bytes=0-9"})
    assert status == 206 and len(part) == 10  # a satisfiable range is still served
    samples = metric_samples(api.rank0.front.metrics.render().decode())
    assert samples['dist_attn_request_errors_total{code="416"}'] == 1
    assert samples['dist_attn_request_errors_total{code="400"}'] == 1


def test_a_store_that_cannot_start_the_next_job_leaves_it_queued(api, monkeypatch, caplog):
    """start_next raising (a full disk) ended the rank-0 loop, and with it the server: the job
    stays queued, the error is logged once a minute, the loop serves on."""
    import logging

    from dist_attn.models.h3.serve.jobs.store import StoreError

    job = api.call("POST", "/v1/videos", GOOD)[1]

    def full(*_a, **_k):
        raise StoreError(507, "the job store (jobs.sqlite3) cannot commit: its disk is full",
                         path=api.store.path)

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(api.store, "start_next", full)
    assert api.rank0.video.start_next() is None
    assert api.rank0.video.start_next() is None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "the next video job cannot start" in errors[0], errors
    monkeypatch.undo()
    assert api.call("GET", f"/v1/videos/{job['id']}")[1]["status"] == "queued"
    assert api.rank0.video.start_next().id == job["id"]
