# SPDX-License-Identifier: Apache-2.0
"""In-process units of the server: request schema and limits, metrics, checksum, job queue,
binding rules. No ranks, no sockets."""

from __future__ import annotations

import pytest
import torch

from dist_attn.models.h3.serve.config import load_config
from dist_attn.models.h3.serve.h3.engine import latent_checksum
from dist_attn.models.h3.serve.http import decode_json
from dist_attn.models.h3.serve.http.metrics import Metrics
from dist_attn.models.h3.serve.jobs.queue import Job, JobQueue, QueueFull
from dist_attn.models.h3.serve.jobs.requests import RequestError, parse_request
from dist_attn.models.h3.serve.launch.process import exposure_warnings, is_loopback
from dist_attn.models.h3.serve.wire import Abort

from tests.serve._server import metric_samples


def test_parse_request_rules():
    cfg = load_config(None)
    req = parse_request({"frames": 5, "height": 64, "width": 96, "steps": 3, "seed": 2}, cfg)
    assert req.layout(cfg).latent_shape == (2, 4, 6) and req.layout(cfg).grid == (2, 2, 3)
    assert parse_request({"frames": 6}, cfg).layout(cfg).frames == 22  # the next 17 n + 5
    assert parse_request({"timeout_s": 1.5}, cfg).timeout_s == 1.5
    for payload, status, match in [
        ([], 400, "JSON object"),
        ({"frame": 3}, 400, r"unknown field\(s\) \['frame'\]"),
        ({"steps": True}, 400, "must be an integer"),
        ({"steps": 0}, 400, "steps=0 must be a positive integer"),
        ({"steps": 51}, 413, "max_steps=50"),
        ({"num_tokens": 10}, 400, r"unknown field\(s\) \['num_tokens'\]"),
        ({"height": 100}, 400, r"height=100 must be a multiple of 32 \(the video VAE's 16x"),
        ({"frames": 400}, 400, r"frames=400 gives 413 frames once aligned .* outside \[0.0, 15.0\] s"),
        ({"frames": 300, "height": 2048, "width": 2048}, 413, r"request has 377900 rows \(32 text, "
                                                              r"1036 audio, 376832 video\), above "
                                                              r"serve.max_tokens=16384"),
        ({"frames": 10**12}, 413, r"frames=1000000000000 is too large: at most 1000000 \(and the "
                                  r"request.s packed rows at most serve.max_tokens=\d+\)"),
        ({"seed": -1}, 400, "seed=-1"),
        ({"timeout_s": 0}, 400, r"timeout_s=0 must be a number in \(0, serve.request_timeout_s"),
        ({"timeout_s": 10**6}, 400, "timeout_s=1000000 must be a number"),
        ({"timeout_s": "1"}, 400, "timeout_s='1' must be a number"),
    ]:
        with pytest.raises(RequestError, match=match) as info:
            parse_request(payload, cfg)
        assert info.value.status == status, payload


def test_json_limits_refuse_before_parsing():
    limits = load_config(None).serve
    assert decode_json(b'{"seed": 12345678901234567890, "a": [1, {"b": "[[[["}]}', limits) == {
        "seed": 12345678901234567890, "a": [1, {"b": "[[[["}]}  # brackets in strings do not count
    for body, match in [
        (b"[" * 30_000 + b"]" * 30_000, "JSON nesting depth 30000 exceeds serve.max_json_depth=4"),
        (b'{"seed": ' + b"9" * 5000 + b"}", "seed=<an integer of 5000 digits> exceeds "
                                             "serve.max_int_digits=20"),
        (b'{"seed": -' + b"9" * 21 + b"}", "seed=<an integer of 21 digits>"),
        (b'{"seed": NaN}', "NaN is not valid JSON"),
        (b'{"seed": 1', "body is not valid JSON"),
        (b"\xff\xfe", "body is not valid JSON"),
    ]:
        with pytest.raises(RequestError, match=match) as info:
            decode_json(body, limits)
        assert info.value.status == 400


def test_metrics_histogram_is_cumulative():
    m = Metrics(lambda: 1)
    m.observe(0.02, 100, 0.01)
    m.observe(3.0, 100, 1.0)
    m.error(400)
    m.cancelled(Abort.DEADLINE.label)
    samples = metric_samples(m.render().decode())
    assert samples['dist_attn_request_latency_seconds_bucket{le="0.025"}'] == 1
    assert samples['dist_attn_request_latency_seconds_bucket{le="5.0"}'] == 2
    assert samples['dist_attn_request_errors_total{code="400"}'] == 1
    assert samples['dist_attn_requests_cancelled_total{reason="deadline"}'] == 1
    assert samples["dist_attn_tokens_total"] == 200 and samples["dist_attn_queue_depth"] == 1
    assert samples["dist_attn_tokens_per_second"] == pytest.approx(200 / 1.01)


