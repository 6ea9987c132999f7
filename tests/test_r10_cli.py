"""Command-line refusals found by the tenth session's adversarial pass: each exits 2 with a
message naming the option, before any model work."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from trtgraph.cli import main


@pytest.mark.parametrize("key", ["", " secret", "secret\\t"])
def test_an_api_key_no_client_can_send_is_refused(key, tmp_path):
    """HTTP strips a header value's surrounding spaces, so a key that is empty or has them
    would answer 401 to every call: refused at once (no manifest is read: the path is absent)."""
    key = key.replace("\\t", "\t")
    r = CliRunner().invoke(main, ["serve", "--manifest", str(tmp_path / "absent"), "--api-key", key])
    assert r.exit_code == 2 and "--api-key" in r.output and "non-empty key" in r.output, r.output
