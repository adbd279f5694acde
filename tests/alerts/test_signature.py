"""Signatures: the documented verification example (docs/operator/alerts.md), run on a real delivery, and the signing
module's own checks (tampering, another secret, the tolerance)."""

import re
import time
from pathlib import Path

from metering.alerts.signature import sign, verify
from tests.alerts.conftest import hold, new_path, wait_for

ALERTS = Path(__file__).resolve().parents[2] / "docs" / "operator" / "alerts.md"


def documented_example() -> dict:
    """The fenced python block under "### Verifying a webhook signature", run on its own."""
    text = ALERTS.read_text()
    section = text.split("### Verifying a webhook signature", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, str(ALERTS), "exec"), namespace)  # the documented example
    return namespace


def test_the_documented_example_verifies_a_real_delivery(alerts_api, receiver):
    verify_signature = documented_example()["verify_signature"]
    path = new_path()
    webhook = hold(alerts_api, receiver.url(path), ["budget.exhausted"], alerts_api.team()["id"])
    alerts_api.ok("POST", f"/v1/webhooks/{webhook['id']}/test", 202)
    (got,) = wait_for(lambda: receiver.at(path), message="the test delivery")
    header, body = got["headers"]["x-metering-signature"], got["body"]
    assert verify_signature(webhook["secret"], header, body) is True
    assert verify_signature(webhook["secret"], header, body + b" ") is False
    assert verify_signature("x" * 32, header, body) is False
    assert verify_signature(webhook["secret"], "v1=" + header.split("v1=")[1], body) is False
    assert verify(webhook["secret"], header, body)


def test_a_signature_is_refused_outside_its_tolerance():
    body = b'{"id":"evt_1"}'
    header = sign("secret-of-sixteen+", body, timestamp=1_000_000)
    assert header.startswith("t=1000000,v1=") and len(header.split("v1=")[1]) == 64
    assert verify("secret-of-sixteen+", header, body, now=1_000_000 + 300)
    assert not verify("secret-of-sixteen+", header, body, now=1_000_000 + 301)
    assert not verify("secret-of-sixteen+", header, body, now=1_000_000 - 301)
    assert not verify("secret-of-sixteen+", "t=x,v1=00", body)
    assert not verify("secret-of-sixteen+", "", body)


def test_a_fresh_signature_verifies():
    body = b"{}"
    assert verify("k" * 20, sign("k" * 20, body), body, now=time.time())