def test_checksum_is_exact_and_order_sensitive():
    video, audio = torch.randn(168, 16), torch.randn(74, 8)
    full = latent_checksum(video, audio)
    assert full == latent_checksum(video.clone(), audio.clone())
    assert abs(full.sum - float(video.double().sum() + audio.double().sum())) < 1e-9
    nudged = video.clone()
    nudged[99, 15] = torch.nextafter(video[99, 15], torch.tensor(1e9))  # one ulp of one element
    assert latent_checksum(nudged, audio).bits64 != full.bits64
    swapped = video.clone()[[1, 0, *range(2, 168)]]  # two rows swapped: the same sums
    assert latent_checksum(swapped, audio).bits64 != full.bits64


def test_job_queue_bounds_removes_and_drains():
    cfg = load_config(None)
    q = JobQueue(2)
    a, b, c = (Job(request=parse_request({}, cfg)) for _ in range(3))
    q.put(a)
    q.put(b)
    with pytest.raises(QueueFull):
        q.put(c)
    assert q.remove(a) and not q.remove(a) and len(q) == 1  # a client that left frees its slot
    q.put(c)
    assert q.get(timeout=0) is b and q.drain() == [c] and q.get(timeout=0.01) is None
    a.cancel(Abort.CLIENT_GONE)
    a.cancel(Abort.DEADLINE)  # the first reason sticks
    assert a.abort_reason() is Abort.CLIENT_GONE
    late = Job(request=b.request, deadline=0.0)
    assert late.abort_reason() is Abort.DEADLINE


def test_binding_outside_loopback_warns():
    assert is_loopback("127.0.0.1") and is_loopback("127.3.4.5") and is_loopback("::1")
    assert is_loopback("localhost") and not is_loopback("0.0.0.0")
    assert not is_loopback("example.org")
    assert exposure_warnings("127.0.0.1", None) == []
    open_warnings = exposure_warnings("0.0.0.0", None)
    assert len(open_warnings) == 2 and "not a loopback address" in open_warnings[0]
    assert "no API key is set (--api-key or DIST_ATTN_API_KEY)" in open_warnings[1]
    assert len(exposure_warnings("0.0.0.0", "secret")) == 1


def test_an_empty_api_key_is_no_key_and_a_key_no_client_can_send_is_refused(caplog):
    import logging

    from dist_attn.models.h3.serve.http import ServerState
    from dist_attn.models.h3.serve.launch.process import resolve_api_key

    caplog.set_level(logging.INFO)
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key(None, {"DIST_ATTN_API_KEY": ""}) is None
    assert "DIST_ATTN_API_KEY is empty: no API key is set" in caplog.text
    assert resolve_api_key("", {"DIST_ATTN_API_KEY": "k"}) is None  # the flag wins, even empty
    assert resolve_api_key(None, {"DIST_ATTN_API_KEY": "k1"}) == "k1"
    assert resolve_api_key("k2", {"DIST_ATTN_API_KEY": "k1"}) == "k2"
    for bad in (" k", "k k", "k\t", "kä"):
        with pytest.raises(ValueError, match=r"must be printable ASCII without spaces"):
            resolve_api_key(bad, {})
    with pytest.raises(ValueError, match=r"api_key='' is not a key"):
        ServerState(cfg=None, jobs=None, metrics=None, liveness=None, api_key="")


def test_an_overlong_integer_names_its_field():
    """The refusal of an integer literal above serve.max_int_digits named no field (16 fields of
    the two request bodies answered the same message): it names where the literal is, nested
    ones by their path, and keeps the limit."""
    limits = load_config(None).serve
    long = b"9" * 5000
    for body, where in [
        (b'{"prompt": "a fox", "frames": ' + long + b"}", "frames"),
        (b'{"seed": -' + b"9" * 21 + b"}", "seed"),
        (b'{"a": {"b": [1, [2, ' + long + b"]]}}", "a.b[1][1]"),
        (b'{"a": [{"c": ' + long + b"}]}", "a[0].c"),
        (b"[1, " + long + b"]", "body[1]"),
        (long, "body"),
    ]:
        with pytest.raises(RequestError) as info:
            decode_json(body, limits)
        digits = 21 if where == "seed" else 5000
        assert info.value.status == 400
        assert str(info.value) == (f"{where}=<an integer of {digits} digits> exceeds "
                                   f"serve.max_int_digits={limits.max_int_digits}"), body[:40]
    duplicate = b'{"seed": ' + b"9" * 30 + b', "seed": 1}'
    with pytest.raises(RequestError, match=r"duplicate key 'seed' in a JSON object \('seed': "
                                           r"<an integer of 30 digits>, then 1\)"):
        decode_json(duplicate, limits)
